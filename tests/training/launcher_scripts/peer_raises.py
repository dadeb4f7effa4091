"""Rank 1 raises its own error (ValueError, on the line marked below); rank 0, waiting in the
next collective, dies of it (gloo: "Connection closed by peer") and prints its error last: rank
1 closes its process group only after its traceback is out, and lives on a moment."""

import atexit
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.all_reduce(torch.ones(1))
print(f"rank {rank} ready", flush=True)
if rank == 1:
    atexit.register(lambda: (dist.destroy_process_group(), time.sleep(3)))
    raise ValueError("bad batch shape (3, 5)")  # RAISED HERE
dist.all_reduce(torch.ones(1))
