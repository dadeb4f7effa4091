"""What a hung job's ranks are doing: each rank's Python stacks, read from outside with py-spy
on every node at once, merged into one report that names the rank (or ranks) that are not
where the others wait, and the line of code they are at.

The collection is one shell command per node (`stacks_command`), run in the job's container in
container mode (which has SYS_PTRACE for it) or on the host; what it prints is parsed here
(`parse`) and judged (`judge`): pure functions of text, tested without a cluster.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from torch_multinode.cluster.versions import PY_SPY_VERSION
from torch_multinode.launch import flight

STACKS_TIMEOUT = 45  # seconds one node's collection may take, all its ranks (in parallel)
PY_SPY_TIMEOUT = 10  # seconds one rank's dump may take
MARK = "=== tmn"
NO_PY_SPY = (
    "py-spy is not installed beside the job's Python there (the training image has it; on the "
    f"host: pip install py-spy=={PY_SPY_VERSION} into the environment the jobs run in)"
)

# Every rank (a process carrying the run's marker and RANK, whose parent does not carry RANK:
# DataLoader workers do) and its stacks. Arguments: py-spy's path, the run's ID, and "native"
# for the native frames too (on GPU nodes: a rank waiting for its GPU is in libcuda there).
STACKS_SCRIPT = f"""\
spy=$1 run=$2 native=
[ "$3" = native ] && native=--native
[ -x "$spy" ] || spy=$(command -v py-spy) || {{ echo "{MARK} {NO_PY_SPY}"; exit 0; }}
found= n=0
out=$(mktemp -d) || exit 1
# Every rank's dump at once, each into its own file, printed in order once all are done: one
# after another, 8 ranks of 10 s each could outlast the node's whole collection.
for d in /proc/[0-9]*; do
    pid=${{d#/proc/}}
    env=$(tr '\\0' '\\n' 2>/dev/null < "$d/environ") || continue  # 2> before <: its error too
    case "$env" in *"TMN_RUN_ID=$run"*) ;; *) continue ;; esac
    printf '%s\n' "$env" | grep -qxF "TMN_RUN_ID=$run" || continue  # not a restart's -r1
    rank=$(printf '%s\\n' "$env" | sed -n 's/^RANK=//p')
    [ -n "$rank" ] || continue
    parent=$(sed -n 's/^PPid:[[:space:]]*//p' "$d/status" 2>/dev/null)
    tr '\\0' '\\n' 2>/dev/null < "/proc/$parent/environ" | grep -q '^RANK=' && continue
    found=1 n=$((n + 1))
    {{
        echo "{MARK} rank $rank pid $pid"
        timeout {PY_SPY_TIMEOUT} "$spy" dump $native --full-filenames --pid "$pid" 2>&1 \\
            || echo "{MARK} py-spy failed: exit $?"
    }} > "$out/$n" &
