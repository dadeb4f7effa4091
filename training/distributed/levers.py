"""What makes the gradient all-reduce cheaper, and `--comm-hook auto`: pick it by measuring.

Two levers cut the time DDP spends on the network. A communication hook compresses what goes
over it (fp16 or bf16 casts, PowerSGD's low-rank approximation); gradient accumulation with
`DDP.no_sync()` all-reduces once per optimizer step instead of once per micro-batch. No hook wins
by a fixed rule: on a CPU, PowerSGD's compression costs more compute than it saves on a 1 Gbit/s
link, on a GPU the opposite. So `auto` times every candidate for a few optimizer steps on the
real model, batch and link, all ranks agree on the slowest rank's times, and the fastest is kept;
rank 0 says in one line what it measured and chose. A recent measurement of the same setup can
be reused from a small JSON cache in the run directory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torch_multinode.cluster import durable
from torch_multinode.training.distributed import parallel
from torch_multinode.training.settings import console

CANDIDATES = parallel.COMM_HOOKS  # none first: on a tie, no compression error
# The probe's PowerSGD compresses from this synced backward on (torch's minimum), so a short
# warm-up reaches the compressed steady state; the real run keeps --powersgd-start-step.
PROBE_POWERSGD_START = 2
PROBE_STEPS = 2  # timed optimizer steps per candidate
PROBE_WARMUP = 1  # untimed optimizer steps per candidate before them (more for PowerSGD)
CACHE_MAX_AGE = 86400.0  # seconds a cached measurement stays good for
CACHE_FILE = "levers.json"

MicroStep = Callable[[nn.Module], object]  # forward and backward of one micro-batch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so the host clock measures it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def syncs_per_step(accumulate: int, no_sync: bool) -> int:
    """Gradient all-reduces per optimizer step: one with no_sync, else one per micro-batch."""
    return 1 if no_sync else accumulate


def warmup_steps(hook: str, accumulate: int, no_sync: bool, minimum: int = PROBE_WARMUP) -> int:
    """Untimed optimizer steps before timing `hook`: at least `minimum`, and for PowerSGD enough
    for its plain all-reduces and its first compressed one (which allocates its buffers)."""
    if hook != "powersgd":
        return minimum
    return max(minimum, math.ceil((PROBE_POWERSGD_START + 1) / syncs_per_step(accumulate, no_sync)))


def run_steps(
    model: nn.Module,
    micro_step: MicroStep,
    accumulate: int,
    steps: int,
    *,
    no_sync: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """`steps` optimizer steps of `accumulate` micro-batches each. With `no_sync` (and a DDP
    model) only the last micro-batch's backward all-reduces; without it every one does, as naive
    accumulation does. Gradients are zeroed before each step; without an optimizer nothing is
    stepped, so the parameters stay as they are."""
    skip_sync = getattr(model, "no_sync", None) if no_sync else None
    for _ in range(steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        for index in range(accumulate):
            last = index == accumulate - 1
            with skip_sync() if skip_sync is not None and not last else nullcontext():
                micro_step(model)
        if optimizer is not None:
            optimizer.step()


def timed_steps(
    model: nn.Module,
    env: parallel.DistEnv,
    micro_step: MicroStep,
    accumulate: int,
    steps: int,
    *,
    no_sync: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """This rank's seconds per optimizer step over `steps` steps, started together with the
    other ranks."""
    parallel.barrier(env)
    synchronize(env.device)
    started = time.perf_counter()
    run_steps(model, micro_step, accumulate, steps, no_sync=no_sync, optimizer=optimizer)
    synchronize(env.device)
    return (time.perf_counter() - started) / steps


def slowest(values: list[float], env: parallel.DistEnv) -> list[float]:
    """Each value's maximum over the ranks: a synchronous job goes at its slowest rank's pace,
    and every rank gets the same numbers, so every rank makes the same choice from them."""
    if not env.launched:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def wrap(module: nn.Module, env: parallel.DistEnv, config, hook: str, **changes) -> nn.Module:
    """A fresh DDP around `module` with `hook` registered (its own, fresh hook state)."""
    return parallel.wrap_ddp(module, env, dataclasses.replace(config, comm_hook=hook, **changes))


def measure_once(
    module: nn.Module,
    env: parallel.DistEnv,
    micro_step: MicroStep,
    accumulate: int,
    *,
    config=None,
    hook: str | None,
    warmup: int,
    steps: int,
    no_sync: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """This rank's seconds per optimizer step with `hook`: a fresh DDP around `module` with
    `config`'s options (hook None: the plain module, no DDP), the warm-up `warmup_steps` gives,
    then `steps` timed steps. The wrapper is gone when this returns (its reducer's autograd
    hooks and buckets with it) and the gradients are None."""
    model = module
    if hook is not None:
        model = wrap(module, env, config, hook, powersgd_start_step=PROBE_POWERSGD_START)
    try:
        warm = warmup_steps(hook or "none", accumulate, no_sync, warmup)
        run_steps(model, micro_step, accumulate, warm, no_sync=no_sync, optimizer=optimizer)
        return timed_steps(
            model, env, micro_step, accumulate, steps, no_sync=no_sync, optimizer=optimizer
        )
    finally:
        module.zero_grad(set_to_none=True)
        del model
        gc.collect()


def measure(
    module: nn.Module,
    env: parallel.DistEnv,
    config,
    micro_step: MicroStep,
    accumulate: int = 1,
    *,
    candidates: tuple[str, ...] = CANDIDATES,
    steps: int = PROBE_STEPS,
    warmup: int = PROBE_WARMUP,
    no_sync: bool = True,
    each: bool = False,
) -> dict[str, float]:
    """Seconds per optimizer step of each candidate hook, the slowest rank's, the same on every
    rank. Every candidate gets its own DDP wrapper (a DDP takes one hook) around `module`
    (unwrapped) with `config`'s other DDP options; nothing is stepped, so the parameters stay
    as they are, and the buffers (BatchNorm statistics) are put back as they were. With `each`,
    rank 0 says its own time of every candidate as it is measured (progress on a slow node)."""
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    own = []
    try:
        for hook in candidates:
            seconds = measure_once(
                module,
                env,
                micro_step,
                accumulate,
                config=config,
                hook=hook,
                warmup=warmup,
                steps=steps,
                no_sync=no_sync,
            )
            own.append(seconds)
            if each:
                console.say(env, f"auto: timed {hook}, {seconds:.3g} s/optimizer-step on rank 0")
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])
    return dict(zip(candidates, slowest(own, env), strict=True))


@dataclass(frozen=True)
class Choice:
    hook: str
    timings: dict[str, float]  # seconds per optimizer step, empty when nothing was measured
    line: str  # what rank 0 printed
    measured_at: float | None = None  # time.time() of the measurement, when one was made
    reused: bool = False  # the timings came from the cache


@dataclass(frozen=True)
class Cache:
    """Where measurements are kept and what they must match to be reused."""

    path: Path
    key: dict
    max_age: float = CACHE_MAX_AGE


def node_names(env: parallel.DistEnv) -> list[str]:
    """Every rank's node name in rank order (a collective: every rank calls it)."""
    import socket

    return parallel.all_gather(os.environ.get("TMN_NODE_NAME") or socket.gethostname(), env)


