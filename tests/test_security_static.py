"""Security properties, proved from the code and the Ansible roles without a cluster:

- SSH host keys are always checked: nothing in the code, roles, Makefile or images turns the
  check off, the fabric remote refuses unknown keys (RejectPolicy), and an inventory that
  would turn it off for Ansible is refused;
- SSH password login is never enabled, and the project never logs in with a password;
- private keys are written mode 0600 (the simulator's, the ssh_mesh role's);
- the training container the launcher and netcheck start is not privileged: no --privileged,
  no added capabilities, no security profile turned off, only the run directory mounted;
- no private key reaches a log, a report or a command: the CLIs never even open the key file.

Each pattern test first shows that its pattern catches the thing it looks for.
"""

from __future__ import annotations

import ast
import configparser
import io
import ipaddress
import re
import shlex
import tokenize
from pathlib import Path

import paramiko
import pytest
import yaml

from tests.fuzz.guard import Reached, call
from tests.netcheck.netcheck_fakes import INVENTORY as FAKE_INVENTORY
from tests.netcheck.netcheck_fakes import FakeCluster
from torch_multinode.cluster import cli as cluster_cli
from torch_multinode.cluster import inventory, inventory_read, remote
from torch_multinode.cluster.containers import training_container_options
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import ContainerContext
from torch_multinode.launch import backends
from torch_multinode.launch import cli as launch_cli
from torch_multinode.launch.commands import remote_command
from torch_multinode.launch.spec import JobSpec
from torch_multinode.launch.staging import REMOTE_RUN_ROOT
from torch_multinode.netcheck import cli as netcheck_cli
from torch_multinode.sim import nodes as sim

REPO = Path(__file__).resolve().parents[1]
SCANNED = [
    "cluster",
    "provision",
    "sim",
    "launch",
    "netcheck",
    "training",
    "ansible",
    "docker",
    "Makefile",
    "inventory.example.yml",
]
TEXT_SUFFIXES = {".py", ".yml", ".yaml", ".j2", ".cfg", ".sh", ".md", ".txt", ".toml", ".conf"}


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in candidates:
            if "__pycache__" in file.parts or "wheels" in file.parts or not file.is_file():
                continue
            if file.suffix in TEXT_SUFFIXES or file.name in ("Makefile", "Dockerfile"):
                files.append(file)
    return files


def matches(pattern: re.Pattern, files: list[Path]) -> list[str]:
    found = []
    for file in files:
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{file.relative_to(REPO)}:{number}: {line.strip()}")
    return found


def test_the_scan_covers_the_code_the_roles_the_makefile_and_the_images():
    names = {str(f.relative_to(REPO)) for f in scanned_files()}
    for expected in (
        "cluster/remote.py",
        "launch/commands.py",
        "cluster/execution.py",
        "sim/nodes.py",
        "ansible/ansible.cfg",
        "ansible/roles/ssh_mesh/tasks/main.yml",
        "ansible/roles/ssh_mesh/templates/ssh_config.j2",
        "Makefile",
        "docker/sim-node/Dockerfile",
    ):
        assert expected in names


# --- host keys ---------------------------------------------------------------------------------

HOST_KEYS_OFF = re.compile(
    r"StrictHostKeyChecking\s*[= ]\s*[\"']?(no|off|false|accept-new)\b"
    r"|(UserKnownHostsFile|GlobalKnownHostsFile)\s*[= ]\s*[\"']?/dev/null"
    r"|host_key_checking\s*[=:]\s*[\"']?(false|no|off|0)\b"
    r"|ANSIBLE_HOST_KEY_CHECKING\s*[=:]\s*[\"']?(false|no|off|0)\b",
    re.IGNORECASE,
)
ACCEPTING_POLICIES = {"AutoAddPolicy", "WarningPolicy"}


@pytest.mark.parametrize(
    "line",
    [
        "ssh -o StrictHostKeyChecking=no node1",
        "StrictHostKeyChecking accept-new",
        "-o UserKnownHostsFile=/dev/null",
        "host_key_checking = False",
        "ANSIBLE_HOST_KEY_CHECKING=false ansible-playbook",
    ],
)
def test_the_host_key_pattern_catches_every_way_of_turning_checks_off(line):
    assert HOST_KEYS_OFF.search(line)


def test_host_key_checking_is_never_turned_off():
    assert matches(HOST_KEYS_OFF, scanned_files()) == []


