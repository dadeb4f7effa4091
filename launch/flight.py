"""The Flight Recorder's part of a hang report, on the controller: the command that asks a
node's ranks for their traces and prints them (training.distributed.flight writes them), the
traces read, each rank's last collective (sequence number, op, sizes), and collectives that do
not match named: "rank 0 (node1) in all_reduce #812 while rank 1 (node2) in broadcast #812"."""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import shlex
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster.jobenv import FLIGHT_DUMP, FLIGHT_REQUEST, FLIGHT_TIMEOUT_DUMP

MARK = "=== tmn flight"
WAIT = 1.0  # seconds the ranks get to write their traces (they look twice a second)


@dataclass(frozen=True)
class Collective:
    seq: int  # the rank's collective sequence number in its process group
    op: str  # all_reduce, broadcast, barrier...
    sizes: str  # the input sizes, as torch records them ("" when none)
    group: str  # the process group's name

    def shown(self) -> str:
        return f"{self.op} #{self.seq}" + (f" (sizes {self.sizes})" if self.sizes else "")


def request_command(run_dir: str) -> str:
    """Asks the node's ranks for their traces (a file they watch, in their run directory)."""
    return f"touch {shlex.quote(f'{run_dir}/{FLIGHT_REQUEST}')} 2>/dev/null"


def collect_command(run_dir: str) -> str:
    """Prints each trace the node's ranks wrote, after a mark naming its file: the JSON ones as
    they are, NCCL's pickles (written on a timeout) in base64, on one line."""
    directory = shlex.quote(run_dir)
    return (
        f"for f in {directory}/{FLIGHT_DUMP.format(rank='*')}; do "
        f'[ -f "$f" ] || continue; echo "{MARK} $f"; cat "$f"; echo; done; '
        f"for f in {directory}/{FLIGHT_TIMEOUT_DUMP}*; do "
        f'[ -f "$f" ] || continue; echo "{MARK} $f"; base64 -w0 "$f"; echo; done'
    )


def _rank_of(path: str) -> tuple[int | None, bool]:
    """The rank a trace file is of, and whether it is NCCL's pickle."""
    name = path.rsplit("/", 1)[-1]
    if name.startswith(FLIGHT_TIMEOUT_DUMP):
        number = name.removeprefix(FLIGHT_TIMEOUT_DUMP)
        return (int(number) if number.isdigit() else None), True
    head, _, tail = FLIGHT_DUMP.partition("{rank}")
    number = name.removeprefix(head).removesuffix(tail)
    return (int(number) if number.isdigit() else None), False


