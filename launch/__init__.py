"""The controller's side of a job: everything here runs on the machine where `make train` is
typed, and reaches the nodes only over SSH. What runs on the nodes (the workloads, and
torchrun's part of them) lives in training/.

    cli           `train`: arguments, checks, the run's record, the backend handed to the
                  restart loop (thin)
    options       `train`'s argument parser: each option's type, default and help
    checks        what `train` checks before anything starts: the workload's arguments, a
                  local job's module
    spec          what a job is (JobSpec) and what became of it (NodeOutcome, JobResult)
    backends      the one interface for a job's runs: SshBackend, SlurmBackend, LocalBackend
    restarts      the restart policy: the one restart loop (run_with_restarts), its options
                  and checks, what a restart does with a lost node (LostNodes)
    survivors     which nodes a restart runs on: every node waited for (wait_for_nodes), or
                  those that answer, a spare in a lost node's place, the compute link probed
    staging       what a job takes to the nodes and what comes back: the project, its mounts
                  and paths, the secrets file, the image it runs in
    image_check   that image on every node checked against this machine's: its ID here, the
                  node's question and what its answer means
    requirements  which Python dependencies a project has (requirements.txt, pyproject.toml,
                  REQUIREMENTS=), and host mode's check that each node's Python holds them
    environment   the job's environment variables: every one any backend sets, which source
                  wins, the names ENV= may not set
    nodes         per-node decisions: GPUs, process counts, the job's backend, what torchrun runs
    commands      the shell commands sent to the nodes, as pure functions: torchrun, the job's
                  command (its `docker run` is cluster.containers'), the port lock, the link
                  probe, the stop
    job           one run's skeleton (Launcher), whichever way it goes: prepare, start,
                  follow, conclude
    way           what differs between the ways one run goes (Way), asked by the skeleton
    over_ssh      the SSH way (OverSsh): sessions, the port claimed and released, the
                  liveness and link watchers
    prepare       the nodes readied: the port lock, each node's GPUs, copy, directories, image,
                  secrets, and its versions against the version lock
    running       what a run's runners, watchers and stop share (RunningJob)
    watch         the watchers of a running job: liveness, the compute link, the stall
    progress      stall detection: step lines, heartbeats, output, when a job is stalled, and
                  the watch that declares the hang (until_hang)
    idle          whether a quiet job's ranks do anything at all: the default hang signal for
                  a script that prints no steps
    hang          a hang's report from every rank's stacks (py-spy)
    flight        the Flight Recorder's part of it: each rank's last collective, a mismatch
    blame         which node caused a failure
    stop          stopping a job on every node
    ending        the summary (a local job's too), the master's run directory brought back,
                  the exit code's file
    signatures    known failure signatures: an error's usual cause and remedy, in the summary
    causes        why a node is slow: its counters read twice on the node, the cause in one line
    gpu_causes    the GPU's part of it: nvidia-smi's query, a GPU held down or on a narrow link
    stragglers    the straggler a job names (from our workloads' warning, or the ranks' waits in
                  collectives), probed (causes) and said once per change
    paces         the watcher that reads the ranks' waits on every node for stragglers
    node_output   one node's output as the launcher shows it
    slurm         the way one run goes through Slurm (SlurmAttempt): submit or requeue, cancel
    slurm_script  the batch script, its paths, the follower of a node's output
    slurm_state   Slurm's answers read: a job's state, its place in the queue
    local         a job with no inventory, on this machine
    relay         a local job's output as it comes, from a thread of its own (Ctrl-C stays with
                  the main one)
    record        the run's record (.runs/ID/run.json), the same for every backend
    recorder      the record kept around one run's job (Recorder): begun, completed, finished
    snapshot      the project's code as a run saw it, kept for `make rerun`
    runs          `make runs` and `make rerun`
"""