def test_no_code_uses_a_policy_that_accepts_unknown_host_keys():
    """As code, not in comments or docstrings (cluster/remote.py explains why it is avoided)."""
    used = []
    for file in scanned_files():
        if file.suffix != ".py":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(file.read_text()).readline)
        used += [
            f"{file.relative_to(REPO)}:{t.start[0]}"
            for t in tokens
            if t.type == tokenize.NAME and t.string in ACCEPTING_POLICIES
        ]
    assert used == []
    # The scan would see one: the name is a NAME token in code.
    sample = "client.set_missing_host_key_policy(paramiko.AutoAddPolicy())\n"
    names = [t.string for t in tokenize.generate_tokens(io.StringIO(sample).readline)]
    assert "AutoAddPolicy" in names


def test_every_missing_host_key_policy_set_in_the_code_is_reject():
    calls = []
    for file in scanned_files():
        if file.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == (
                "set_missing_host_key_policy"
            ):
                calls.append((file.relative_to(REPO), ast.unparse(node.args[0])))
    # cluster.trust sets it for every client: fabric's (cluster.remote), bootstrap's password login
    assert calls == [(Path("cluster/trust.py"), "paramiko.RejectPolicy()")]


def test_ansible_checks_host_keys_and_so_do_the_nodes_among_themselves():
    config = configparser.ConfigParser()
    config.read(REPO / "ansible" / "ansible.cfg")
    assert config.getboolean("defaults", "host_key_checking") is True
    template = (REPO / "ansible/roles/ssh_mesh/templates/ssh_config.j2").read_text()
    assert re.search(r"^\s*StrictHostKeyChecking yes$", template, re.MULTILINE)
    # every ssh the controller starts (rsync, the image stream of cluster ship) is cluster.trust's
    from torch_multinode.cluster import trust

    hosts = inventory_read.parse(
        "all:\n  vars: {compute_subnet: 10.7.0.0/24}\n  children:\n    nodes:\n      hosts:\n"
        "        n1: {ansible_host: 10.1.0.1, compute_ip: 10.7.0.1, compute_interface: eth1, "
        "gpus: 0}\n"
    )
    command = trust.openssh_command(hosts, hosts.hosts[0])
    assert "StrictHostKeyChecking=yes" in command and "BatchMode=yes" in command


def test_the_simulated_clusters_inventory_checks_host_keys(tmp_path):
    config = sim.SimConfig("sectest", "172.29.250.0/24", tmp_path, "172.30.250.0/24")
    written = inventory_read.load(sim.write_inventory(config, 2))
    args = yaml.safe_load(written.path.read_text())["all"]["vars"]["ansible_ssh_common_args"]
    assert "-o StrictHostKeyChecking=yes" in args
    assert f"-o UserKnownHostsFile={config.known_hosts_path.resolve()}" in args
    assert written.known_hosts == config.known_hosts_path.resolve()


@pytest.mark.parametrize(
    "variable, value",
    [
        ("ansible_ssh_common_args", "-o StrictHostKeyChecking=no"),
        ("ansible_ssh_extra_args", "-o UserKnownHostsFile=/dev/null"),
        ("ansible_ssh_common_args", "-oStrictHostKeyChecking=accept-new"),
        ("ansible_host_key_checking", False),
    ],
)
def test_an_inventory_that_turns_host_key_checks_off_is_refused(variable, value):
    text = yaml.safe_load((REPO / "inventory.example.yml").read_text())
    text["all"]["children"]["nodes"]["hosts"]["pc2"][variable] = value
    with pytest.raises(UserError) as refused:
        inventory_read.parse(yaml.safe_dump(text), "inv.yml")
    assert refused.value.line().startswith(
        f"Error: inventory inv.yml: host 'pc2': field '{variable}'"
    )
    assert "turns off SSH host-key checking" in refused.value.line()


def _host(key: Path | None = None, gpus: int = 0) -> inventory.Host:
    return inventory.Host(
        name="node1",
        ssh_address="192.0.2.1",
        ssh_port=22,
        ssh_user="trainer",
        ssh_key=key,
        compute_ip=ipaddress.IPv4Address("192.0.2.1"),
        compute_interface="eth1",
        gpus=gpus,
    )


