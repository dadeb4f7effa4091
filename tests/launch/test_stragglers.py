"""The straggler watch for any script (issue 55, "who"): each rank's time waiting in collectives
(training.distributed.waits, with the sitecustomize that starts it in a script of the user's;
its last totals written as the rank ends)
and the launcher's reading of it (launch.stragglers): the node the others wait for, named after
two windows in a row; a job held by the network names the one node whose link is the cause."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, run_cli
from tests.launch.test_causes import SLOW_WARNING, SNMP, sample
from tests.launch.test_causes import THROTTLED_NODE as THROTTLED
from tests.training.conftest import TINY
from torch_multinode.cluster import durable
from torch_multinode.cluster.jobenv import PACE_FILE
from torch_multinode.launch import stragglers
from torch_multinode.launch.stragglers import Pace
from torch_multinode.training.distributed import waits

SHAPED = "@@first\n@@second\n@@qdisc\nqdisc tbf 1: root rate 50Mbit burst 4Kb\n"
CALM = "@@first\n@@second\n"
# A node that resent 5 % of its TCP segments in the probe's window.
RESENT = (
    f"@@first\n{sample(snmp=SNMP.format(insegs=10, out=1000, again=10))}"
    f"@@second\n{sample(snmp=SNMP.format(insegs=10, out=11000, again=510))}"
)


def reading(at: float, shares: dict[int, tuple[str, float]], collectives: int) -> dict:
    """Every rank's totals `at` seconds in, having waited its share of the time."""
    return {
        rank: Pace(rank, node, at, at * share, collectives)
        for rank, (node, share) in shares.items()
    }


def watcher(
    answers: dict[str, str], ours: bool = False
) -> tuple[stragglers.Stragglers, list[str], list[str]]:
    said: list[str] = []
    probed: list[str] = []

    def probe(node: str) -> str:
        probed.append(node)
        return answers.get(node, CALM)

    watch = stragglers.Stragglers(probe, lambda node: "eth1", said.append, ours=ours)
    return watch, said, probed


def test_the_node_the_others_wait_for_is_found_from_each_ranks_own_window():
    # Two ranks a node; each window on the rank's own clock (node2's clock far off: only
    # differences within a rank count).
    before = {
        0: Pace(0, "node1", 10.0, 2.0, 10),
        1: Pace(1, "node1", 11.0, 2.0, 10),
        2: Pace(2, "node2", 5000.0, 2.0, 10),
        3: Pace(3, "node2", 5001.0, 2.0, 10),
    }
    now = {
        0: Pace(0, "node1", 30.0, 19.0, 40),  # waited 17 of 20 s
        1: Pace(1, "node1", 31.0, 18.0, 40),  # 16 of 20
        2: Pace(2, "node2", 5020.0, 3.0, 40),  # 1 of 20
        3: Pace(3, "node2", 5021.0, 2.4, 40),
    }
    shares = stragglers.wait_shares(before, now)
    assert shares == {"node1": 0.825, "node2": 0.035}
    assert stragglers.slowest(shares) == ("node2", 0.035, 0.825)
    # An even job, a single node, and a rank with too few collectives in the window: nothing.
    assert stragglers.slowest({"node1": 0.55, "node2": 0.45}) is None
    assert stragglers.slowest({"node1": 0.9}) is None
    quiet = {0: Pace(0, "node1", 30.0, 19.0, 11)}
    assert stragglers.wait_shares(before, quiet) == {}
    # A rank seen for the first time, or restarted (its clock went back), starts its window.
    assert stragglers.wait_shares({}, now) == {}
    assert stragglers.wait_shares(now, before) == {}


def _printed(command: str) -> str:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout


def test_the_nodes_print_their_ranks_totals_which_the_launcher_reads(tmp_path):
    (tmp_path / PACE_FILE.format(rank=0)).write_text(
        json.dumps({"rank": 0, "node": "node1", "wall": 5.0, "waited": 4.0, "collectives": 9})
    )
    (tmp_path / PACE_FILE.format(rank=1)).write_text('{"rank": 1, "node": "node1", "wal')
    printed = _printed(stragglers.pace_command(str(tmp_path)))
    # A file cut short (never so: they are replaced whole) is skipped, not an error.
    assert stragglers.parse_paces([printed, "not json\n"]) == {0: Pace(0, "node1", 5.0, 4.0, 9)}
    assert _printed(stragglers.pace_command(str(tmp_path / "none"))) == ""


