"""How a job ends: the summary, node by node, with the failed node's own last lines (a local
job's, rank by rank: `local_summary`), and the master's run directory brought back."""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster import durable
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch import staging
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.signatures import STORE_CLOSED, known_problems
from torch_multinode.launch.spec import EXCERPT_LINES, Emit, JobResult, JobSpec


def summary(result: JobResult, hosts: tuple[Host, ...]) -> list[str]:
    """What happened, node by node; for a failed node, its last lines."""
    verdict = (
        ("terminated (SIGTERM)" if result.terminated else "interrupted")
        if result.interrupted
        else "succeeded"
        if result.exit_code == 0
        else f"FAILED on {result.failed_node}"
    )
    lines = [
        f"Job {result.run_id} {verdict} after {result.seconds:.1f} s on {len(hosts)} node(s)"
        + (f", restart {result.restart} of {result.restarts}." if result.restart else ".")
    ]
    lines += [f"Nodes: {change}" for change in result.nodes_changed]
    lines += [f"Straggler: {line}" for line in result.stragglers]
    if result.failed_node and not result.interrupted:
        lines += _why(result, hosts) + list(result.flights)
    for host in hosts:
        outcome = result.outcomes[host.name]
        state = (
            outcome.error
            if outcome.error
            else "stopped"
            if outcome.exit_code is None
            else f"exit {outcome.exit_code}"
        )
        if outcome.link_down and not (outcome.error or "").startswith("lost:"):
            state += f"; {outcome.link_down}"
        lines.append(f"  {host.name:<12} {state}")
    if result.failed_node and not result.interrupted:
        excerpt = failure_excerpt(list(result.outcomes[result.failed_node].tail))
        if excerpt:
            lines.append(f"Last lines from {result.failed_node}:")
            lines += [f"  | {line}" for line in excerpt]
    return lines


def _why(result: JobResult, hosts: tuple[Host, ...]) -> list[str]:
    """The failed node's own exception, then every rank's error that follows from it (on that
    node or another) marked as its consequence."""
    failed = result.failed_node
    assert failed is not None  # asked of a failed run only (summary)
    cause, knock_ons = cause_and_knock_ons(exceptions(list(result.outcomes[failed].tail)))
    marked = [(failed, r) for r in knock_ons]
    for host in hosts:
        if host.name != failed:
            marked += [
                (host.name, r)
                for r in cause_and_knock_ons(exceptions(list(result.outcomes[host.name].tail)))[1]
            ]
    labelled = [(f"{name} rank {r.rank}" if r.rank else name, r) for name, r in marked]
    # What the table of known failures recognises, the failed node's lines first.
    tails = [result.outcomes[failed].tail] + [
        result.outcomes[host.name].tail for host in hosts if host.name != failed
    ]
    known = known_problems((line for tail in tails for line in tail), cause is not None)
    return cause_lines(cause, labelled, where=failed) + [s.line() for s in known]