class _PlainData(pickle.Unpickler):
    """A trace holds dicts, lists, strings and numbers only: anything else is refused, so a
    file on a node can never run code here."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a trace names no class ({module}.{name})")


def load_trace(content: bytes, pickled: bool) -> dict:
    """One trace file's content: NCCL's pickle (read as plain data only) or JSON."""
    return _PlainData(io.BytesIO(content)).load() if pickled else json.loads(content)


def _last_of(content: bytes, pickled: bool) -> Collective | None:
    """The last collective of one trace file's content; None for a trace cut short or
    unreadable (the stacks still say where the rank is)."""
    try:
        return last_collective(load_trace(content, pickled))
    except (ValueError, TypeError, KeyError, EOFError, pickle.PickleError):
        return None


def _keep(found: dict[int, Collective], rank: int, collective: Collective | None) -> None:
    """`collective` as `rank`'s last, unless a trace of the same rank already shows a later one
    (a rank may leave both its own trace and NCCL's)."""
    if collective is not None and (rank not in found or found[rank].seq < collective.seq):
        found[rank] = collective


def last_collective(trace: dict) -> Collective | None:
    """The collective (not a point-to-point op) of the default group a rank waits in. Under
    NCCL its lowest one not completed: NCCL's collectives return at once, and a rank queues
    several (a whole backward's buckets) behind the one that blocks, each recorded as queued
    and marked completed when its kernel ends. Under gloo, which blocks in each one and marks
    none completed, the newest; the newest too where every one completed."""
    entries = [
        e for e in trace.get("entries", []) if not e.get("is_p2p") and e.get("collective_seq_id")
    ]
    if not entries:
        return None
    default = [e for e in entries if "default_pg" in (e.get("process_group") or [""])]
    entries = default or entries
    pending = [
        e
        for e in entries
        if str(e.get("profiling_name", "")).startswith("nccl:")
        and e.get("state") not in (None, "completed")
    ]
    if pending:
        waiting = min(pending, key=lambda e: e["collective_seq_id"])
    else:
        waiting = max(entries, key=lambda e: e["collective_seq_id"])
    sizes = waiting.get("input_sizes") or []
    return Collective(
        int(waiting["collective_seq_id"]),
        str(waiting.get("profiling_name", "?")).split(":", 1)[-1],
        json.dumps(sizes, separators=(",", ":")) if sizes else "",
        (waiting.get("process_group") or ["", ""])[-1],
    )


def split(text: str) -> tuple[str, dict[int, Collective]]:
    """One node's collection: the text without the traces, and each rank's last collective."""
    kept: list[str] = []
    found: dict[int, Collective] = {}
    rank: int | None = None
    pickled = False
    body: list[str] = []

    def done() -> None:
        if rank is None:
            return
        text = "\n".join(body)
        try:  # NCCL's pickle travels in base64
            content = base64.b64decode(text.strip(), validate=True) if pickled else text.encode()
        except binascii.Error:
            return  # cut short in transit
        _keep(found, rank, _last_of(content, pickled))

    for line in text.splitlines():
        if line.startswith(MARK):
            done()
            (rank, pickled), body = _rank_of(line.removeprefix(MARK).strip()), []
        elif rank is not None and line.startswith("=== tmn"):
            done()
            rank, body = None, []
            kept.append(line)
        elif rank is not None:
            body.append(line)
        else:
            kept.append(line)
    done()
    return "\n".join(kept), found


# Collectives whose sizes differ between ranks by design (an uneven all_to_all, the root's
# scatter or gather): compared by op alone, as torch's own trace analyzer does.
_OWN_SIZES = ("all_to_all", "scatter", "gather")


def mismatch(flights: dict[int, Collective], nodes: dict[int, str]) -> str | None:
    """Ranks waiting in a collective of the same group and sequence number but another op or
    sizes: the collectives do not match (one rank skipped or reordered one)."""
    by_seq: dict[tuple[str, int], dict[tuple[str, str], list[int]]] = {}
    for rank, collective in flights.items():
        sizes = "" if collective.op.startswith(_OWN_SIZES) else collective.sizes
        key = (collective.op, sizes)
        by_seq.setdefault((collective.group, collective.seq), {}).setdefault(key, []).append(rank)
    for _, kinds in sorted(by_seq.items()):
        if len(kinds) < 2:
            continue
        parts = [
            ", ".join(f"rank {r} ({nodes.get(r, '?')})" for r in sorted(ranks))
            + f" in {flights[ranks[0]].shown()}"
            for _, ranks in sorted(kinds.items(), key=lambda item: min(item[1]))
        ]
        return "mismatched collectives: " + " while ".join(parts)
    return None


def from_directory(directory: Path) -> dict[int, Collective]:
    """Each rank's last collective from the traces in a run directory on this machine (a
    local job's), read as a node's collection is."""
    found: dict[int, Collective] = {}
    paths = [
        *directory.glob(FLIGHT_DUMP.format(rank="*")),
        *directory.glob(f"{FLIGHT_TIMEOUT_DUMP}*"),
    ]
    for path in sorted(paths):
        rank, pickled = _rank_of(path.name)
        if rank is None:
            continue
        try:
            content = path.read_bytes()
        except OSError:
            continue
        _keep(found, rank, _last_of(content, pickled))
    return found


def failure_lines(flights: dict[int, Collective], nodes: dict[int, str]) -> list[str]:
    """A failed job's summary lines from the traces its ranks left: each rank's last collective,
    and the mismatch, if any, named."""
    if not flights:
        return []
    lines = ["Last collectives (the Flight Recorder's traces, written as the ranks ended):"]
    lines += [
        f"  rank {rank} ({nodes.get(rank, '?')}): {collective.shown()}"
        for rank, collective in sorted(flights.items())
    ]
    found = mismatch(flights, nodes)
    if found is not None:
        lines.append(f"  {found}")
    return lines
