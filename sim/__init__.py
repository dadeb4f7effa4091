"""The simulated cluster: node containers reached over SSH, the test and benchmark infrastructure.

Production rooms (`cluster/`, `provision/`, `launch/`, `netcheck/`, `training/`) never import it;
tests and `bench/` do.

    nodes       the cluster itself: node containers on a private bridge network, reached over
                real SSH (up, down, status), its inventory written
    node_image  what a node container is made of: its image, the controller's Python environment
                mounted, the options an engine inside it needs
    cli         `python -m torch_multinode.sim.cli` (`make sim-up`, `make sim-down`) (thin)
"""