def test_the_fabric_remote_rejects_unknown_host_keys_and_never_uses_a_password(
    monkeypatch, tmp_path
):
    """Remote as it connects, up to the socket: fabric's Connection is replaced by a recorder
    that refuses to open, so nothing leaves the machine."""
    made: list[tuple[dict, paramiko.SSHClient]] = []

    class Recorder:
        def __init__(self, host, **kwargs):
            self.client = paramiko.SSHClient()
            made.append((kwargs, self.client))

        def open(self):
            raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(remote, "Connection", Recorder)
    key = tmp_path / "id_ed25519"
    key.write_text(PRIVATE_KEY)
    with pytest.raises(UserError) as refused:
        remote.Remote(_host(key), known_hosts=tmp_path / "known_hosts").run("true")
    ((kwargs, client),) = made
    assert isinstance(client._policy, paramiko.RejectPolicy)
    options = kwargs["connect_kwargs"]
    assert options["key_filename"] == str(key)
    assert options["allow_agent"] is False and options["look_for_keys"] is False
    assert not {"password", "passphrase"} & set(options) and "password" not in kwargs
    assert refused.value.line() == (
        "Error: host 'node1': cannot SSH to trainer@192.0.2.1:22: connection refused "
        "(try checking that the node is up and its key is authorized)"
    )


# --- passwords ---------------------------------------------------------------------------------

PASSWORDS_ON = re.compile(
    r"(PasswordAuthentication|KbdInteractiveAuthentication|ChallengeResponseAuthentication"
    r"|PermitEmptyPasswords)\s*[= ]\s*[\"']?yes\b"
    r"|\bansible_(ssh_)?pass(word)?\b|\bansible_become_pass(word)?\b|\bsshpass\b"
    r"|\bask_pass\s*=\s*(true|yes|1)\b|--ask-pass\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize(
    "line",
    [
        "PasswordAuthentication yes",
        "    KbdInteractiveAuthentication yes",
        "ansible_ssh_pass: secret",
        "ansible_password: x",
        "sshpass -p x ssh node1",
        "ask_pass = True",
        "PermitEmptyPasswords yes",
    ],
)
def test_the_password_pattern_catches_every_way_of_enabling_passwords(line):
    assert PASSWORDS_ON.search(line)


# The one place password login is turned on: a simulated node started as a fresh install
# (make sim-up FRESH=1), the state make bootstrap exists for. Bootstrap logs in with the
# password once and only ever turns password login off.
FRESH_INSTALL = "docker/sim-node/entrypoint.sh"


def test_password_login_is_never_enabled_nor_used():
    found = matches(PASSWORDS_ON, scanned_files())
    assert [line for line in found if not line.startswith(f"{FRESH_INSTALL}:")] == []
    fresh = [int(line.split(":")[1]) for line in found if line.startswith(f"{FRESH_INSTALL}:")]
    lines = (REPO / FRESH_INSTALL).read_text().splitlines()
    opened = lines.index('if [ -n "${SIM_FRESH_USER:-}" ]; then') + 1
    closed = lines.index("fi", opened) + 1
    assert len(fresh) == 1 and opened < fresh[0] < closed, (fresh, opened, closed)


def test_the_simulated_nodes_refuse_password_login():
    dockerfile = (REPO / "docker/sim-node/Dockerfile").read_text()
    for setting in (
        "'PasswordAuthentication no'",
        "'KbdInteractiveAuthentication no'",
        "'PermitRootLogin prohibit-password'",
    ):
        assert setting in dockerfile


# --- private keys ------------------------------------------------------------------------------


def _tasks(role: str) -> list[dict]:
    tasks = []
    for file in sorted((REPO / "ansible/roles" / role / "tasks").glob("*.yml")):
        tasks += yaml.safe_load(file.read_text()) or []
    return tasks


def test_the_ssh_mesh_role_keeps_the_private_key_0600_and_its_directory_0700():
    tasks = _tasks("ssh_mesh")
    names = [t["name"] for t in tasks]
    generate = next(
        i
        for i, t in enumerate(tasks)
        if "ansible.builtin.command" in t
        and t["ansible.builtin.command"]["argv"][0] == "ssh-keygen"
    )
    key_modes = [
        (i, t["ansible.builtin.file"])
        for i, t in enumerate(tasks)
        if t.get("ansible.builtin.file", {}).get("path") == "{{ ssh_mesh_key_file }}"
    ]
    assert [(file["mode"], file["owner"], file["state"]) for _, file in key_modes] == [
        ("0600", "{{ ssh_mesh_user }}", "file")
    ], names
    assert key_modes[0][0] > generate  # after ssh-keygen, so it also covers a key made then
    directory = next(
        t["ansible.builtin.file"]
        for t in tasks
        if t.get("ansible.builtin.file", {}).get("path") == "{{ ssh_mesh_home }}/.ssh"
    )
    assert directory["mode"] == "0700"


