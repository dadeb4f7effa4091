"""A restart at the edges of node loss (issue 49's launcher crash): a node killed before the
job printed anything, every node silent through the whole wait, the master unreachable for a
moment or lost for good. The real launcher and restart loop on fake nodes (tests/fakes.py): no
process, no traffic; the waits are a fraction of a second."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fakes import FakeNodes
from tests.helpers import MANAGEMENT_NET, inventory, inventory_text, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Result
from torch_multinode.launch import backends, cli, ending, record, staging
from torch_multinode.launch.backends import SshBackend
from torch_multinode.launch.blame import blame
from torch_multinode.launch.recorder import Recorder
from torch_multinode.launch.restarts import run_with_restarts
from torch_multinode.launch.spec import JobResult, JobSpec, NodeOutcome
from torch_multinode.launch.staging import Project
from torch_multinode.launch.survivors import survivors

PROJECT = Project(trees=(), workdir="/w", script=None)
WAIT = 0.05  # --restart-wait: the fakes answer at once, or never
NO_FETCH = (0, None)  # the master's run directory "brought back": no rsync to a fake node


def _three(**cluster_vars):
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    return inventory(hosts, launch_mode="host", rendezvous_port=29400, **cluster_vars)


def _run_id(command: str) -> str:
    return re.search(r"TMN_RUN_ID=([\w-]+)", command).group(1)


@dataclass
class Cluster:
    """What the fake nodes do with each run (by run ID): n3 is killed as the first run starts,
    before any node printed a line; `then` says what else is down from that moment (the master
    for a moment, every node for the whole wait)."""

    nodes: FakeNodes
    then: set[str] = field(default_factory=set)
    ran: list[tuple[str, str]] = field(default_factory=list)  # (run ID, node)
    killed: threading.Event = field(default_factory=threading.Event)
    begun: threading.Barrier = field(default_factory=lambda: threading.Barrier(3, timeout=10))

    def stream(self, host, command, out) -> int:
        run_id = _run_id(command)
        self.ran.append((run_id, host.name))
        if not run_id.endswith("-r1"):  # the first run: killed before a word
            self.begun.wait()  # every node's session open: the kill comes after
            if host.name == "n3":
                self.nodes.down.update({"n3", *self.then})
                self.killed.set()
                return -1  # the session ended with no exit status: node down
            self.killed.wait(10)  # the others' torchrun gives up on the lost peer, silently
            return 1
        out.write(f"step 1/1 loss 0.5 on {host.name}\n")
        return 0


def _cluster(job, then=()) -> Cluster:
    cluster = Cluster(FakeNodes(list(job.hosts)), set(then))
    cluster.nodes.streamer = cluster.stream
    return cluster


@pytest.fixture
def no_fetch(monkeypatch):
    monkeypatch.setattr(ending.staging, "fetch_run_dir", lambda *args: NO_FETCH)


def fetching(monkeypatch, cluster: Cluster) -> list[tuple[str, str]]:
    """The master's run directory "brought back" after each run: (node, run directory) as
    asked, 2 files from a node that answers, ssh's refusal from one that is down."""
    asked: list[tuple[str, str]] = []

    def fetch(inventory, master, run_dir, local):
        asked.append((master.name, run_dir))
        if master.name in cluster.nodes.down:
            return 0, f"ssh: connect to host {master.ssh_address} port 22: Connection timed out"
        return 2, None

    monkeypatch.setattr(ending.staging, "fetch_run_dir", fetch)
    return asked


def _backend(job, cluster: Cluster, said: list[str], log_dir: Path, min_nodes=2) -> SshBackend:
    spec = JobSpec(run_id="tmn-e", log_dir=log_dir)
    return SshBackend(
        job, spec, said.append, PROJECT, WAIT, nodes=cluster.nodes, min_nodes=min_nodes
    )


