"""What several test modules share: the inventory builder, the launcher's test scripts, make
train started and read as it runs, and looks at the simulated nodes and what a job left there. Test modules import from here (and from
tests/fakes.py and the conftest files), never from each other."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import paramiko
import yaml

from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.cluster.remote import Remote, on_all
from torch_multinode.launch.spec import RUN_LABEL
from torch_multinode.sim import nodes as sim

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "training" / "launcher_scripts"
"""Training scripts the launcher's tests run (tutorial DDP, an endless all-reduce...)."""

MANAGEMENT_NET, COMPUTE_NET = "10.1.0", "10.7.0"
"""The addresses of built inventories: documentation only, nothing is ever sent to them."""


ERROR_LINE = re.compile(r"^(?:\[[^\]\n]+\]:? )*(?:Error:|Traceback )", re.M)
"""A line that reports an error: the launcher's `Error: ...`, a Python traceback, also behind a
node's or rank's prefix. Not any text that contains "Error:": torch's C++ warnings quote
`c10::Error::Error` frames, as when a node's torchrun finds the rendezvous host already gone at
shutdown after a job that passed (docs/faults.md)."""


def unique_run_id() -> str:
    """A run id of this test's own: what scans every process of this machine (the hang's and the
    idleness' collections) also sees the ranks that tests beside it (pytest -n) start."""
    return f"tmn-{uuid.uuid4().hex[:10]}"


def node(index: int, **fields) -> dict:
    """One host's fields: SSH on 10.1.0.INDEX, compute on 10.7.0.INDEX over eth1, no GPU;
    `fields` add to or replace them."""
    return {
        "ansible_host": f"{MANAGEMENT_NET}.{index}",
        "compute_ip": f"{COMPUTE_NET}.{index}",
        "compute_interface": "eth1",
        "gpus": 0,
        **fields,
    }


def inventory_text(hosts: dict[str, dict], **cluster_vars) -> str:
    """An inventory in the project's layout: `cluster_vars` in all.vars (compute_subnet
    defaults to 10.7.0.0/24), `hosts` (name -> node(...)) in the nodes group, in rank order."""
    variables = {"compute_subnet": f"{COMPUTE_NET}.0/24", **cluster_vars}
    document = {"all": {"vars": variables, "children": {"nodes": {"hosts": hosts}}}}
    return yaml.safe_dump(document, sort_keys=False)


def inventory(
    hosts: dict[str, dict], path: str = "/nonexistent/inv.yml", **cluster_vars
) -> Inventory:
    """inventory_text(...) parsed and validated, as if read from `path`."""
    return parse(inventory_text(hosts, **cluster_vars), path)


def run_id_in(stdout: str) -> str:
    """The job's run ID, from the launcher's '[launcher] job ID: ...' line."""
    return stdout.split("[launcher] job ", 1)[1].split(":", 1)[0]


