"""The first-day check of a cluster: every GPU path the project has, on every node, as a job.

    make selftest                          # this machine (2 CPU processes, or one per GPU)
    make selftest INVENTORY=cluster.yml    # every node, in the training containers

Each rank runs every check on its own device (cuda:LOCAL_RANK, or the CPU with gloo), and rank 0
prints one table (check, node, result, time, what it proves) of every rank's results, gathered
over a gloo group. A check a CPU node cannot run (fp16 with GradScaler, DataParallel and model
parallel over 2+ GPUs, NCCL's transport) is SKIPPED with its reason. A failed check is one
`Error:` line naming the check, the node and the remedy, with NCCL's own WARN lines where it
said any, and the exit code is 1. On a GPU each rank's NCCL log stays in the run directory
(training.selftesting.nccl_log), its warnings on the console, all of it under DEBUG=1.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.distributed import parallel
from torch_multinode.training.selftesting import nccl_log
from torch_multinode.training.selftesting.checks import (
    DATA_TIMEOUT,
    DEBUG_REMEDY,
    FAIL,
    PASS,
    SKIPPED,
    STOPPED,
    WARN,
    Failed,
    Job,
    Skip,
    Stopped,
)
from torch_multinode.training.selftesting.checks import RUNS as _RUNS
from torch_multinode.training.selftesting.ft import check_ft_replicas
from torch_multinode.training.selftesting.node_gpus import check_data_parallel, check_model_parallel
from torch_multinode.training.selftesting.replicas import check_fsdp2_replicas
from torch_multinode.training.settings import arguments, console

# A node's row shows its ranks' worst result, a skip counting least: the checks over all of a
# node's GPUs run in its local rank 0 and skip in the others, and that row is local rank 0's.
_ORDER = (SKIPPED, PASS, WARN, STOPPED, FAIL)
CONTROL_TIMEOUT = 600  # the gloo group the results travel on outlives a check's timeout


@dataclass(frozen=True)
class Check:
    name: str
    proves: str


CHECKS = (
    Check("device", "each local rank computes on its own device, cuda:LOCAL_RANK or the CPU"),
    Check(
        "comm-in-node",
        "all_reduce, all_gather, broadcast, send/recv exact between the node's ranks",
    ),
    Check("comm-across-nodes", "all_reduce, all_gather, broadcast, send/recv exact between nodes"),
    Check(
        "nccl-transport", "the network NCCL used between nodes (IB or sockets) fits the hardware"
    ),
    Check("amp-bf16", "bf16 autocast training steps: bf16 compute, fp32 weights, loss falls"),
    Check("amp-fp16", "fp16 autocast steps with torch.amp.GradScaler, an overflow skipped"),
    Check("ddp-checkpoint", "DDP checkpoint saved and resumed (CheckpointStore, RNG): same result"),
    Check("fsdp2-dcp", "FSDP2 mixed precision; DCP save, load and reshard to one process"),
    Check(
        "fsdp2-replicas",
        "a step's shards copied to the next node beside the job's collectives; a wiped node "
        "gets them back on resume",
    ),
    Check(
        "ft-replicas",
        "FT=1: torchft replicates DDP's gradients across groups (a rank each here); steps commit",
    ),
    Check("compile", "torch.compile (inductor) builds and matches eager, forward and backward"),
    Check(
        "flight-recorder",
        "this rank's Flight Recorder trace (a hang report's) holds its collective",
    ),
    Check(
        "nccl-waits",
        "the straggler watch's waits: NCCL's collectives timed on the GPU, read from the trace",
    ),
    Check("data-parallel", "nn.DataParallel over the node's GPUs equals one GPU"),
    Check(
        "model-parallel",
        "a model split over two GPUs equals it on one, gradients included; DDP trains it",
    ),
)
CHECK_NAMES = tuple(check.name for check in CHECKS)
RUNS = {
    **_RUNS,
    "fsdp2-replicas": check_fsdp2_replicas,
    "ft-replicas": check_ft_replicas,
    "data-parallel": check_data_parallel,
    "model-parallel": check_model_parallel,
}
assert CHECK_NAMES == arguments.SELFTEST_CHECKS  # --fail offers them without importing torch


@dataclass(frozen=True)
class Result:
    check: str
    rank: int
    node: str
    status: str
    seconds: float
    detail: str = ""
    remedy: str = ""


# -- running and reporting -------------------------------------------------------------------


def run_check(job: Job, name: str) -> Result:
    """One check on this rank, whatever happens in it; every rank meets after it."""
    started = time.perf_counter()
    status, detail, remedy = PASS, "", ""
    mark = job.nccl_log.mark() if job.nccl_log is not None else 0
    raised: BaseException | None = None
    try:
        answer = RUNS[name](job)
        status, detail = answer if isinstance(answer, tuple) else (PASS, answer or "")
        if job.fail == name and job.env.rank == job.env.world_size - 1:
            raise Failed("failed on purpose (--fail, a test hook)", "leaving out --fail")
    except Skip as skipped:
        status, detail = SKIPPED, str(skipped)
    except Stopped as stopped:
        status, detail = STOPPED, str(stopped)
    except Failed as failed:
        status, detail, remedy = FAIL, str(failed), failed.remedy
    except Exception as error:  # a crash in a check is its failure, not the selftest's
        lines = traceback.format_exception_only(error)[-1].strip().splitlines()
        status, detail = FAIL, lines[0] if lines else type(error).__name__
        remedy, raised = DEBUG_REMEDY, error
    if job.cuda:
        try:  # the check's kernels are done before its time is taken
            torch.cuda.synchronize(job.device)
        except RuntimeError as error:  # an asynchronous CUDA error surfaces here
            status, detail, remedy = FAIL, str(error).splitlines()[0], DEBUG_REMEDY
            raised = error
    if status == FAIL and job.nccl_log is not None:
        # NCCL's own words: the cause that torch's first line leaves out.
        explained = job.nccl_log.explain(detail, mark, raised)
        if explained != detail:
            detail = explained
            remedy = f"{remedy}; NCCL's whole log: {job.nccl_log.path} on {job.node}"
    return Result(
        name, job.env.rank, job.node, status, time.perf_counter() - started, detail, remedy
    )


def rows(results: list[Result]) -> list[tuple[str, str, str, str, str]]:
    """One row per check and node: its ranks' worst result, their longest time, and what they
    said (each different thing once)."""
    by_node: dict[tuple[str, str], list[Result]] = {}
    for result in results:
        by_node.setdefault((result.check, result.node), []).append(result)
    table = []
    proves = {check.name: check.proves for check in CHECKS}
    for (name, node), found in by_node.items():
        status = max((r.status for r in found), key=_ORDER.index)
        seconds = max(r.seconds for r in found)
        said = "; ".join(dict.fromkeys(r.detail for r in found if r.status == status and r.detail))
        what = f"{proves[name]} ({said})" if said and status == PASS else proves[name]
        if status != PASS and said:
            what = f"{said}" if status in (SKIPPED, STOPPED) else f"{proves[name]}: {said}"
        shown_time = "-" if status == SKIPPED else f"{seconds:.1f}s"
        table.append((name, node, status, shown_time, what))
    return table


def render(results: list[Result]) -> list[str]:
    table = rows(results)
    header = ("check", "node", "result", "time", "what it proves")
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
        + "  "
        + row[4]
        for row in [header, *table]
    ]
    return lines


def problems(results: list[Result]) -> tuple[list[str], list[str]]:
    """(one `Error:` line per failed check and node, one `Warning:` line per warning)."""
    errors, warnings = {}, {}
    for result in results:
        key = (result.check, result.node)
        if result.status == FAIL and key not in errors:
            rank = f"rank {result.rank}"
            errors[key] = UserError(
                f"selftest check {result.check} failed on {result.node} ({rank}): {result.detail}",
                hint=result.remedy or None,
            ).line()
        elif result.status == WARN and key not in warnings:
            warnings[key] = f"Warning: {result.check} on {result.node}: {result.detail}"
    return list(errors.values()), list(warnings.values())


def start_failed(job: Job, error: BaseException) -> UserError:
    """A rank that could not join the job's process group (under NCCL: its first communicator
    between the nodes) as one line: torch's first line, then NCCL's own words."""
    lines = str(error).strip().splitlines()
    detail = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    hint = DEBUG_REMEDY
    if job.nccl_log is not None:
        explained = job.nccl_log.explain(detail, 0, error)
        if explained != detail:
            detail = explained
            hint = f"{hint}; NCCL's whole log: {job.nccl_log.path} on {job.node}"
    return UserError(
        f"selftest could not join the job's process group on {job.node} "
        f"(rank {job.env.rank}): {detail}",
        hint=hint,
        exit_code=1,
    )


def main(argv: list[str] | None = None) -> int:
    args = arguments.selftest(argv)
    env = parallel.read_env()
    node = parallel.node_name()
    local = Path(tempfile.mkdtemp(prefix="selftest-"))  # this rank's own
    job = Job(env, node, local, args.fail)
    # Before the first communicator: NCCL reads its variables once.
    job.nccl_log = nccl_log.place(env.device.type, env.rank, local)
    if job.nccl_log is not None:
        job.nccl_log.start()
    try:
        try:  # under NCCL the job's first communicator forms here (bound to the rank's GPU)
            parallel.start(env, timeout_seconds=DATA_TIMEOUT)
        except UserError:
            raise
        except Exception as error:
            raise start_failed(job, error) from None
        if env.launched:
            job.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT))
        # One name on every rank: on storage they share, the checkpoints of every rank meet.
        token = job.gather(uuid.uuid4().hex[:10])[0]
        base = Path(args.checkpoint_dir or tempfile.gettempdir())
        job.scratch = base / f"selftest-{token}"
        job.scratch.mkdir(parents=True, exist_ok=True)
        job.nodes = job.gather(node)
        console.say(
            env,
            f"selftest: {env.world_size} rank(s) on {len(set(job.nodes))} node(s), "
            f"{env.backend or 'no process group'}, {env.device.type}",
        )
        results: list[Result] = []
        for name in CHECK_NAMES:
            if not args.only or name in args.only:
                results += job.gather(run_check(job, name))
        errors, warnings = problems(results)
        console.say(env, *render(results), *warnings)
        if errors:
            if env.is_main:
                console.emit("\n".join(errors), sys.stderr)
            return 1
        console.say(env, f"selftest passed on {len(set(job.nodes))} node(s)")
        return 0
    finally:
        if env.launched and dist.is_initialized() and job.control is not None:
            dist.barrier(group=job.control)  # every rank is done with the files
        if job.nccl_log is not None:
            job.nccl_log.stop()  # the log itself stays where it is (the run directory)
        if job.scratch != local:
            shutil.rmtree(job.scratch, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    parallel.run(main)
