"""Checkpoints, in the two formats the workloads write: checkpoint (a file per rank on its node's
own disk, agreed on by every rank before a resume; the training loop's) and dcp
(torch.distributed.checkpoint shards with a manifest, resharded on load; fsdp's), whose files
on node-local disks replicate copies to a second node (over transfer's gloo stream). Both write
through durable: a name only ever holds a complete file, fsynced, renamed into place, its directory
fsynced.
"""
