"""Shared fixtures: the simulated cluster, started by the tests themselves.

In CI (CI=true) the simulated cluster is required: a missing Docker engine fails the run.
Elsewhere, tests marked `sim` skip with the reason when no engine answers.

Every cluster a test run starts gets its own name and /24 subnet, so several test runs (or a
developer's own `make sim-up` cluster) never share containers. SIM_TEST_PREFIX, SIM_TEST_OCTET
and SIM_TEST_LAST_OCTET (80 and 254 by default) move a whole run elsewhere when two runs must go
on side by side.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# torch._dynamo (which torchvision imports) registers sys.intern as it finds it, and ansible-core's
# inventory loader replaces sys.intern on Python 3.11 with a callable object that dynamo refuses
# ("substitute_in_graph expects a function"). The project never imports both in one process;
# pytest does, collecting every module: dynamo first.
import torch._dynamo  # noqa: F401
import yaml

from tests.helpers import bootstrap_unattended, on_node
from tests.run_logs import run_logs
from torch_multinode.cluster import engine
from torch_multinode.sim import nodes as sim

pytest_plugins = ["tests.three_nodes"]  # sim3, shared by two modules of one group

if TYPE_CHECKING:
    from tests.ansible.conftest import PlaybookRun

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
_PREFIX = os.environ.get("SIM_TEST_PREFIX", "tmntest")
# Under pytest-xdist every worker starts its clusters in a band of subnets of its own, the
# octets from SIM_TEST_OCTET to SIM_TEST_LAST_OCTET shared out evenly; a worker that has used
# its whole band starts again at its beginning, past the clusters it still holds. (Fixed bands
# of 30 once let a worker that started more clusters than that take its neighbour's names.)
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
_FIRST_OCTET = int(os.environ.get("SIM_TEST_OCTET", "80"))
_LAST_OCTET = int(os.environ.get("SIM_TEST_LAST_OCTET", "254"))
_BAND = (_LAST_OCTET + 1 - _FIRST_OCTET) // max(
    1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
)
_OCTETS = itertools.cycle(
    range(_FIRST_OCTET + _BAND * _WORKER, _FIRST_OCTET + _BAND * (_WORKER + 1))
)
# Tests that share one expensive thing run in one xdist worker, one after the other.
_GROUPS: dict[str, str] = {
    "tests/docker/": "image",  # the training image, built once
    "tests/test_end_to_end.py": "image",  # and the cluster provisioned with it, once
    "tests/test_readme_commands.py": "image",
    "tests/test_projects_in_containers.py": "image",
    "tests/test_image_shipping.py": "image",  # layers through the registry, on that cluster
    "tests/launch/test_slurm_jobs.py": "image",  # Slurm on that provisioned cluster
    "tests/launch/test_auto_fields_on_cluster.py": "image",  # its inventory saying auto
    "tests/test_hangs.py": "image",  # hung jobs on the provisioned cluster
    "tests/test_cuda_image.py": "cuda_image",  # a 6 GB build of its own, beside the others
    # One cluster of a pair of nodes per network stack, beside the others.
    "tests/ansible/test_static_ip.py": "static_ip",
    # Slurm from the inventory, first on the node-loss tests' 3 nodes (tests/three_nodes.py).
    "tests/ansible/test_slurm.py": "node_loss",
    "tests/ansible/": "provisioning",  # apt installs in every node: one scenario at a time
    "tests/training/test_node_loss.py": "node_loss",  # one 3-node cluster, its nodes killed
    "tests/training/test_ft_nodes.py": "node_loss",  # FT=1 on it
    "tests/training/test_fsdp_cluster.py": "fsdp",  # a pair of its own, beside the loopback FSDP2
}
# The order in which xdist hands the groups out, each to the first worker free, before every
# ungrouped test (each a unit of its own, which fills the workers' ends). Three start at once;
# `static_ip` ends first (about 570 s) and its worker takes `node_loss`, whose cluster waits
# for the training image that `image` builds meanwhile (about 560 s); `fsdp`'s then takes
# `provisioning`. Left to xdist (largest group first: provisioning, image, fsdp), `node_loss`
# went to the first worker free after 1,320 s, and its chain of 2,300 s ran alone at the end of
# CI run 53 (6 minutes of its 62; docs/ci-time.md has the simulation behind this order).
_GROUP_ORDER = ["fsdp", "image", "static_ip", "node_loss", "provisioning", "cuda_image"]


def pytest_configure(config):
    """Tests press Ctrl-C by sending SIGINT to what they started. A shell ignores SIGINT in the
    commands it starts in the background (`make check &`), and an ignored signal stays ignored
    in every child: give ours back the terminal's default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config.option, "loadscopereorder"):  # xdist: the groups in _GROUP_ORDER's order
        config.option.loadscopereorder = False
    # `make train` and `make selftest` write the launcher's code to EXIT_CODE, by default the
    # repository's .runs/exit-code. Each process of the run (xdist's workers) gets a file of its
    # own, so that a job of one worker never replaces the code the README's check reads there
    # (exit_code_of_a_failed_job, which runs with the default) while its job runs.
    own = tempfile.mkdtemp(prefix="tmn-exit-code-")
    config.add_cleanup(lambda: shutil.rmtree(own, ignore_errors=True))
    os.environ["EXIT_CODE"] = str(Path(own) / "exit-code")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.fspath).relative_to(REPO_ROOT).as_posix()
        for prefix, group in _GROUPS.items():
            if path.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
                break
    # A group's worker runs its tests in this order. The FSDP2 matrix's pair waits for the CPU
    # twin's build (minutes, on another worker): its loopback FSDP2 jobs go first meanwhile.
    items.sort(key=lambda item: item.fspath.basename == "test_fsdp_cluster.py")  # stable
    items.sort(key=_handed_out)  # the groups first, in _GROUP_ORDER's order
    # In CI nothing is skipped: the sim_factory fixture fails the run instead.
    ok, why = engine.engine_available()
    if ok or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason=f"simulated cluster unavailable: {why}")
    for item in items:
        if "sim" in item.keywords:
            item.add_marker(skip)


