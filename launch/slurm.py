"""The same job through Slurm, on an inventory with `scheduler: slurm`.

The job becomes one batch script, generated from the same job spec as the SSH launcher's: it
asks Slurm for exactly the job's nodes (the inventory's first NNODES, whole), and its one step
runs, on each node, the very command the SSH launcher would run there (torchrun with c10d
rendezvous on the master's compute address, in the training container or on the host). Slurm
queues it: a second job waits for the first instead of being refused, and never shares its
nodes, so their rendezvous ports cannot clash.

`make train` submits the script, says where the job waits in the queue, and once the nodes are
the job's, sends the project and checks every node as the SSH launcher does (secrets handed
over); only then does the script go on (it waits for a go file, each run of it for its own), so
a queued job never changes the code of a running one.
Each node's part writes its output to a file on that node, which the launcher follows over SSH
with the node's prefix, and ends with its exit status, which the follower exits with: the
summary and exit code are the SSH launcher's. Ctrl-C or SIGTERM cancels the job (scancel) and
stops whatever it left on any node (a container outlives its `docker run`). RESTARTS=N requeues
the job in Slurm (scontrol requeue): the same job ID runs again, on the same nodes.
"""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import dataclass

from torch_multinode.cluster.errors import Terminated, UserError
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.staging import Project
from torch_multinode.launch import stop
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.ending import bring_back, summary
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.nodes import visible_gpus
from torch_multinode.launch.spec import (
    BLAME_GRACE,
    Emit,
    JobResult,
    JobSpec,
)

SCRIPT_NAME = "job.sbatch"
EXIT_MARKER = "tmn-slurm-task-exit"
"""The last line of a node's output file: its part's exit status (the follower exits with it)."""
GO_WAIT = 600  # seconds the batch script waits for the launcher's go before giving up
POLL = 1.0  # seconds between two looks at the state of a running job
START_POLL = 0.25  # the same while it waits to start: it may start a moment after submission
SLURM_TIMEOUT = 30.0  # for one sbatch, squeue, scontrol or scancel
SQUEUE_ORDER = "squeue --noheader --format '%i|%j|%u|%T'"  # in Slurm's order
# Slurm's states of a job that has ended (squeue/scontrol's JobState).
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
# Python on the node: print the file as it grows (waiting for it to exist), until the line
# EXIT_MARKER N, then exit N. Text after the last newline is printed at once (a progress bar
# redrawn with "\r" must show), unless it may be the start of the marker's line.
FOLLOWER = r"""
import os, sys, time
path, marker = sys.argv[1], sys.argv[2].encode() + b" "
while not os.path.exists(path):
    time.sleep(0.2)
out, pending, start = sys.stdout.buffer, b"", True
with open(path, "rb") as f:
    while True:
        chunk = f.read(65536)
        if not chunk:
            time.sleep(0.1)
            continue
        pending += chunk
        while pending:
            line, newline, rest = pending.partition(b"\n")
            if start and line.startswith(marker) and newline:
                out.flush()
                sys.exit(int(line[len(marker):].split()[0]))
            if not newline and start and marker.startswith(line[: len(marker)]):
                break  # perhaps the marker, still being written
            out.write(line + newline)
            start, pending = bool(newline), rest
        out.flush()
"""


def script_path(spec: JobSpec) -> str:
    """Where the batch script is on the master: in the job's run directory."""
    return f"{run_dir(spec)}/{SCRIPT_NAME}"


def go_path(spec: JobSpec) -> str:
    return f"{run_dir(spec)}/go"


def output_path(spec: JobSpec, node: str, attempt: int | str) -> str:
    """A node's output for one attempt (SLURM_RESTART_COUNT), on that node."""
    return f"{run_dir(spec)}/slurm-{node}-{attempt}.log"