def test_a_node_is_named_after_two_windows_in_a_row_with_its_cause_once():
    watch, said, probed = watcher({"node2": THROTTLED})
    slow = {0: ("node1", 0.9), 1: ("node2", 0.05)}
    watch.paces(reading(10, slow, 10))
    watch.paces(reading(30, slow, 50))  # one window: not yet
    watch.join(10)
    assert said == [] and probed == []
    watch.paces(reading(50, slow, 90))
    watch.join(10)
    assert said == [
        "[launcher] node2 is the straggler: the other nodes' ranks wait in collectives 90% of "
        "the time, its own 5%: every rank waits for it; cause: CPU throttled by its cgroup "
        "quota (0.3 CPU, 100% of periods throttled)"
    ]
    watch.paces(reading(70, slow, 130))  # the same node and cause: probed, not said again
    watch.join(10)
    assert probed == ["node2", "node2"] and len(said) == 1
    assert watch.said == [line.removeprefix("[launcher] ") for line in said]


def test_an_even_job_a_passing_slowness_and_our_workloads_own_warning_say_nothing():
    watch, said, probed = watcher({"node2": THROTTLED})
    even = {0: ("node1", 0.5), 1: ("node2", 0.4)}
    slow = {0: ("node1", 0.9), 1: ("node2", 0.05)}
    for step, shares in enumerate([even, even, slow, even, slow, even]):
        watch.paces(reading(10 + 20 * step, shares, 10 + 40 * step))
    watch.join(10)
    assert said == [] and probed == []
    # Where our workload speaks (its per-step split says more), the waits say nothing.
    watch, said, probed = watcher({"node2": THROTTLED})
    watch.note("[node1] [rank 0] warning: rank 7 on node9 is not the line it looks for")
    watch.note("[node1] [rank 0] " + SLOW_WARNING.format(node="node2"))
    watch.join(10)
    for step in range(3):
        watch.paces(reading(10 + 20 * step, slow, 10 + 40 * step))
    watch.join(10)
    assert probed == ["node2"] and len(said) == 1 and "rank 1's own work" in said[0]
    # Nor, in our workload, for a node the others wait for before it speaks: that is its own
    # split's to say, with the numbers of each rank's own work.
    watch, said, probed = watcher({"node2": THROTTLED}, ours=True)
    for step in range(4):
        watch.paces(reading(10 + 20 * step, slow, 10 + 40 * step))
    watch.join(10)
    assert said == [] and probed == []


def test_a_job_held_by_the_network_names_the_one_node_whose_link_is_shaped():
    watch, said, probed = watcher({"node2": SHAPED})
    bound = {0: ("node1", 0.85), 1: ("node2", 0.8), 2: ("node3", 0.9)}
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert sorted(probed) == ["node1", "node2", "node3"]
    assert said == [
        "[launcher] node2 is the straggler: every node's ranks wait in collectives 80% of the "
        "time or more, and its link is the one that holds them; cause: network: eth1 is shaped "
        "(tbf at 50Mbit, tc)"
    ]
    # The same in a job of our workload, whose waits are read for this case (a slow link slows
    # no rank's own work, which is all its own split sees).
    watch, said_ours, _ = watcher({"node2": SHAPED}, ours=True)
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert said_ours == said
    # And after our workload's own warning has named a node for its CPU, a link shaped later
    # is still named from the waits (CI run 54: a loaded host's warning had silenced them).
    answers = {"node2": THROTTLED}
    watch, said_after, _ = watcher(answers)
    watch.note("[node1] [rank 0] " + SLOW_WARNING.format(node="node2"))
    watch.join(10)
    answers["node2"] = SHAPED
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert said_after[1:] == said, said_after
    # The shaped link's peers resend what it drops: their retransmits are the link's symptom,
    # not a second cause, so the one node whose own link is shaped is still named.
    watch, said_resent, _ = watcher({"node1": RESENT, "node2": SHAPED, "node3": RESENT})
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert said_resent == said
    # Where retransmits are all there is, one node alone with them is named...
    watch, said, _ = watcher({"node3": RESENT})
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert [line.split("; cause: ")[1] for line in said] == [
        "network: TCP retransmits 5.0% of its segments"
    ]
    assert said[0].startswith("[launcher] node3 is the straggler: ")
    # ...and two with them are not.
    watch, said, _ = watcher({"node1": RESENT, "node3": RESENT})
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert said == []
    # Two nodes whose links are shaped alike: which one holds the job is not known, and not said.
    watch, said, _ = watcher({"node1": SHAPED, "node2": SHAPED})
    for step in range(3):
        watch.paces(reading(10 + 20 * step, bound, 10 + 40 * step))
    watch.join(10)
    assert said == []


