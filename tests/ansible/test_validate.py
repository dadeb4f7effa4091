"""The validate play runs the project's one validator (`cluster check`): every inventory that
`make check-inventory` rejects, the playbook rejects too, with the same line naming the host and
the field, before any play that could touch a node.

Every run here is limited to `--tags validate` and uses the local connection: even if a
check wrongly let an inventory through, nothing but the asserts and a read-only fact gathering
on this machine would run, and no address in these inventories is ever contacted.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.ansible.conftest import ansible_playbook
from tests.conftest import run_cli

VALID = """\
all:
  vars:
    compute_subnet: 10.9.0.0/24
    rendezvous_port: 29511
    ansible_connection: local
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
  children:
    nodes:
      hosts:
        alpha:
          ansible_host: 10.9.0.1
          compute_ip: 10.9.0.1
          compute_interface: eth1
          gpus: 2
        beta:
          ansible_host: 10.9.0.2
          compute_ip: 10.9.0.2
          compute_interface: eth1
          gpus: 0
"""

# (case, inventory text); the expected message is whatever `cluster check` says.
REJECTIONS = [
    ("hostname differing only in case", VALID.replace("        beta:", "        ALPHA:")),
    ("duplicate compute IP", VALID.replace("compute_ip: 10.9.0.2", "compute_ip: 10.9.0.1")),
    ("duplicate SSH address", VALID.replace("ansible_host: 10.9.0.2", "ansible_host: 10.9.0.1")),
    ("hostname with an underscore", VALID.replace("        beta:", "        beta_2:")),
    (
        "compute IP outside the subnet",
        VALID.replace("compute_ip: 10.9.0.2", "compute_ip: 10.9.1.2"),
    ),
    ("compute IP not an address", VALID.replace("compute_ip: 10.9.0.2", "compute_ip: pc2.lan")),
    ("missing gpus", VALID.replace("          gpus: 0\n", "")),
    ("missing ansible_host", VALID.replace("          ansible_host: 10.9.0.2\n", "")),
    ("gpus as a boolean", VALID.replace("gpus: 0", "gpus: true")),
    (
        "interface name with a slash",
        VALID.replace(
            "compute_interface: eth1\n          gpus: 0",
            "compute_interface: eth/1\n          gpus: 0",
        ),
    ),
    (
        "SSH port out of range",
        VALID.replace("          gpus: 0\n", "          gpus: 0\n          ansible_port: 70000\n"),
    ),
    (
        "training_python with a space",
        VALID.replace(
            "          gpus: 0\n", "          gpus: 0\n          training_python: my python\n"
        ),
    ),
    ("missing compute_subnet", VALID.replace("    compute_subnet: 10.9.0.0/24\n", "")),
    (
        "compute_subnet with host bits",
        VALID.replace("compute_subnet: 10.9.0.0/24", "compute_subnet: 10.9.0.1/24"),
    ),
    ("rendezvous port out of range", VALID.replace("rendezvous_port: 29511", "rendezvous_port: 0")),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(textwrap.dedent(text))
    return path


def cluster_check_message(path: Path) -> str:
    """`cluster check`'s error, without 'Error: ' and the '(try ...)' hint."""
    proc = run_cli("cluster", "check", "-i", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: ")
    return line.removeprefix("Error: ").split(" (try ")[0]


def test_a_valid_inventory_passes_the_validate_play(tmp_path):
    # --tags validate: beyond the asserts, only the (read-only) fact gathering runs, locally.
    run = ansible_playbook(write(tmp_path, VALID), "--tags", "validate")
    assert run.returncode == 0, run.describe()
    assert run.recap["alpha"]["failed"] == 0 and run.recap["beta"]["failed"] == 0


@pytest.mark.parametrize("case, text", REJECTIONS, ids=[case for case, _ in REJECTIONS])
def test_the_validate_play_rejects_what_cluster_check_rejects(tmp_path, case, text):
    path = write(tmp_path, text)
    expected = cluster_check_message(path)
    run = ansible_playbook(path, "--tags", "validate")
    assert run.returncode == 2, run.describe()
    assert any(f"Action failed: {expected}" in line for line in run.errors), (
        f"expected: {expected}\n{run.describe()}"
    )
    # Stopped in the validate play: the provisioning play never started, nothing changed.
    assert "PLAY [Provision every node" not in run.output, run.describe()
    assert set(run.changed().values()) == {0}, run.describe()


def test_an_inventory_without_nodes_fails_instead_of_doing_nothing(tmp_path):
    path = write(tmp_path, VALID.replace("    nodes:\n", "    workers:\n"))
    run = ansible_playbook(path, "--tags", "validate")
    assert run.returncode == 2, run.describe()
    assert run.errors[0].endswith(
        f"Action failed: inventory {path}: no hosts under all.children.nodes.hosts "
        "(try listing the nodes as in inventory.example.yml)"
    ), run.describe()
    assert "PLAY [Provision every node" not in run.output, run.describe()


def test_the_validate_play_names_every_problem_not_only_the_last(tmp_path):
    path = write(tmp_path, VALID.replace("gpus: 2", "gpus: -1").replace("gpus: 0", "gpus: -2"))
    lines = run_cli("cluster", "check", "-i", str(path)).stderr.strip().splitlines()
    assert len(lines) == 2, lines  # one line per host
    run = ansible_playbook(path, "--tags", "validate")
    assert run.returncode == 2, run.describe()
    expected = "; ".join(line.removeprefix("Error: ") for line in lines)
    assert any(f"Action failed: {expected}" in line for line in run.errors), (
        f"expected: {expected}\n{run.describe()}"
    )
