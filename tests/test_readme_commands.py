"""README.md's commands, run as a user types them, so the guide cannot drift from the product.

Every line of README's ```sh blocks that starts with `make ` (backslash continuations joined) is
a command, and so is every inline `make ...` in backticks outside them. On the simulated
cluster of the `provisioned` fixture (2 nodes, the CPU twin, launch_mode: container):
`my-cluster.yml` (and `INVENTORY=...`) is its inventory, `path/to/train.py` and
`~/proj/train.py` a project of the test's own (a package beside the script, a config read
relative to it), `~/datasets/cifar` a small directory the test makes, `JOB-ID` the ID of a job
the test ran. Each command runs through `make` and must exit 0 with its own line of success.

What cannot run inside the suite is listed in ANOTHER_WAY with the reason, and checked as far
as it can be. An inline command that only names a target (`make train`, `make bootstrap
INVENTORY=...`) is covered by the README's full command it begins. Any other command, or a
line of a ```sh block that is not a `make` command, fails the test: a new command in the README
needs its entry here. So does an entry here that the README no longer has.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, make
from torch_multinode.cluster.inventory import DEFAULT_CHECKPOINT_ROOT, DEFAULT_DATA_ROOT
from torch_multinode.sim import nodes as sim

README = REPO_ROOT / "README.md"

# README's placeholders and what stands in for them here.
INVENTORY_PLACEHOLDERS = ("my-cluster.yml", "...")
SCRIPT_PLACEHOLDERS = ("path/to/train.py", "~/proj/train.py")
DATASET_PLACEHOLDER = "~/datasets/cifar"
JOB_PLACEHOLDER = "JOB-ID"
CHECKPOINT_DIR = "exp1"  # the README's --checkpoint-dir, under checkpoint_root on every node
DATASET = "cifar"  # the README's --data-dir, under data_root on every node once `make data` ran

TRAIN = '''\
"""A user's project: its own package, a config beside the script, a dataset, a checkpoint."""
import argparse
import os
import pathlib

import torch
import torch.distributed as dist
import yaml

from mylib.model import VERSION, build

here = pathlib.Path(__file__).resolve().parent
config = yaml.safe_load((here / "config.yaml").read_text())
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--checkpoint-dir")
parser.add_argument("--data-dir")
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = "none"
if args.data_dir:
    files = sorted(p.name for p in pathlib.Path(args.data_dir).iterdir())
    data = f"{args.data_dir}: {' '.join(files)}"
model = torch.nn.parallel.DistributedDataParallel(build())
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
for epoch in range(args.epochs):
    optimizer.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
saved = "none"
if args.checkpoint_dir:
    path = pathlib.Path(args.checkpoint_dir) / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.module.state_dict(), path)
    saved = str(path)
secrets = ", ".join(f"{n} of {len(os.environ.get(n, ''))} characters"
                    for n in ("WANDB_API_KEY", "HF_TOKEN"))
print(f"rank {rank}/{world}: mylib {VERSION}, config {config['name']}, lr {args.lr}, "
      f"{args.epochs} epoch(s), in its project {os.getcwd() == str(here)}, data {data}, "
      f"checkpoint {saved}, {secrets}", flush=True)