class _Work:
    def __init__(self, future=None, wait=None):
        self.future, self._wait = future, wait

    def get_future(self):
        if self.future is None:
            raise RuntimeError("Work::getFuture not implemented.")
        return self.future

    def wait(self):
        self._wait()


class _Future:
    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback):
        self.callbacks.append(callback)

    def complete(self):
        for callback in self.callbacks:
            callback(self)


class _Args:
    def __init__(self, op_id, work=None, async_op=True):
        self.op_id, self.work, self.async_op = op_id, work, async_op


def test_a_ranks_waits_count_the_time_with_a_collective_open_once():
    now = [0.0]
    measure = waits.Waits(clock=lambda: now[0])
    first, second = _Future(), _Future()
    now[0] = 1.0
    measure.pre_hook(_Args(1))
    measure.post_hook(_Args(1, _Work(first)))
    now[0] = 1.5
    measure.pre_hook(_Args(2))
    measure.post_hook(_Args(2, _Work(second)))  # two open together: DDP's buckets
    now[0] = 3.0
    first.complete()
    assert measure.totals() == {"wall": 3.0, "waited": 2.0, "collectives": 1}  # still open
    now[0] = 4.0
    second.complete()
    now[0] = 10.0
    # A work without a future (torch's coalesced ones) is not timed, and never raises into
    # the script's collective; nor does a hook given what it does not expect.
    measure.pre_hook(_Args(3))
    measure.post_hook(_Args(3, _Work(None)))
    measure.post_hook(object())
    measure.pre_hook(object())
    assert measure.totals() == {"wall": 10.0, "waited": 3.0, "collectives": 2}


def test_a_blocking_collective_is_waited_for_in_its_hook_and_its_error_left_to_torch():
    """A blocking collective (async_op=False), which torch waits for right after the hook, is
    waited for in the hook itself and ends where that wait returns (no callback from gloo's
    thread); one that fails is closed all the same, its error left for torch's own wait."""
    now = [0.0]
    measure = waits.Waits(clock=lambda: now[0])

    def completes_at(moment):
        def wait():
            now[0] = moment

        return wait

    def fails():
        now[0] = 9.0
        raise RuntimeError("Connection closed by peer")

    now[0] = 1.0
    measure.pre_hook(_Args(1))
    measure.post_hook(_Args(1, _Work(wait=completes_at(3.5)), async_op=False))
    assert measure.totals() == {"wall": 3.5, "waited": 2.5, "collectives": 1}
    now[0] = 8.0
    measure.pre_hook(_Args(2))
    measure.post_hook(_Args(2, _Work(wait=fails), async_op=False))  # raises nothing
    now[0] = 10.0
    assert measure.totals() == {"wall": 10.0, "waited": 3.5, "collectives": 2}