# torchrun's own log lines (glog style: W1124 14:17:15.365000 PID path/to/torch/...py:LINE] ...).
_TORCHRUN_LOG = re.compile(r"^[DIWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
_FIRST_FAILURE = re.compile(r"^\[torchrun\] (rank \d+) failed first \((.+)\)$")


def local_summary(
    run_id: str,
    code: int,
    seconds: float,
    tail: list[str],
    flights: list[str] | None = None,
    hung: str | None = None,
) -> list[str]:
    """The summary a job on the nodes ends with, for this machine: which rank failed and how,
    each rank's last collective where the ranks left their traces (`flights`, launch.flight's
    lines), then the workers' last lines (torchrun's own log lines left out). `hung`: the hang
    report's cause, for a job stopped as hung (`tail`: its lines before the stop)."""
    if hung is not None:
        lines = [f"Job {run_id} FAILED on this machine after {seconds:.1f} s (hung: {hung})."]
        excerpt = failure_excerpt([line for line in tail if not _TORCHRUN_LOG.match(line)])
        return lines + (["Last lines:", *(f"  | {line}" for line in excerpt)] if excerpt else [])
    if code == 0:
        return [f"Job {run_id} succeeded after {seconds:.1f} s on this machine."]
    first = next((m for line in reversed(tail) if (m := _FIRST_FAILURE.match(line))), None)
    how = f"{first.group(1)}, {first.group(2)}" if first else f"exit {code}"
    workers = [
        line for line in tail if not (_TORCHRUN_LOG.match(line) or _FIRST_FAILURE.match(line))
    ]
    # The rank whose own exception started it leads, even when a peer's knock-on error (its
    # collective's "Connection closed by peer") ended first or was printed last.
    cause, knock_ons = cause_and_knock_ons(exceptions(workers))
    if (
        cause is not None
        and cause.rank is not None
        and (not first or first.group(1) != f"rank {cause.rank}")
    ):
        how = f"rank {cause.rank}" + (
            f"; {first.group(1)} exited first, {first.group(2)}" if first else f", exit {code}"
        )
    lines = [f"Job {run_id} FAILED on this machine after {seconds:.1f} s ({how})."]
    lines += cause_lines(cause, [(f"rank {r.rank}" if r.rank else "a rank", r) for r in knock_ons])
    lines += [signature.line() for signature in known_problems(workers, cause is not None)]
    lines += flights or []
    excerpt = failure_excerpt(workers)
    if excerpt:
        lines.append("Last lines:")
        lines += [f"  | {line}" for line in excerpt]
    return lines


def bring_back(
    inventory: Inventory, master: Host, spec: JobSpec, result: JobResult, emit: Emit
) -> None:
    """The master's run directory into the job's log directory, after a job that ended by
    itself (successful or not); after Ctrl-C or SIGTERM the user wants it stopped now, so only
    how to fetch it is said."""
    if spec.log_dir is None:
        return
    where = f"{master.name}:{run_dir(spec)}"
    if result.interrupted:
        result.brought_back = f"not copied (interrupted): it stays in {where}"
        return
    if result.outcomes[master.name].lost:
        result.brought_back = f"not copied: {master.name} was lost"
        return
    files, problem = staging.fetch_run_dir(inventory, master, run_dir(spec), spec.log_dir)
    if problem is None:
        result.brought_back = f"{files} file(s) from {where}"
    else:
        result.brought_back = f"not copied from {where}: {problem}"
        emit(f"[launcher] the run directory {where} was {result.brought_back}")


def failure_excerpt(lines: list[str], limit: int = EXCERPT_LINES) -> list[str]:
    """The worker's last words, not torchrun's: a failed torchrun ends with its own traceback
    (ChildFailedError) and a report; what the worker said comes just before them. A C++ stack
    (c10's "frame #N:" lines, after a store's or gloo's warning or an abort) is one line: its 30
    frames would fill the excerpt and push the worker's words out of it."""
    lines = _frames_collapsed(lines)
    cut = len(lines)
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].lstrip().startswith("Traceback (most recent call last):") and any(
            "ChildFailedError" in line for line in lines[index:]
        ):
            cut = index
            break
    report = [
        line.strip() for line in lines[cut:] if re.match(r"\s*(host|rank|exitcode)\s*:", line)
    ]
    window = lines[max(0, cut - limit) : cut]
    # The worker's own one-line error can be followed by a C++ abort's stack (gloo, NCCL) longer
    # than the window; that line says what to do, so it is kept, ahead of the stack's end.
    errors = [line for line in lines[: max(0, cut - limit)] if _WORKER_ERROR.match(line)]
    if errors and not any(_WORKER_ERROR.match(line) for line in window):
        window = [errors[-1], "..."] + window[-(limit - 2) :]
    return window + report


_WORKER_ERROR = re.compile(r"\s*(\[rank\d+\]:\s*)?(?P<said>Error: )")
CPP_FRAME = re.compile(r"\s*(\[rank\d+\]:\s*)?frame #\d+: ")  # a line of c10's C++ stacks


def _frames_collapsed(lines: list[str]) -> list[str]:
    out: list[str] = []
    for is_frame, run in itertools.groupby(lines, key=lambda line: bool(CPP_FRAME.match(line))):
        if is_frame:
            out.append(f"({len(list(run))} C++ stack frames, in the node's log)")
        else:
            out.extend(run)
    return out


# A rank's error that follows from a peer's failure, not its own (gloo, NCCL, c10d's store,
# torchrun's SIGTERM of the survivors): the knock-on, never the cause.
_KNOCK_ON = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused"
    r"|DistBackendError|DistNetworkError|DistStoreError|TCPStore|recvValue|Socket Timeout"
    r"|NCCL communicator was aborted|ncclRemoteError|remote process exited|ProcessGroupNCCL"
    r"|got signal: 15|SignalException|Signals\.SIGTERM|Watchdog caught collective"
)
_RANK = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?")
# Where a rank's prefixed line begins in the middle of another's: ranks share one output, and
# a line written in two pieces (print under PYTHONUNBUFFERED: the text, then its newline) can
# take another rank's in between ("rank 0 ready[rank1]: Traceback ..."; seen in CI run 25).
_GLUED = re.compile(r"(?<=.)(?=\[(?:default)?rank\d+\]: )")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+)')
_RAISED = re.compile(r"^(?P<kind>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python\d|^<")
MESSAGE_CHARS = 200


@dataclass(frozen=True)
class Raised:
    """One Python exception a rank died of, as its traceback showed it."""

    rank: str | None  # torchrun's "[rankN]:" prefix, when the line had one
    kind: str  # ValueError, torch.distributed.DistBackendError, ...
    message: str
    where: str | None  # file:line of the innermost frame outside installed packages
    knock_on: bool  # a consequence of a peer's failure
    wraps: str | None = None  # the exception it was raised from or while handling

    def said(self) -> str:
        text = f"{self.kind}: {_short(self.message)}" if self.message else self.kind
        text += f" (at {self.where})" if self.where else ""
        return text + (f", from {_short(self.wraps)}" if self.wraps else "")


