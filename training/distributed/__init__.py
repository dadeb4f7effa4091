"""The process group and what runs over it: parallel reads the job's environment (RANK, LOCAL_RANK,
WORLD_SIZE, the backend), binds each rank to its device, starts and stops the group and wraps a
model in DDP; levers picks and applies the all-reduce levers (comm hooks, `--comm-hook auto`,
no_sync accumulation). Every workload starts its ranks through parallel.
"""
