"""Checkpoints, in the two formats the workloads write, and what keeps them safe.

    checkpoint  the training loop's (ddp, manual_dp): a file per rank on its node's own disk;
                the newest step every rank holds, agreed on before a resume; a rank with none
                (a spare) gets the state from one that has it
    dcp         fsdp's: torch.distributed.checkpoint shards with a manifest, one directory per
                step, renamed into place once every rank wrote it; resharded on load
    complete    when a file, and a step, is complete: the one rule every resume follows
    durable     torch.save through cluster.durable (the one durable write: a file written,
                fsynced, renamed into place, its directory fsynced), so a name only ever holds
                a complete file
    replicate   checkpoint replication: each node's files of a dcp step also on the next node,
                and a step's missing files fetched back before a resume
    transfer    files between two ranks over a gloo group (replicate's copies), each received
                under a temporary name and renamed into place once whole, paced to a cap

checkpoint's files and dcp's rank files and manifests are written through durable (torch.save
on cluster.durable, the one durable write); transfer's received files go through
cluster.durable's AtomicFile; dcp's step directory and replicate's restored directory are
renamed into place by those modules, once their files are written, with durable's directory
fsync.
"""
