"""The CLIs (cluster, netcheck, train, the simulator's), fuzzed in this process: any command
line, with inventory and script files of any content, ends in exit 0, or exit 2 with one
`Error:` line and nothing else, or reaches real work with input the seam finds valid. See
guard.assert_clean for the contract.

Nothing leaves the machine or changes it: the seams (netcheck's pre-flight, the launcher, the
docker engine, image builds) raise Reached instead of working, and under them guard.py stops
and reports any connection, DNS lookup, process, signal or file write outside the example's
directory that some other code path might attempt.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch  # noqa: F401 - imported on first use inside train: here, where nothing is watched
from hypothesis import event, given
from hypothesis import strategies as st

import torch_multinode.cluster.cli
import torch_multinode.launch.cli
import torch_multinode.netcheck.cli
import torch_multinode.netcheck.envfile  # noqa: F401 - the same, for netcheck
from tests.fakes import FakeNodes
from tests.fuzz.guard import Reached, assert_clean, call
from tests.fuzz.strategies import (
    FUZZ,
    VALID_INVENTORY,
    any_text,
    dump,
    inventory_texts,
    near_valid_inventories,
)
from torch_multinode import cluster, launch, netcheck
from torch_multinode.cluster import engine, sync
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.inventory_checks import is_word
from torch_multinode.launch import backends
from torch_multinode.launch.spec import JobSpec
from torch_multinode.netcheck.attempts import Options
from torch_multinode.provision import bootstrap, images, ship
from torch_multinode.sim import cli as sim_cli
from torch_multinode.sim import nodes as sim

# --- the seams: where real work would start --------------------------------------------------


def fake_preflight(inventory: Inventory, options: Options, nodes) -> None:
    """What netcheck hands to its pre-flight, it must have checked."""
    assert isinstance(inventory, Inventory) and inventory.hosts
    assert options.nnodes is None or 1 <= options.nnodes <= len(inventory.hosts)
    assert options.timeout is None or (math.isfinite(options.timeout) and options.timeout > 0)
    raise Reached("netcheck pre-flight")


class FakeLauncher:
    """What train hands to the launcher, it must have checked."""

    def __init__(self, inventory: Inventory, spec: JobSpec, emit, project, nodes, spares) -> None:
        assert isinstance(inventory, Inventory) and inventory.hosts  # narrowed: the job's nodes
        # an FT=1 job's spares, never one of its nodes; none for any other job
        assert not set(spares) & set(inventory.hosts) and (spec.fault_tolerant or not spares)
        assert project.workdir and all(remote.startswith("/") for _, remote in project.trees)
        assert spec.rendezvous_timeout >= 1 and spec.max_restarts >= 0
        assert spec.nproc_per_node is None or spec.nproc_per_node >= 1
        assert spec.script is not None or all(p.isidentifier() for p in spec.module.split("."))
        assert spec.script is None or spec.script.is_file()
        raise Reached("launcher")


def fake_build(kind: str, tag: str, progress=None, base_image=None, platform=None) -> None:
    assert kind in ("auto", "cpu", "cuda") and is_word(tag)
    assert base_image is None or is_word(base_image)
    assert platform is None or platform.startswith("linux/")
    raise Reached("docker build")


def fake_bootstrap(inventory: Inventory, prompter, say, fingerprints=None, disable=False):
    """Where bootstrap would make a key and reach the nodes: what it was handed is checked."""
    assert isinstance(inventory, Inventory) and inventory.hosts
    assert fingerprints is None or isinstance(fingerprints, Path)
    raise Reached("bootstrap")


def fake_ship(inventory, image=None, via="auto", emit=print):
    assert via in ("auto", "registry", "stream") and (image is None or is_word(image))
    assert inventory.hosts
    raise Reached("ship")


def no_engine() -> None:
    raise Reached("docker engine")


@pytest.fixture
def seams(monkeypatch, tmp_path) -> Path:
    """Seams patched, the working directory inside tmp_path: relative paths stay there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(netcheck.cli, "preflight", fake_preflight)
    monkeypatch.setattr(backends, "Launcher", FakeLauncher)
    monkeypatch.setattr(images, "build", fake_build)
    monkeypatch.setattr(bootstrap, "bootstrap", fake_bootstrap)
    monkeypatch.setattr(sim, "require_engine", no_engine)
    monkeypatch.setattr(engine, "require_engine", no_engine)  # cluster image -i asks it first
    # A project is listed as a plain directory, not by asking git (a process of its own).
    monkeypatch.setattr(sync, "_git", lambda root, *args: None)
    monkeypatch.setattr(ship, "ship", fake_ship)
    # An inventory directory is read by ansible-core, whose first import opens /dev/null for
    # writing: imported here, outside the guard, so that is not taken for the CLI writing.
    import ansible.inventory.manager  # noqa: F401
    import ansible.parsing.dataloader  # noqa: F401
    import ansible.vars.manager  # noqa: F401

    return tmp_path


