"""Keeps every rank busy in collectives until stopped: the target for fault tests."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group(
    "gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "600")))
)
rank = dist.get_rank()
fail_at = int(sys.argv[1]) if len(sys.argv) > 1 else -1
for step in range(100000):
    value = torch.ones(1)
    dist.all_reduce(value)
    if step % 10 == 0:
        print(f"rank {rank} step {step} sum {value.item():.0f}", flush=True)
    if rank == dist.get_world_size() - 1 and step == fail_at:
        raise SystemExit(f"rank {rank} failing on purpose at step {step}")
    time.sleep(0.1)