def batch_script(
    inventory: Inventory, spec: JobSpec, commands: dict[str, str], requeue: bool
) -> str:
    """The batch script for the job: a plain sbatch script, which a user could submit by hand
    from the master (the project already on every node). `commands`: each node's command, as
    the SSH launcher would run it there."""
    names = [host.name for host in inventory.hosts]
    directory = run_dir(spec)
    cases = "\n".join(f"{name}) ( {commands[name]} ) ;;" for name in names)
    task = f"""\
attempt=${{SLURM_RESTART_COUNT:-0}}
out={shlex.quote(directory)}/slurm-$SLURMD_NODENAME-$attempt.log
mkdir -p {shlex.quote(directory)}
# Slurm sets CUDA_VISIBLE_DEVICES to the GPUs of the GRES request, the same count on every node;
# the job holds its nodes whole (--exclusive), and each node's command names its own GPUs (GPUS=,
# the host's selection) or uses all it has, as over SSH.
unset CUDA_VISIBLE_DEVICES
case "$SLURMD_NODENAME" in
{cases}
*) echo "$SLURMD_NODENAME is not one of this job's nodes ({", ".join(names)})"; false ;;
esac >"$out" 2>&1
code=$?
echo "{EXIT_MARKER} $code" >>"$out"
exit $code"""
    what = f"script {spec.script}" if spec.script else f"module {spec.module}"
    gres = _gpu_request(inventory, spec)
    return f"""\
#!/bin/bash
# torch-multinode job {spec.run_id}: {what} on {", ".join(names)}
# (inventory {inventory.path}). Made by `make train`, which saves it in .runs/{spec.run_id}/.
# By hand, from {names[0]}, once the project is on every node: sbatch {SCRIPT_NAME}
# Each node's output: {directory}/slurm-NODE-ATTEMPT.log on that node.
#SBATCH --job-name={spec.run_id}
#SBATCH --nodes={len(names)}
#SBATCH --nodelist={",".join(names)}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=/tmp/%x-%j.out
#SBATCH --open-mode=append
#SBATCH {"--requeue" if requeue else "--no-requeue"}
{gres}set -u
if [ -n "${{TMN_GO_FILE:-}}" ]; then
    # make train sends the project once the nodes are this job's, then writes this file.
    for _ in $(seq {GO_WAIT * 5}); do [ -e "$TMN_GO_FILE" ] && break; sleep 0.2; done
    [ -e "$TMN_GO_FILE" ] || {{ echo "no go from make train within {GO_WAIT} s"; exit 1; }}
    rm -f "$TMN_GO_FILE"  # a requeued run waits for a go of its own
fi
# One task per node: that node's command, its output into its file, then its exit status.
read -r -d '' TASK <<'END_OF_TASK'
{task}
END_OF_TASK
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c "$TASK"
"""


def _gpu_request(inventory: Inventory, spec: JobSpec) -> str:
    """The GPUs the job holds on each node, as Slurm's GRES request ('' on CPU nodes): what the
    job uses there (GPUS=, the host's selection, else all of them). `--gres` asks the same count
    of every node (Slurm's sbatch: "per node"); where the job uses more on some, the smallest is
    asked, for Slurm's accounting only: the job holds its nodes whole (--exclusive), and the task
    drops the CUDA_VISIBLE_DEVICES Slurm derives from the request, so that a host-mode node with
    more GPUs than the smallest runs a rank on each of them, as the launcher counted."""
    counts = []
    for host in inventory.hosts:
        selected = visible_gpus(host, spec)
        counts.append(len(selected) if selected is not None else host.gpus)
    if not all(counts):
        return ""
    line = f"#SBATCH --gres=gpu:{min(counts)}\n"
    if len(set(counts)) > 1:
        used = ", ".join(f"{h.name} {n}" for h, n in zip(inventory.hosts, counts, strict=True))
        line = f"# GPUs used per node: {used}; Slurm asks every node for the same count\n" + line
    return line


def follow_command(path: str) -> str:
    return f"python3 -c {shlex.quote(FOLLOWER)} {shlex.quote(path)} {EXIT_MARKER}"


@dataclass
class JobState:
    state: str
    reason: str = ""
    nodes: str = ""
    restarts: int = 0  # how often Slurm has requeued it (the script's SLURM_RESTART_COUNT)

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def parse_job(text: str) -> JobState | None:
    """`scontrol show job -o ID`'s one line as a JobState (None: no such job)."""
    fields = dict(word.split("=", 1) for word in text.split() if "=" in word)
    if "JobState" not in fields:
        return None
    restarts = fields.get("Restarts", "0")
    return JobState(
        fields["JobState"],
        fields.get("Reason", ""),
        fields.get("NodeList", ""),
        int(restarts) if restarts.isdigit() else 0,
    )


def queue_position(squeue: str, job_id: str) -> tuple[int, str] | None:
    """Where job `job_id` is in Slurm's queue (`squeue --noheader --format '%i|%j|%u|%T'`,
    running jobs first, then pending ones in Slurm's order): its position counting the jobs
    ahead of it, and the one just ahead; None when it is not listed."""
    rows = [line.split("|") for line in squeue.splitlines() if line.count("|") == 3]
    rows.sort(key=lambda row: row[3] != "RUNNING")  # stable: Slurm's order within each
    ids = [row[0] for row in rows]
    if job_id not in ids:
        return None
    index = ids.index(job_id)
    if index == 0:
        return 1, ""
    ahead = rows[index - 1]
    return index + 1, f"job {ahead[0]} ({ahead[1]}, {ahead[2]}, {ahead[3].lower()})"