def run_record(run_id: str) -> dict:
    """`make runs RUN=ID JSON=1`: a run's record as a script reads it (issue 32)."""
    shown = subprocess.run(
        ["make", "--no-print-directory", "runs", f"RUN={run_id}", "JSON=1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return json.loads(shown.stdout)


def leftovers(inventory: Inventory, run_id: str, hosts=None) -> dict[str, str]:
    """Per node: processes still carrying the run's marker, and listeners on the rendezvous port."""
    probe = (
        f"grep -lsaF TMN_RUN_ID={run_id} /proc/[0-9]*/environ | grep -v self; "
        f"ss -ltnH 'sport = :{inventory.rendezvous_port}'"
    )

    def look(host):
        with Remote.for_inventory(inventory, host) as remote:
            return remote.run(probe).stdout.strip()

    return on_all(hosts or inventory.hosts, look)


def on_node(cluster: sim.SimCluster, index: int, command: str, check: bool = True) -> str:
    """`command` in the shell of simulated node `index`: its output."""
    container = cluster.config.container(index)
    return sim.docker("exec", container, "sh", "-c", command, check=check).stdout


def no_containers_left(cluster: sim.SimCluster, indices, run_id: str | None = None) -> None:
    """No container (of run `run_id`; else none at all) on nodes `indices`, each given up to a
    minute to remove a job's: the stop kills a container at once, and Docker removes it when its
    cleanup is done (launch.commands.stop_command)."""
    listed = "docker ps -aq" + (f" --filter label={RUN_LABEL}={run_id}" if run_id else "")
    for index in indices:
        for _ in range(60):
            if not on_node(cluster, index, listed).strip():
                break
            time.sleep(1)
        assert on_node(cluster, index, listed).strip() == "", f"node{index}"


def start_train(inventory: Path, *variables: str, env: dict | None = None) -> subprocess.Popen:
    """`make train INVENTORY=... NNODES=2 VARIABLES` started, its output read as it comes (in a
    session of its own: os.killpg presses Ctrl-C as a terminal does)."""
    return subprocess.Popen(
        ["make", "--no-print-directory", "train", f"INVENTORY={inventory}", "NNODES=2", *variables],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def interrupt(process: subprocess.Popen) -> tuple[str, float]:
    """Ctrl-C at the launcher: its remaining output, and how long it took to end."""
    process.send_signal(signal.SIGINT)
    sent_at = time.monotonic()
    rest, _ = process.communicate(timeout=60)
    return rest, time.monotonic() - sent_at


def read_until(process: subprocess.Popen, *texts: str, limit: int = 400) -> str:
    """The process's output up to the line where the last of `texts` was seen (each in some
    line); AssertionError when it ends or `limit` lines go by first."""
    seen, missing = [], list(texts)
    while missing:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"never saw {missing}:\n{''.join(seen)[-4000:]}")
        seen.append(line)
        missing = [text for text in missing if text not in line]
        if len(seen) > limit:
            raise AssertionError(f"never saw {missing} in {limit} lines:\n{''.join(seen)[-4000:]}")
    return "".join(seen)


def bootstrap_unattended(
    inventory: Path, fingerprints: Path, password: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`cluster bootstrap` as a script runs it: the host keys' fingerprints from a file, the
    login password on standard input, password login turned off once key and sudo work."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "cluster"),
            "bootstrap",
            "-i",
            str(inventory),
            "--fingerprints",
            str(fingerprints),
            "--password-stdin",
            "--disable-password-login",
        ],
        input=password + "\n",
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def password_in_node_files(container: str, password: str) -> str:
    """Where simulated node `container` holds `password`: its container log, or the files
    under the directories a login, sudo, provisioning or a job write to. Empty: nowhere."""
    logs = sim.docker("logs", container)
    if password in logs.stdout + logs.stderr:
        return f"{container}: docker logs"
    found = sim.docker(
        "exec",
        container,
        "grep",
        "-rlsF",
        password,
        "/etc",
        "/home",
        "/root",
        "/tmp",
        "/var/log",
        "/var/lib/torch-multinode",
        "/run",
        check=False,
    )
    return found.stdout


def password_login(host, known_hosts: Path, password: str, user: str = "trainer") -> str:
    """Logging in to `host` as `user` with `password` (its host key checked against
    `known_hosts`): 'ok', 'refused' (wrong password) or 'not offered' (password login off)."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.load_host_keys(str(known_hosts))
    try:
        client.connect(
            host.ssh_address,
            username=user,
            password=password,
            timeout=15,
            look_for_keys=False,
            allow_agent=False,
        )
        return "ok"
    except paramiko.BadAuthenticationType:
        return "not offered"
    except paramiko.AuthenticationException:
        return "refused"
    finally:
        client.close()


# A user's project whose packages are named like ours (training, cluster, launch): issue 29.
_NAMESAKE_BODY = """
import torch
import torch.distributed as dist
from cluster.topology import WHO as CLUSTER
from launch.settings import WHO as LAUNCH
from training.model import WHO as TRAINING

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()}: {KIND} sees {TRAINING} {CLUSTER} {LAUNCH}, sum {int(total.item())}"
      + EXTRA, flush=True)
dist.destroy_process_group()
"""
NAMESAKE_SCRIPT = '"""A plain script."""\nKIND, EXTRA = "script", ""\n' + _NAMESAKE_BODY
NAMESAKE_LEGACY = (
    '"""A torch.distributed.launch-era script: it takes --local_rank."""\n'
    "import argparse\n\n"
    "parser = argparse.ArgumentParser()\n"
    'parser.add_argument("--local_rank", type=int, required=True)\n'
    'KIND, EXTRA = "legacy", f", local_rank {parser.parse_args().local_rank}"\n' + _NAMESAKE_BODY
)
NAMESAKE_MODULE = (
    '"""The project\'s own training.main."""\nKIND, EXTRA = "module", ""\n' + _NAMESAKE_BODY
)