def test_every_node_silent_through_the_wait_is_one_error_not_the_launchers_index_error(
    tmp_path, no_fetch
):
    """Issue 49: node3 killed before any output, and no node answering within the wait. The
    survivors list came out empty and the compute-link probe took its first host as the master:
    `IndexError: list index out of range` after the whole wait (survivors.py, _unlinked's
    hosts[0], called by survivors before it counted the nodes left)."""
    job = _three()
    cluster = _cluster(job, then={"n1", "n2"})
    said: list[str] = []
    backend = _backend(job, cluster, said, tmp_path / "tmn-e")
    with pytest.raises(UserError) as caught:
        run_with_restarts(backend, backend.spec, 1, said.append)
    error = caught.value
    assert error.exit_code == 1
    assert error.line() == (
        "Error: n1, n2, n3 did not answer within --restart-wait 0.05 s (no node of the job is "
        "left to run it on): host 'n1': cannot SSH to it: timed out; host 'n2': cannot SSH to "
        "it: timed out; host 'n3': cannot SSH to it: timed out (try bringing the node back, "
        "then running the job again (it resumes from its checkpoints))"
    )
    # every node's log empty: no step to say where the run had got to
    assert {p.name: p.read_text() for p in (tmp_path / "tmn-e").glob("*.log")} == {
        "n1.log": "",
        "n2.log": "",
        "n3.log": "",
    }
    # the failed run's summary, then the wait, then where its logs are: all before the error
    summary = next(i for i, line in enumerate(said) if line.startswith("Job tmn-e FAILED on n3"))
    waiting = said.index(
        "[launcher] restart 1 of 1: waiting up to 0.05 s for the nodes to answer..."
    )
    logs = said.index(f"Logs: {tmp_path / 'tmn-e'}/ (one file per node)")
    assert summary < waiting < logs and said[logs + 1 :] == [said[-1]]
    assert said[-1].startswith("Run directory of n1: ")  # brought back, or not: n1 was lost
    assert [run for run, _ in cluster.ran] == ["tmn-e"] * 3  # no second run was started


@pytest.mark.parametrize("min_nodes", [1, 2, 3])
def test_no_survivor_at_all_is_a_user_error_whatever_min_nodes(min_nodes):
    job = _three()
    nodes = FakeNodes(list(job.hosts), down={"n1", "n2", "n3"})
    with pytest.raises(UserError) as caught:
        survivors(job, [], min_nodes, WAIT, lambda _: None, nodes, 0.01)
    assert str(caught.value).startswith(
        "n1, n2, n3 did not answer within --restart-wait 0.05 s (no node of the job is left to "
        "run it on): host 'n1': "
    )
    # the link probe needs a master: none was sent
    assert not [c for _, c in nodes.commands if c.startswith("out=$(ping")]


def test_a_spare_that_is_silent_too_leaves_no_node_and_says_so():
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    whole = inventory(hosts, launch_mode="host")
    job = whole.first(2)
    nodes = FakeNodes(list(whole.hosts), down={"n1", "n2", "n3"})
    with pytest.raises(UserError) as caught:
        survivors(job, [whole.hosts[2]], 2, WAIT, lambda _: None, nodes, 0.01)
    assert str(caught.value).startswith("n1, n2 did not answer within --restart-wait 0.05 s (no")


def test_one_survivor_left_with_min_nodes_one_goes_on_alone_without_a_link_probe():
    job = _three()
    nodes = FakeNodes(list(job.hosts), down={"n1", "n3"})
    found = survivors(job, [], 1, WAIT, lambda _: None, nodes, 0.01, " at restart 1")
    assert [host.name for host in found.hosts] == ["n2"]
    assert found.changes == [
        "n1 lost at restart 1: dropped",
        "n3 lost at restart 1: dropped",
        "continuing on n2: 1 of 3 nodes (--min-nodes 1)",
    ]
    assert not [c for _, c in nodes.commands if c.startswith("out=$(ping")]


def test_a_probe_that_fails_names_what_the_check_said_not_its_whole_command():
    """In container mode a node answers SSH a moment before its Docker engine: the error names
    the engine, once per node, on one line."""
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    job = inventory(hosts, launch_mode="container")

    def engine(host, command):
        if "docker info" in command and host.name != "n1":
            return Result(host.name, command, 1, "its Docker engine does not answer yet\n", "")
        return ""

    nodes = FakeNodes(list(job.hosts), responder=engine)
    with pytest.raises(UserError) as caught:
        survivors(job, [], 2, WAIT, lambda _: None, nodes, 0.01)
    assert str(caught.value) == (
        "n2, n3 did not answer within --restart-wait 0.05 s and 1 node(s) are fewer than "
        "--min-nodes 2: host 'n2': its Docker engine does not answer yet; host 'n3': its "
        "Docker engine does not answer yet"
    )


