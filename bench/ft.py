"""18. FT=1 against the restart path (issue 54), on 3 nodes in the training image (launch_mode:
container), behind the bench's link, side by side in each rep:

- a node's death: node3 killed after step 12 of training.ddp. With FT=1 (RESTARTS=1), timed
  from the kill to the survivors' next committed step (node1's `step N: 2 of 3 replica groups
  train`, said at the first step without node3), the steps done again (node1's `step N not
  committed` lines), and, node3's container started again at once, the seconds from its return
  to its group's first committed step (`healed from a peer`, said after that step). On the
  restart path (section 15's job: RESTARTS=1 MIN_NODES=2, --restart-wait 10 s, a checkpoint
  every 5 steps), the same death to the first step of the restarted run, and the steps since
  the checkpoint it resumed from, done again;
- without a fault: the same job with FT=1 and as plain DDP, its step time from step 10's line
  to the last step's (the order alternating); and the same with ResNet-18, whose step takes
  hundreds of milliseconds as a real model's does, where the tiny model's step of about 25 ms
  shows torchft's fixed cost a step (its quorum and commit, a few ms) as a large fraction.

At the defaults the restart path waits --restart-wait 300 s where this one waits 10: its time
there is reported as the measured one plus the 290 s more it would wait (derived, not run)."""

from __future__ import annotations

import re
from pathlib import Path

from torch_multinode.bench import nodeloss
from torch_multinode.bench.measure import Progress, Series
from torch_multinode.launch.spec import DEFAULT_RESTART_WAIT
from torch_multinode.sim import nodes as sim
from torch_multinode.training.distributed.replicas import DEFAULT_TIMEOUT

FT_NODES = 3
# The job of section 15 without its checkpoints (FT=1's groups survive a loss without them),
# long enough for node3 to come back and heal while the others train.
JOB = [*nodeloss.JOB[: nodeloss.JOB.index("--steps")], "--steps", "200", "--step-delay", "0.3"]
# Without a fault, no delay: the steps' own time, as the overhead target is stated.
PLAIN = [*nodeloss.JOB[: nodeloss.JOB.index("--steps")], "--steps", "60"]
# The same with training.ddp's default model, ResNet-18, at 32 px: 16 images a rank.
REAL = [
    "--model",
    "resnet18",
    "--image-size",
    "32",
    *PLAIN[PLAIN.index("--image-size") + 2 : PLAIN.index("--steps")],
    "--steps",
    "30",
]
DEATH_BUDGET = DEFAULT_TIMEOUT + 5  # the FT timeout + 5 s
RESTART_FRACTION = 1 / 3  # of the restart path's time at the defaults
OVERHEAD_BUDGET = 1.05
HEAL_BUDGET = 60.0
_NEXT = re.compile(r"^\[node1\] step \d+: \d+ of 3 replica groups train")
_REDONE = re.compile(r"^\[node1\] step \d+ not committed")
_HEALED = re.compile(r"^\[node3\] healed from a peer")
_STEP = re.compile(r"^\[node1\] step +(\d+)/\d+")
_RESUMED = re.compile(r"^\[node1\] resuming from step (\d+)")


def _ft_loss(
    train: Path, inventory: Path, config: sim.SimConfig, nnodes: int, link: str | None
) -> tuple[list[tuple[float, str]], float]:
    """An FT=1 job, node3 killed after step 12 and started again at once: its lines timed from
    the kill, and the seconds from the kill to node3's return (its engine answering)."""
    return nodeloss.killed_after_step_12(
        [str(train), "-i", str(inventory), "--nnodes", str(FT_NODES), "--ft", "--restarts", "1"]
        + ["--restart-wait", "300", "--", *JOB],
        config,
        then=lambda: nodeloss._node3_back(nnodes, link, config),
    )


def ft_figures(lines: list[tuple[float, str]], back: float) -> tuple[float, int, float]:
    """From an FT=1 job's lines timed since the kill: seconds to the survivors' next committed
    step, steps done again, and seconds from node3's return to its first committed step."""
    after = next((at for at, line in lines if _NEXT.search(line)), None)
    healed = next((at for at, line in lines if _HEALED.search(line)), None)
    if after is None or healed is None:
        raise RuntimeError("ft: no step without node3, or node3 never healed")
    return after, sum(1 for _, line in lines if _REDONE.search(line)), healed - back