dist.destroy_process_group()
'''

SERVING = re.compile(r"^TensorBoard \S+ at http://([^/:\s]+):(\d+)/", re.MULTILINE)
LOOPBACK_ONLY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --- README's commands -------------------------------------------------------------------


def readme_commands(text: str) -> tuple[list[str], list[str], list[str]]:
    """(fenced commands, inline commands, lines of ```sh blocks that are no make command), in
    README's order, each with its comment cut and its whitespace collapsed."""
    fenced, strays = [], []
    for block in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```", text, re.MULTILINE | re.DOTALL):
        line = ""
        for raw in block.splitlines():
            line += raw.strip()
            if line.endswith("\\"):
                line = line[:-1] + " "
                continue
            command = " ".join(re.sub(r"(^|\s)#\s.*$", "", line).split())
            if command.startswith("make "):
                fenced.append(command)
            elif command:
                strays.append(command)
            line = ""
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.MULTILINE | re.DOTALL)
    inline = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return fenced, [c for c in inline if c == "make" or c.startswith("make ")], strays


def words(command: str) -> list[str]:
    return shlex.split(command)


def _as_fenced(command: str) -> list[str]:
    return [
        "INVENTORY=my-cluster.yml" if word == "INVENTORY=..." else word for word in words(command)
    ]


def names_a_target(inline: str, fenced: list[str]) -> bool:
    """An inline command that only names a target, maybe with INVENTORY: the beginning of one
    of README's full commands."""
    head = _as_fenced(inline)
    return len(head) >= 2 and any(words(full)[: len(head)] == head for full in fenced)


# --- What stands in for README's placeholders ---------------------------------------------


@dataclass
class Stand:
    inventory: Path
    script: Path
    dataset: Path
    hostfile: Path
    job_id: str | None = None

    def substitute(self, command: str) -> tuple[list[str], Path | None]:
        """make's arguments for README's `command` (its leading `make` dropped), and the file
        its standard output is redirected to, if any."""
        out = None
        argv = words(command)[1:]
        if ">" in argv:
            at = argv.index(">")
            assert argv[at + 1 :] == ["hostfile"], command
            argv, out = argv[:at], self.hostfile
        result = []
        for word in argv:
            name, eq, value = word.partition("=")
            if eq and name == "INVENTORY" and value in INVENTORY_PLACEHOLDERS:
                value = str(self.inventory)
            elif eq and name == "SCRIPT" and value in SCRIPT_PLACEHOLDERS:
                value = str(self.script)
            elif eq and name == "SRC" and value == DATASET_PLACEHOLDER:
                value = str(self.dataset)
            elif eq and name == "RUN" and value == JOB_PLACEHOLDER:
                assert self.job_id, "no job has run yet to give make tensorboard its RUN"
                value = self.job_id
            for placeholder in (*INVENTORY_PLACEHOLDERS[:1], *SCRIPT_PLACEHOLDERS):
                assert placeholder not in value, f"{placeholder} left in {word!r}"
            result.append(f"{name}={value}" if eq else word)
        return result, out


def _project(root: Path) -> Path:
    (root / "mylib").mkdir(parents=True)
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "model.py").write_text(
        'import torch\n\nVERSION = "v7"\n\n\ndef build():\n    return torch.nn.Linear(2, 2)\n'
    )
    (root / "config.yaml").write_text("name: readme-experiment\n")
    (root / "train.py").write_text(TRAIN)
    return root / "train.py"


def _dataset(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in ("train.bin", "test.bin", "labels.txt"):
        (root / name).write_text(f"{name}\n" * 100)
    return root


# --- Each command, run and checked --------------------------------------------------------


class Run:
    """What the test does for each README command: `make` with the substituted arguments."""

    def __init__(self, provisioned, stand: Stand, selftest: subprocess.CompletedProcess):
        self.provisioned = provisioned
        self.stand = stand
        self.selftest = selftest  # the cluster_selftest fixture's run
        self.env = {"WANDB_API_KEY": f"wandb-{uuid.uuid4().hex}"}
        self.seconds: dict[str, float] = {}

    def make(self, command: str, timeout: float = 900) -> subprocess.CompletedProcess:
        argv, out = self.stand.substitute(command)
        started = time.monotonic()
        done = make(*argv, timeout=timeout, env=self.env)
        self.seconds[command] = time.monotonic() - started
        assert done.returncode == 0, (
            f"{argv} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
        )
        if out is not None:
            out.write_text(done.stdout)
        return done

    @staticmethod
    def project_line(output: str, rank: int, where: str, rest: str) -> None:
        """Rank `rank` of 2 of the project's script said it ran with its package and config, in
        its project's directory, and then `rest`."""
        line = f"{where}rank {rank}/2: mylib v7, config readme-experiment, {rest}"
        assert line in output, (line, output[-4000:])


def check_inventory(run: Run, command: str) -> None:
    out = run.make(command).stdout
    assert f"inventory {run.stand.inventory}: valid, 2 host(s)" in out, out
    assert "node_rank 0  node1" in out and "node_rank 1  node2" in out, out


def netcheck(run: Run, command: str) -> None:
    """Ready, and each node's versions locked beside the inventory: every job after it here
    is checked against them (and none has drifted)."""
    out = run.make(command).stdout
    assert re.search(r"^ready: 0 FAIL, 0 WARN, \d+ SKIP in ", out, re.MULTILINE), out[-4000:]
    lock = run.stand.inventory.resolve().parent / "versions.lock.json"
    assert f"Each node's versions locked in {lock} (make train checks them)" in out, out[-4000:]


def selftest_is_the_fixtures(run: Run, command: str) -> None:
    """Run once by the `cluster_selftest` fixture (minutes of compiling), whose table
    tests/docker/test_selftest_cluster.py reads check by check: the README's command is the
    fixture's, and it passed."""
    argv, _ = run.stand.substitute(command)
    done = run.selftest
    assert done.args == ["make", "--no-print-directory", *argv], (done.args, argv)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "selftest passed on 2 node(s)" in done.stdout, done.stdout[-4000:]


def train_default(run: Run, command: str) -> None:
    out = run.make(command).stdout
    assert re.search(r"^Job \S+ succeeded after [\d.]+ s on 2 node\(s\)\.$", out, re.M), out[-4000:]
    run.stand.job_id = re.search(r"^Job (\S+) succeeded", out, re.M).group(1)
    assert (REPO_ROOT / ".runs" / run.stand.job_id).is_dir()


def train_default_here_plans_a_local_run(run: Run, command: str) -> None:
    """`make train` without INVENTORY runs the default job on this machine, a minute of the
    shared CPU: tests/training/test_ddp_runs.py runs it (its exit code written to a file of its
    own, EXIT_CODE=) and checks that it learns. Here `make -n` shows it plans that local run."""
    argv, _ = run.stand.substitute(command)
    recipe = run.make(f"make -n {' '.join(argv)}").stdout.replace("\\\n", " ")
    planned = next(line for line in recipe.splitlines() if ".venv/bin/train " in line)
    assert " -i " not in planned and "--module" not in planned, planned


def train_script(run: Run, command: str) -> None:
    out = run.make(command).stdout
    assert re.search(r"^Job \S+ succeeded after [\d.]+ s on 2 node\(s\)\.$", out, re.M), out[-4000:]
    rest = "lr 0.01, 3 epoch(s), in its project True, data none, checkpoint none"
    for rank, node in ((0, "node1"), (1, "node2")):
        run.project_line(out, rank, f"[{node}] ", rest)


def train_script_here(run: Run, command: str) -> None:
    out = run.make(command).stdout
    assert re.search(r"^Job \S+ succeeded after [\d.]+ s on this machine\.$", out, re.M), out[
        -4000:
    ]
    for rank in (0, 1):
        run.project_line(out, rank, "", "lr 0.1, 1 epoch(s), in its project True, data none")


def train_project(run: Run, command: str) -> None:
    """README's own project on the cluster: ENV's secrets, a checkpoint, the dataset `make data`
    copied (run before this one)."""
    cluster = run.provisioned.cluster
    try:
        out = run.make(command).stdout
        assert re.search(r"^Job \S+ succeeded after [\d.]+ s on 2 node\(s\)\.$", out, re.M), out[
            -4000:
        ]
        data = f"{DEFAULT_DATA_ROOT}/{DATASET}: labels.txt test.bin train.bin"
        for rank, node in ((0, "node1"), (1, "node2")):
            saved = f"{DEFAULT_CHECKPOINT_ROOT}/{CHECKPOINT_DIR}/rank{rank}.pt"
            rest = (
                f"lr 0.01, 1 epoch(s), in its project True, data {data}, checkpoint {saved}, "
                f"WANDB_API_KEY of {len(run.env['WANDB_API_KEY'])} characters, HF_TOKEN of 6 "
                "characters"
            )
            run.project_line(out, rank, f"[{node}] ", rest)
            # The checkpoint outlived the container, on the node's disk.
            assert on_node(cluster, rank + 1, f"ls {saved}").strip() == saved
        assert run.env["WANDB_API_KEY"] not in out and "hf_xxx" not in out
    finally:
        for index in (1, 2):
            on_node(cluster, index, f"rm -rf {DEFAULT_CHECKPOINT_ROOT}/{CHECKPOINT_DIR}")


def data(run: Run, command: str) -> None:
    out = run.make(command).stdout
    for name in ("node1", "node2"):
        assert re.search(rf"^  {name} +3 file\(s\) sent, ", out, re.M), out
    assert re.search(r"^Done: 6 file\(s\), .* sent in all\.$", out, re.M), out
    assert f"Use it in a job as --data-dir {DATASET} ({DEFAULT_DATA_ROOT}/{DATASET} " in out, out
    for index in (1, 2):
        listed = on_node(run.provisioned.cluster, index, f"ls {DEFAULT_DATA_ROOT}/{DATASET}")
        assert listed.split() == ["labels.txt", "test.bin", "train.bin"], (index, listed)


def hostfile(run: Run, command: str) -> None:
    run.make(command)
    assert run.stand.hostfile.read_text() == "node1 slots=1\nnode2 slots=1\n"


def help_lists_targets(run: Run, command: str) -> None:
    out = run.make(command).stdout
    targets = re.findall(r"^\.PHONY: ([a-z0-9-]+) +## ", (REPO_ROOT / "Makefile").read_text(), re.M)
    listed = re.findall(r"^  ([a-z0-9-]+) ", out, re.M)
    assert listed == targets and "Usage: make TARGET" in out, out


def tensorboard(run: Run, command: str) -> None:
    """Serves the job's run directory on loopback until stopped: started, asked for its page,
    stopped (its whole process group)."""
    argv, _ = run.stand.substitute(command)
    process = subprocess.Popen(
        ["make", "--no-print-directory", *argv],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stream=process.stdout) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen = ""
    try:
        deadline = time.monotonic() + 90
        while not (serving := SERVING.search(seen)):
            left = deadline - time.monotonic()
            assert left > 0, f"TensorBoard never said where it serves:\n{seen}"
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"{argv} ended:\n{seen}"
            seen += line
        assert serving.group(1) in ("localhost", "127.0.0.1"), seen
        port = int(serving.group(2))
        while True:
            try:
                with LOOPBACK_ONLY.open(f"http://127.0.0.1:{port}/data/runs", timeout=5) as page:
                    runs = page.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, f"no answer on 127.0.0.1:{port}\n{seen}"
                time.sleep(0.5)
        assert runs.startswith("["), runs
    finally:
        for sent in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sent)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue


def bootstrap_again(run: Run, command: str) -> None:
    """The provisioned cluster is bootstrapped already: a second run asks nothing (its standard
    input is closed) and changes nothing, on the controller or the nodes."""
    argv, _ = run.stand.substitute(command)
    cluster = run.provisioned.cluster
    known_hosts = cluster.config.known_hosts_path
    key = cluster.config.key_path
    probe = "cat /root/.ssh/authorized_keys /etc/sudoers.d/* 2>/dev/null | sha256sum"
    before = [on_node(cluster, i, probe) for i in (1, 2)], _digest(known_hosts), _digest(key)
    started = time.monotonic()
    done = subprocess.run(
        ["make", "--no-print-directory", *argv],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **run.env},
    )
    run.seconds[command] = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"Controller key: {key.resolve()} (already there;" in out, out
    for name in ("node1", "node2"):
        assert re.search(rf"^  {name} +already bootstrapped, nothing changed$", out, re.M), out
    assert "All 2 node(s) take key login and passwordless sudo." in out, out
    # A question would have found no terminal and ended it with an error.
    assert "Is it the same?" not in done.stderr and "password" not in done.stderr, done.stderr
    after = [on_node(cluster, i, probe) for i in (1, 2)], _digest(known_hosts), _digest(key)
    assert after == before


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def on_node(cluster: sim.SimCluster, index: int, command: str) -> str:
    return sim.docker("exec", cluster.config.container(index), "sh", "-c", command).stdout


# --- Checked another way, each with the reason --------------------------------------------


def provision_is_the_fixtures(run: Run, command: str) -> None:
    """Run by the `provisioned` fixture, the cluster every other command here uses (minutes
    of shipping the image): the README's command is the fixture's, and it succeeded."""
    argv, _ = run.stand.substitute(command)
    done = run.provisioned.provision
    assert done.args == ["make", "--no-print-directory", *argv], (done.args, argv)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "2 node(s) ready for provisioning: key login and passwordless sudo." in done.stdout
    lock = run.provisioned.inventory.resolve().parent / "versions.lock.json"
    assert f"Each node's versions locked in {lock} (make train checks them)" in done.stdout


def check_plans_lint_then_test(run: Run, command: str) -> None:
    """`make check` is this suite itself: `make -n` shows it plans the linters, then pytest."""
    argv, _ = run.stand.substitute(command)
    out = run.make(f"make -n {' '.join(argv)}").stdout.splitlines()
    steps = [i for i, line in enumerate(out) if "ruff check ." in line or "pytest -n" in line]
    assert [("pytest" in out[i]) for i in steps] == [False, True], out


def every_test_planned(run: Run, command: str) -> None:
    """`make test-all` is this suite with the extended tests (CI's `make test` leaves them
    out): `make -n` shows pytest, which `make check`'s test step runs with `not extended`."""
    argv, _ = run.stand.substitute(command)
    planned = run.make(f"make -n {' '.join(argv)}").stdout.splitlines()
    tests = [line for line in run.make("make -n test").stdout.splitlines() if "pytest -n" in line]
    every = [line for line in planned if "pytest -n" in line]
    assert len(every) == 1 and "extended" not in every[0], planned
    assert len(tests) == 1 and tests[0].endswith('-m "not extended"'), tests
    assert tests[0].removesuffix(' -m "not extended"') == every[0], (tests, every)


def sim_up_plans_the_simulated_cluster(run: Run, command: str) -> None:
    """`make sim-up` starts this checkout's own cluster (.sim/, the default names), which may be
    a developer's; the suite's clusters come from the same sim.nodes.up under names of their
    own. `make -n` shows what it would run."""
    argv, _ = run.stand.substitute(command)
    out = run.make(f"make -n {' '.join(argv)}").stdout
    assert re.search(r"^\S*/python -m torch_multinode.sim.cli up --nodes 2 *$", out, re.M), out


def selftest_here_plans_a_local_run(run: Run, command: str) -> None:
    """`make selftest` without INVENTORY (README: it runs on this machine) costs minutes of the
    shared CPU and tests/training/test_selftest.py runs it: `make -n` shows a local run."""
    argv, _ = run.stand.substitute(command)
    out = run.make(f"make -n {' '.join(argv)}").stdout
    planned = next(line for line in out.splitlines() if "--module training.selftest" in line)
    assert " -i " not in planned, planned


def bench_plans_the_benchmarks(run: Run, command: str) -> None:
    """`make bench` starts fresh simulated nodes of its own and measures for a long time
    (docs/benchmarks.md): `make -n` shows it runs the bench entry point, which answers --help."""
    argv, _ = run.stand.substitute(command)
    out = run.make(f"make -n {' '.join(argv)}").stdout
    assert re.search(r"^\S*/bin/bench *$", out, re.M), out
    helped = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "bench"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stdout + helped.stderr


def runs_lists_the_job(run: Run, command: str) -> None:
    """The table of runs holds the job that ran on the cluster, succeeded, on both nodes."""
    assert run.stand.job_id, "no job has run yet for make runs to list"
    out = run.make(command).stdout
    row = next((line for line in out.splitlines() if line.startswith(run.stand.job_id)), None)
    assert row is not None, out[-4000:]
    assert "node1,node2" in row and " succeeded " in row, row


def runs_shows_the_job(run: Run, command: str) -> None:
    """One run's whole record: its ID, backend, inventory, result and exit code."""
    out = run.make(command).stdout
    fields = dict(line.split(None, 1) for line in out.splitlines() if len(line.split(None, 1)) == 2)
    assert fields["id"] == run.stand.job_id, out
    assert (fields["backend"], fields["result"], fields["exit_code"]) == ("ssh", "succeeded", "0")
    assert str(run.stand.inventory) in fields["inventory"], out


def rerun_plans_the_recorded_run(run: Run, command: str) -> None:
    """`make rerun` runs a whole job again, minutes of the shared CPU: tests/launch/
    test_record.py reruns recorded jobs for real (the snapshot, not the edit; a failed run fails
    the same way). Here `make -n` shows it asks for that run's rerun."""
    argv, _ = run.stand.substitute(command)
    out = run.make(f"make -n {' '.join(argv)}").stdout
    assert f'--rerun "{run.stand.job_id}"' in out, out


def exit_code_of_a_failed_job(run: Run, command: str) -> None:
    """README's shell line, its `...` a job of the project on this machine whose script refuses
    its argument: make exits 2, .runs/exit-code holds the launcher's 1 (the job failed)."""
    job = f"make train SCRIPT={shlex.quote(str(run.stand.script))} ARGS='--epochs x'"
    assert command.startswith("make train ...;"), command
    line = (
        command.replace("make train ...", f"{job}; made=$?", 1) + '; echo "made $made code $code"'
    )
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={name: value for name, value in os.environ.items() if name != "EXIT_CODE"},
    )
    run.seconds[command] = time.monotonic() - started
    assert done.stdout.splitlines()[-1:] == ["made 2 code 1"], done.stdout[-3000:] + done.stderr
    assert re.search(r"^Job \S+ FAILED", done.stdout, re.M), done.stdout[-3000:]


Check = Callable[[Run, str], None]

# README's ```sh commands, exactly as README writes them (comments cut), in the order run here:
# `make data` (inline) must come before the job that reads its dataset, a job before
# `make tensorboard RUN=JOB-ID`.
FENCED: dict[str, Check] = {
    "make provision INVENTORY=my-cluster.yml": provision_is_the_fixtures,
    "make check": check_plans_lint_then_test,
    "make check-inventory INVENTORY=my-cluster.yml NNODES=2": check_inventory,
    "make bootstrap INVENTORY=my-cluster.yml": bootstrap_again,
    "make netcheck INVENTORY=my-cluster.yml NNODES=2": netcheck,
    'make train INVENTORY=my-cluster.yml NNODES=2 SCRIPT=path/to/train.py ARGS="--epochs 3"': (
        train_script
    ),
    'make train SCRIPT=~/proj/train.py ARGS="--lr 0.1"': train_script_here,
    "make train INVENTORY=my-cluster.yml NNODES=2": train_default,
    "make train": train_default_here_plans_a_local_run,
    "make selftest INVENTORY=my-cluster.yml": selftest_is_the_fixtures,
}
# README's inline `make ...` commands that are more than a target's name.
INLINE: dict[str, Check] = {
    "make": help_lists_targets,
    "make test-all": every_test_planned,
    "make sim-up": sim_up_plans_the_simulated_cluster,
    "make selftest": selftest_here_plans_a_local_run,
    "make -s hostfile INVENTORY=my-cluster.yml > hostfile": hostfile,
    "make data INVENTORY=... SRC=~/datasets/cifar": data,
    "make tensorboard RUN=JOB-ID": tensorboard,
    "make bench": bench_plans_the_benchmarks,
    "make train ...; code=$(cat .runs/exit-code)": exit_code_of_a_failed_job,
    "make runs": runs_lists_the_job,
    "make runs RUN=JOB-ID": runs_shows_the_job,
    "make rerun RUN=JOB-ID": rerun_plans_the_recorded_run,
}
# The one command of two lines, after `make data`.
PROJECT = (
    "make train INVENTORY=my-cluster.yml SCRIPT=~/proj/train.py "
    'ENV="WANDB_API_KEY HF_TOKEN=hf_xxx" ARGS="--checkpoint-dir exp1 --data-dir cifar"'
)
FENCED[PROJECT] = train_project
# Not run, checked another way: the reason is each function's docstring.
ANOTHER_WAY = (
    provision_is_the_fixtures,
    selftest_is_the_fixtures,
    check_plans_lint_then_test,
    every_test_planned,
    sim_up_plans_the_simulated_cluster,
    selftest_here_plans_a_local_run,
    train_default_here_plans_a_local_run,
    bench_plans_the_benchmarks,
    rerun_plans_the_recorded_run,
)
ORDER = (
    *list(FENCED)[:5],
    "make",
    "make test-all",
    "make sim-up",
    "make selftest",
    "make bench",
    "make train ...; code=$(cat .runs/exit-code)",
    "make -s hostfile INVENTORY=my-cluster.yml > hostfile",
    "make data INVENTORY=... SRC=~/datasets/cifar",
    PROJECT,
    *list(FENCED)[5:9],
    "make tensorboard RUN=JOB-ID",
    "make runs",
    "make runs RUN=JOB-ID",
    "make rerun RUN=JOB-ID",
    "make selftest INVENTORY=my-cluster.yml",
)


def test_every_readme_command_is_known_here():
    """No cluster needed: README's commands are exactly those this file runs or checks."""
    fenced, inline, strays = readme_commands(README.read_text())
    assert strays == [], f"lines of README's ```sh blocks that are no make command: {strays}"
    assert sorted(set(fenced)) == sorted(FENCED), (
        f"in README, not here: {sorted(set(fenced) - set(FENCED))}; "
        f"here, not in README: {sorted(set(FENCED) - set(fenced))}"
    )
    own = {c for c in inline if not names_a_target(c, fenced) or c in INLINE}
    assert own == set(INLINE), (
        f"inline in README, not here: {sorted(own - set(INLINE))}; "
        f"here, not in README: {sorted(set(INLINE) - own)}"
    )
    assert sorted(ORDER) == sorted({*FENCED, *INLINE})


@pytest.mark.sim
@pytest.mark.timeout(2400)
def test_readme_commands_run_on_the_simulated_cluster(provisioned, cluster_selftest, tmp_path):
    fenced, inline, strays = readme_commands(README.read_text())
    assert not strays and set(fenced) == set(FENCED), "see test_every_readme_command_is_known_here"
    stand = Stand(
        inventory=provisioned.inventory,
        script=_project(tmp_path / "proj"),
        dataset=_dataset(tmp_path / "datasets" / DATASET),
        hostfile=tmp_path / "hostfile",
    )
    run = Run(provisioned, stand, cluster_selftest)
    checks = {**FENCED, **INLINE}
    failed = []
    try:
        for command in ORDER:
            try:
                checks[command](run, command)
            except AssertionError as error:
                failed.append(f"{command}\n  {error}")
    finally:
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {DEFAULT_DATA_ROOT}/{DATASET}")
        timings = ", ".join(f"{c!r} {s:.0f} s" for c, s in run.seconds.items())
        print(f"README commands: {timings}")
    assert not failed, "README commands that failed:\n" + "\n\n".join(failed)