def test_the_master_silent_for_a_moment_is_waited_for_and_the_job_goes_on_on_the_survivors(
    tmp_path, monkeypatch
):
    """node3 killed before any output, and node1 (the master) not answering the restart's first
    probe: it answers within the wait, node3 is dropped, and restart 1 runs on node1 and
    node2, node1 still the master, from no checkpoint (no step to name). The data-safety
    matrix's run directory brought home x a node killed before the first checkpoint: the
    master's run directory of each run comes home, the failed one's and the restart's."""
    job = _three()
    cluster = _cluster(job)
    fetched = fetching(monkeypatch, cluster)
    said: list[str] = []
    backend = _backend(job, cluster, said, tmp_path / "tmn-e")
    probed: list[str] = []

    def n1_out_for_a_moment(host, command):  # the restart's first probe of n1 times out
        if command == "true" and host.name == "n1" and not probed:
            probed.append(host.name)
            raise UserError(f"host '{host.name}': cannot SSH to it: timed out", exit_code=1)
        return ""

    cluster.nodes.responder = n1_out_for_a_moment
    backend.restart_wait = 1.0  # n1 answers at the second look, n3 never
    result = run_with_restarts(backend, backend.spec, 1, said.append)
    assert result.exit_code == 0 and (result.restart, result.run_id) == (1, "tmn-e-r1")
    assert sorted(cluster.ran) == sorted(
        [("tmn-e", f"n{i}") for i in (1, 2, 3)] + [("tmn-e-r1", "n1"), ("tmn-e-r1", "n2")]
    )
    assert any(line.startswith("[launcher] n1 answers again after ") for line in said), said
    assert result.nodes_changed == (
        "n3 lost at restart 1: dropped",
        "continuing on n1, n2: 2 of 3 nodes (--min-nodes 2)",
    )
    second = [c for _, c in cluster.nodes.commands if "TMN_RUN_ID=tmn-e-r1" in c]
    assert second and all("10.7.0.1:29400" in c for c in second), second  # n1's compute IP
    runs = staging.REMOTE_RUN_ROOT
    assert fetched == [("n1", f"{runs}/tmn-e"), ("n1", f"{runs}/tmn-e-r1")]  # both runs'
    assert result.brought_back == f"2 file(s) from n1:{runs}/tmn-e-r1"
    assert not [line for line in said if line.startswith("[launcher] the run directory")]


def test_the_master_lost_for_good_makes_the_next_node_the_master_of_the_restart(
    tmp_path, monkeypatch
):
    """And its run directory: not brought home from the lost master, said with ssh's cause;
    the restart's, from its new master, is."""
    job = _three()
    cluster = _cluster(job, then={"n1"})  # n1 and n3 gone as the first run ends
    fetched = fetching(monkeypatch, cluster)
    said: list[str] = []
    backend = _backend(job, cluster, said, tmp_path / "tmn-e", min_nodes=1)
    result = run_with_restarts(backend, backend.spec, 1, said.append)
    assert result.exit_code == 0 and result.run_id == "tmn-e-r1"
    assert sorted(name for run, name in cluster.ran if run == "tmn-e-r1") == ["n2"]
    assert backend.inventory.master.name == "n2"
    assert result.nodes_changed == (
        "n1 lost at restart 1: dropped",
        "n3 lost at restart 1: dropped",
        "continuing on n2: 1 of 3 nodes (--min-nodes 1)",
    )
    runs = staging.REMOTE_RUN_ROOT
    assert fetched == [("n1", f"{runs}/tmn-e"), ("n2", f"{runs}/tmn-e-r1")]
    lost = (
        f"not copied from n1:{runs}/tmn-e: ssh: connect to host {MANAGEMENT_NET}.1 port 22: "
        "Connection timed out"
    )
    assert f"[launcher] the run directory n1:{runs}/tmn-e was {lost}" in said
    assert result.brought_back == f"2 file(s) from n2:{runs}/tmn-e-r1"


