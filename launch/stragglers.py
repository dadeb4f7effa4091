"""The straggler a job names, said with its cause. Who, from either of two sources:

- our workloads' warning (`rank R on NODE is slow: ...`), from each rank's own work per step;
- for any script, each rank's time waiting in collectives (training.distributed.waits writes its
  totals, the launcher reads them every PACE_INTERVAL seconds: `paces`): the node whose ranks
  wait least while the other nodes' wait most is the one they wait for. A job where every node
  waits in collectives most of the time is held by the network: every node is probed, and the
  one whose link is the cause, if one alone is, is named. Our workloads measure their waits
  too, for that case only: a slow link slows no rank's own work, so their own split sees
  nothing, while who is slow by its own work is theirs to say (they say more). A job whose
  output carries our workloads' warning is read as ours from then on, the network's case
  included; a job on one node compares nothing (ranks sharing a loaded CPU are not
  stragglers).

Then the node is probed for the why (launch.causes), and the launcher's line naming the node and
its cause is said once, and again only when the node or the cause changes; every such line
goes in the run's record."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch_multinode.cluster.jobenv import PACE_FILE
from torch_multinode.cluster.sync import TOOL_PACKAGE
from torch_multinode.launch import causes
from torch_multinode.launch.spec import LEGACY_SHIM, JobSpec, job_module

# Our workloads' warning (training/loop/trainer.py's `_check_pace`).
SLOW_LINE = re.compile(
    r"warning: rank (\d+) on (\S+) is slow: ([\d.]+) s of its own work per step .*?"
    r"the other ranks' median ([\d.]+) s"
)


PACE_INTERVAL = 20.0  # seconds between two readings of the ranks' waits
# A node is the straggler when, in two windows in a row, its ranks wait in collectives a share of
# their time at least WAIT_GAP below the other nodes' ranks, and those wait at least WAIT_SHARE:
# on two loaded cores an even 2-node job's shares differ by a few percent; a node held to a
# tenth of a core leaves the other waiting over 80 % of the time.
WAIT_GAP = 0.3
WAIT_SHARE = 0.4
# Every node waiting this share of its time or more, in two windows in a row: the network holds
# the job, and every node is probed for it.
COMM_BOUND = 0.6
MIN_COLLECTIVES = 2  # a rank's window with fewer says nothing of it
COMM_BOUND_MARK = "(every node)"  # not a node's name: the network probe's place in the state


@dataclass(frozen=True)
class Pace:
    """A rank's totals since it started measuring (training.distributed.waits), on its clock."""

    rank: int
    node: str
    wall: float
    waited: float
    collectives: int


def watched(spec: JobSpec) -> bool:
    """Whether the job runs a script or module of the user's, whose ranks measure their waits
    because our sitecustomize (on its import path) starts the measure. Our workloads start it
    themselves (training.distributed.parallel.start) and say who is slow by their own split."""
    module = job_module(spec)
    ours = module.startswith(f"{TOOL_PACKAGE}.") and module != LEGACY_SHIM
    return spec.script is not None or not ours


def pace_command(run_dir: str) -> str:
    """Prints each rank's totals in a node's run directory, one a line."""
    files = f"{shlex.quote(run_dir)}/{PACE_FILE.format(rank='*')}"
    return f'for f in {files}; do [ -f "$f" ] && cat "$f" && echo; done; true'


def parse_paces(texts: Iterable[str]) -> dict[int, Pace]:
    """The ranks' totals in what the nodes printed (one JSON object a line; others skipped)."""
    found: dict[int, Pace] = {}
    for text in texts:
        for line in text.splitlines():
            try:
                data = json.loads(line)
                pace = Pace(
                    int(data["rank"]),
                    str(data["node"]),
                    float(data["wall"]),
                    float(data["waited"]),
                    int(data["collectives"]),
                )
            except (ValueError, TypeError, KeyError):
                continue
            found[pace.rank] = pace
    return found


def wait_shares(before: dict[int, Pace], now: dict[int, Pace]) -> dict[str, float]:
    """Per node, the median over its ranks of the share of the window between two readings
    that the rank spent waiting in collectives (each rank's window on its own clock)."""
    by_node: dict[str, list[float]] = {}
    for rank, pace in now.items():
        old = before.get(rank)
        if old is None or pace.wall <= old.wall:
            continue  # new, or restarted: its window starts at the next reading
        if pace.collectives - old.collectives < MIN_COLLECTIVES:
            continue
        share = (pace.waited - old.waited) / (pace.wall - old.wall)
        by_node.setdefault(pace.node, []).append(min(max(share, 0.0), 1.0))
    return {node: statistics.median(shares) for node, shares in by_node.items()}


def slowest(shares: dict[str, float]) -> tuple[str, float, float] | None:
    """The node the others wait for: (node, its ranks' share, the other nodes' median share),
    or None."""
    if len(shares) < 2:
        return None
    node = min(shares, key=shares.__getitem__)
    others = statistics.median_high(v for n, v in shares.items() if n != node)
    if others >= WAIT_SHARE and others - shares[node] >= WAIT_GAP:
        return node, shares[node], others
    return None