def test_no_role_writes_a_private_key_file_with_a_looser_mode():
    """Any task whose target names a private key must give it 0600 or 0400."""
    key_path = re.compile(r"(key_file|private_key|id_(rsa|ed25519|ecdsa))(?!.*\.pub)")
    loose = []
    for role in sorted(p.name for p in (REPO / "ansible/roles").iterdir()):
        for task in _tasks(role):
            for module, args in task.items():
                if not isinstance(args, dict) or "mode" not in args:
                    continue
                target = str(args.get("path") or args.get("dest") or "")
                if key_path.search(target) and str(args["mode"]) not in ("0600", "0400"):
                    loose.append(f"{role}: {task['name']}: {module} {target} {args['mode']}")
    assert loose == []


def test_the_simulators_private_key_is_written_0600(tmp_path):
    config = sim.SimConfig("sectest", "172.29.250.0/24", tmp_path / "state", "172.30.250.0/24")
    public = sim.ensure_key(config)
    assert config.key_path.stat().st_mode & 0o777 == 0o600
    assert public.startswith("ssh-ed25519 ")
    assert "PRIVATE KEY" in config.key_path.read_text()


# --- the training container --------------------------------------------------------------------

# Options that would give a container more than a job needs: the host's devices, capabilities,
# PID or user namespace, or switch off its seccomp/AppArmor confinement.
PRIVILEGED = re.compile(
    r"^--(privileged|cap-add|security-opt|pid|userns|uts|device|cgroupns|cgroup-parent|mount)"
    r"(=|$)|docker\.sock"
)


def _container_options(words: list[str]) -> list[str]:
    """The options of a `docker run` command line: the words between `run` and the image."""
    start = words.index("run") + 1
    options, index = [], start
    takes_value = {
        "--pull",
        "--label",
        "--network",
        "--ipc",
        "--ulimit",
        "--gpus",
        "--name",
        "-v",
        "-w",
        "-e",
        "--cap-add",
    }
    while index < len(words) and words[index].startswith("-"):
        options.append(words[index])
        if words[index] in takes_value:
            options.append(words[index + 1])
            index += 1
        index += 1
    return options


def assert_unprivileged(words: list[str], run_dir: str | None = None, ptrace: bool = False) -> None:
    """No privilege but, where `ptrace`, SYS_PTRACE (py-spy reads a hung job's stacks with it,
    within the container's own PID namespace), once."""
    options = _container_options(words)
    pairs = list(zip(options, options[1:], strict=False))
    assert pairs.count(("--cap-add", "SYS_PTRACE")) == (1 if ptrace else 0), options
    if ptrace:
        at = pairs.index(("--cap-add", "SYS_PTRACE"))
        options = options[:at] + options[at + 2 :]
    assert [o for o in options if PRIVILEGED.search(o)] == [], options
    pairs = list(zip(options, options[1:], strict=False))
    # Host networking and IPC (NCCL, DataLoader shared memory), nothing else of the host's.
    assert {f"{a} {b}" for a, b in pairs if a in ("--network", "--ipc")} == {
        "--network host",
        "--ipc host",
    }
    # NCCL's configuration read-only, the run directory; no other path of the host's.
    mounts = [b for a, b in pairs if a == "-v"]
    expected = ["/etc/nccl.conf:/etc/nccl.conf:ro"] + ([f"{run_dir}:{run_dir}"] if run_dir else [])
    assert mounts == expected, mounts
    assert "--rm" in options and "--init" in options


@pytest.mark.parametrize("gpus", [0, 2])
@pytest.mark.parametrize("memlock", ["unlimited", "8388608"])
def test_the_training_container_options_are_unprivileged(gpus, memlock):
    options = training_container_options(_host(gpus=gpus), memlock, "label=x")
    assert_unprivileged(options)
    assert ("--gpus" in options) == (gpus > 0)
    assert PRIVILEGED.search("--privileged") and PRIVILEGED.search("--cap-add=ALL")
    assert PRIVILEGED.search("/var/run/docker.sock:/var/run/docker.sock")


def test_the_job_container_the_launcher_runs_is_unprivileged():
    host = _host(None)
    spec = JobSpec(run_id="tmn-sec")
    run_dir = f"{REMOTE_RUN_ROOT}/{spec.run_id}"
    command = remote_command(
        host,
        host,
        1,
        spec,
        29500,
        {"GLOO_SOCKET_IFNAME": "eth1"},
        mode="container",
        image="torch-multinode/train:latest",
        memlock="unlimited",
    )
    words = shlex.split(command)
    docker = words[words.index("exec") + 1 :]
    assert docker[:2] == ["docker", "run"]
    assert_unprivileged(docker, run_dir, ptrace=True)