class SlurmAttempt(Launcher):
    """One run of the job through Slurm: the first submits it, each restart requeues it. The
    SSH launcher's node runners, outcomes, blame, hang watcher and stop, with Slurm in place of
    the port lock, the liveness watchers and the restart loop."""

    def __init__(
        self,
        inventory: Inventory,
        spec: JobSpec,
        emit: Emit,
        project: Project | None,
        nodes: Nodes,
        job_id: str | None = None,
        restarts_left: int = 0,
    ):
        super().__init__(inventory, spec, emit, project=project, nodes=nodes)
        self.job_id, self.restarts_left = job_id, restarts_left
        self.state: JobState | None = None

    # -- Slurm, on the master ---------------------------------------------------------------

    def _slurm(self, command: str, what: str) -> str:
        master = self.inventory.master
        answer = self.nodes.run(master, command, SLURM_TIMEOUT)
        if not answer.ok:
            raise UserError(
                f"Slurm on {master.name} refused to {what}: {answer.last_line or 'no output'}",
                hint=f"make netcheck INVENTORY={self.inventory.path}, which names what is wrong",
                exit_code=1,
            )
        return answer.stdout

    def _look(self) -> JobState | None:
        answer = self.nodes.run(
            self.inventory.master, f"scontrol show job -o {self.job_id}", SLURM_TIMEOUT
        )
        return parse_job(answer.stdout) if answer.ok else None

    def _submit(self, commands: dict[str, str]) -> None:
        script = batch_script(self.inventory, self.spec, commands, requeue=self.restarts_left > 0)
        saved = ""
        if self.spec.log_dir:
            self._log_dir()
            (self.spec.log_dir / SCRIPT_NAME).write_text(script)
            saved = f" (its script: {self.spec.log_dir / SCRIPT_NAME})"
        directory = shlex.quote(run_dir(self.spec))
        self._remotes[self.inventory.master.name].run(
            f"mkdir -p {directory} && cat > {shlex.quote(script_path(self.spec))}",
            timeout=SLURM_TIMEOUT,
            check=True,
            stdin=script,
        )
        said = self._slurm(
            f"cd {directory} && sbatch --parsable "
            f"--export=ALL,TMN_GO_FILE={shlex.quote(go_path(self.spec))} {SCRIPT_NAME}",
            "queue the job",
        )
        self.job_id = said.strip().split(";")[0]
        self.emit(f"[launcher] Slurm job {self.job_id} submitted{saved}")

    def _wait_until_running(self) -> JobState:
        """Until Slurm runs the job, saying where it waits whenever that changes."""
        shown = where = None
        while True:
            state = self._look()
            if state is not None and state.state == "RUNNING":
                return state
            if state is not None and state.ended:
                raise UserError(
                    f"Slurm job {self.job_id} ended before it ran: {state.state} "
                    f"({state.reason or 'no reason given'})",
                    hint="make queue, and make netcheck for the nodes' state",
                    exit_code=1,
                )
            if state is not None and state.state == "PENDING":
                listing = self.nodes.run(self.inventory.master, SQUEUE_ORDER, SLURM_TIMEOUT)
                where = queue_position(listing.stdout, self.job_id)
                if where is not None and where[0] > 1 and where != shown:
                    shown = where
                    self.emit(
                        f"[launcher] Slurm job {self.job_id} waits in the queue: position "
                        f"{where[0]}, behind {where[1]}; Slurm's reason: {state.reason}"
                    )
            time.sleep(START_POLL if where is None or where[0] == 1 else POLL)

    def _cancel(self) -> None:
        """scancel, then until Slurm has it ended (at most a few seconds)."""
        if self.job_id is None:
            return
        self.nodes.run(self.inventory.master, f"scancel {self.job_id}", SLURM_TIMEOUT)
        deadline = time.monotonic() + SLURM_TIMEOUT
        while time.monotonic() < deadline:
            state = self._look()
            if state is None or state.ended:
                return
            time.sleep(0.5)

    def _watch_state(self) -> None:
        """Until the job ends in Slurm's eyes. The nodes' followers then have a moment to
        report their exit; a node that did not ends as Slurm says the job did."""
        while not self.done.is_set():
            state = self._look()
            if state is not None and state.ended:
                self.state = state
                deadline = time.monotonic() + BLAME_GRACE
                while time.monotonic() < deadline and not self.done.is_set():
                    time.sleep(0.1)
                if not self.done.is_set():
                    self._ended_by_slurm(state)
                return
            self.done.wait(POLL)

    def _ended_by_slurm(self, state: JobState) -> None:
        silent = [name for name, outcome in self.outcomes.items() if outcome.exit_code is None]
        for name in silent:
            self.outcomes[name].error = f"Slurm ended the job: {state.state} ({state.reason})"
        self._name_down_nodes()
        if silent and self.first_failure is None:
            self.fail(silent[0])
        self.done.set()

    def _name_down_nodes_after_node_fail(self) -> None:
        """A job Slurm ended for a node: that node is the one to name, not a peer whose rank
        failed in consequence."""
        ended = self.state or self._look()
        if ended is not None and ended.state == "NODE_FAIL":
            self._name_down_nodes()

    def _name_down_nodes(self) -> None:
        """The job's nodes Slurm has down (a slurmd that stopped answering: NODE_FAIL) are the
        ones to name: marked lost, with Slurm's state and reason."""
        listing = self.nodes.run(
            self.inventory.master,
            "sinfo --Node --noheader --format '%N|%T|%E' --nodes "
            + ",".join(host.name for host in self.hosts),
            SLURM_TIMEOUT,
        )
        for line in listing.stdout.splitlines():
            name, _, rest = line.partition("|")
            node_state, _, reason = rest.partition("|")
            node_state = node_state.rstrip("*~#")
            if name in self.outcomes and node_state in ("down", "fail", "failing"):
                self.outcomes[name].error = f"Slurm has {name} {node_state} ({reason})"
                self.outcomes[name].unreachable = True
                if name not in self.failures:
                    self.fail(name)

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> JobResult:
        started = time.monotonic()
        master, nnodes = self.inventory.master, len(self.hosts)
        envs = self._setup(announce=self.job_id is None)
        interrupted = terminated = False
        runners: list[threading.Thread] = []
        try:
            self._parallel(self._connect)
            if self.job_id is None:
                self._submit(
                    {h.name: self._command(h, master, nnodes, envs[h.name]) for h in self.hosts}
                )
            else:
                self._slurm(f"scontrol requeue {self.job_id}", "requeue the job")
            state = self._wait_until_running()
            # The nodes are the job's now: no other job's code changes. On a requeue this sends
            # nothing new, but checks the nodes again and hands over the secrets once more.
            self._send_project()
            self._parallel(
                lambda host: self._remotes[host.name].run(
                    f"touch {shlex.quote(go_path(self.spec))}", timeout=15, check=True
                )
            )
            self.emit(
                f"[launcher] Slurm job {self.job_id} runs on {state.nodes}"
                + (f", requeued {state.restarts} time(s)" if state.restarts else "")
            )
            runners = self._runners(
                {
                    h.name: follow_command(output_path(self.spec, h.name, state.restarts))
                    for h in self.hosts
                }
            )
            watchers = [threading.Thread(target=self._watch_state, daemon=True)]
            for thread in runners + watchers + self._stall_watcher():
                thread.start()
            self._follow(runners)
        except KeyboardInterrupt as signalled:
            interrupted = True
            terminated = isinstance(signalled, Terminated)
            why = "SIGTERM" if terminated else "Ctrl-C"
            self.emit(f"[launcher] {why}: cancelling Slurm job {self.job_id or '(not queued)'}...")
        except BaseException:
            self._cancel()
            stop.everywhere(self, master)
            self._close()
            raise
        if self.first_failure is not None and not interrupted:
            self._settle_blame(runners, self._name_down_nodes_after_node_fail)
        if interrupted or self.first_failure is not None:
            if interrupted or not self.restarts_left:
                self._cancel()  # a restart requeues the job instead
            self._stop_everywhere(master)  # a container outlives its `docker run`
        return self._wind_down(runners, started, interrupted, terminated)


def run_job(
    inventory: Inventory,
    spec: JobSpec,
    emit: Emit = print,
    restarts: int = 0,
    project: Project | None = None,
    nodes: Nodes | None = None,
) -> JobResult:
    """The job through Slurm, requeued after a failure up to `restarts` times (Slurm runs it
    again once its nodes are free and up); the master's run directory brought back after each
    run, as the SSH launcher does."""
    nodes = nodes or SshNodes(inventory)
    job_id = None
    for restart in range(restarts + 1):
        attempt = SlurmAttempt(inventory, spec, emit, project, nodes, job_id, restarts - restart)
        result = attempt.run()
        job_id, project = attempt.job_id, attempt.project
        result.restart, result.restarts = restart, restarts
        bring_back(inventory, inventory.master, spec, result, emit)
        if result.exit_code != 1 or restart == restarts or job_id is None:
            return result
        for line in summary(result, inventory.hosts):
            emit(line)
        emit(f"[launcher] restart {restart + 1} of {restarts}: requeueing Slurm job {job_id}...")
    raise AssertionError("unreachable")  # the loop returns on its last turn