def exceptions(lines: list[str]) -> list[Raised]:
    """Every exception whose traceback ended in `lines`, in the order they ended; ranks'
    interleaved lines are told apart by torchrun's "[rankN]:" prefix. Of a chain ("During
    handling of the above exception"), only the last, the one the rank died of, with what it
    wraps; it is a knock-on where that was a c10d store its other end closed."""
    frames: dict[str | None, list[tuple[str, str]] | None] = {}
    found: list[Raised] = []
    chained: set[str | None] = set()
    for raw in (part for glued in lines for part in _GLUED.split(glued)):
        match = _RANK.match(raw)
        rank, line = (match.group(1), raw[match.end() :]) if match else (None, raw)
        if line.startswith("Traceback (most recent call last):"):
            frames[rank] = []
            continue
        if any(line.startswith(text) for text in _CHAINED):
            chained.add(rank)
            continue
        stack = frames.get(rank)
        if stack is None:
            continue
        frame = _FRAME.match(line)
        if frame:
            stack.append((frame.group("file"), frame.group("line")))
            continue
        if line[:1].isspace() or not line.strip():
            continue  # the source line under a frame, or its ^^^ markers
        raised = _RAISED.match(line.strip())
        frames[rank] = None
        if raised is None or raised.group("kind").endswith("ChildFailedError"):
            continue  # not an exception line, or torchrun's own report of the failure
        previous = None
        if rank in chained:  # it replaces the one it was raised while handling
            chained.discard(rank)
            previous = next((r for r in reversed(found) if r.rank == rank), None)
            found = [r for r in found if r is not previous]
        own = [f for f in stack if not _LIBRARY.search(f[0])] or stack
        kind, message = raised.group("kind"), (raised.group("message") or "").strip()
        inner = f"{previous.kind}: {previous.message}" if previous else None
        found.append(
            Raised(
                rank=rank,
                kind=kind,
                message=message,
                where=f"{own[-1][0]}:{own[-1][1]}" if own else None,
                # Raised from a c10d store whose other end closed (torchrun's
                # RendezvousConnectionError): a knock-on too. Only the store's own words: one
                # raised from, say, a download's "Connection reset by peer" stays a cause.
                knock_on=bool(
                    _KNOCK_ON.search(f"{kind}: {message}") or (inner and STORE_CLOSED in inner)
                ),
                wraps=inner,
            )
        )
    return found


def own_words(lines: list[str]) -> str | None:
    """Why a node's ranks ended, in their own words and one line: the last one-line error a
    worker printed (`Error: ...`, with its remedy), else the exception a rank died of that is no
    peer's consequence; None where they said neither (killed, say). An FT=1 job's lost group."""
    errors = [found for line in lines if (found := _WORKER_ERROR.match(line))]
    if errors:
        return errors[-1].string[errors[-1].start("said") :].strip()
    cause, _ = cause_and_knock_ons(exceptions(lines))
    return f"raised {cause.said()}" if cause is not None else None


def cause_and_knock_ons(raised: list[Raised]) -> tuple[Raised | None, list[Raised]]:
    """The root cause (the first exception that is no peer's consequence) and the knock-on
    errors, one per rank."""
    cause = next((r for r in raised if not r.knock_on), None)
    knock_ons: dict[str | None, Raised] = {}
    for r in raised:
        if r.knock_on and r is not cause:
            knock_ons.setdefault(r.rank, r)
    return cause, list(knock_ons.values())


def cause_lines(
    cause: Raised | None, knock_ons: list[tuple[str, Raised]], where: str = ""
) -> list[str]:
    """The summary's lines on why: the cause first, then each knock-on error (`who`, the
    rank's label, and what it raised) marked as its consequence. `where`: the cause's node."""
    lines = []
    if cause is not None:
        who = " ".join(part for part in (where, f"rank {cause.rank}" if cause.rank else "") if part)
        lines.append(f"Cause: {who} raised {cause.said()}" if who else f"Cause: {cause.said()}")
    of = (f"rank {cause.rank}'s" if cause.rank else "that") if cause else "a peer's"
    for who, raised in knock_ons:
        lines.append(
            f"Consequence (of {of} failure): {who}'s {raised.kind}: {_short(raised.message)}"
        )
    return lines


def _short(message: str) -> str:
    return message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 3] + "..."


EXIT_CODE_VARIABLE = "TMN_EXIT_CODE_FILE"


def record_exit_code(code: int, environ=os.environ) -> None:
    """The launcher's exit code (0, 1, 2, 130, 143), written as one line to the file that
    TMN_EXIT_CODE_FILE names, when set: `make train` sets it (EXIT_CODE=, default
    .runs/exit-code) since make itself exits 2 whenever a recipe fails, whatever its code."""
    path = environ.get(EXIT_CODE_VARIABLE)
    if not path:
        return
    target = Path(path)
    try:
        durable.write_atomically(target, f"{code}\n")  # whole or absent, never half-written
    except OSError as exc:
        print(f"[launcher] could not write the exit code to {path}: {exc}", file=sys.stderr)