def test_netchecks_probe_container_is_the_job_container():
    context = ContainerContext("torch-multinode/train:latest")
    command = context.wrap(_host(), "true", "netcheck-token")
    guard, _, started = command.partition(" && ")
    assert guard.startswith("test -f /etc/nccl.conf || {")
    words = shlex.split(started)
    assert words[:2] == ["docker", "run"]
    assert_unprivileged(words)


# --- no private key in any output --------------------------------------------------------------

SECRET = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ-security-test-marker"
PRIVATE_KEY = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SECRET}\n-----END OPENSSH PRIVATE KEY-----\n"


@pytest.fixture
def keyed_inventory(tmp_path) -> tuple[Path, Path]:
    """netcheck's fake-cluster inventory, with a private key file and known_hosts of its own."""
    key = tmp_path / "id_ed25519"
    key.write_text(PRIVATE_KEY)
    key.chmod(0o600)
    path = tmp_path / "inventory.yml"
    path.write_text(
        FAKE_INVENTORY.replace(
            "    launch_mode: host\n",
            f"    launch_mode: host\n    ansible_user: trainer\n"
            f"    ansible_ssh_private_key_file: {key}\n    ssh_known_hosts_file: {tmp_path}/known\n",
        )
    )
    assert [h.ssh_key for h in inventory_read.load(path).hosts] == [key] * 3
    return path, key


def assert_no_key_in(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text and "PRIVATE KEY" not in text, text[-500:]


def test_the_watch_sees_a_read_of_the_key(keyed_inventory, tmp_path):
    _, key = keyed_inventory

    def reads_the_key(argv: list[str]) -> int:
        Path(argv[0]).read_text()
        return 0

    outcome = call(reads_the_key, [str(key)], tmp_path)
    assert outcome.code == 0 and str(key) in outcome.opened


def test_cluster_check_never_reads_or_prints_the_key(keyed_inventory, tmp_path):
    path, key = keyed_inventory
    outcome = call(cluster_cli.main, ["check", "-i", str(path)], tmp_path)
    assert outcome.code == 0 and outcome.stopped == [], str(outcome)
    assert str(path) in outcome.opened and str(key) not in outcome.opened
    assert_no_key_in(outcome.out, outcome.err)


def test_netcheck_never_reads_prints_or_sends_the_key(keyed_inventory, tmp_path, monkeypatch):
    """The whole pre-flight against netcheck's fake healthy cluster: the report, the env file,
    the version lock and every command sent to the nodes are free of the key; the key file is never opened."""
    path, key = keyed_inventory
    sent: list[str] = []

    class Recording(FakeCluster):
        def run(self, host, command, timeout):
            sent.append(command)
            return super().run(host, command, timeout)

    fakes: list[FakeCluster] = []
    monkeypatch.setattr(
        netcheck_cli, "SshNodes", lambda inv: fakes.append(Recording(list(inv.hosts))) or fakes[-1]
    )
    monkeypatch.chdir(tmp_path)
    for flags in ([], ["--json"]):
        outcome = call(netcheck_cli.main, ["-i", str(path), *flags], tmp_path)
        assert outcome.code == 0 and outcome.stopped == [], str(outcome)
        assert str(key) not in outcome.opened
        assert_no_key_in(
            outcome.out,
            outcome.err,
            *sent,
            (tmp_path / "netcheck-env.json").read_text(),
            (tmp_path / "versions.lock.json").read_text(),
        )
    assert sent and fakes[-1].surprises == []


def test_train_never_reads_or_prints_the_key_and_never_puts_it_in_a_job(
    keyed_inventory, tmp_path, monkeypatch
):
    path, key = keyed_inventory
    handed: list[tuple] = []

    def launched(inv, spec, emit, project, nodes, spares):
        handed.append((inv, inv.hosts, spec))
        raise Reached("launcher")

    monkeypatch.setattr(backends, "Launcher", launched)
    monkeypatch.chdir(tmp_path)
    outcome = call(launch_cli.main, ["-i", str(path), "--debug"], tmp_path)
    assert outcome.reached == "launcher" and outcome.stopped == [], str(outcome)
    assert str(key) not in outcome.opened
    assert_no_key_in(outcome.out, outcome.err)
    inv, hosts, spec = handed[0]
    for host in hosts:
        for mode in ("host", "container"):
            command = remote_command(
                host,
                hosts[0],
                len(hosts),
                spec,
                inv.rendezvous_port,
                {"A": "b"},
                mode=mode,
                image=inv.training_image,
                memlock=inv.container_memlock,
            )
            assert_no_key_in(command)
            assert str(key) not in command  # not even where the key lives
