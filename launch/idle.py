"""Whether a quiet job's ranks do anything at all: the default hang signal for any script.

A job whose output has no step lines of our form and no heartbeat has no default stall time
(launch.progress): a user's own script may print once an epoch. What it cannot do, and still
train, is go on with every rank idle. So once such a job has printed nothing for IDLE_AFTER
seconds, each rank's processes' CPU time and the bytes they read and wrote (their /proc files,
every socket included) are read twice, IDLE_WINDOW seconds apart, and each rank's place in its
stacks (launch.hang) at both ends; when no process used more than IDLE_CPU of a CPU nor moved
more than IDLE_BYTES, every rank is where it was, and some rank waits in a collective, it is a
hang (progress.until_hang). Nothing runs inside the user's process.

A slow checkpoint written to a network filesystem moves bytes, and a rank computing uses CPU:
neither is idle. On GPUs NCCL's own threads may keep a waiting rank's CPU time moving, and
NCCL's watchdog (its collective timeout) still ends such a hang there.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

IDLE_AFTER = 120.0  # seconds without output before a quiet job's ranks are looked at
IDLE_WINDOW = 30.0  # seconds between the two readings
IDLE_CPU = 0.02  # of one CPU, over the window: what an idle rank's own threads may use
IDLE_BYTES = 65536  # read and written over the window, sockets and files together
MARK = "=== tmn idle"
WAITING = ("collective", "gpu", "backward")  # launch.hang's places where a rank waits for others

# Every process of the run's ranks: the ranks and what they started (DataLoader workers inherit
# RANK), found by the run's marker and RANK in their environment (hang.STACKS_SCRIPT's marker; a
# restart's run ID differs), and each one's CPU time in clock ticks (utime + stime, fields 14 and
# 15 of /proc/PID/stat, counted after the command's closing parenthesis) and bytes read and
# written (rchar + wchar of /proc/PID/io). Argument: the run's ID.
COUNTERS_SCRIPT = f"""\
run=$1
hz=$(getconf CLK_TCK)
for d in /proc/[0-9]*; do
    env=$(tr '\\0' '\\n' 2>/dev/null < "$d/environ") || continue
    printf '%s\\n' "$env" | grep -qxF "TMN_RUN_ID=$run" || continue
    rank=$(printf '%s\\n' "$env" | sed -n 's/^RANK=//p')
    [ -n "$rank" ] || continue
    ticks=$(sed 's/.*) //' "$d/stat" 2>/dev/null | awk '{{print $12 + $13}}')
    bytes=$(awk '/^(rchar|wchar):/ {{s += $2}} END {{print s + 0}}' "$d/io" 2>/dev/null)
    echo "{MARK} rank $rank pid ${{d#/proc/}} ticks ${{ticks:-}} hz $hz bytes ${{bytes:-}}"
done
"""
_LINE = re.compile(rf"^{MARK} rank (\d+) pid (\d+) ticks (\d+) hz (\d+) bytes (\d+)$")


@dataclass(frozen=True)
class Counters:
    cpu: float  # seconds of CPU, all its threads
    io: int  # bytes read and written


Processes = dict[tuple[int, int], Counters]
"""(rank, pid) -> its counters: a rank's own process and the ones it started."""


def command(run_id: str, container: str | None) -> str:
    """The command that prints every rank's counters on one node (in `container` when given)."""
    script = ["sh", "-c", COUNTERS_SCRIPT, "tmn-idle", run_id]
    if container is None:
        return shlex.join(script)
    return shlex.join(["docker", "exec", container, *script])


def parse(text: str) -> Processes:
    """One node's counters; a process whose files could not be read is left out."""
    found: Processes = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match:
            rank, pid, ticks, hz, io = (int(part) for part in match.groups())
            found[rank, pid] = Counters(ticks / max(hz, 1), io)
    return found


def idle(before: Processes, after: Processes, window: float) -> bool:
    """Whether every process of the ranks was idle between the readings: the same processes
    both times (a worker that ended or started is activity), none over IDLE_CPU of a CPU or
    IDLE_BYTES."""
    if not before or before.keys() != after.keys():
        return False
    return all(
        after[key].cpu - before[key].cpu <= IDLE_CPU * window
        and after[key].io - before[key].io <= IDLE_BYTES
        for key in before
    )


def moved(before: Processes, after: Processes) -> str:
    """What the ranks' processes did between the readings, for the launcher's line."""
    keys = sorted(before.keys() & after.keys())
    cpu = max((after[k].cpu - before[k].cpu for k in keys), default=0.0)
    io = max((after[k].io - before[k].io for k in keys), default=0)
    ranks = len({rank for rank, _ in keys})
    return (
        f"{ranks} rank(s), {len(keys)} process(es), each at most {cpu:.2f} s of CPU and {io} "
        "bytes read or written"
    )


def look(
    read: Callable[[], Processes],
    places: Callable[[], dict[int, str]],
    ended: Callable[[float], bool],
) -> str | None:
    """The ranks' counters read (`read`: every node's, merged) twice, IDLE_WINDOW seconds apart
    (`ended(seconds)`: waits, True when the job ended meanwhile), and where each rank is
    (`places`: rank -> its place, launch.hang's kind first) at both ends: what they did when
    every process was idle, every rank stayed where it was and some rank waits in a collective,
    else None. A silent script that makes slow progress (a small collective, then a sleep) is
    idle by its counters, but its ranks are not found in the same collective twice."""
    before = read()
    if not before:
        return None
    where = places()
    if not any(place.startswith(WAITING) for place in where.values()) or ended(IDLE_WINDOW):
        return None
    after = read()
    if not idle(before, after, IDLE_WINDOW) or places() != where:
        return None
    return moved(before, after)