def _handed_out(item: pytest.Item) -> int:
    """Where `item`'s group stands in _GROUP_ORDER; an ungrouped test after them all."""
    group = item.get_closest_marker("xdist_group")
    name = group.args[0] if group is not None else None
    return _GROUP_ORDER.index(name) if name in _GROUP_ORDER else len(_GROUP_ORDER)


_UNGROUPED = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)  # after xdist's own hook has renamed the grouped items
def pytest_collection_finish(session):
    """Under --dist loadgroup, a grouped test that xdist did not rename runs on any worker, each
    starting its own copy of the group's expensive fixtures (seen with pytest 9.2): such tests
    fail at once, saying why, instead of slowing the run down unnoticed."""
    if getattr(session.config.option, "loadgroup", False):
        session.config.stash[_UNGROUPED] = {
            item.nodeid
            for item in session.items
            if (group := item.get_closest_marker("xdist_group")) is not None
            and not item.nodeid.endswith(f"@{group.args[0]}")
        }


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.nodeid in item.config.stash.get(_UNGROUPED, set()):
        pytest.fail(
            "pytest-xdist did not keep this test in its group: this pytest and pytest-xdist do "
            "not work together (see the pin in pyproject.toml)",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A simulated-cluster test that failed shows its jobs' node logs (tests/run_logs.py)."""
    report = yield
    if report.when == "call" and report.failed and item.get_closest_marker("sim"):
        logs = run_logs(REPO_ROOT / ".runs", call.start, os.environ.get("PYTEST_XDIST_WORKER"))
        if logs:
            report.sections.append(("node logs of the jobs this test ran", logs))
    return report


class SimFactory:
    """Starts clusters on demand, each with its own name and subnet; removes them all at exit."""

    def __init__(self, root: Path):
        self.root = root
        self.started: list[sim.SimConfig] = []
        self.used: list[str] = []

    def config(self) -> sim.SimConfig:
        held = {config.name for config in self.started}
        for _ in range(_BAND):
            octet = next(_OCTETS)
            name = f"{_PREFIX}{octet}"
            if name not in held:
                break
        else:
            raise RuntimeError(f"all {_BAND} simulated clusters of this worker's band are up")
        # A name used again gets state of its own: the old nodes' host keys are not these.
        state = self.root / f"{name}-{len(self.used)}"
        self.used.append(name)
        return sim.SimConfig(name, f"172.29.{octet}.0/24", state, f"172.30.{octet}.0/24")

    def up(
        self,
        nnodes: int,
        link: str | None = None,
        fresh_password: str | None = None,
        tmpfs: tuple[tuple[str, str], ...] = (),
    ) -> sim.SimCluster:
        """Nodes as sim-up starts them; with `fresh_password`, as a fresh install leaves them
        (FRESH=1: a user with that password, no key); `tmpfs`: SimConfig.tmpfs."""
        config = dataclasses.replace(self.config(), tmpfs=tmpfs)
        self.started.append(config)
        fresh = fresh_password is not None
        return sim.up(nnodes, link, config, fresh=fresh, fresh_password=fresh_password)

    def down(self, cluster: sim.SimCluster) -> sim.Removed:
        self.started.remove(cluster.config)
        return sim.down(cluster.config)

    def close(self) -> None:
        """Every cluster removed, each tried even when one before it fails (the first raises)."""
        failures = []
        for config in self.started:
            try:
                sim.down(config)
            except sim.UserError as error:
                failures.append(error)
        self.started.clear()
        if failures:
            raise failures[0]


@pytest.fixture(scope="session")
def sim_factory(tmp_path_factory):
    ok, why = engine.engine_available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI requires the simulated cluster, but {why}", pytrace=False)
        pytest.skip(f"simulated cluster unavailable: {why}")
    factory = SimFactory(tmp_path_factory.mktemp("sim"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def sim2(sim_factory):
    """A plain 2-node cluster shared by tests that leave the nodes as they found them."""
    return sim_factory.up(2)


@pytest.fixture(scope="session")
def training_image(sim_factory, request, tmp_path_factory):
    """The CPU twin of the training image, built once per run (about 6 minutes the first time,
    seconds when the layers are cached). Where this run's tests use the `provisioned` cluster,
    its nodes come up and go through bootstrap meanwhile (`fresh_pair`): neither needs the
    image, and the `image` group's worker then spends the build's minutes on both."""
    if any("provisioned" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("fresh_pair")
    return build_training_image(tmp_path_factory)


TEST_IMAGE = "torch-multinode/train:test"


def build_training_image(tmp_path_factory):
    """The CPU twin (TEST_IMAGE), built by one worker at a time: the `image` group's and the
    node-loss cluster's workers both need it, and the second to come waits on a lock held by
    the first, then finds every layer cached (images.build says up to date in a second)."""
    from torch_multinode.provision import images

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, shared by its workers
    with open(root / "training-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return images.build("cpu", TEST_IMAGE, progress=lambda _: None)


@pytest.fixture(scope="session")
def entrypoint_rebuild(training_image, tmp_path_factory):
    """The CPU twin rebuilt by images.build from a copy of the repository whose
    docker/entrypoint.sh has one more line (tests/image_layers.py): built once, for the tests
    of what such a rebuild makes anew (tests/docker/test_image.py) and ships
    (tests/test_image_shipping.py); removed at the end."""
    from tests.image_layers import build_with_an_edited_entrypoint

    tag = f"{training_image.tag}-entrypoint-{secrets.token_hex(4)}"
    try:
        copy = tmp_path_factory.mktemp("entrypoint") / "copy"  # made by the copy itself
        yield build_with_an_edited_entrypoint(copy, tag)
    finally:
        subprocess.run(["docker", "rmi", tag], capture_output=True, check=False)


@dataclass(frozen=True)
class Provisioned:
    """Two nodes as a fresh install leaves them (a user with a password, no key), taken through
    `make bootstrap` (unattended: their fingerprints from a file, the password on standard
    input, password login turned off) and `make provision` to run jobs in the test image, as
    that user (not root)."""

    cluster: sim.SimCluster
    inventory: Path
    password: str
    bootstrap: subprocess.CompletedProcess
    playbook: PlaybookRun  # site.yml's first run, during the image's build
    provision: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def fresh_pair(sim_factory, tmp_path_factory):
    """Two nodes as a fresh install leaves them, taken through `make bootstrap` and then the
    playbook `make provision` runs (ansible/site.yml), in a thread of their own: the
    `provisioned` cluster's first steps (and Slurm's packages, for the Slurm tests), begun by
    `training_image` so that they run during its build, since none of them needs the image.
    The future of (cluster, inventory, password, bootstrap's run, the playbook's run or None
    when bootstrap failed)."""
    here = tmp_path_factory.mktemp("provisioned")
    with ThreadPoolExecutor(1, thread_name_prefix="fresh-pair") as pool:
        yield pool.submit(_bootstrapped_pair, sim_factory, here)


# A 2 MB filesystem inside the provisioned cluster's /shared, which every node and every job
# container sees as one (a test fills it up): a tmpfs volume that the Docker engine mounts on
# the nodes (SimConfig.tmpfs), and each job container's mount of /shared, recursive, carries.
SMALL_SHARED = f"{sim.SHARED_DIR}/small"


def _bootstrapped_pair(sim_factory: SimFactory, here: Path):
    password = secrets.token_urlsafe(12)
    cluster = sim_factory.up(2, fresh_password=password, tmpfs=((SMALL_SHARED, "2m"),))
    document = yaml.safe_load(cluster.config.inventory_path.read_text())
    document["all"]["vars"].update(
        launch_mode="container", training_image=TEST_IMAGE, container_mounts=["/shared"]
    )
    inventory = here / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    # What each node's own console prints, as the user would copy it into the file.
    fingerprints = here / "fingerprints"
    fingerprints.write_text(
        "".join(
            f"node{index} {console_fingerprint(cluster.config.container(index))}\n"
            for index in (1, 2)
        )
    )
    bootstrap = bootstrap_unattended(inventory, fingerprints, password)
    if bootstrap.returncode != 0:
        return cluster, inventory, password, bootstrap, None
    from tests.ansible.conftest import ansible_playbook  # it imports this module

    playbook = ansible_playbook(inventory, timeout=1800)
    if playbook.returncode == 0:
        _install_slurm_packages(cluster)
    return cluster, inventory, password, bootstrap, playbook


def _install_slurm_packages(cluster: sim.SimCluster) -> None:
    """Slurm's packages on the pair, the ones the slurm role's apt task installs (node1 the
    controller), during the image's build instead of in the Slurm tests' fixture. The role
    itself still runs there, on nodes that ran containers (tests/launch/test_slurm_jobs.py),
    and configures and starts every daemon; only its apt task then finds the packages."""
    defaults = yaml.safe_load((REPO_ROOT / "ansible/roles/slurm/defaults/main.yml").read_text())
    for index in (1, 2):
        names = defaults["slurm_node_packages"]
        if index == 1:
            names = [*defaults["slurm_controller_packages"], *names]
        packages = " ".join(sorted(set(names)))
        on_node(cluster, index, f"DEBIAN_FRONTEND=noninteractive apt-get install -y -q {packages}")


@pytest.fixture(scope="session")
def provisioned(fresh_pair, training_image) -> Provisioned:
    """One cluster for every test of jobs in containers: `fresh_pair`'s nodes, bootstrapped
    and taken through the playbook while the image built, then `make provision` in full as the
    user runs it (the playbook again, every task already in place, then the image shipped and
    the versions locked). Tests leave the nodes as they found them (images, mounts, files)."""
    cluster, inventory, password, bootstrap, playbook = fresh_pair.result()
    if bootstrap.returncode != 0:
        pytest.fail(f"bootstrap failed:\n{bootstrap.stdout}{bootstrap.stderr}", pytrace=False)
    if playbook.returncode != 0:
        pytest.fail(f"site.yml failed:\n{playbook.describe()}", pytrace=False)
    # The `image` group's worker decides the run's length (CONTRIBUTING.md, "Time and disk"),
    # and from here on nearly all of its work runs in these two nodes: when the cores are
    # contended, they get CPU before other workers' containers (four times the weight; other
    # groups end minutes earlier). Only a weight: where the engine cannot set it, as it was.
    for index in (1, 2):
        sim.docker("update", "--cpu-shares", "4096", cluster.config.container(index), check=False)
    provision = make("provision", f"INVENTORY={inventory}")
    return Provisioned(cluster, inventory, password, bootstrap, playbook, provision)


@pytest.fixture(scope="session")
def cluster_selftest(provisioned) -> subprocess.CompletedProcess:
    """`make selftest INVENTORY=...` on the shared cluster, as README writes it: minutes of
    compiling, so run once, for tests/docker/test_selftest_cluster.py (its table) and the
    README's commands (tests/test_readme_commands.py) alike."""
    return make("selftest", f"INVENTORY={provisioned.inventory}", timeout=1200)


@pytest.fixture(scope="session")
def small_job_over_ssh(provisioned) -> subprocess.CompletedProcess:
    """`make train` of the default workload, small (tests/training/conftest.py's SMALL_JOB), on
    the shared cluster over SSH: run once, for what a job brings back
    (tests/test_projects_in_containers.py) and as the run that the same job through Slurm must
    end like (tests/launch/test_slurm_jobs.py)."""
    from tests.training.conftest import SMALL_JOB

    return make(
        "train",
        f"INVENTORY={provisioned.inventory}",
        "NNODES=2",
        "ARGS=" + " ".join(SMALL_JOB),
        timeout=900,
    )


def console_fingerprint(container: str) -> str:
    """What the node's own console prints (ssh-keygen -lf of its ed25519 host key)."""
    out = sim.docker("exec", container, "ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub")
    return out.stdout.split()[1]


def make(*args: str, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """`make ARGS` in the repository, as a user types it."""
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def run_cli(*args: str, timeout: float = 300, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    """Run one of the project's console scripts from the venv, as a user would."""
    command = [str(VENV_BIN / args[0]), *args[1:]]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