@dataclass
class Broken:
    """A backend whose first run fails and whose restart raises `error`."""

    error: BaseException
    restart_note: str = "broken"
    said: list[str] = field(default_factory=list)

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        return JobResult(spec.run_id, {"n1": NodeOutcome("n1", exit_code=1)}, "n1", False, 0.0)

    def ended(self, spec: JobSpec, result: JobResult) -> None:
        return None

    def can_restart(self) -> bool:
        return True

    def before_restart(self, first, failed, restart, restarts):
        self.said.append("waiting")
        raise self.error

    def summary(self, result: JobResult) -> list[str]:
        return [f"summary {result.run_id}"]

    def closing(self, result: JobResult) -> list[str]:
        return [f"logs of {result.run_id}"]


@pytest.mark.parametrize(
    "error",
    [UserError("n2 did not answer", exit_code=1), KeyboardInterrupt(), IndexError("a bug")],
    ids=["refused", "ctrl-c", "bug"],
)
def test_whatever_ends_a_restart_comes_after_the_failed_runs_summary_and_keeps_its_type(error):
    """A bug still raises itself (its traceback shown by the CLI), but never before the summary
    of the run that failed and where its logs are."""
    backend = Broken(error)
    said: list[str] = []
    with pytest.raises(type(error)) as caught:
        run_with_restarts(backend, JobSpec(run_id="j"), 2, said.append)
    assert caught.value is error
    assert said == ["summary j", "logs of j"] and backend.said == ["waiting"]


def test_the_cli_ends_a_restart_with_no_node_left_on_one_error_line_and_records_it(
    tmp_path, monkeypatch, capsys
):
    """The whole `train` command (its record, its exit code, what the console shows) on the
    fake nodes: no traceback, one `Error:` line naming every node, exit 1."""
    hosts = {f"n{i}": node(i) for i in (1, 2, 3)}
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text(hosts, launch_mode="host", rendezvous_port=29400))
    job = inventory(hosts, str(path), launch_mode="host", rendezvous_port=29400)
    cluster = _cluster(job, then={"n1", "n2"})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(backends, "SshNodes", lambda inventory: cluster.nodes)
    monkeypatch.setattr(staging, "plan", lambda *args, **kwargs: PROJECT)  # nothing to rsync
    monkeypatch.setattr(Recorder, "started", lambda self: None)  # no git snapshot
    monkeypatch.setattr(ending.staging, "fetch_run_dir", lambda *args: NO_FETCH)
    argv = ["-i", str(path), "--restarts", "1", "--restart-wait", "0.05", "--min-nodes", "2"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "Error: n1, n2, n3 did not answer within --restart-wait 0.05 s (no node of the job is "
        "left to run it on): host 'n1': cannot SSH to it: timed out; host 'n2': cannot SSH to "
        "it: timed out; host 'n3': cannot SSH to it: timed out (try bringing the node back, "
        "then running the job again (it resumes from its checkpoints))"
    ]
    assert "Traceback" not in out + err
    found = re.search(r"^Job (\S+) FAILED on n3 ", out, re.MULTILINE)
    assert found, out
    run_id = found.group(1)
    assert f"Logs: .runs/{run_id}/ (one file per node)" in out.splitlines()
    kept = json.loads((tmp_path / ".runs" / run_id / record.RECORD).read_text())
    assert (kept["result"], kept["exit_code"]) == ("error", 1)


def test_a_node_whose_session_broke_is_blamed_before_silent_peers_that_failed_first():
    """Killed before a word: the peers' torchrun may give up (exit 1, nothing printed) before
    the launcher hears the lost node's session end; the lost node is still the one named."""
    hosts = _three().hosts
    outcomes = {
        "n1": NodeOutcome("n1", exit_code=1),
        "n2": NodeOutcome("n2", exit_code=1),
        "n3": NodeOutcome("n3", exit_code=-1, session_lost=True, error="node down?"),
    }
    assert blame(["n1", "n2", "n3"], outcomes, hosts) == "n3"
    outcomes["n2"].unreachable = True  # one the liveness watcher declared lost comes first
    assert blame(["n1", "n2", "n3"], outcomes, hosts) == "n2"
