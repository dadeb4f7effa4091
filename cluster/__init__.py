"""What every room shares: the one inventory, SSH to the nodes and what runs over it, the
training container's options, Docker, Slurm's queue, errors, versions and the version lock.
The simulated cluster is sim/'s, not this room's. Runs on the controller; durable, errors,
jobenv, nccl_transport and versions also run on the nodes (cluster.sync.NODE_SIDE).

    inventory         the one inventory's model: Host, Inventory, their defaults (it imports
                      neither reading nor checking: read -> check -> model, one way)
    inventory_read    where an inventory is loaded (load, parse): the file read into the
                      document the checks run on (YAML, or ansible-core where only Ansible
                      resolves it), then validated
    inventory_validate  a document checked whole into an Inventory, one named check at a time
    inventory_host    one host's fields checked into a Host (inventory_validate's, per host)
    inventory_static_ip  the static_ip role's fields (stack, gateway, resolvers, old names)
    inventory_checks  the field vocabulary, each value's check and its message, the typo help
    autodetect        the `auto` values (compute_interface, gpus), found on the nodes once per
                      command
    trust             SSH trust: the known_hosts file, the options of every SSH client, an
                      unknown or changed host key refused with its remedy, adding a confirmed key
    remote            every SSH connection (Fabric, paramiko), host keys checked by trust's policy
    execution         how netcheck and the launcher reach the nodes (Nodes, SshNodes) and where
                      the training stack lives there (HostContext, ContainerContext)
    containers        every container command line: the job's `docker run` and netcheck's
                      probes', on one set of options (RDMA devices, NCCL's configuration)
    engine            the controller's Docker engine: the one way `docker` is called, Debian bases
    sync              a project, a dataset or our node-side code sent to the nodes (rsync over
                      SSH), and each node's copy checked
    datasets          `make data`: each node's copy of a dataset replaced all at once
    durable           the one durable write: temp file, fsync, rename, directory fsync
    files             the controller's files written whole or not at all (beside the inventory,
                      in the run directories)
    slurm             Slurm's queue seen and changed from the controller (squeue, scancel)
    version_lock      the version lock: each node's versions when netcheck last passed, kept
                      beside the inventory, and a changed node refused
    versions          what a node or an image runs (Python, torch, CUDA, NCCL, ...); also the
                      image's own script
    nccl_transport    which transport NCCL used, read from its INFO lines, against the hardware
    jobenv            the environment variable names the launcher and the workloads share
    errors            UserError, the one `Error: ...` line, and argparse's errors made into it
    cli               `cluster`: check, image, data, ship, lock, hostfile, ready, bootstrap, queue,
                      cancel (thin; image, ship, ready and bootstrap are provision/'s)
"""

__version__ = "0.1.0"
