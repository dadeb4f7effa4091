"""The launcher's backends behind one interface (launch.backends) and the one restart loop
(launch.restarts.run_with_restarts). Fakes only: no process, no traffic."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from tests.fakes import FakeNodes
from tests.helpers import inventory, inventory_text, node
from torch_multinode.cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, UserError
from torch_multinode.cluster.execution import Result
from torch_multinode.launch import backends, cli, options
from torch_multinode.launch.backends import (
    Backend,
    LocalBackend,
    SlurmBackend,
    SshBackend,
    backend_for,
)
from torch_multinode.launch.restarts import run_with_restarts
from torch_multinode.launch.spec import JobResult, JobSpec, NodeOutcome
from torch_multinode.launch.staging import Project

PROJECT = Project(trees=(), workdir="/w", script=None)


@dataclass
class Scripted:
    """A backend whose runs end with the given exit codes, in order."""

    codes: list[int]
    restartable: bool = True
    restart_note: str = "scripted"
    runs: list[tuple[str, int]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        code = self.codes[len(self.runs)]
        self.runs.append((spec.run_id, restarts_left))
        interrupted = code in (INTERRUPTED_EXIT, TERMINATED_EXIT)
        outcome = NodeOutcome("n1", exit_code=None if interrupted else code)
        return JobResult(spec.run_id, {"n1": outcome}, None, interrupted, 0.0)

    def ended(self, spec: JobSpec, result: JobResult) -> None:
        self.said.append(f"ended {spec.run_id}")

    def can_restart(self) -> bool:
        return self.restartable

    def before_restart(self, first: JobSpec, failed: JobSpec, restart: int, restarts: int):
        self.said.append(f"ready {restart}/{restarts} after {failed.run_id}")
        return replace(first, run_id=f"{first.run_id}-r{restart}")

    def summary(self, result: JobResult) -> list[str]:
        return [f"summary {result.run_id}"]

    def closing(self, result: JobResult) -> list[str]:
        return []


@pytest.mark.parametrize(
    ("codes", "restarts", "runs", "code"),
    [
        ([0], 2, 1, 0),  # a success is never run again
        ([1, 1, 0], 2, 3, 0),  # failed twice, then succeeded on the last restart allowed
        ([1, 1, 1], 2, 3, 1),  # every restart used up: the last failure is the job's
        ([1, INTERRUPTED_EXIT], 3, 2, INTERRUPTED_EXIT),  # Ctrl-C during a restart: no more
        ([1], 0, 1, 1),  # no restart asked
    ],
)
def test_the_restart_loop_runs_a_failed_job_again_up_to_restarts_times(codes, restarts, runs, code):
    backend = Scripted(codes)
    said: list[str] = []
    result = run_with_restarts(backend, JobSpec(run_id="j"), restarts, said.append)
    assert result.exit_code == code
    assert [run_id for run_id, _ in backend.runs] == ["j"] + [f"j-r{n}" for n in range(1, runs)]
    assert [left for _, left in backend.runs] == [restarts - n for n in range(runs)]
    assert (result.restart, result.restarts) == (runs - 1, restarts)
    # after each run, what it left is brought back; a failed run restarted is summed up first
    assert backend.said.count("ended j") == 1 and len(backend.said) == 2 * runs - 1
    assert said == [f"summary {run_id}" for run_id, _ in backend.runs[:-1]]


def test_a_backend_that_cannot_restart_ends_the_job_at_its_first_failure():
    # Slurm before the job was queued (a refusal at sbatch): nothing to requeue
    backend = Scripted([1, 0], restartable=False)
    result = run_with_restarts(backend, JobSpec(run_id="j"), 3)
    assert result.exit_code == 1 and backend.runs == [("j", 3)]


def test_each_inventory_gets_its_backend_and_each_backend_has_the_whole_interface():
    hosts = {"n1": node(1), "n2": node(2)}
    ssh = inventory(hosts, launch_mode="host")
    slurm = inventory(hosts, launch_mode="host", scheduler="slurm")
    spec = JobSpec()
    chosen = [
        backend_for(None, spec, print),
        backend_for(ssh, spec, print, PROJECT, 7),
        backend_for(slurm, spec, print, PROJECT),
    ]
    assert [type(backend) for backend in chosen] == [LocalBackend, SshBackend, SlurmBackend]
    assert "--restart-wait 7 s" in chosen[1].restart_note
    wanted = {name for name in vars(Backend) if not name.startswith("_")} | {"restart_note"}
    for backend in chosen:
        assert all(hasattr(backend, name) for name in wanted), type(backend)
    assert chosen[2].can_restart() is False  # nothing submitted yet: nothing to requeue


@pytest.mark.parametrize(
    ("code", "exit_code", "interrupted"),
    [(0, 0, False), (1, 1, False), (INTERRUPTED_EXIT, INTERRUPTED_EXIT, True)]
    + [(TERMINATED_EXIT, TERMINATED_EXIT, True)],
)
def test_a_local_job_ends_with_the_exit_code_of_its_run(monkeypatch, code, exit_code, interrupted):
    begun = []

    def run_local(spec, emit, started):
        started()  # as torchrun has started
        return code

    monkeypatch.setattr(backends, "run_local", run_local)
    result = LocalBackend(print, started=lambda: begun.append(1)).attempt(JobSpec(run_id="j"), 0)
    assert (result.exit_code, result.interrupted) == (exit_code, interrupted)
    assert begun == [1]  # the run's record was told the job began
    assert LocalBackend().can_restart() is False and LocalBackend().summary(result) == []


def test_a_restart_on_fewer_nodes_keeps_the_first_runs_world_and_says_what_became_of_the_lost():
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    job = inventory(hosts, launch_mode="host")
    nodes = FakeNodes(list(job.hosts), down={"n3"})
    said: list[str] = []
    backend = backend_for(job, JobSpec(run_id="j"), said.append, PROJECT, 0.05, min_nodes=2)
    backend.nodes = nodes
    assert backend.restart_note == (
        "each on the nodes that answer within --restart-wait 0.05 s (at least 2 of 3 nodes)"
    )
    attempt = backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 2)
    assert [host.name for host in backend.inventory.hosts] == ["n1", "n2"]
    assert attempt.run_id == "j-r1" and attempt.planned_world == 3  # one process per CPU node
    assert backend.nodes_changed == [
        "n3 lost at restart 1: dropped",
        "continuing on n1, n2: 2 of 3 nodes (--min-nodes 2)",
    ]
    assert said[-1] == (
        "[launcher] job j-r1: the nodes answer (waited 0 s); restart 1 of 2 on 2 node(s), "
        "keeping the first run's world of 3 process(es)"
    )
    # every node back at the next restart: no node comes back into the job, the world stays
    nodes.down.clear()
    again = backend.before_restart(JobSpec(run_id="j"), attempt, 2, 2)
    assert again.planned_world == 3 and len(backend.inventory.hosts) == 2


def test_without_min_nodes_or_spares_a_restart_waits_for_every_node_as_before():
    hosts = {f"n{i}": node(i) for i in (1, 2)}
    job = inventory(hosts, launch_mode="host")
    backend = backend_for(job, JobSpec(run_id="j"), print, PROJECT, 0.05)
    backend.nodes = FakeNodes(list(job.hosts), down={"n2"})
    assert backend.restart_note == "each once every node answers again (--restart-wait 0.05 s)"
    with pytest.raises(UserError) as caught:
        backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 1)
    assert str(caught.value).startswith("n2 did not answer within --restart-wait 0.05 s: ")


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            ["--restarts", "1", "--min-nodes", "3", "--nnodes", "2"],
            "Error: --min-nodes=3 (MIN_NODES) but the job runs on 2 node(s) (try MIN_NODES=2 "
            "or fewer)",
        ),
        (
            ["--min-nodes", "2"],
            "Error: --min-nodes=2 (MIN_NODES) acts on a restart, and --restarts is 0 (try "
            "RESTARTS=1 or more, or FT=1)",
        ),
    ],
    ids=["above-the-job", "no-restarts"],
)
@pytest.mark.parametrize("scheduler", ["ssh", "slurm"])
def test_min_nodes_the_job_cannot_honour_is_refused_before_any_node_is_touched(
    tmp_path, capsys, extra, error, scheduler
):
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text(hosts, launch_mode="host", scheduler=scheduler))
    assert cli.main(["-i", str(path), *extra]) == 2
    assert capsys.readouterr().err.strip() == error


def _slurm_job(down: set[str], quiet: set[str] = frozenset(), spares: int = 0, **policy):
    """A Slurm backend on 3 hosts (n1 runs slurmctld), the last `spares` of them spares, whose
    job 7 ran once; `down` do not answer at all, `quiet` answer but their slurmd does not run."""
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    whole = inventory(hosts, launch_mode="host", scheduler="slurm")
    job = whole.first(3 - spares)
    policy["spares"] = whole.hosts[3 - spares :]

    def respond(host, command):
        if "pgrep -x slurmd" in command and host.name in quiet:
            return Result(host.name, command, 1, "its slurmd does not run\n", "")
        if command.startswith("scontrol show job"):
            return "JobId=7 JobState=CANCELLED Reason=None NodeList=n[1-3]\n"
        return ""

    said: list[str] = []
    backend = backend_for(job, JobSpec(run_id="j"), said.append, PROJECT, 0.05, **policy)
    backend.nodes = FakeNodes(list(whole.hosts), down=set(down), responder=respond)
    backend.job_id = "7"
    return backend, said


def test_under_slurm_a_node_lost_for_good_ends_the_job_and_a_new_one_runs_on_the_survivors():
    backend, said = _slurm_job(set(), quiet={"n3"}, min_nodes=2)
    assert backend.restart_note == (
        "each a requeue of the job in Slurm, or a new job on the nodes that answer within "
        "--restart-wait 0.05 s (at least 2 of 3 nodes) once a node is lost"
    )
    attempt = backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 1)
    assert [host.name for host in backend.inventory.hosts] == ["n1", "n2"]
    assert (attempt.run_id, attempt.planned_world) == ("j-r1", 3)
    assert backend.job_id is None and backend.can_restart() is False  # the next run submits
    assert ("n1", "scancel 7") in backend.nodes.commands  # on the node that runs slurmctld
    assert backend.nodes_changed == [
        "n3 lost at restart 1: dropped",
        "continuing on n1, n2: 2 of 3 nodes (--min-nodes 2)",
    ]
    assert "[launcher] cancelling Slurm job 7 (it holds a lost node)" in said


def test_under_slurm_a_spare_takes_a_lost_nodes_place_in_the_new_job():
    backend, said = _slurm_job({"n2"}, spares=1)
    attempt = backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 1)
    assert [host.name for host in backend.inventory.hosts] == ["n1", "n3"]
    assert attempt.planned_world is None  # the same world: a spare of the same shape
    assert backend.nodes_changed == ["n2 lost at restart 1: replaced by spare n3"]


def test_under_slurm_every_node_back_is_a_requeue_and_a_lost_controller_is_named():
    backend, said = _slurm_job(set(), min_nodes=2)
    assert backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 1).run_id == "j"
    assert (
        backend.job_id == "7" and said[-1] == "[launcher] restart 1 of 1: requeueing Slurm job 7..."
    )
    assert not [command for _, command in backend.nodes.commands if "scancel" in command]

    backend, _ = _slurm_job({"n1"}, min_nodes=2)
    with pytest.raises(UserError) as caught:
        backend.before_restart(JobSpec(run_id="j"), JobSpec(run_id="j"), 1, 1)
    assert str(caught.value) == (
        "n1 runs Slurm's controller (slurmctld) and is lost: Slurm cannot run the job on the "
        "other nodes without it"
    )


@pytest.mark.parametrize(
    ("extra", "spares"),
    [
        (["--nnodes", "2", "--restarts", "1"], ["n3"]),  # spares with restarts alone
        (["--nnodes", "2"], []),  # no restart: nothing takes a lost node's place
        (["--restarts", "1"], []),  # every host in the job
    ],
)
def test_a_restarted_job_takes_its_spares_from_the_inventory_beyond_nnodes(tmp_path, extra, spares):
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text(hosts, launch_mode="host"))
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    args = options.parser().parse_args(["-i", str(path), "--script", str(script), *extra])
    args.argv = []
    _, _, _, found = cli._on_nodes(args, cli._spec(args))
    assert [host.name for host in found] == spares
