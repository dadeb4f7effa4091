"""The controller's tools that prepare nodes before any job: first contact, the training image's
build and its shipment to the nodes, a project's dependency layer. Runs on the controller only,
never sent to a node (cluster.sync.NODE_SIDE does not list this room); cluster/cli.py fronts it.

    bootstrap      first contact (`make bootstrap`): key login, passwordless sudo, SSH password
                   login off where asked; whether nodes are ready for provisioning
    keys           first contact's keys: the controller's key pair, each node's host key
                   confirmed by its fingerprint and added to known_hosts; the terminal's questions
    images         the training image's build (CUDA, or its CPU twin) from docker/Dockerfile, and
                   its labels
    build_watch    a build's live output
    platforms      the nodes' platform, which the build is pinned to and shipping checks
    ship           image shipping: by layers through the controller's registry, else one
                   `docker save` streamed over SSH; every node left holding the controller's ID
    ship_progress  what a shipment says while it goes and when it is done
    dependencies   a project's Python dependencies (the front door): built into a layer on the
                   image (shipped by ship), or installed for a local job
    resolution     their resolution with pip against what the environment holds: stand-ins,
                   conflicts, wheels built from source
    held_packages  what an environment (the image's, this machine's) holds, the packages a
                   requirement may never change (torch, the CUDA libraries), and the refusal
"""