done
wait
i=1
while [ "$i" -le "$n" ]; do cat "$out/$i"; i=$((i + 1)); done
rm -rf "$out"
[ -n "$found" ] || echo "{MARK} no rank process"
"""

_THREAD = re.compile(r'^Thread (?P<id>\S+) \((?P<state>[^)]*)\)(?::\s*"(?P<name>.*)")?\s*$')
_FRAME = re.compile(r"^\s+(?P<function>.+?) \((?P<file>.+):(?P<line>\d+)\)\s*$")
# --native: "    cuLaunchKernel (/usr/local/nvidia/lib64/libcuda.so.580.159.04)", no line
_NATIVE = re.compile(r"^\s+(?P<function>.+) \((?P<file>/[^()]*)\)\s*$")
# A rank whose main thread is in one of these waits for its GPU: NCCL's collectives return at
# once, and the rank waits at its next synchronisation (.item(), a copy, a kernel launch).
_GPU_LIBRARIES = re.compile(r"/lib(cuda|cudart|nccl)\.so")
_RANK = re.compile(rf"^{MARK} rank (?P<rank>\d+) pid (?P<pid>\d+)$")
# Where library code lives: a frame there is not the user's line.
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")
# Our measure of a rank's waits (training.distributed.waits) waits for a blocking collective in
# the process group's hook, inside the script's call: never the rank's place or its line.
_OUR_HOOK = "torch_multinode/training/distributed/waits.py"
# torch.distributed's own wrappers around a collective: the op is the frame below them.
_WRAPPERS = {"wrapper", "inner", "_fn", "__call__", "_wrapped_call_impl", "_call_impl"}


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int  # 0: a native frame (py-spy --native)

    @property
    def python(self) -> bool:
        return self.line > 0

    def shown(self, workdir: str | None = None) -> str:
        return f"{short_path(self.file, workdir)}:{self.line} in {self.function}"


@dataclass
class RankStacks:
    node: str
    rank: int
    pid: int
    threads: dict[str, list[Frame]] = field(default_factory=dict)  # innermost frame first
    problem: str | None = None  # why no stacks were read

    @property
    def main(self) -> list[Frame]:
        if "MainThread" in self.threads:
            return self.threads["MainThread"]
        return next(iter(self.threads.values()), [])


@dataclass(frozen=True)
class Place:
    """Where one rank's main thread is: in a collective (`op`), waiting for its GPU, in backward
    (DDP's gradient all_reduce waits there), or elsewhere; `line` is the user's innermost
    frame, `innermost` the innermost Python frame."""

    kind: str  # "collective", "gpu", "backward", "elsewhere", "unknown"
    op: str | None
    line: Frame | None
    innermost: Frame | None


def short_path(path: str, workdir: str | None = None) -> str:
    """A frame's file as a person reads it: relative to the project, or from the package on."""
    if workdir and path.startswith(workdir.rstrip("/") + "/"):
        return path[len(workdir.rstrip("/")) + 1 :]
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def stacks_command(run_id: str, py_spy: str, container: str | None, native: bool = False) -> str:
    """The command that prints every rank's stacks on one node (in `container` when given),
    with their native frames where `native`."""
    script = ["sh", "-c", STACKS_SCRIPT, "tmn-stacks", py_spy, run_id, "native" if native else "-"]
    if container is None:
        return shlex.join(script)
    return shlex.join(["docker", "exec", container, *script])


def parse(node: str, text: str) -> tuple[list[RankStacks], str | None]:
    """One node's collection: its ranks' stacks, and why there are none (or None)."""
    ranks: list[RankStacks] = []
    problem: str | None = None
    thread: list[Frame] | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        found = _RANK.match(line)
        if found:
            ranks.append(RankStacks(node, int(found["rank"]), int(found["pid"])))
            thread = None
            continue
        if line.startswith(MARK):
            said = line.removeprefix(MARK).strip()
            if ranks and said.startswith("py-spy failed"):
                ranks[-1].problem = ranks[-1].problem or said  # py-spy's own words first
            elif not ranks:
                problem = said
            continue
        if not ranks:
            continue
        found = _THREAD.match(line)
        if found:
            thread = ranks[-1].threads.setdefault(found["name"] or found["id"], [])
            continue
        found = _FRAME.match(line)
        if found and thread is not None:
            thread.append(Frame(found["function"], found["file"], int(found["line"])))
            continue
        found = _NATIVE.match(line)
        if found and thread is not None:
            thread.append(Frame(found["function"], found["file"], 0))
        elif line.strip() and ranks[-1].problem is None and not ranks[-1].threads:
            if not line.startswith(("Process ", "Python v")):
                ranks[-1].problem = line.strip()
    for rank in ranks:
        if not rank.threads and rank.problem is None:
            rank.problem = "py-spy printed no stack"
    return ranks, problem


def place(stacks: RankStacks) -> Place:
    frames = [f for f in stacks.main if f.python and _OUR_HOOK not in f.file]
    if not frames:
        return Place("unknown", None, None, None)
    user = next((f for f in frames if not any(m in f.file for m in _LIBRARY)), None)
    distributed = [f for f in frames if "/torch/distributed/" in f.file]
    if distributed:
        # py-spy names a function by its qualified name: "_exception_logger.<locals>.wrapper"
        named = [f for f in distributed if f.function.rsplit(".", 1)[-1] not in _WRAPPERS]
        op = (named or distributed)[-1].function  # the outermost: the call the user made
        return Place("collective", op, user, frames[0])
    if any(_GPU_LIBRARIES.search(f.file) for f in stacks.main if not f.python):
        return Place("gpu", None, user, frames[0])
    if any("/torch/autograd/" in f.file for f in frames):
        return Place("backward", None, user, frames[0])
    return Place("elsewhere", None, user, frames[0])


def shown_place(stacks: RankStacks) -> str:
    """Where a rank is, in one line that starts with its place's kind (launch.idle compares two
    readings of it)."""
    found = place(stacks)
    at = found.line or found.innermost
    return f"{found.kind} {found.op or '-'} {at.shown() if at is not None else '-'}"


def _waits(found: Place) -> str:
    return "a collective queued on the GPU" if found.kind == "gpu" else "backward"


@dataclass
class Verdict:
    lines: list[str]  # the report, short: what is printed
    culprits: list[RankStacks]  # the ranks named as the cause (may be empty)
    cause: str  # one line for the job's summary


def _where(stacks: RankStacks, found: Place, workdir: str | None) -> str:
    who = f"rank {stacks.rank} on {stacks.node}"
    if found.kind == "unknown":
        return f"{who}: no stacks ({stacks.problem or 'none read'})"
    at = found.line or found.innermost
    called = f", called at {at.shown(workdir)}" if at is not None else ""
    if found.kind == "collective":
        return f"{who}: waits in {found.op}{called}"
    if found.kind == "gpu":
        return f"{who}: waits for its GPU (a collective or kernel queued there){called}"
    if found.kind == "backward":
        return f"{who}: in backward (DDP's gradient all_reduce waits there){called}"
    assert at is not None  # every place but "unknown" has its innermost frame
    inner = found.innermost
    deeper = f" (inside {inner.shown(workdir)})" if inner is not None and inner != at else ""
    return f"{who}: not in a collective, at {at.shown(workdir)}{deeper}"


def judge(
    ranks: list[RankStacks],
    silent: dict[str, str],
    workdir: str | None = None,
    flights: dict[int, flight.Collective] | None = None,
) -> Verdict:
    """The report: each rank's place, then who is the likely cause. `silent`: nodes whose
    stacks could not be read, and why; `flights`: each rank's last collective, from the
    Flight Recorder (launch.flight), where its trace was read."""
    flights = flights or {}
    ordered = sorted(ranks, key=lambda r: r.rank)
    places = {id(r): place(r) for r in ordered}
    lines = [
        _where(r, places[id(r)], workdir)
        + (f"; last collective {flights[r.rank].shown()}" if r.rank in flights else "")
        for r in ordered
    ]
    lines += [f"{node}: no stacks ({why})" for node, why in sorted(silent.items())]
    waiting = [r for r in ordered if places[id(r)].kind in ("collective", "gpu", "backward")]
    elsewhere = [r for r in ordered if places[id(r)].kind == "elsewhere"]
    ops = {places[id(r)].op for r in waiting if places[id(r)].kind == "collective"}

    def named(group: list[RankStacks]) -> str:
        return ", ".join(f"rank {r.rank} ({r.node})" for r in group)

    mismatched = flight.mismatch(flights, {r.rank: r.node for r in ordered})
    if mismatched:
        cause = mismatched  # the Flight Recorder's sequence numbers say it exactly
        culprits = []
    elif waiting and elsewhere:
        first = elsewhere[0]
        at = places[id(first)].line or places[id(first)].innermost
        cause = (
            f"{named(elsewhere)} not in a collective (rank {first.rank} at "
            f"{at.shown(workdir) if at else 'an unknown line'}) while {named(waiting)} "
            f"wait{'s' if len(waiting) == 1 else ''} in "
            f"{' / '.join(sorted(o for o in ops if o)) or _waits(places[id(waiting[0])])}"
        )
        culprits = elsewhere
    elif len(ops) > 1:
        parts = "; ".join(
            f"{named([r for r in waiting if places[id(r)].op == op])} in {op}"
            for op in sorted(o for o in ops if o)
        )
        cause = f"ranks wait in different collectives: {parts}"
        culprits = []
    elif silent and waiting:
        cause = (
            f"{named(waiting)} wait in {next(iter(ops), None) or _waits(places[id(waiting[0])])}; "
            f"no stacks from "
            f"{', '.join(sorted(silent))}, the likely cause"
        )
        culprits = []
    elif waiting:
        cause = (
            f"every rank read waits in {next(iter(ops), None) or _waits(places[id(waiting[0])])}: "
            f"a rank or node "
            f"not in this job's stacks, or the network, holds them"
        )
        culprits = []
    elif elsewhere:
        cause = "no rank is in a collective: each rank's line is above"
        culprits = elsewhere
    else:
        cause = "no rank's stacks could be read"
        culprits = []
    return Verdict(lines, culprits, cause)
