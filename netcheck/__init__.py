"""netcheck: the pre-flight check that the inventory's nodes can train together. Runs on the
controller; on the nodes, collective runs as a module (with bandwidth and softprobe:
cluster.sync.NODE_SIDE), and sockprobe and softprobe run as source shipped with the command.

    cli         `netcheck -i INVENTORY`: arguments, the run, the env file and the version lock
                written, the table or JSON (thin)
    preflight   the run: every stage on all nodes in parallel, each under a wall-clock limit
    stages      the stages that start listeners and workers on the nodes: ports, raw TCP, the
                collective (its workers' command line and wall clock)
    attempts    what every stage shares: the run's Options, one command on a node under a
                wall-clock limit (attempt) and on many at once (parallel), the probes' source
    facts       what one SSH round trip learns about a node (names, interfaces, routes, pings)
    checks      the judgement of each check, no I/O: reach, addressing, software, traffic
    slurm       the Slurm check (scheduler: slurm): every node ready, munge working
    report      what netcheck found (findings, measurements) and how it prints
    envfile     the file handed to the launcher: per node, the variables that pin NCCL and gloo
                to the compute interface
    sockprobe   node side of the port and raw-TCP checks (standard library only)
    softprobe   node side of the software check: what the training interpreter sees
    collective  node side of the collective check: one rank of all_reduce, all_gather, broadcast
    bandwidth   nccl-tests' bandwidth arithmetic, shared by the node workers and the controller
"""