class Stragglers:
    """The straggler a job's output names, probed for its cause. `probe(node)`: the output of
    `script()` run on that node (raising where it cannot be reached); `interface(node)`: its
    compute interface. Each probe runs in a thread of its own, one per node at a time. `ours`:
    the job is one of our workloads, whose waits are read for the network's case only."""

    def __init__(
        self,
        probe: Callable[[str], str],
        interface: Callable[[str], str],
        emit: Callable[[str], None],
        ours: bool = False,
    ):
        self.probe, self.interface, self.emit, self.ours = probe, interface, emit, ours
        self.said: list[str] = []  # every line said, for the run's record
        self._last: tuple[str, str] | None = None  # (node, kind) last said
        self._probing: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._paces: dict[int, Pace] = {}  # the last reading
        self._candidate: str | None = None  # the last window's straggler, or COMM_BOUND's mark

    def note(self, line: str) -> None:
        """Read one line of the job's output; a slow rank's warning starts its node's probe."""
        found = SLOW_LINE.search(line)
        if found is None:
            return
        self.ours = True  # its own split says who is slow; the waits, the network's case
        rank, own, others = int(found.group(1)), float(found.group(3)), float(found.group(4))
        who = (
            f"rank {rank}'s own work takes {own * 1000:.0f} ms a step, the others' "
            f"{others * 1000:.0f} ms, and every rank waits for it"
        )
        self._begin(found.group(2), self._look, found.group(2), who)

    def paces(self, now: dict[int, Pace]) -> None:
        """Read the ranks' totals (parse_paces) of one reading; a node the others waited for in
        this window and the one before is probed (not in our workloads, which say it), and so is
        every node of a job held by the network."""
        before, self._paces = self._paces, {**self._paces, **now}
        shares = wait_shares(before, now)
        # Not who the others wait for in our workload: its own split says that. The network's
        # case holds for every job (CI run 54: our workload's warning for a loaded host, read
        # as ending every use of the waits, silenced the shaped link that followed).
        found = None if self.ours else slowest(shares)
        if found is not None:
            node, share, others = found
            if self._candidate == node:
                who = (
                    f"the other nodes' ranks wait in collectives {others:.0%} of the time, its "
                    f"own {share:.0%}: every rank waits for it"
                )
                self._begin(node, self._look, node, who)
            self._candidate = node
            return
        if len(shares) >= 2 and min(shares.values()) >= COMM_BOUND:
            if self._candidate == COMM_BOUND_MARK:
                self._begin(COMM_BOUND_MARK, self._look_links, sorted(shares), min(shares.values()))
            self._candidate = COMM_BOUND_MARK
            return
        self._candidate = None

    def _begin(self, key: str, look: Callable[..., None], *args: object) -> None:
        """`look(*args)` in a thread of its own, unless the probe for `key` (a node, or
        COMM_BOUND_MARK) is under way."""
        with self._lock:
            if key in self._probing:
                return
            self._probing.add(key)

        def probe() -> None:
            try:
                look(*args)
            finally:
                with self._lock:
                    self._probing.discard(key)

        thread = threading.Thread(target=probe, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the probes under way."""
        for thread in list(self._threads):
            thread.join(timeout)

    def _cause(self, node: str) -> causes.Cause:
        try:
            return causes.judge(*causes.parse(self.probe(node)), self.interface(node))
        except Exception as exc:  # noqa: BLE001 - a node that cannot be probed is said
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return causes.Cause("unknown", f"unknown (not probed: {first})")

    def _say(self, node: str, who: str, cause: causes.Cause) -> None:
        line = f"{node} is the straggler: {who}; cause: {cause.text}"
        with self._lock:
            if self._last == (node, cause.kind):
                return
            self._last = (node, cause.kind)
            self.said.append(line)
        self.emit(f"[launcher] {line}")

    def _look(self, node: str, who: str) -> None:
        self._say(node, who, self._cause(node))

    def _look_links(self, nodes: list[str], share: float) -> None:
        """Every node probed at once; the one node whose cause is its network, if one alone:
        its own link's (shaped, or with errors) before retransmits, which the nodes sending to
        a slow link show as well: with both counted, a job held by one shaped link named no one
        while its peers resent what that link dropped."""
        found: dict[str, causes.Cause] = {}

        def look(node: str) -> None:
            found[node] = self._cause(node)

        threads = [threading.Thread(target=look, args=(n,), daemon=True) for n in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(causes.WINDOW + 60)
        links = [n for n in nodes if n in found and found[n].kind == "network"]
        own = [n for n in links if not found[n].shared]
        if own:
            links = own
        if len(links) == 1:
            who = (
                f"every node's ranks wait in collectives {share:.0%} of the time or more, "
                f"and its link is the one that holds them"
            )
            self._say(links[0], who, found[links[0]])
