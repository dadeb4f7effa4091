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
the job in Slurm (scontrol requeue): the same job ID runs again, on the same nodes; once a node
is lost for good, with a spare or MIN_NODES (launch.backends), a new job on the nodes left.

Here: the way one run of it goes (SlurmAttempt: the Way of launch.job's Launcher, whose one
skeleton of a run runs it); launch.backends' SlurmBackend runs it again. The batch script, its
paths and the follower are launch.slurm_script's; reading Slurm's answers is
launch.slurm_state's.
"""

from __future__ import annotations

import shlex
import threading
import time

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch import stop
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.slurm_script import (
    SCRIPT_NAME,
    batch_script,
    follow_command,
    go_path,
    output_path,
    script_path,
)
from torch_multinode.launch.slurm_state import SQUEUE_ORDER, JobState, parse_job, queue_position
from torch_multinode.launch.spec import (
    BLAME_GRACE,
    Emit,
    JobSpec,
)
from torch_multinode.launch.staging import Project

POLL = 1.0  # seconds between two looks at the state of a running job
START_POLL = 0.25  # the same while it waits to start: it may start a moment after submission
SLURM_TIMEOUT = 30.0  # for one sbatch, squeue, scontrol or scancel


class SlurmAttempt:
    """One run of the job through Slurm: the first submits it, each restart requeues it. The
    way (launch.way's Way) its run, `launcher`, goes: the same node runners, outcomes, blame,
    hang watcher and stop as over SSH, with Slurm in place of the port lock, the liveness
    watchers and the restart loop."""

    queues = True  # an interrupt or an error while it waits to run cancels the job

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
        self.launcher = Launcher(inventory, spec, emit, project=project, nodes=nodes, way=self)
        self.inventory, self.spec, self.emit, self.nodes = inventory, spec, emit, nodes
        self.hosts = inventory.hosts
        # what the runners, the watchers and the stop share (launch.running): the launcher's
        self.job, self.outcomes = self.launcher.job, self.launcher.outcomes
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
        assert self.job_id is not None  # submitted (or requeued) before it is looked at
        return look(self.nodes, self.inventory.master, self.job_id)

    def _submit(self, commands: dict[str, str]) -> None:
        script = batch_script(self.inventory, self.spec, commands, requeue=self.restarts_left > 0)
        saved = ""
        if self.spec.log_dir:
            self.launcher.make_log_dir()
            (self.spec.log_dir / SCRIPT_NAME).write_text(script)
            saved = f" (its script: {self.spec.log_dir / SCRIPT_NAME})"
        directory = shlex.quote(run_dir(self.spec))
        self.launcher.remotes[self.inventory.master.name].run(
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
                assert self.job_id is not None  # submitted: _look found it
                where = queue_position(listing.stdout, self.job_id)
                if where is not None and where[0] > 1 and where != shown:
                    shown = where
                    self.emit(
                        f"[launcher] Slurm job {self.job_id} waits in the queue: position "
                        f"{where[0]}, behind {where[1]}; Slurm's reason: {state.reason}"
                    )
            time.sleep(START_POLL if where is None or where[0] == 1 else POLL)

    def _cancel(self) -> None:
        if self.job_id is not None:
            cancel(self.nodes, self.inventory.master, self.job_id)

    def _watch_state(self) -> None:
        """Until the job ends in Slurm's eyes. The nodes' followers then have a moment to
        report their exit; a node that did not ends as Slurm says the job did."""
        while not self.job.done.is_set():
            state = self._look()
            if state is not None and state.ended:
                self.state = state
                deadline = time.monotonic() + BLAME_GRACE
                while time.monotonic() < deadline and not self.job.done.is_set():
                    time.sleep(0.1)
                if not self.job.done.is_set():
                    self._ended_by_slurm(state)
                return
            self.job.done.wait(POLL)

    def _ended_by_slurm(self, state: JobState) -> None:
        silent = [name for name, outcome in self.outcomes.items() if outcome.exit_code is None]
        for name in silent:
            self.outcomes[name].error = f"Slurm ended the job: {state.state} ({state.reason})"
        self._name_down_nodes()
        if silent and self.job.first_failure is None:
            self.job.fail(silent[0])
        self.job.done.set()

    def _name_down_nodes_after_node_fail(self) -> None:
        """A job Slurm ended for a node: that node is the one to name, not a peer whose rank
        failed in consequence. With RESTARTS the script asks Slurm to requeue the job, which
        it then does by itself after a NODE_FAIL (the job pends instead of having ended): the
        nodes Slurm has down are named then too."""
        if self.restarts_left > 0:
            self._name_down_nodes()
            return
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
                if name not in self.job.failures:
                    self.job.fail(name)

    # -- the way its run goes (launch.way's Way) ------------------------------------------

    @property
    def announce(self) -> bool:
        return self.job_id is None  # not again on a requeue

    def prepare(self, envs: dict[str, dict[str, str]]) -> dict[str, str]:
        """Submitted (or requeued), run by Slurm, the project sent and the go files touched:
        each node's follower of its part's output."""
        run = self.launcher
        master, nnodes = self.inventory.master, len(self.hosts)
        run.parallel(run.connect)
        if self.job_id is None:
            self._submit({h.name: run.command(h, master, nnodes, envs[h.name]) for h in self.hosts})
        else:
            self._slurm(f"scontrol requeue {self.job_id}", "requeue the job")
        state = self._wait_until_running()
        # The nodes are the job's now: no other job's code changes. On a requeue this sends
        # nothing new, but checks the nodes again and hands over the secrets once more.
        run.send_project()
        run.parallel(
            lambda host: run.remotes[host.name].run(
                f"touch {shlex.quote(go_path(self.spec))}", timeout=15, check=True
            )
        )
        self.emit(
            f"[launcher] Slurm job {self.job_id} runs on {state.nodes}"
            + (f", requeued {state.restarts} time(s)" if state.restarts else "")
        )
        return {
            h.name: follow_command(output_path(self.spec, h.name, state.restarts))
            for h in self.hosts
        }

    def watchers(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._watch_state, daemon=True)]

    def stopping(self) -> str:
        return f"cancelling Slurm job {self.job_id or '(not queued)'}"

    def name_lost(self) -> None:
        self._name_down_nodes_after_node_fail()

    def conclude(self, interrupted: bool) -> None:
        if interrupted or self.job.first_failure is not None:
            if interrupted or not self.restarts_left:
                self._cancel()  # a restart requeues the job instead
            # a container outlives its `docker run`
            self.launcher.stop_everywhere(self.inventory.master)

    def broke(self) -> bool:
        self._cancel()
        stop.everywhere(self.job, self.inventory.master)
        self.launcher.close()
        return False


def cancel(nodes: Nodes, master: Host, job_id: str) -> None:
    """scancel job `job_id` on `master`, then until Slurm has it ended (at most a few
    seconds)."""
    nodes.run(master, f"scancel {job_id}", SLURM_TIMEOUT)
    deadline = time.monotonic() + SLURM_TIMEOUT
    while time.monotonic() < deadline:
        state = look(nodes, master, job_id)
        if state is None or state.ended:
            return
        time.sleep(0.5)


def look(nodes: Nodes, master: Host, job_id: str) -> JobState | None:
    """Job `job_id`'s state as Slurm on `master` tells it (None: no such job, or no answer)."""
    answer = nodes.run(master, f"scontrol show job -o {job_id}", SLURM_TIMEOUT)
    return parse_job(answer.stdout) if answer.ok else None
