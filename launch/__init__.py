"""The controller's side of a job: everything here runs on the machine where `make train` is
typed, and reaches the nodes only over SSH. What runs on the nodes (the workloads, and
torchrun's part of them) lives in training/.

    cli         `train`: arguments, checks, then the backend's run (thin)
    backends    the one interface for a job's runs: SshBackend, SlurmBackend, LocalBackend
    restarts    the one restart loop (run_with_restarts); waiting for the nodes to answer
    running     what a run's runners, watchers and stop share (RunningJob)
    spec        what a job is (JobSpec) and what became of it (NodeOutcome, JobResult)
    nodes       per-node decisions: GPUs, process counts, backend, environment
    commands    the shell commands sent to the nodes, as pure functions
    job         one run on the nodes: prepare, start, conclude (Launcher)
    prepare     the nodes readied: the port lock, each node's GPUs, copy, image, secrets
    watch       the watchers of a running job: liveness, the compute link, the stall
    progress    the stall clock: step lines, heartbeats, output
    hang        a hang's report from every rank's stacks (py-spy)
    flight      the Flight Recorder's part of it: each rank's last collective, a mismatch
    blame       which node caused a failure
    stop        stopping a job on every node
    slurm       one run of the job through Slurm (SlurmAttempt)
    slurm_script  the batch script, its paths, the follower of a node's output
    slurm_state   Slurm's answers read: a job's state, its place in the queue
    ending      the summary, and the master's run directory brought back
    local       a job with no inventory, on this machine
    relay       its output as it comes, from a thread of its own (Ctrl-C stays with the main)
    node_output one node's output as the launcher shows it
"""