def restart_redone(lines: list[tuple[float, str]]) -> int | None:
    """The restart path's steps done again: the newest step trained before the restart (12 at
    least: the kill came after its line) less the step it resumed from."""
    newest, resumed = 12, None
    for _, line in lines:
        if re.search(r"\[launcher\] job \S+-r1: ", line):
            break
        if found := _STEP.search(line):
            newest = max(newest, int(found[1]))
    for _, line in lines:
        if found := _RESUMED.search(line):
            resumed = int(found[1])
            break
    return None if resumed is None else newest - resumed


def _plain(train: Path, inventory: Path, ft: bool, job: list[str]) -> float:
    """`job` without a fault, with FT=1 or as plain DDP: seconds from step 10 to the last."""
    lines = nodeloss.timed_job(
        [str(train), "-i", str(inventory), "--nnodes", str(FT_NODES)]
        + (["--ft"] if ft else [])
        + ["--", *job],
        "ft",
    )
    node1 = [(at, line.split("] ", 1)[1]) for at, line in lines if line.startswith("[node1] ")]
    return nodeloss.timed_window(node1, 10)[0]


def measure_ft(
    inventory: Path,
    config: sim.SimConfig,
    nnodes: int,
    link: str | None,
    reps: int,
    progress: Progress,
    train: Path,
) -> dict:
    """`reps` times, side by side: the FT=1 loss and return, the restart path's loss, and the
    job without a fault with FT=1 and without (the order alternating)."""
    death, redone, heal, restart, restart_steps = [], [], [], [], []
    overhead: list[float] = []
    real: list[float] = []
    try:
        for rep in range(reps):
            lines, back = _ft_loss(train, inventory, config, nnodes, link)
            after, again, healed = ft_figures(lines, back)
            restarted = nodeloss._one_loss(train, inventory, config)
            took, _ = nodeloss.death_to_first_step(restarted)
            steps = restart_redone(restarted)
            nodeloss._node3_back(nnodes, link, config)
            if took is None or steps is None:
                raise RuntimeError("ft: the restart path's run had no step after the restart")
            plain: dict[bool, float] = {}
            resnet: dict[bool, float] = {}
            for ft in (True, False) if rep % 2 == 0 else (False, True):
                plain[ft] = _plain(train, inventory, ft, PLAIN)
                resnet[ft] = _plain(train, inventory, ft, REAL)
            death.append(after)
            redone.append(again)
            heal.append(healed)
            restart.append(took)
            restart_steps.append(steps)
            overhead.append(plain[True] / plain[False])
            real.append(resnet[True] / resnet[False])
            progress(
                f"ft: rep {rep + 1}/{reps}: death to the survivors' next step {after:.1f} s with "
                f"FT=1 ({again} step(s) done again), {took:.1f} s on the restart path ({steps} "
                f"done again); node3's return to its first committed step {healed:.1f} s; "
                f"steps 10-60 without a fault {plain[True]:.1f} s with FT=1, "
                f"{plain[False]:.1f} s without; ResNet-18's steps 10-30 {resnet[True]:.1f} s with "
                f"FT=1, {resnet[False]:.1f} s without"
            )
    finally:
        nodeloss._node3_back(nnodes, link, config)
    more = DEFAULT_RESTART_WAIT - nodeloss.NODELOSS_GRACE
    return {
        "nodes": FT_NODES,
        "timeout": DEFAULT_TIMEOUT,
        "grace": nodeloss.NODELOSS_GRACE,
        "death_seconds": Series(death).as_dict(),
        "death_ratio": Series([s / DEATH_BUDGET for s in death]).as_dict(),
        "death_budget": DEATH_BUDGET,
        "redone": Series([float(n) for n in redone]).as_dict(),
        "restart_seconds": Series(restart).as_dict(),
        "restart_redone": Series([float(n) for n in restart_steps]).as_dict(),
        "default_ratio": Series(
            [d / (r + more) for d, r in zip(death, restart, strict=True)]
        ).as_dict(),
        "heal_seconds": Series(heal).as_dict(),
        "heal_ratio": Series([s / HEAL_BUDGET for s in heal]).as_dict(),
        "overhead": Series(overhead).as_dict(),
        "overhead_resnet": Series(real).as_dict(),
    }