def namesake_project(root: Path) -> Path:
    """A project with its own `training/`, `cluster/` and `launch/` packages and three entry
    points: train.py, legacy.py (parses --local_rank) and the module training.main."""
    for package, module in (("training", "model"), ("cluster", "topology"), ("launch", "settings")):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / f"{module}.py").write_text(f'WHO = "own-{package}"\n')
    (root / "training" / "main.py").write_text(NAMESAKE_MODULE)
    (root / "train.py").write_text(NAMESAKE_SCRIPT)
    (root / "legacy.py").write_text(NAMESAKE_LEGACY)
    return root


def check_namesake_project_runs(train, root: Path) -> None:
    """`train(*make_variables)` (make train on 2 nodes of one process each) runs the namesake
    project's three entry points unchanged, each rank seeing the project's own packages, and
    MODULE=training.ddp with that project as WORKDIR still runs our workload."""
    seen = "sees own-training own-cluster own-launch, sum 2"
    jobs = {
        "script": [f"SCRIPT={root / 'train.py'}"],
        "legacy": [f"SCRIPT={root / 'legacy.py'}"],
        "module": ["MODULE=training.main", f"WORKDIR={root}"],
    }
    for kind, variables in jobs.items():
        done = train(*variables)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{kind}:\n{output[-3000:]}"
        for rank in (0, 1):
            extra = ", local_rank 0" if kind == "legacy" else ""
            assert f"rank {rank}: {kind} {seen}{extra}" in output, f"{kind}:\n{output[-3000:]}"
    done = train(
        "MODULE=training.ddp", f"WORKDIR={root}", "ARGS=--model tiny --steps 2 --no-tensorboard"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "[rank 0] parameters sha256" in output, output[-3000:]


def git_repository(root: Path, files: dict[str, str | bytes]) -> list[str]:
    """A git repository of its own at `root` holding `files` (name: content) in one commit; the
    git command that works in it (an identity of its own, the user's never needed)."""
    root.mkdir(parents=True)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (root / name).write_bytes(content)
        else:
            (root / name).write_text(content)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for step in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    return git


def known_line(name: str) -> str:
    """The `Known problem:` line of the launcher's signature `name` (launch/signatures.py)."""
    from torch_multinode.launch.signatures import SIGNATURES

    return next(signature for signature in SIGNATURES if signature.name == name).line()


# A project that imports what the training image lacks (demo-config, from wheels a test makes:
# bench.wheels), for the jobs of issue 50 over SSH and under Slurm.
DEPENDENT = '''\
"""A project that imports what the training image lacks, from its requirements.txt."""
import importlib.metadata
import os
import sys


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


import demo_config  # noqa: E402  (the project's own dependency)

said = f"demo-config {version('demo-config')} demo-progress {version('demo-progress')}"
rank = os.environ["RANK"]
if sys.argv[1:] == ["--versions-only"]:  # a run that proves its environment, no torch import
    print(f"rank {rank}: {said}", flush=True)
    sys.exit(0)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=demo_config.LR)
for step in range(2):
    loss = model(torch.ones(4, 2)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    optimizer.step()
print(f"rank {rank}: {said}; trained 2 steps, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
'''


def dependent_versions(output: str, rank: str) -> str:
    """What `rank` of DEPENDENT said of its demo-config and demo-progress, from a job's output
    ([node] prefix or not)."""
    return re.search(rf"rank {rank}: (demo-config \S+ demo-progress [^\s;]+)", output).group(1)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's form: 1m, 2m) mounted at `path` for the block: a disk to
    fill (needs root, as CI has)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def digests(directory: Path) -> dict[str, str]:
    """Every file under `directory`, by its path there: its SHA-256."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def digests_on_node(
    cluster: sim.SimCluster, index: int, directory: str, leave_out: str | None = None
) -> dict[str, str]:
    """digests() of `directory` on simulated node `index`: every file under it (but those under
    its subdirectory `leave_out`), by its path there: its SHA-256."""
    skip = f" -not -path './{leave_out}/*'" if leave_out else ""
    listed = on_node(
        cluster, index, f"cd {directory} && find . -type f{skip} | sort | xargs -r sha256sum"
    )
    return {
        path.removeprefix("./"): digest
        for digest, path in (line.split(maxsplit=1) for line in listed.splitlines())
    }


def fill(filesystem: Path) -> Path:
    """`filesystem` full: a file of zeros (`filler`, returned: unlink it for room again)."""
    filler = filesystem / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True, check=False
    )
    return filler
