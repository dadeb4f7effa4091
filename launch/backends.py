"""The three ways `train` runs a job, behind one small interface (Backend): on this machine
(LocalBackend), on the inventory's nodes over SSH (SshBackend), and through Slurm
(SlurmBackend). The CLI picks one (backend_for) and hands it to the one restart loop
(launch.restarts.run_with_restarts); each backend says only how one run goes, how the next one
is made ready, and how the job ends."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch_multinode.cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, UserError
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch import staging, stop
from torch_multinode.launch.ending import bring_back, summary
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.local import run_local
from torch_multinode.launch.restarts import Backend, LostNodes
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.slurm import SlurmAttempt, cancel
from torch_multinode.launch.spec import DEFAULT_RESTART_WAIT, Emit, JobResult, JobSpec, NodeOutcome
from torch_multinode.launch.staging import Project
from torch_multinode.launch.survivors import wait_for_nodes

# Slurm takes a node back once its slurmd registers: under Slurm a node answers a restart's
# probe only where its slurmd runs (LostNodes' `also`).
SLURMD_RUNS = "pgrep -x slurmd >/dev/null || { echo 'its slurmd does not run'; exit 1; }"


def _nothing() -> None:
    return None


class _OnNodes:
    """What the SSH and Slurm backends share: the master's run directory brought back after
    each run, the nodes' summary, and what a restart does with a lost node (their LostNodes,
    `lost`, asked with the nodes the job runs on now)."""

    inventory: Inventory
    spec: JobSpec
    emit: Emit
    nodes: Nodes | None
    restart_wait: float
    lost: LostNodes
    spares: tuple[Host, ...]

    @property
    def nodes_changed(self) -> list[str]:
        """What became of each lost node so far, restart after restart."""
        return self.lost.changed

    def _survivors(self, failed: JobSpec, restart: int) -> tuple[Inventory, float]:
        return self.lost.survivors(
            self.inventory, failed, restart, self.restart_wait, self.emit, self.nodes
        )

    def _next_spec(self, first: JobSpec, restart: int) -> JobSpec:
        return self.lost.next_spec(self.inventory, first, restart)

    def _said_restart(self, attempt: JobSpec, restart: int, restarts: int, waited: float) -> None:
        self.emit(self.lost.restart_line(self.inventory, attempt, restart, restarts, waited))

    def ended(self, spec: JobSpec, result: JobResult) -> None:
        bring_back(self.inventory, self.inventory.master, spec, result, self.emit)

    def summary(self, result: JobResult) -> list[str]:
        # an FT=1 job's spare that took a lost group's place ran in it too (a restart's is
        # one of the nodes it runs on already)
        names = {h.name for h in self.inventory.hosts}
        joined = tuple(h for h in self.spares if h.name in result.outcomes and h.name not in names)
        return summary(result, self.inventory.hosts + joined)

    def closing(self, result: JobResult) -> list[str]:
        log_dir = self.spec.log_dir
        lines = [f"Logs: {log_dir}/ (one file per node)"]
        if result.brought_back:
            lines.append(f"Run directory of {self.inventory.master.name}: {result.brought_back}")
            if log_dir is not None and (log_dir / "tensorboard").is_dir():
                lines.append(f"TensorBoard: make tensorboard RUN={log_dir.name}")
        return lines


@dataclass
class SshBackend(_OnNodes):
    """One SSH session per node (launch.job); a restart waits for every node to answer again
    and stops whatever the failed run left; a node lost for good: see LostNodes."""

    inventory: Inventory
    spec: JobSpec
    emit: Emit = print
    project: Project | None = None
    restart_wait: float = DEFAULT_RESTART_WAIT
    nodes: Nodes | None = None
    started: Callable[[], None] = _nothing
    spares: tuple[Host, ...] = ()  # as the job started (self.lost keeps those still unused)
    min_nodes: int | None = None  # None: every node of the job

    def __post_init__(self) -> None:
        self.nodes = self.nodes or SshNodes(self.inventory)
        if self.project is None:
            spec = self.spec
            self.project = staging.plan(
                self.inventory, spec.script, spec.workdir, spec.workdir_limit
            )
        self.lost = LostNodes(
            self.inventory, self.spec, self.restart_wait, self.spares, self.min_nodes
        )
        lost = self.lost.note
        wait = f"--restart-wait {self.restart_wait:g} s"
        self.restart_note = (
            f"each on {lost}" if lost else f"each once every node answers again ({wait})"
        )

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        launcher = Launcher(
            self.inventory,
            spec,
            self.emit,
            project=self.project,
            nodes=self.nodes,
            spares=self.spares if spec.fault_tolerant else (),
        )
        self.started()
        result = launcher.run()
        result.nodes_changed = tuple(self.nodes_changed) + result.nodes_changed
        return result

    def can_restart(self) -> bool:
        return True

    def before_restart(
        self, first: JobSpec, failed: JobSpec, restart: int, restarts: int
    ) -> JobSpec:
        self.emit(
            f"[launcher] restart {restart} of {restarts}: waiting up to {self.restart_wait:g} s "
            + (
                "for the nodes to answer..."
                if self.lost.flexible
                else "for every node to answer..."
            )
        )
        if self.lost.flexible:
            inventory, waited = self._survivors(failed, restart)
        else:
            inventory = self.inventory
            waited = wait_for_nodes(inventory, self.restart_wait, self.emit, self.nodes)
        assert self.nodes is not None  # made in __post_init__
        left = RunningJob(
            failed,
            inventory.hosts,
            self.nodes,
            self.emit,
            inventory.rendezvous_port,
            inventory.launch_mode == "container",
        )
        stop.everywhere(left, inventory.master)  # what the failed run left on a node cut off
        self.inventory = inventory
        attempt = self._next_spec(first, restart)
        self._said_restart(attempt, restart, restarts, waited)
        return attempt


@dataclass
class SlurmBackend(_OnNodes):
    """One batch job (launch.slurm); a restart requeues it: the same Slurm job runs again. A
    node lost for good (see LostNodes; a node whose slurmd does not run counts as silent): the
    job is cancelled and a new one submitted on the nodes the restart runs on."""

    inventory: Inventory
    spec: JobSpec
    emit: Emit = print
    project: Project | None = None
    nodes: Nodes | None = None
    job_id: str | None = None  # once submitted
    started: Callable[[], None] = _nothing
    restart_wait: float = DEFAULT_RESTART_WAIT
    spares: tuple[Host, ...] = ()  # as the job started (self.lost keeps those still unused)
    min_nodes: int | None = None  # None: every node of the job

    def __post_init__(self) -> None:
        self.nodes = self.nodes or SshNodes(self.inventory)
        self.lost = LostNodes(
            self.inventory,
            self.spec,
            self.restart_wait,
            self.spares,
            self.min_nodes,
            also=(SLURMD_RUNS,),
        )
        lost = self.lost.note
        self.restart_note = "each a requeue of the job in Slurm" + (
            f", or a new job on {lost} once a node is lost" if lost else ""
        )

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        assert self.nodes is not None  # made in __post_init__
        run = SlurmAttempt(
            self.inventory, spec, self.emit, self.project, self.nodes, self.job_id, restarts_left
        )
        self.started()
        try:
            result = run.launcher.run()
            result.nodes_changed = tuple(self.nodes_changed)
            return result
        finally:
            self.job_id, self.project = run.job_id, run.launcher.project

    def can_restart(self) -> bool:
        return self.job_id is not None

    def before_restart(
        self, first: JobSpec, failed: JobSpec, restart: int, restarts: int
    ) -> JobSpec:
        if self.lost.flexible:
            self.emit(
                f"[launcher] restart {restart} of {restarts}: waiting up to "
                f"{self.restart_wait:g} s for the nodes to answer..."
            )
            controller = self.inventory.master
            inventory, waited = self._survivors(failed, restart)
            if inventory.hosts != self.inventory.hosts:
                if controller.name not in {host.name for host in inventory.hosts}:
                    raise UserError(
                        f"{controller.name} runs Slurm's controller (slurmctld) and is lost: "
                        "Slurm cannot run the job on the other nodes without it",
                        hint=f"bringing {controller.name} back, then running the job again "
                        "(it resumes from its checkpoints)",
                        exit_code=1,
                    )
                self.emit(f"[launcher] cancelling Slurm job {self.job_id} (it holds a lost node)")
                # a restart follows a submitted job (can_restart); nodes: made in __post_init__
                assert self.nodes is not None and self.job_id is not None
                cancel(self.nodes, controller, self.job_id)
                self.job_id, self.inventory = None, inventory
                attempt = self._next_spec(first, restart)
                self._said_restart(attempt, restart, restarts, waited)
                return attempt
        self.emit(
            f"[launcher] restart {restart} of {restarts}: requeueing Slurm job {self.job_id}..."
        )
        return first  # the same job ID, the same run directory


@dataclass
class LocalBackend:
    """torchrun on this machine (launch.local), which says its own summary; never restarted."""

    emit: Emit = print
    started: Callable[[], None] = _nothing
    restart_note = "none: a local job is not restarted"

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        began = time.monotonic()
        code = run_local(spec, self.emit, started=self.started)
        here = socket.gethostname()
        interrupted = code in (INTERRUPTED_EXIT, TERMINATED_EXIT)
        outcome = NodeOutcome(here, exit_code=None if interrupted else code)
        return JobResult(
            spec.run_id,
            {here: outcome},
            None if code == 0 else here,
            interrupted,
            time.monotonic() - began,
            terminated=code == TERMINATED_EXIT,
        )

    def ended(self, spec: JobSpec, result: JobResult) -> None:
        return None  # the run directory is here already

    def can_restart(self) -> bool:
        return False

    def before_restart(
        self, first: JobSpec, failed: JobSpec, restart: int, restarts: int
    ) -> JobSpec:
        raise AssertionError("a local job is never restarted")

    def summary(self, result: JobResult) -> list[str]:
        return []  # launch.local said it as the job ended

    def closing(self, result: JobResult) -> list[str]:
        return []


def backend_for(
    inventory: Inventory | None,
    spec: JobSpec,
    emit: Emit,
    project: Project | None = None,
    restart_wait: float = DEFAULT_RESTART_WAIT,
    started: Callable[[], None] = _nothing,
    spares: tuple[Host, ...] = (),
    min_nodes: int | None = None,
) -> Backend:
    """The backend an inventory asks for: none (this machine), `scheduler: slurm`, or SSH;
    `started` is called as each run has begun; `spares` and `min_nodes`: see LostNodes."""
    if inventory is None:
        return LocalBackend(emit, started=started)
    if inventory.scheduler == "slurm":
        return SlurmBackend(
            inventory,
            spec,
            emit,
            project,
            started=started,
            restart_wait=restart_wait,
            spares=spares,
            min_nodes=min_nodes,
        )
    return SshBackend(
        inventory,
        spec,
        emit,
        project,
        restart_wait,
        started=started,
        spares=spares,
        min_nodes=min_nodes,
    )
