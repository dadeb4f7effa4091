"""FT=1 in the launcher (issue 54), without a cluster: the replica groups' policy (launch.groups),
what FT=1 refuses (launch.ft.check), and one whole run over fake nodes with the real
torchft lighthouse on loopback: each node its own torchrun and group, a group that dies is
reported with its step and the others' end decides the job. On 3 simulated nodes in containers:
tests/training/test_ft_nodes.py."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace

import pytest

from tests.conftest import run_cli
from tests.fakes import FakeNodes
from tests.helpers import inventory, node
from torch_multinode.cluster import routes
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import (
    LIGHTHOUSE_VARIABLE,
    REPLICA_GROUP_VARIABLE,
    REPLICA_START_WAIT_VARIABLE,
    REPLICA_TIMEOUT_VARIABLE,
)
from torch_multinode.launch import ft
from torch_multinode.launch.groups import Groups
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import JobResult, JobSpec, NodeOutcome
from torch_multinode.launch.staging import Project
from torch_multinode.training.distributed.replicas import VARIABLES

THREE = inventory({f"node{i}": node(i) for i in (1, 2, 3)}, launch_mode="host")


def test_a_lost_group_is_said_with_its_step_and_the_others_go_on_down_to_the_minimum():
    said: list[str] = []
    groups = Groups(("node1", "node2", "node3"), 2, said.append)
    groups.note("node3", "step  11/40  loss 2.1")
    groups.note("node3", "step  12/40  loss 2.0")
    groups.note("node3", "epoch 2")  # no step: the last one stays
    assert groups.lose("node3", "exit 137")
    assert said == [
        "[launcher] node3 lost at step 12: continuing on node1, node2 (2 of 3 groups) (exit 137)"
    ]
    assert groups.lose("node3", None)  # said once
    assert len(said) == 1
    # One more would leave 1 of the 2 the job needs: not a loss it goes on with.
    assert not groups.lose("node2", "exit 1")
    assert groups.alive() == ["node1", "node2"]
    (change,) = groups.changes
    assert re.fullmatch(
        r"node3 lost at step 12: continuing on node1, node2 \(2 of 3 groups\), \d+ s into the "
        r"job; exit 137",
        change,
    )


def test_a_group_lost_before_its_first_step_is_said_so():
    said: list[str] = []
    assert Groups(("a", "b"), 1, said.append).lose("b", None)
    assert said == ["[launcher] b lost before its first step: continuing on a (1 of 2 groups)"]


def _job(min_groups: int = 1) -> RunningJob:
    job = RunningJob(
        JobSpec(), THREE.hosts, FakeNodes(list(THREE.hosts)), lambda _: None, 29500, False
    )
    job.groups = Groups(tuple(h.name for h in THREE.hosts), min_groups, lambda _: None)
    return job


def test_in_an_ft_job_one_nodes_failure_ends_the_job_only_once_the_others_have_ended():
    job = _job()
    job.outcomes["node3"].exit_code = 137
    job.fail("node3")
    assert not job.done.is_set() and job.first_failure is None
    assert job.groups is not None and list(job.groups.lost) == ["node3"]
    job.outcomes["node1"].exit_code = 0
    assert not job.ended()
    job.outcomes["node2"].exit_code = 0
    assert job.ended()


def test_in_an_ft_job_a_failure_below_the_minimum_of_groups_fails_the_job():
    job = _job(min_groups=3)
    job.fail("node2", "stopped answering", unreachable=True)
    assert job.done.is_set() and job.first_failure == "node2"


def test_an_ft_job_succeeds_when_the_groups_left_end_well_and_fails_when_none_is_left():
    outcomes = {name: NodeOutcome(name, exit_code=0) for name in ("node1", "node2")}
    outcomes["node3"] = NodeOutcome("node3", error="lost")
    result = JobResult("tmn-x", outcomes, None, False, 1.0, groups_lost=("node3",))
    assert result.exit_code == 0
    assert replace(result, groups_lost=()).exit_code == 1
    outcomes["node2"].exit_code = 1
    assert result.exit_code == 1


@pytest.mark.parametrize(
    "spec, scheduler, restarts, expected",
    [
        (JobSpec(), None, 0, "FT=1 needs an inventory: its replica groups are nodes"),
        (JobSpec(), "slurm", 0, "FT=1 runs over SSH, not under Slurm"),
        (
            JobSpec(module="training.pipeline"),
            "ssh",
            0,
            "FT=1 runs training.ddp, training.fsdp or your own",
        ),
    ],
)
def test_what_ft_refuses_is_one_error_naming_what_to_do_instead(
    spec, scheduler, restarts, expected
):
    with pytest.raises(UserError) as refused:
        ft.check(True, spec, scheduler, restarts, None)
    assert str(refused.value).startswith(expected)
    assert refused.value.hint


def test_ft_sets_the_spec_and_min_nodes_is_its_quorums_minimum():
    # training.fsdp's checkpoints included: each group writes its own (training.fsdp).
    fsdp = JobSpec(module="training.fsdp", args=("--checkpoint-dir", "c"))
    assert ft.check(True, fsdp, "ssh", 0, None).fault_tolerant
    spec = ft.check(True, JobSpec(), "ssh", 2, 2, 30.0)
    assert (spec.fault_tolerant, spec.min_groups) == (True, 2)
    assert (spec.group_restarts, spec.restart_wait) == (2, 30.0)
    assert ft.check(True, JobSpec(), "ssh", 0, None).min_groups == 1
    plain = JobSpec()
    assert ft.check(False, plain, "slurm", 3, None) is plain


def test_ft_without_an_inventory_is_one_error_line():
    proc = run_cli("train", "--ft")
    assert (proc.returncode, proc.stderr) == (
        2,
        "Error: FT=1 needs an inventory: its replica groups are nodes (try INVENTORY=path.yml, "
        "or 'make sim-up' for a simulated cluster)\n",
    )


@pytest.mark.parametrize(
    "last_words, code, why",
    [
        ((), 137, "exit 137"),  # killed: nothing said
        (
            ("Error: cannot write checkpoint step 12 to /c: No space left on device (try x)",),
            1,
            "Error: cannot write checkpoint step 12 to /c: No space left on device (try x)",
        ),
    ],
)
def test_an_ft_run_gives_each_node_its_group_and_goes_on_without_the_one_that_dies(
    tmp_path, monkeypatch, last_words, code, why
):
    """Over fake nodes, with torchft's lighthouse really started on loopback: every node's
    torchrun is its own (nnodes 1, its own rendezvous), with its group and the lighthouse's URL;
    node3 dies after step 12, the others end well later: the job succeeds, node3's loss said
    once, the lighthouse gone at the end."""
    port = _free_port()
    hosts = {f"node{i}": node(i) for i in (1, 2, 3)}
    three = inventory(hosts, launch_mode="host", lighthouse_port=port)
    monkeypatch.setattr(routes, "address_towards", lambda host: "127.0.0.1")
    node3_gone = threading.Event()
    jobs: dict[str, str] = {}

    def stream(host, command, out):
        jobs[host.name] = command
        for step in range(1, 13):
            out.write(f"step {step:3d}/20  loss 1.0\n")
        if host.name == "node3":
            for line in last_words:
                out.write(line + "\n")
            node3_gone.set()
            return code
        node3_gone.wait(10)
        for step in range(13, 21):
            out.write(f"step {step:3d}/20  loss 1.0\n")
        return 0

    said: list[str] = []
    nodes = FakeNodes(list(three.hosts), streamer=stream)
    spec = JobSpec(run_id="tmn-ft", log_dir=tmp_path / "run", fault_tolerant=True)
    project = Project(trees=(), workdir="/w", script=None)
    result = Launcher(three, spec, said.append, project=project, nodes=nodes).run()
    assert result.exit_code == 0, said
    assert result.groups_lost == ("node3",)
    # Why, in the group's own words where it said any.
    assert (
        f"[launcher] node3 lost at step 12: continuing on node1, node2 (2 of 3 groups) ({why})"
        in said
    )
    assert result.nodes_changed[0].startswith("node3 lost at step 12: continuing on node1, node2")
    assert result.nodes_changed[0].endswith(f"; {why}"), result.nodes_changed
    assert sorted(jobs) == ["node1", "node2", "node3"]
    for index, name in enumerate(sorted(jobs)):
        command = jobs[name]
        assert "--nnodes=1" in command or "--nnodes 1" in command, command
        assert f"10.7.0.{index + 1}:29500" in command, command  # its own rendezvous
        assert f"{REPLICA_GROUP_VARIABLE}={index} " in command, command
        assert f"{LIGHTHOUSE_VARIABLE}=http://127.0.0.1:{port}" in command, command
        # every variable of the group but its timeout, left to the workload's default
        given = [v for v in VARIABLES if v != REPLICA_TIMEOUT_VARIABLE]
        assert all(f" {variable}=" in command for variable in given), command
    assert any("torchft lighthouse on 127.0.0.1:" in line for line in said), said
    assert "Lighthouse listening on" in (tmp_path / "run" / "lighthouse.log").read_text()
    assert not _listening(port)


def test_with_restarts_a_lost_group_starts_again_once_its_node_answers_and_the_job_ends_whole(
    tmp_path, monkeypatch
):
    """RESTARTS=1: node3's group dies after step 12 and its node answers again at once: the
    launcher stops what it left, claims its port, and starts its group again without the start
    wait (it heals from a peer); the job ends with every group, the return said."""
    port = _free_port()
    three = inventory(
        {f"node{i}": node(i) for i in (1, 2, 3)}, launch_mode="host", lighthouse_port=port
    )
    monkeypatch.setattr(routes, "address_towards", lambda host: "127.0.0.1")
    back = threading.Event()
    commands: list[tuple[str, str]] = []

    def stream(host, command, out):
        commands.append((host.name, command))
        if host.name == "node3" and not back.is_set():
            back.set()
            out.write("step  12/20  loss 1.0\n")
            return 137
        back.wait(10)
        if host.name != "node3":
            time.sleep(4)  # the others go on while node3's group is started again
        out.write("step  20/20  loss 1.0\n")
        return 0

    said: list[str] = []
    nodes = FakeNodes(list(three.hosts), streamer=stream)
    spec = ft.check(True, JobSpec(run_id="tmn-ft2", log_dir=tmp_path), "ssh", 1, None, 5)
    project = Project(trees=(), workdir="/w", script=None)
    result = Launcher(three, spec, said.append, project=project, nodes=nodes).run()
    assert result.exit_code == 0, said
    assert result.groups_lost == ()
    assert [name for name, _ in commands].count("node3") == 2, commands
    again = [command for name, command in commands if name == "node3"][1]
    assert f"{REPLICA_START_WAIT_VARIABLE}=0 " in again, again
    assert [line for line in said if "node3" in line and line.startswith("[launcher]")] == [
        "[launcher] node3 lost at step 12: continuing on node1, node2 (2 of 3 groups) (exit 137)",
        "[launcher] node3: waiting up to 5 s for it to answer, to start its group again "
        "(restart 1 of 1)",
        "[launcher] node3 answers again: its group starts again and heals from a live peer "
        "(restart 1 of 1)",
    ]
    assert len(result.nodes_changed) == 2, result.nodes_changed
    # what the lost group left was stopped, and its port claimed again, before it started
    sent = [command for name, command in nodes.commands if name == "node3"]
    assert any("kill -TERM" in command for command in sent), sent


def test_with_restarts_and_a_spare_the_spare_takes_the_lost_groups_place_at_once(
    tmp_path, monkeypatch
):
    """NNODES=2 of 3 with RESTARTS=1: node2's group dies after step 12 and node3, the spare,
    is readied and runs group 1 (node2's index and share of the data), healing; the job ends
    well on node1 and node3, node2 lost."""
    port = _free_port()
    three = inventory(
        {f"node{i}": node(i) for i in (1, 2, 3)}, launch_mode="host", lighthouse_port=port
    )
    two = replace(three, hosts=three.hosts[:2])
    monkeypatch.setattr(routes, "address_towards", lambda host: "127.0.0.1")
    spare_started = threading.Event()
    commands: dict[str, str] = {}

    def stream(host, command, out):
        commands[host.name] = command
        out.write("step  12/20  loss 1.0\n")
        if host.name == "node2":
            return 137
        if host.name == "node3":
            spare_started.set()
        spare_started.wait(15)
        out.write("step  20/20  loss 1.0\n")
        return 0

    said: list[str] = []
    nodes = FakeNodes(list(three.hosts), streamer=stream)
    spec = ft.check(True, JobSpec(run_id="tmn-ft4", log_dir=tmp_path), "ssh", 1, None, 5)
    project = Project(trees=(), workdir="/w", script=None)
    launcher = Launcher(
        two, spec, said.append, project=project, nodes=nodes, spares=(three.hosts[2],)
    )
    result = launcher.run()
    assert result.exit_code == 0, said
    assert result.groups_lost == ("node2",)
    assert sorted(result.outcomes) == ["node1", "node2", "node3"]
    assert result.outcomes["node3"].ok
    assert f"{REPLICA_GROUP_VARIABLE}=1 " in commands["node3"], commands["node3"]
    assert f"{REPLICA_START_WAIT_VARIABLE}=0 " in commands["node3"], commands["node3"]
    assert "--rdzv-endpoint=10.7.0.3:29500" in commands["node3"], commands["node3"]
    assert (
        "[launcher] node2's group goes to spare node3 (restart 1 of 1)" in said
        and "[launcher] spare node3 takes node2's group at the others' step 12 and heals from a "
        "live peer (restart 1 of 1)"
        in said
    ), said
    assert [change.split(",")[0] for change in result.nodes_changed] == [
        "node2 lost at step 12: continuing on node1 (1 of 2 groups)",
        "spare node3 takes node2's group at the others' step 12 and heals from a live peer "
        "(restart 1 of 1)",
    ]


def test_a_lighthouse_port_taken_here_is_one_error_and_every_nodes_port_is_freed(
    tmp_path, monkeypatch
):
    """The lighthouse cannot listen (another process holds its port on this machine): the job
    is refused with one line before anything starts, and the rendezvous port every node had
    claimed is released."""
    import socket

    monkeypatch.setattr(routes, "address_towards", lambda host: "127.0.0.1")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        three = inventory(
            {f"node{i}": node(i) for i in (1, 2, 3)}, launch_mode="host", lighthouse_port=port
        )
        nodes = FakeNodes(list(three.hosts))
        spec = JobSpec(run_id="tmn-ft3", log_dir=tmp_path, fault_tolerant=True)
        project = Project(trees=(), workdir="/w", script=None)
        with pytest.raises(UserError, match=f"the torchft lighthouse on 127.0.0.1:{port} exited"):
            Launcher(three, spec, lambda _: None, project=project, nodes=nodes).run()
    freed = {
        name for name, command in nodes.commands if "port-29500" in command and "rm -rf" in command
    }
    assert freed == {"node1", "node2", "node3"}, nodes.commands
    assert not any("torchrun" in command for _, command in nodes.commands)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
