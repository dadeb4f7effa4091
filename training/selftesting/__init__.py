"""The checks `make selftest` runs. training.selftest, the workload, keeps their list, runs them on
every rank and prints the table; the checks are here, each a function of this rank's Job, with
what a check that does not apply or fails says.

    checks     the device, communication in and across nodes, NCCL's transport, mixed
               precision, DDP and FSDP2 checkpoints, torch.compile, the Flight Recorder
    node_gpus  the checks over all of a node's GPUs from one process: DataParallel, a model
               split over two GPUs, training.model_parallel under DDP
    replicas   FSDP2's checkpoint replicas (training.checkpointing.replicate): a node's copy wiped
               and got back
    nccl_log   NCCL's own log per rank: kept in the run directory, read back for the checks,
               echoed to the console
"""
