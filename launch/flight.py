"""The Flight Recorder's part of a hang report, on the controller: the command that asks a
node's ranks for their traces and prints them (training.distributed.flight writes them), the
traces read, each rank's last collective (sequence number, op, sizes), and collectives that do
not match named: "rank 0 (node1) in all_reduce #812 while rank 1 (node2) in broadcast #812"."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from torch_multinode.cluster.jobenv import FLIGHT_DUMP, FLIGHT_REQUEST

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
    """Prints each trace the node's ranks wrote, after a mark naming its file."""
    pattern = f"{shlex.quote(run_dir)}/{FLIGHT_DUMP.format(rank='*')}"
    return f'for f in {pattern}; do [ -f "$f" ] || continue; echo "{MARK} $f"; cat "$f"; echo; done'


def _rank_of(path: str) -> int | None:
    name = path.rsplit("/", 1)[-1]
    head, _, tail = FLIGHT_DUMP.partition("{rank}")
    number = name.removeprefix(head).removesuffix(tail)
    return int(number) if number.isdigit() else None


def last_collective(trace: dict) -> Collective | None:
    """The newest collective (not a point-to-point op) of the default group in a trace."""
    entries = [
        e for e in trace.get("entries", []) if not e.get("is_p2p") and e.get("collective_seq_id")
    ]
    if not entries:
        return None
    default = [e for e in entries if "default_pg" in (e.get("process_group") or [""])]
    newest = max(default or entries, key=lambda e: e["collective_seq_id"])
    sizes = newest.get("input_sizes") or []
    return Collective(
        int(newest["collective_seq_id"]),
        str(newest.get("profiling_name", "?")).split(":", 1)[-1],
        json.dumps(sizes, separators=(",", ":")) if sizes else "",
        (newest.get("process_group") or ["", ""])[-1],
    )


def split(text: str) -> tuple[str, dict[int, Collective]]:
    """One node's collection: the text without the traces, and each rank's last collective."""
    kept: list[str] = []
    found: dict[int, Collective] = {}
    rank: int | None = None
    body: list[str] = []

    def done() -> None:
        if rank is None:
            return
        try:
            collective = last_collective(json.loads("\n".join(body)))
        except (ValueError, TypeError, KeyError):
            collective = None  # a trace cut short: the stacks still say where the rank is
        if collective is not None:
            found[rank] = collective

    for line in text.splitlines():
        if line.startswith(MARK):
            done()
            rank, body = _rank_of(line.removeprefix(MARK).strip()), []
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


def mismatch(flights: dict[int, Collective], nodes: dict[int, str]) -> str | None:
    """Ranks whose newest collective has the same sequence number but another op or sizes: the
    collectives do not match (one rank skipped or reordered one)."""
    by_seq: dict[int, dict[tuple[str, str], list[int]]] = {}
    for rank, collective in flights.items():
        key = (collective.op, collective.sizes)
        by_seq.setdefault(collective.seq, {}).setdefault(key, []).append(rank)
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