def cached(cache: Cache, candidates: tuple[str, ...], now: float) -> dict | None:
    """The newest entry of the cache file measured for `cache.key` and every candidate within
    `cache.max_age` seconds, or None; an unreadable file counts as empty."""
    try:
        entries = json.loads(cache.path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entries, list):
        return None
    found = None
    for entry in entries:
        try:
            age = now - float(entry["measured_at"])
            usable = (
                entry["key"] == cache.key
                and 0 <= age <= cache.max_age
                and set(candidates) <= set(entry["timings"])
            )
            timings = {hook: float(entry["timings"][hook]) for hook in candidates}
        except (KeyError, TypeError, ValueError):
            continue
        if usable and (found is None or entry["measured_at"] > found["measured_at"]):
            found = {"measured_at": float(entry["measured_at"]), "timings": timings}
    return found


def remember(cache: Cache, timings: dict[str, float], now: float) -> None:
    """Add a measurement to the cache file (replacing the one of the same key), atomically;
    a cache that cannot be written is only a warning's worth."""
    try:
        entries = json.loads(cache.path.read_text(encoding="utf-8"))
        if not isinstance(entries, list):
            entries = []
    except (OSError, ValueError):
        entries = []
    entries = [e for e in entries if not (isinstance(e, dict) and e.get("key") == cache.key)]
    entries.append({"key": cache.key, "measured_at": now, "timings": timings})
    try:
        durable.write_atomically(cache.path, json.dumps(entries, indent=1) + "\n")
    except OSError as error:
        console.emit(f"warning: cannot write the comm-hook cache {cache.path}: {error.strerror}")


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(timings: dict[str, float], chosen: str, note: str = "") -> str:
    measured = ", ".join(f"{hook} {seconds:.3g}" for hook, seconds in timings.items())
    return f"auto: s/optimizer-step {measured}{note} -> {chosen}"


def choose(
    module: nn.Module,
    env: parallel.DistEnv,
    config,
    micro_step: MicroStep,
    accumulate: int = 1,
    *,
    candidates: tuple[str, ...] = CANDIDATES,
    steps: int = PROBE_STEPS,
    warmup: int = PROBE_WARMUP,
    no_sync: bool = True,
    cache: Cache | None = None,
    each: bool = False,
) -> Choice:
    """The fastest candidate hook for this model, batch and link; every rank calls it and gets
    the same choice. Ties go to the earlier candidate (none first: no compression error).
    Rank 0 prints one line of what was measured (or reused) and chosen."""
    if env.world_size <= 1:
        line = "auto: 1 process, no gradient all-reduce to speed up -> none"
        console.say(env, line)
        return Choice("none", {}, line)
    found = None
    if cache is not None:
        # Rank 0's node holds the file (no shared filesystem): its answer goes for every rank.
        found = parallel.all_gather(
            cached(cache, candidates, time.time()) if env.is_main else None, env
        )[0]
    if found is not None:
        assert cache is not None  # found in it
        timings, measured_at = found["timings"], found["measured_at"]
        note = f" (measured {_ago(time.time() - measured_at)} ago, {cache.path})"
    else:
        timings = measure(
            module,
            env,
            config,
            micro_step,
            accumulate,
            candidates=candidates,
            steps=steps,
            warmup=warmup,
            no_sync=no_sync,
            each=each,
        )
        measured_at, note = time.time(), ""
        if cache is not None and env.is_main:
            remember(cache, timings, measured_at)
    chosen = min(candidates, key=timings.__getitem__)
    line = describe(timings, chosen, note)
    console.say(env, line)
    return Choice(chosen, timings, line, measured_at, reused=found is not None)
