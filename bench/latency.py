"""19. The straggler watch's latency (issue 55): seconds from a slowdown to the launcher's line
naming the node and its cause, against LATENCY_TARGET, on 2 nodes in the training image
(launch_mode: container), their links unshaped for it. In each rep, two jobs: our workload
(training.ddp) and a user's own script (an all_reduce in a loop, nothing of ours in it). Each
runs even first, and nothing may be said then (five minutes in the first rep, a minute after),
then node2's compute link is shaped far below the other's (`tc`,
SHAPED_RATE) until the line names it with cause network; the link freed, node2's job container
is held to a fraction of a core (`docker update --cpus`) until the line names it with cause CPU.

Who is slow comes from our workload's own split of its step (the CPU case in our workload), or
from the ranks' waits in collectives read every stragglers.PACE_INTERVAL seconds (the rest); a
node is named after two windows in a row, then probed for causes.WINDOW seconds. What the watch
costs a step is section 17's."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

from torch_multinode.bench.measure import REPO_ROOT, Progress, Series
from torch_multinode.bench.timed import TimedOutput
from torch_multinode.cluster.containers import container_name
from torch_multinode.sim import nodes as sim

LATENCY_TARGET = 120.0  # seconds from the slowdown to the line
SHAPED_RATE = "200kbit"
HELD_CPUS = {"ours": "0.1", "script": "0.02"}
# The even cluster first, and nothing said: five minutes in the first rep (issue 55's even run),
# a minute (three readings of the waits) in the others and under --quick.
EVEN_SECONDS, EVEN_FIRST = 60.0, 300.0
WAIT_LIMIT = 300.0  # a line that never comes fails the section, not the bench's whole run
# Our workload with steps big enough that a held rank loses well over 20 ms a step (the test's).
OURS = (
    "--model tiny --image-size 32 --train-samples 256 --val-samples 128 --global-batch-size 64 "
    "--workers 0 --log-every 5 --steps 100000"
).split()
# A user's own script: a little work (5 ms of CPU, 15 ms waiting as for a GPU) and an
# all_reduce, forever; a line every 200 rounds.
SCRIPT = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.set_num_threads(1)
tensor, rounds = torch.ones(1000), 0
while True:
    begun = time.process_time()
    while time.process_time() - begun < 0.005:
        pass
    time.sleep(0.015)
    dist.all_reduce(tensor)
    rounds += 1
    if rounds % 200 == 0 and dist.get_rank() == 0:
        print(f"round {rounds}", flush=True)
"""
_RUN_ID = re.compile(r"^\[launcher\] job ([^:\s]+):")
_LINK = re.compile(r"^\[launcher\] node2 is the straggler: .*; cause: network: \S+ is shaped")
_CPU = re.compile(r"^\[launcher\] node2 is the straggler: .*; cause: CPU throttled")
_STARTED = {"ours": re.compile(r"^\[node1\] step +20/"), "script": re.compile(r"^\[node1\] round")}