# --- command lines ---------------------------------------------------------------------------

INVENTORY = "@inventory"  # replaced by the path of the example's inventory file
SCRIPT = "@script"  # the example's script file
MISSING = "@missing"  # a path that does not exist
HERE = "@dir"  # the example's own directory


@dataclass
class Invocation:
    argv: list[str]
    inventory: str | bytes
    script: str

    def materialise(self, root: Path) -> list[str]:
        """Write the files into a fresh directory under root; the argv with real paths."""
        directory = Path(tempfile.mkdtemp(dir=root))
        inventory = directory / "inventory.yml"
        if isinstance(self.inventory, bytes):
            inventory.write_bytes(self.inventory)
        else:
            inventory.write_text(self.inventory, encoding="utf-8")
        script = directory / "train_script.py"
        script.write_text(self.script, encoding="utf-8")
        places = {INVENTORY: inventory, SCRIPT: script, MISSING: directory / "missing.yml"}
        argv = []
        for word in self.argv:
            for mark, path in places.items():
                word = word.replace(mark, str(path))
            argv.append(word.replace(HERE, str(directory)))
        return argv


# Weighted towards inventories that load, so that calls get past the loader to the seams.
inventory_contents = st.one_of(
    st.just(dump(VALID_INVENTORY)),
    st.just(dump(VALID_INVENTORY)),
    near_valid_inventories().map(dump),
    near_valid_inventories().map(dump),
    inventory_texts,
    st.binary(max_size=100),
)
script_contents = st.one_of(
    st.sampled_from(
        [
            "",
            "import argparse\nparser.add_argument('--local_rank')\n",
            "parser.add_argument('--local-rank', type=int)\n",
        ]
    ),
    any_text,
)


def digits_beyond_int() -> str:
    """More digits than int() converts (built, not listed: Hypothesis shows its strategies)."""
    return "9" * 5000


# Mostly numbers a user would give, so that several options are often valid at once.
numbers = st.one_of(
    st.sampled_from(["1", "2", "5", "60"]),
    st.sampled_from(["1", "2", "5", "60"]),
    st.sampled_from(
        ["0", "3", "-1", "01", " 2", "1_0", "x", "", "nan", "inf", "1e400", "0.5", "²"]
    ),
    st.builds(digits_beyond_int),
    any_text,
)
paths = st.one_of(
    st.sampled_from([INVENTORY, MISSING, HERE, f"{HERE}/sub/dir", "relative/dir", ""]), any_text
)


def option(name: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.just(name), values).map(list)


@st.composite
def command_line(
    draw, first: st.SearchStrategy[list[str]], pieces: list[st.SearchStrategy]
) -> list[str]:
    """The first words, then some of the pieces in any order, now and then a stray word."""
    chosen = [draw(piece) for piece in pieces if draw(st.integers(0, 4)) < 2]
    argv = draw(first) + [word for piece in draw(st.permutations(chosen)) for word in piece]
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(any_text))
    return argv


