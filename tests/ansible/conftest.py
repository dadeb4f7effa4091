"""Running the provisioning playbook the way the Makefile does, and looking into the nodes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, VENV_BIN

ANSIBLE_DIR = REPO_ROOT / "ansible"
SITE = ANSIBLE_DIR / "site.yml"
PLAYBOOKS = Path(__file__).resolve().parent / "playbooks"
_RECAP_LINE = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")


def recap_of(output: str) -> dict[str, dict[str, int]]:
    """The last PLAY RECAP's counters by host in a playbook's output (also `make provision`'s):
    {'node1': {'ok': 40, 'changed': 0, ...}}."""
    _, _, tail = output.rpartition("PLAY RECAP")
    counters = {}
    for line in tail.splitlines():
        match = _RECAP_LINE.match(line.strip())
        if match:
            counters[match[1]] = {
                key: int(value) for key, value in (pair.split("=") for pair in match[2].split())
            }
    return counters


@dataclass
class PlaybookRun:
    command: list[str]
    returncode: int
    output: str
    seconds: float

    @property
    def recap(self) -> dict[str, dict[str, int]]:
        return recap_of(self.output)

    def changed(self) -> dict[str, int]:
        return {host: counts["changed"] for host, counts in self.recap.items()}

    def failed(self) -> dict[str, int]:
        return {
            host: counts["failed"] + counts["unreachable"] for host, counts in self.recap.items()
        }

    @property
    def errors(self) -> list[str]:
        """The one-line '[ERROR]: ...' messages Ansible printed."""
        return [line for line in self.output.splitlines() if line.startswith("[ERROR]: ")]

    def describe(self) -> str:
        return f"$ {' '.join(self.command)}\n(exit {self.returncode}, {self.seconds:.0f} s)\n{self.output[-6000:]}"


def ansible_playbook(
    inventory: Path | str, *args: str, playbook: Path = SITE, timeout: float = 1200
) -> PlaybookRun:
    """`ANSIBLE_CONFIG=ansible/ansible.cfg .venv/bin/ansible-playbook -i INVENTORY site.yml ARGS`."""
    command = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(playbook), *args]
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    started = time.monotonic()
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )
    run = PlaybookRun(
        command, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started
    )
    print(f"\n[ansible-playbook {' '.join(args)}: exit {run.returncode} in {run.seconds:.1f} s]")
    return run


def node_sh(container: str, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A shell command inside a node container (for looking, and for setting up test cases)."""
    return subprocess.run(
        ["docker", "exec", container, "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_inventory(path: Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def write_inventory(document: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def tcp_connects(address: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from this machine (the controller) is accepted in time."""
    with socket.socket() as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        return True


def node_tcp_connects(container: str, address: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from inside a node is accepted in time."""
    probe = (
        "import socket, sys\n"
        f"s = socket.socket(); s.settimeout({timeout})\n"
        "try:\n"
        f"    s.connect(({address!r}, {port}))\n"
        "except OSError:\n"
        "    sys.exit(3)\n"
    )
    proc = subprocess.run(
        ["docker", "exec", container, "python3", "-c", probe],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        check=False,
    )
    if proc.returncode not in (0, 3):  # anything else: the probe itself failed
        raise AssertionError(f"TCP probe in {container} failed: {proc.stderr}")
    return proc.returncode == 0


# Run inside a node: argv is the source address, the timeout and the targets as JSON.
_PROBE_FROM = """
import json, socket, sys, threading
source, timeout, targets = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
result = {}
def one(address, port):
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            s.bind((source, 0))
            s.connect((address, port))
            result[f"{address}:{port}"] = True
        except OSError:
            result[f"{address}:{port}"] = False
threads = [threading.Thread(target=one, args=tuple(t)) for t in targets]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(result))
"""


def node_tcp_probe(
    container: str, source: str, targets: list[tuple[str, int]], timeout: float = 3.0
) -> dict[tuple[str, int], bool]:
    """From inside a node, sending from its address `source`: which (address, port) targets
    accept a TCP connection in time. All are probed at once: dropped ones cost one timeout."""
    proc = subprocess.run(
        [
            "docker",
            "exec",
            container,
            "python3",
            "-c",
            _PROBE_FROM,
            source,
            str(timeout),
            json.dumps(targets),
        ],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"TCP probe in {container} failed: {proc.stderr}")
    found = json.loads(proc.stdout)
    return {(address, port): found[f"{address}:{port}"] for address, port in targets}


def listening_tcp(container: str) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener in a node, loopback ones left out."""
    out = node_sh(container, "ss -ltnH").stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]  # State Recv-Q Send-Q Local:Port Peer:Port
        address, _, port = local.rpartition(":")
        address = address.strip("[]").split("%")[0]
        if address.startswith("127.") or address == "::1":
            continue
        found.append((address, int(port)))
    return sorted(set(found))


class Listener:
    """A TCP server on a node (python's http.server), started and stopped by its process id."""

    def __init__(self, container: str, port: int):
        self.container, self.port = container, port
        self.pidfile = f"/tmp/test-listener-{port}.pid"

    def __enter__(self) -> Listener:
        subprocess.run(
            [
                "docker",
                "exec",
                "-d",
                self.container,
                "sh",
                "-c",
                f"echo $$ > {self.pidfile}; exec python3 -m http.server {self.port} --bind 0.0.0.0",
            ],
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 20
        while not node_tcp_connects(self.container, "127.0.0.1", self.port, timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"listener on {self.container}:{self.port} did not start")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        node_sh(self.container, f"kill $(cat {self.pidfile}) && rm -f {self.pidfile}")


def image_id(image: str, container: str | None = None) -> str:
    """The image's ID in the controller's engine, or in a node's engine."""
    prefix = ["docker", "exec", container] if container else []
    proc = subprocess.run(
        [*prefix, "docker", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


# What provisioning could change on a node, read without changing anything.
SNAPSHOT = (
    "hostname; cat /etc/hostname /etc/hosts; ls -A /root/.ssh /etc/ssh/ssh_config.d; "
    "ls /etc/ssh/ssh_known_hosts /etc/netplan 2>&1; command -v ufw docker dockerd; "
    "dpkg-query -W -f='${Package} ${Version}\\n'"
)


def snapshot(containers: list[str]) -> dict[str, str]:
    """Each node's state as far as provisioning is concerned, to prove that nothing changed."""
    return {container: node_sh(container, SNAPSHOT).stdout for container in containers}


def ship_image(inventory: Path, image: str) -> subprocess.CompletedProcess:
    """`cluster ship` of `image` to the inventory's nodes, as make provision runs it last."""
    return subprocess.run(
        [str(VENV_BIN / "cluster"), "ship", "-i", str(inventory), "--image", image],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def ufw_status_lines(inventory) -> list[str]:
    """`ufw status` with exactly our rules: SSH from anywhere, all TCP from the compute subnet,
    the lighthouse's port from every node's ansible_host (addresses in the simulator)."""
    port = f"{inventory.lighthouse_port}/tcp"
    return [
        "Status: active",
        "",
        "To                         Action      From",
        "--                         ------      ----",
        "22/tcp                     ALLOW       Anywhere",
        f"Anywhere                   ALLOW       {inventory.compute_subnet}/tcp",
        *(f"{port:<27}ALLOW       {host.ssh_address}" for host in inventory.hosts),
        "22/tcp (v6)                ALLOW       Anywhere (v6)",
    ]


@pytest.fixture(scope="session")
def tiny_image(tmp_path_factory):
    """A few-byte image in the controller's engine, standing in for the training image."""
    prefix = os.environ.get("SIM_TEST_PREFIX", "tmntest")
    name = f"torch-multinode-test/{prefix}-tiny:{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("tiny-image")
    (root / "hello.txt").write_text("the training image stands in here\n")
    archive = root / "tiny.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root / "hello.txt", arcname="hello.txt")
    subprocess.run(["docker", "import", str(archive), name], check=True, capture_output=True)
    yield name
    subprocess.run(["docker", "image", "rm", "-f", name], check=False, capture_output=True)