def test_nccls_timed_collectives_of_the_default_group_are_summed_once_each():
    def entry(record, state="completed", duration=2.5, group="default_pg", p2p=False):
        return {
            "record_id": record,
            "state": state,
            "is_p2p": p2p,
            "process_group": ["0", group],
            **({"duration_ms": duration} if duration is not None else {}),
        }

    trace = {
        "entries": [
            entry(0),
            entry(1, duration=None),  # not timed (TORCH_NCCL_ENABLE_TIMING unset)
            entry(2, group="sub"),  # another group's, on its own stream
            entry(3, p2p=True),
            entry(4, duration=7.5),
            entry(5, state="started"),  # read again later
        ]
    }
    assert waits.nccl_durations(trace, -1) == (0.01, 2, 4)
    assert waits.nccl_durations(trace, 4) == (0.0, 0, 4)


USER_SCRIPT = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1000)
for _ in range(40):
    if dist.get_rank() == 1:
        time.sleep(0.2)  # rank 1 works; rank 0 waits for it in every all_reduce
    dist.all_reduce(tensor)
print("done", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


def test_a_users_script_unchanged_has_its_ranks_waits_measured_in_a_local_job(tmp_path):
    """The sitecustomize on a job's import path starts the measurement in a script that knows
    nothing of ours: rank 0, which waits for rank 1 in every all_reduce, waited most of its
    time; rank 1 hardly any."""
    script = tmp_path / "proj" / "train.py"
    script.parent.mkdir()
    script.write_text(USER_SCRIPT)
    done = run_cli("train", "--script", str(script), "--nproc-per-node", "2", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = Path(re.search(r"^Run directory: (\S+)", done.stdout, re.M).group(1))
    found = {
        rank: json.loads((run_dir / PACE_FILE.format(rank=rank)).read_text()) for rank in (0, 1)
    }
    assert found[0]["waited"] > 0.6 * found[0]["wall"], found
    assert found[1]["waited"] < 0.3 * found[1]["wall"], found
    assert found[0]["collectives"] >= 40 and found[0]["node"], found
    # Readable by all, as the node's SSH user reads what a container's root wrote.
    modes = {(run_dir / PACE_FILE.format(rank=rank)).stat().st_mode & 0o777 for rank in (0, 1)}
    assert modes == {durable.FILE_MODE}, modes


def test_the_sitecustomize_chains_to_the_interpreters_own_and_touches_nothing_else(tmp_path):
    """Without RANK it wraps nothing; another sitecustomize later on the path still runs."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_RAN = True\n")
    site = REPO_ROOT / "training" / "distributed" / "site"
    probe = (
        "import builtins, sys; "
        "print(getattr(builtins, 'OTHER_RAN', False), "
        "any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    )
    env = {"PYTHONPATH": f"{site}:{other}", "PATH": "/usr/bin:/bin"}
    plain = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    assert plain.stdout.split() == ["True", "False"], plain.stderr
    rank = {**env, "RANK": "0", "TMN_RUN_DIR": str(tmp_path)}
    ranked = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=rank, check=True
    )
    assert ranked.stdout.split() == ["True", "True"], ranked.stderr


def test_a_users_script_or_module_is_watched_and_our_workloads_speak_for_themselves():
    from pathlib import PurePosixPath

    from torch_multinode.launch.spec import JobSpec
    from torch_multinode.launch.staging import Project

    assert stragglers.watched(JobSpec(script=Path("/w/train.py")))
    assert stragglers.watched(JobSpec(module="mypkg.train"))
    assert not stragglers.watched(JobSpec())  # training.ddp
    assert not stragglers.watched(JobSpec(module="training.fsdp"))
    tool = "/var/tmp/tmn/torch-multinode-tool/torch_multinode"
    project = Project(((None, "/w/proj"), (None, tool)), "/w/proj", "/w/proj/train.py")
    site = str(PurePosixPath(tool) / "training" / "distributed" / "site")
    assert project.import_path(JobSpec(script=Path("/w/proj/train.py"))) == (
        f"/w/proj:{PurePosixPath(tool).parent}:{site}"
    )
    assert (
        project.import_path(JobSpec())
        == project.python_path
        == f"/w/proj:{PurePosixPath(tool).parent}"
    )


def test_the_launcher_reads_a_scripts_waits_on_every_node_and_names_the_straggler(monkeypatch):
    """The real launcher on fake nodes (no traffic), readings every 0.05 s instead of 20: each
    node prints its rank's totals, node1's rank waiting 90 % of the time and node2's 5 %; the
    launcher names node2 with the cause its probe found, and the result keeps it. A job of our
    workload reads them too, and names nothing from them but a link that holds every node (it
    says who is slow by its own work itself)."""
    from tests.fakes import FakeNodes
    from tests.helpers import inventory_text, node
    from torch_multinode.cluster.inventory_read import parse as parse_inventory
    from torch_multinode.launch.backends import SshBackend
    from torch_multinode.launch.restarts import run_with_restarts
    from torch_multinode.launch.spec import JobSpec
    from torch_multinode.launch.staging import Project

    monkeypatch.setattr(stragglers, "PACE_INTERVAL", 0.05)
    hosts = {"n1": node(1, compute_ip="10.7.0.9"), "n2": node(2, compute_ip="10.7.0.10")}
    inventory = parse_inventory(
        inventory_text(hosts, launch_mode="host", training_python="/opt/venv/bin/python"),
        "/nonexistent/inv.yml",
    )
    said: list[str] = []
    reads = {"n1": 0, "n2": 0}

    def job_on(host, command, out) -> int:
        if "tmn-ours" in command:
            time.sleep(0.5)  # ten intervals of the reader's
            return 0
        for _ in range(200):  # the job goes on while the launcher looks
            if any("is the straggler" in line for line in said):
                break
            time.sleep(0.05)
        return 0

    def answer(host, command):
        if "read_all" in command:
            return THROTTLED if host.name == "n2" else CALM
        if "pace-rank-" not in command:
            return ""
        reads[host.name] += 1
        at = 10.0 * reads[host.name]
        rank, share = (0, 0.9) if host.name == "n1" else (1, 0.05)
        total = {"rank": rank, "node": host.name, "wall": at, "waited": at * share}
        return json.dumps({**total, "collectives": 10 * reads[host.name]}) + "\n"

    def run(spec: JobSpec) -> tuple:
        nodes = FakeNodes(list(inventory.hosts), responder=answer, streamer=job_on)
        project = Project(trees=(), workdir="/w", script="/w/train.py")
        backend = SshBackend(inventory, spec, said.append, project, restart_wait=5, nodes=nodes)
        return run_with_restarts(backend, spec, 0, said.append), nodes

    result, nodes = run(JobSpec(run_id="tmn-own", script=Path("/w/train.py")))
    assert result.exit_code == 0, said
    named = [line for line in said if "is the straggler" in line]
    assert named == [
        "[launcher] n2 is the straggler: the other nodes' ranks wait in collectives 90% of the "
        "time, its own 5%: every rank waits for it; cause: CPU throttled by its cgroup quota "
        "(0.3 CPU, 100% of periods throttled)"
    ], said
    assert result.stragglers == (named[0].removeprefix("[launcher] "),)
    assert reads["n1"] >= 3 and reads["n2"] >= 3
    # Our workload: the same readings, and nothing said from them.
    said.clear()
    before = dict(reads)
    result, nodes = run(JobSpec(run_id="tmn-ours"))
    assert result.exit_code == 0, said
    assert reads["n1"] >= before["n1"] + 3 and reads["n2"] >= before["n2"] + 3
    assert not [line for line in said if "is the straggler" in line], said
    assert result.stragglers == ()


def test_our_workload_measures_its_waits_with_its_detector_and_not_without():
    """training.ddp starts the measure of its waits (for a slow link) with its own detector:
    with `--slow-rank-factor 0` neither runs, and no rank writes its totals."""
    done = run_cli(
        "train",
        "--nproc-per-node",
        "2",
        "--",
        *TINY,
        "--steps",
        "3",
        "--slow-rank-factor",
        "0",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3/3" in done.stdout, done.stdout
    run_dir = Path(re.search(r"^Run directory: (\S+)", done.stdout, re.M).group(1))
    assert run_dir.is_dir() and not list(run_dir.glob(PACE_FILE.format(rank="*"))), sorted(
        run_dir.iterdir()
    )
