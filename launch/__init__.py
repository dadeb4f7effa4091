"""The controller's side of a job: everything here runs on the machine where `make train` is
typed, and reaches the nodes only over SSH. What runs on the nodes (the workloads, and
torchrun's part of them) lives in training/.

    cli         `train`: arguments, checks, then a local job or a job on the nodes
    spec        what a job is (JobSpec) and what became of it (NodeOutcome, JobResult)
    nodes       per-node decisions: GPUs, process counts, backend, environment
    commands    the shell commands sent to the nodes, as pure functions
    job         one run on the nodes: prepare, start, conclude (Launcher)
    prepare     the nodes readied: the port lock, each node's GPUs, copy, image, secrets
    watch       the watchers of a running job: liveness and the compute link
    blame       which node caused a failure
    stop        stopping a job on every node
    restarts    restarts once every node answers again (run_job)
    slurm       the job through Slurm (SlurmAttempt, run_job)
    slurm_script  the batch script, its paths, the follower of a node's output
    slurm_state   Slurm's answers read: a job's state, its place in the queue
    ending      the summary, and the master's run directory brought back
    local       a job with no inventory, on this machine
    node_output one node's output as the launcher shows it
"""