class _Job:
    """A launcher's job, its lines read in a thread of their own (bench.timed), each timed and
    kept in `log` (seconds since the start before each)."""

    def __init__(self, command: list[str], log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output = TimedOutput(self.proc, time.monotonic(), self.log)

    def said_within(self, text: str, until: float) -> str | None:
        """The first line holding `text` before `until` seconds into the job (waited for, not
        past it), or None: a line on the even cluster ends the section at once."""
        hit = self.output.matching(text, timeout=until - self.output.now())
        return None if hit is None else hit[1]

    def first(self, pattern: re.Pattern, since: float, what: str) -> tuple[float, str]:
        """The time (seconds into the job) and text of the first line from `since` seconds on
        that matches."""
        hit = self.output.matching(pattern, since, WAIT_LIMIT)
        if hit is None:
            tail = "".join(line for _, line in self.output.lines[-20:])
            raise RuntimeError(f"stragglers: never saw {what}:\n{tail}")
        return hit

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.output.mark("Ctrl-C")
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                self.output.mark("still running 180 s after Ctrl-C: killed")
                self.proc.kill()
        self.output.reader.join(timeout=30)  # the job's last lines in the log before it closes
        self.output.mark(f"ended, exit {self.proc.wait()}")
        if not self.output.reader.is_alive():  # else a child of the job still holds its output
            self.log.close()


def one_job(
    command: list[str],
    kind: str,
    config: sim.SimConfig,
    link: str | None,
    log: Path,
    even: float | None = None,
) -> dict[str, float]:
    """Seconds from node2's link shaped to the line naming it (network), then from its job
    container held to the line naming it (cpu); node2's link is given back its `link` (the
    bench's) in between. Nothing may be said in the `even` seconds before (EVEN_SECONDS by
    default). A line for another cause meanwhile (a loaded host's) is waited past. The job's
    output goes to `log`, with the bench's own changes marked."""
    job = _Job(command, log)
    node2 = config.container(2)
    try:
        begun, _ = job.first(_STARTED[kind], 0.0, "the job's first steps")
        even = EVEN_SECONDS if even is None else even
        early = job.said_within("is the straggler", begun + even)
        if early is not None:
            raise RuntimeError(f"stragglers: said on an even cluster: {early.strip()}")
        run_id = next(m[1] for _, line in job.output.lines if (m := _RUN_ID.search(line)))
        shaped = job.output.now()
        job.output.mark(f"node2's link shaped to {SHAPED_RATE}")
        sim.shape_link(node2, SHAPED_RATE)
        try:
            linked, _ = job.first(_LINK, shaped, "node2 named for its shaped link")
        finally:
            sim.shape_link(node2, link)
        held = job.output.now()
        job.output.mark(f"node2's link freed; its job container held to {HELD_CPUS[kind]} CPU")
        job_container = container_name(run_id, "node2")
        sim.docker("exec", node2, "docker", "update", "--cpus", HELD_CPUS[kind], job_container)
        throttled, _ = job.first(_CPU, held, "node2 named for its CPU quota")
        return {"network": linked - shaped, "cpu": throttled - held}
    finally:
        job.stop()


def measure_latency(
    inventory: Path,
    config: sim.SimConfig,
    link: str | None,
    reps: int,
    progress: Progress,
    train: Path,
    work: Path,
    quick: bool = False,
) -> dict:
    """`reps` times, each our workload's job and a user script's (`work`: a directory for the
    script's project and every job's log); the first rep's jobs run even for EVEN_FIRST seconds
    (not under `quick`). The two nodes' links are unshaped for the section and given back
    `link` (the bench's) after it: with every link shaped alike, which one holds a job is not
    known, and not said (launch.stragglers)."""
    nodes = [config.container(index) for index in (1, 2)]
    for node in nodes:
        sim.shape_link(node, None)
    try:
        return _measure(inventory, config, reps, progress, train, work, quick)
    finally:
        for node in nodes:
            sim.shape_link(node, link)


def _measure(
    inventory: Path,
    config: sim.SimConfig,
    reps: int,
    progress: Progress,
    train: Path,
    work: Path,
    quick: bool,
) -> dict:
    # The script's project (what the launcher sends) apart from the jobs' logs, which grow
    # while a job's project is sent.
    script = work / "project" / "loop.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SCRIPT)
    base = [str(train), "-i", str(inventory), "--nnodes", "2"]
    commands = {"ours": [*base, "--", *OURS], "script": [*base, "--script", str(script)]}
    found: dict[str, list[float]] = {}
    for rep in range(reps):
        for kind, command in commands.items():
            even = EVEN_FIRST if rep == 0 and not quick else EVEN_SECONDS
            seconds = one_job(command, kind, config, None, work / f"{kind}-{rep + 1}.log", even)
            for cause, value in seconds.items():
                found.setdefault(f"{kind}_{cause}", []).append(value)
            progress(
                f"stragglers: rep {rep + 1}/{reps}, {kind}: named {seconds['network']:.0f} s after "
                f"the link was shaped, {seconds['cpu']:.0f} s after the CPU was held"
            )
    worst = [max(values) for values in zip(*found.values(), strict=True)]
    return {
        "even_first": EVEN_SECONDS if quick else EVEN_FIRST,
        "even": EVEN_SECONDS,
        "target": LATENCY_TARGET,
        "rate": SHAPED_RATE,
        "held": HELD_CPUS,
        "seconds": {key: Series(values).as_dict() for key, values in found.items()},
        "ratio": Series([value / LATENCY_TARGET for value in worst]).as_dict(),
    }