def invocations(argv: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(Invocation, argv, inventory_contents, script_contents)


def words(*fixed: str) -> st.SearchStrategy[list[str]]:
    return st.just(list(fixed))


# Mostly the example's inventory file; sometimes another path, or none.
inventory_option = st.one_of(*[words("-i", INVENTORY)] * 6, option("--inventory", paths), words())
NETCHECK = command_line(
    inventory_option,
    [
        option("-n", numbers),
        option("--nnodes", numbers),
        st.sampled_from([["--json"], ["--sweep"], ["--no-sweep"], ["--bandwidth"], ["--pairwise"]]),
        option("--env-file", paths),
        option("--timeout", numbers),
    ],
)
TRAIN = command_line(
    inventory_option,
    [
        option("-n", numbers),
        st.one_of(
            option("--script", st.sampled_from([SCRIPT, MISSING, HERE])),
            option(
                "--module",
                st.one_of(
                    st.sampled_from(["training.ddp", "a..b", "", "1x", "-m", "pkg.mod"]), any_text
                ),
            ),
        ),
        option("--nproc-per-node", numbers),
        option("--rendezvous-timeout", numbers),
        option("--max-restarts", numbers),
        option("--restarts", numbers),
        option("--restart-wait", numbers),
        option("--min-nodes", numbers),
        option(
            "--gpus",
            st.one_of(st.sampled_from(["0", "0,1", "0,0", "²", "", "1024", "x"]), any_text),
        ),
        st.one_of(words("--debug"), option("--debug", st.sampled_from(["info", "detail", "x"]))),
        option("--local-rank-arg", st.sampled_from(["auto", "none", "--local_rank", "x"])),
        option("--log-dir", paths),
        st.lists(any_text, max_size=3).map(lambda extra: ["--", *extra]),
    ],
)
SIM_OPTIONS = [
    option("--name", st.one_of(st.sampled_from(["tmn", "fuzz"]), any_text)),
    option(
        "--subnet", st.one_of(st.sampled_from(["172.29.77.0/24", "10.0.0.0/30", "x"]), any_text)
    ),
    option("--mgmt-subnet", st.sampled_from(["172.30.77.0/24", "172.29.77.0/24", "300.0.0.0/8"])),
    option("--state-dir", paths),
]
CLUSTER = st.one_of(
    command_line(inventory_option.map(lambda found: ["check", *found]), [option("-n", numbers)]),
    command_line(
        words("image"),
        [
            option("--kind", st.sampled_from(["auto", "cpu", "cuda", "gpu"])),
            option("--tag", st.one_of(st.sampled_from(["t:1", "a b", ""]), any_text)),
            inventory_option,
        ],
    ),
    command_line(inventory_option.map(lambda found: ["hostfile", *found]), [option("-n", numbers)]),
    command_line(
        inventory_option.map(lambda found: ["ship", *found]),
        [
            option("-n", numbers),
            option("--image", st.one_of(st.sampled_from(["t:1", "a b", ""]), any_text)),
            option("--via", st.sampled_from(["auto", "registry", "stream", "fast"])),
        ],
    ),
    command_line(
        inventory_option.map(lambda found: ["bootstrap", *found]),
        [option("--fingerprints", paths), words("--disable-password-login")],
    ),
)
SIM = st.one_of(
    command_line(
        words("up"),
        [
            *SIM_OPTIONS,
            option("-n", numbers),
            option("--nodes", numbers),
            option("--link", st.sampled_from(["1gbit", "100mbit", "fast", ""])),
        ],
    ),
    command_line(words("down"), SIM_OPTIONS),
    command_line(words("status"), SIM_OPTIONS),
)
KNOWN_WORDS = [
    "check",
    "image",
    "up",
    "down",
    "status",
    "bootstrap",
    "ship",
    "-i",
    "-n",
    "--help",
    "-h",
    "--",
]
ANY_ARGV = st.lists(st.one_of(any_text, st.sampled_from(KNOWN_WORDS)), max_size=6)


# --- the fuzz tests ----------------------------------------------------------------------------


@FUZZ
@given(invocations(st.one_of(NETCHECK, NETCHECK, NETCHECK, ANY_ARGV)))
def test_netcheck(seams, invocation):
    outcome = call(netcheck.cli.main, invocation.materialise(seams), seams)
    event(outcome.kind())
    assert_clean(outcome)


@FUZZ
@given(invocations(st.one_of(TRAIN, TRAIN, TRAIN, ANY_ARGV)))
def test_train(seams, invocation):
    outcome = call(launch.cli.main, invocation.materialise(seams), seams)
    event(outcome.kind())
    # Without an inventory the job would start here (torchrun); the guard stops the process.
    assert_clean(outcome, processes=True)


@FUZZ
@given(invocations(st.one_of(CLUSTER, CLUSTER, CLUSTER, ANY_ARGV)))
def test_cluster(seams, invocation):
    outcome = call(cluster.cli.main, invocation.materialise(seams), seams)
    event(outcome.kind())
    assert_clean(outcome)


@FUZZ
@given(invocations(st.one_of(SIM, SIM, SIM, ANY_ARGV)))
def test_sim(seams, invocation):
    outcome = call(sim_cli.main, invocation.materialise(seams), seams)
    event(outcome.kind())
    assert_clean(outcome)


@pytest.fixture
def dead_cluster(monkeypatch, tmp_path) -> Path:
    """The real pre-flight, on a cluster where no node answers."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        netcheck.cli,
        "SshNodes",
        lambda inventory: FakeNodes(list(inventory.hosts), down={h.name for h in inventory.hosts}),
    )
    return tmp_path


@FUZZ
@given(near_valid_inventories(), st.sampled_from([[], ["--json"], ["--sweep"], ["--pairwise"]]))
def test_netcheck_reports_any_valid_inventory_whose_nodes_do_not_answer(
    dead_cluster, document, flags
):
    argv = Invocation(
        ["-i", INVENTORY, "--env-file", f"{HERE}/env.json", *flags], dump(document), ""
    ).materialise(dead_cluster)
    outcome = call(netcheck.cli.main, argv, dead_cluster)
    event(outcome.kind())
    if outcome.code == 1:  # a valid inventory: every node FAILs its SSH check, nothing else runs
        assert outcome.stopped == [] and outcome.err == "", str(outcome)
        assert "FAIL" in outcome.out and "does not answer over SSH" in outcome.out, str(outcome)
    else:
        assert_clean(outcome)
        assert outcome.code == 2, str(outcome)


# --- what the fuzzing found, one example each --------------------------------------------------


# Where the hints' commands are: the venv's bin directory, named whole (the calls run in a
# directory of their own, not below it).
BIN = Path(sys.executable).parent


def run(main, argv: list[str], root: Path):
    outcome = call(main, argv, root)
    assert_clean(outcome, processes=main is launch.cli.main)
    return outcome


@pytest.mark.parametrize(
    "main, argv, line",
    [
        # argparse printed its usage and a second line; now one line like every other error.
        (
            sim_cli.main,
            ["up", "--nodes", "x"],
            "Error: NNODES=x (--nodes): invalid int value: 'x' "
            f"(try {BIN}/python -m torch_multinode.sim.cli up --help)",
        ),
        (
            sim_cli.main,
            [],
            "Error: the following arguments are required: ACTION "
            f"(try {BIN}/python -m torch_multinode.sim.cli --help)",
        ),
        (
            netcheck.cli.main,
            ["-i", "x.yml", "--bogus"],
            f"Error: unknown option --bogus (try {BIN}/netcheck --help)",
        ),
        (
            launch.cli.main,
            ["--debug", "x"],
            "Error: DEBUG=x (--debug): invalid choice: 'x' "
            f"(choose from 'info', 'detail') (try {BIN}/train --help)",
        ),
        (
            netcheck.cli.main,
            ["-i", "x.yml", "a\nb"],
            f"Error: unrecognized arguments: a\\nb (try {BIN}/netcheck --help)",
        ),
        # float() takes 'nan' and 'inf': a stage limit that never comes.
        (
            netcheck.cli.main,
            ["-i", "x.yml", "--timeout", "nan"],
            "Error: argument --timeout: 'nan' is not a number of seconds "
            f"(try {BIN}/netcheck --help)",
        ),
        (
            netcheck.cli.main,
            ["-i", "x.yml", "--timeout", "inf"],
            "Error: argument --timeout: 'inf' is not a number of seconds "
            f"(try {BIN}/netcheck --help)",
        ),
        # Handed on to torchrun on every node, which failed each in its own way.
        (
            launch.cli.main,
            ["--rendezvous-timeout", "0"],
            f"Error: argument --rendezvous-timeout: 0 is below 1 (try {BIN}/train --help)",
        ),
        (
            launch.cli.main,
            ["--max-restarts", "-1"],
            f"Error: argument --max-restarts: -1 is below 0 (try {BIN}/train --help)",
        ),
        (
            launch.cli.main,
            ["--restarts", "-1"],
            f"Error: RESTARTS=-1 (--restarts): -1 is below 0 (try {BIN}/train --help)",
        ),
        (
            launch.cli.main,
            ["--restart-wait", "nan"],
            "Error: argument --restart-wait: 'nan' is not a number of seconds "
            f"(try {BIN}/train --help)",
        ),
        (
            launch.cli.main,
            ["--restarts", "1"],
            "Error: --restarts=1 needs an inventory: a local "
            "job has no node to wait for (try INVENTORY=path.yml)",
        ),
        (
            launch.cli.main,
            ["--min-nodes", "0"],
            f"Error: MIN_NODES=0 (--min-nodes): 0 is below 1 (try {BIN}/train --help)",
        ),
        (
            launch.cli.main,
            ["--min-nodes", "1"],
            "Error: --min-nodes=1 needs an inventory: a local "
            "job has no node to lose (try INVENTORY=path.yml)",
        ),
        (
            launch.cli.main,
            ["--module", "a..b"],
            "Error: --module 'a..b' is not a Python module name (try a dotted name like training.ddp)",
        ),
        (
            launch.cli.main,
            ["--module", ""],
            "Error: --module '' is not a Python module name (try a dotted name like training.ddp)",
        ),
        # str.isdigit('²') but not int('²'): a ValueError traceback.
        (
            launch.cli.main,
            ["--gpus", "²"],
            "Error: GPUS: '²' is not a list of GPU indices (try a form like 0,2)",
        ),
        # Went to `docker build -t`.
        (cluster.cli.main, ["image", "--tag", "a b"], "Error: --tag 'a b' is not an image name"),
        # A newline in a path split the error line in two.
        (
            launch.cli.main,
            ["--script", "no\nsuch.py"],
            "Error: script no\\nsuch.py does not exist (try a path to a .py file)",
        ),
    ],
)
def test_what_fuzzing_found_is_one_error_line(seams, main, argv, line):
    outcome = run(main, argv, seams)
    assert (outcome.code, outcome.err, outcome.out) == (2, line + "\n", "")


def test_an_inventory_value_too_long_to_print_is_an_error_line_not_a_crash(seams):
    path = seams / "inventory.yml"
    path.write_text(dump(VALID_INVENTORY).replace("gpus: 1", "gpus: 0x" + "f" * 4000))
    outcome = run(cluster.cli.main, ["check", "-i", str(path)], seams)
    assert outcome.code == 2
    assert outcome.err == (
        f"Error: inventory {path}: host 'node2': field 'gpus': <int too long to show> is more "
        "than one node holds (at most 1024)\n"
    )


def test_valid_input_reaches_each_seam_and_nothing_else(seams):
    """The seams are where the fuzzed calls stop: prove each one is reached by valid input."""
    path = seams / "inventory.yml"
    path.write_text(dump(VALID_INVENTORY))
    assert run(netcheck.cli.main, ["-i", str(path), "-n", "2"], seams).reached == (
        "netcheck pre-flight"
    )
    assert run(launch.cli.main, ["-i", str(path)], seams).reached == "launcher"
    assert run(cluster.cli.main, ["image", "--kind", "cpu"], seams).reached == "docker build"
    assert run(sim_cli.main, ["status"], seams).reached == "docker engine"
    checked = run(cluster.cli.main, ["check", "-i", str(path)], seams)
    assert checked.code == 0 and checked.out.startswith(f"inventory {path}: valid, 2 host(s)")
    local = run(launch.cli.main, ["--nproc-per-node", "1"], seams)
    assert [a.event for a in local.stopped] == ["subprocess.Popen"]
    assert "'torch_multinode.training.local_launch', '--standalone'" in local.stopped[0].detail
    assert sys.executable in local.stopped[0].detail


@pytest.mark.parametrize(
    "workload, argv, line",
    [
        ("training.ddp", ["--steps", "-1"], "Error: --steps must be positive, got -1"),
        ("training.manual_dp", ["--lr", "-0.5"], "Error: --lr must be 0 or more, got -0.5"),
        (
            "training.model_parallel",
            ["--split-size", "-3"],
            "Error: --split-size must be 0 (off) or positive",
        ),
        (
            "training.pipeline",
            ["--batch-size", "10", "--microbatches", "4"],
            "Error: batch 10 does not split into 4 micro-batches (10 % 4 = 2)",
        ),
        (
            "training.comm_demo",
            ["--bogus"],
            f"Error: unknown option --bogus (try {BIN}/train --module training.comm_demo -- --help)",
        ),
    ],
)
def test_a_workloads_bad_arguments_are_refused_before_any_node_is_touched(
    seams, workload, argv, line
):
    """The workload's own checks run on the controller: one line and exit 2, nothing reached
    (neither the launcher nor a process), instead of the same error from every rank."""
    path = seams / "inventory.yml"
    path.write_text(dump(VALID_INVENTORY))
    for inventory in (["-i", str(path)], []):  # on the nodes, and locally
        outcome = run(launch.cli.main, [*inventory, "--module", workload, "--", *argv], seams)
        assert (outcome.code, outcome.err, outcome.out) == (2, line + "\n", "")
        assert outcome.reached is None and outcome.stopped == []


def test_the_guard_stops_and_reports_what_a_call_must_not_do(tmp_path):
    """The net itself. Had it a hole, these would touch only this test's scratch space and
    loopback: a file beside the watched directory, a connection to 127.0.0.1, localhost."""
    import socket

    watched, outside = tmp_path / "watched", tmp_path / "outside.txt"
    watched.mkdir()

    def misbehave(argv):
        if argv[0] == "write":
            outside.write_text("x")
        elif argv[0] == "connect":
            with socket.socket() as sock:
                sock.settimeout(0.5)
                sock.connect(("127.0.0.1", 9))
        elif argv[0] == "resolve":
            socket.getaddrinfo("localhost", 22)
        else:
            (watched / "inside.txt").write_text("x")
        return 0

    for action, audit_event in [
        ("write", "open"),
        ("connect", "socket.connect"),
        ("resolve", "socket.getaddrinfo"),
    ]:
        outcome = call(misbehave, [action], watched)
        assert [a.event for a in outcome.stopped] == [audit_event]
        with pytest.raises(AssertionError):
            assert_clean(outcome)
    assert not outside.exists()
    allowed = call(misbehave, ["inside"], watched)
    assert allowed.stopped == [] and allowed.code == 0
    assert (watched / "inside.txt").read_text() == "x"
