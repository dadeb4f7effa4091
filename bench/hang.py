"""12. A hang explained: the time from the stall (the job's last step line) to the launcher's
printed verdict, with jobs in containers on 2 and on 4 nodes, against the budget the launcher
is held to (STALL + 15 s: the stall itself, then the stacks of every rank on every node read
and judged)."""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path

from torch_multinode.bench.measure import REPO_ROOT, Progress, Series

HANG_STALL = 15
HANG_BUDGET = HANG_STALL + 15
HANG_NODES = (2, 4)
STEP_LINE = re.compile(r"\bstep \d+/\d+\b")
VERDICT = "[launcher] hang: "

# The last rank sleeps in its data loading at step 5; rank 0 prints a step line per step.
HANG_SCRIPT = """\
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(1, 11):
    if rank == world - 1 and step == 5:
        time.sleep(3600)
    batch = torch.ones(1)
    dist.all_reduce(batch)
    if rank == 0:
        print(f"step {step}/10", flush=True)
    time.sleep(0.3)
dist.destroy_process_group()
"""


def stall_to_verdict(lines: list[tuple[float, str]]) -> float | None:
    """Seconds from the last step line before the verdict to the verdict (None: no verdict)."""
    last_step = None
    for at, line in lines:
        if VERDICT in line:
            return None if last_step is None else at - last_step
        if STEP_LINE.search(line):
            last_step = at
    return None


def _timed_train(inventory: Path, nodes: int, script: Path) -> list[tuple[float, str]]:
    proc = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "train",
            f"INVENTORY={inventory}",
            f"NNODES={nodes}",
            f"SCRIPT={script}",
            f"WORKDIR={script.parent}",
            f"STALL={HANG_STALL}",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    lines = [(time.monotonic(), line) for line in proc.stdout]
    proc.wait(timeout=120)
    return lines


def measure_hang(inventory: Path, reps: int, progress: Progress) -> dict:
    """On nodes provisioned for jobs in containers (all of `inventory`'s, at least 4): for 2
    and 4 nodes, the seconds from the stall to the verdict, and their ratio to HANG_BUDGET."""
    found: dict = {"stall": HANG_STALL, "budget": HANG_BUDGET}
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as scratch:
        script = Path(scratch) / "hang.py"
        script.write_text(HANG_SCRIPT)
        for nodes in HANG_NODES:
            seconds = []
            for rep in range(reps):
                lines = _timed_train(inventory, nodes, script)
                took = stall_to_verdict(lines)
                if took is None:
                    tail = "".join(line for _, line in lines[-15:])
                    raise RuntimeError(f"hang on {nodes} nodes: no verdict printed:\n{tail}")
                seconds.append(took)
                progress(
                    f"hang: {nodes} nodes, rep {rep + 1}/{reps}: the verdict {took:.1f} s after "
                    f"the last step line (STALL={HANG_STALL})"
                )
            found[f"nodes_{nodes}"] = {
                "seconds": Series(seconds).as_dict(),
                "ratio": Series([s / HANG_BUDGET for s in seconds]).as_dict(),
            }
    return found
