"""Every inventory rejection, through the real CLI: the exact error line and the exit code."""

from __future__ import annotations

import ipaddress
import textwrap
from pathlib import Path

import pytest

from cluster import inventory
from cluster.errors import ClusterError
from tests.conftest import REPO_ROOT, run_cli

VALID = """\
all:
  vars:
    compute_subnet: 10.9.0.0/24
    rendezvous_port: 29511
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


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(textwrap.dedent(text))
    return path


def check(path: Path, *extra: str):
    return run_cli("cluster", "check", "-i", str(path), *extra)


def test_valid_inventory_is_read_in_rank_order(tmp_path):
    loaded = inventory.load(write(tmp_path, VALID))
    assert [h.name for h in loaded.hosts] == ["alpha", "beta"]
    assert loaded.master.name == "alpha"
    assert loaded.compute_subnet == ipaddress.IPv4Network("10.9.0.0/24")
    assert loaded.rendezvous_port == 29511
    assert loaded.hosts[0].gpus == 2 and loaded.hosts[0].compute_interface == "eth1"
    assert loaded.hosts[1].ssh_port == 22 and loaded.hosts[1].python == "python3"


def test_cli_lists_hosts_of_a_valid_inventory(tmp_path):
    proc = check(write(tmp_path, VALID), "--nnodes", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("valid, 2 host(s), compute subnet 10.9.0.0/24, rendezvous port 29511")
    assert len(lines) == 2 and "node_rank 0  alpha" in lines[1] and "master" in lines[1]


def test_host_vars_override_cluster_vars(tmp_path):
    text = VALID.replace(
        "    rendezvous_port: 29511\n", "    rendezvous_port: 29511\n    gpus: 4\n"
    )
    text = text.replace("          gpus: 0\n", "")
    loaded = inventory.load(write(tmp_path, text))
    assert [h.gpus for h in loaded.hosts] == [2, 4]


REJECTIONS = [
    (
        "duplicate hostname",
        VALID.replace("        beta:", "        alpha:"),
        "line 13: duplicate key 'alpha' (first on line 8) (try giving each host a unique name)",
    ),
    (
        "duplicate hostname differing in case",
        VALID.replace("        beta:", "        ALPHA:"),
        "host 'ALPHA': name duplicates host 'alpha' (hostnames are case-insensitive)",
    ),
    (
        "duplicate compute IP",
        VALID.replace("compute_ip: 10.9.0.2", "compute_ip: 10.9.0.1"),
        "host 'beta': field 'compute_ip': 10.9.0.1 is already used by host 'alpha'",
    ),
    (
        "duplicate SSH address",
        VALID.replace("ansible_host: 10.9.0.2", "ansible_host: 10.9.0.1"),
        "host 'beta': field 'ansible_host': 10.9.0.1:22 is already used by host 'alpha'",
    ),
    (
        "hostname with an underscore",
        VALID.replace("        beta:", "        beta_2:"),
        "host 'beta_2': name is not a valid RFC 1123 hostname label (letters, digits and '-', "
        "1-63 characters, no '-' at either end)",
    ),
    (
        "hostname ending in a hyphen",
        VALID.replace("        beta:", "        beta-:"),
        "host 'beta-': name is not a valid RFC 1123 hostname label (letters, digits and '-', "
        "1-63 characters, no '-' at either end)",
    ),
    (
        "hostname longer than 63",
        VALID.replace("        beta:", "        " + "b" * 64 + ":"),
        f"host '{'b' * 64}': name is not a valid RFC 1123 hostname label (letters, digits and "
        "'-', 1-63 characters, no '-' at either end)",
    ),
    (
        "compute IP outside the subnet",
        VALID.replace("compute_ip: 10.9.0.2", "compute_ip: 10.9.1.2"),
        "host 'beta': field 'compute_ip': 10.9.1.2 is outside compute_subnet 10.9.0.0/24 "
        "(try an address inside the subnet, or correct compute_subnet)",
    ),
    (
        "compute IP not an address",
        VALID.replace("compute_ip: 10.9.0.2", "compute_ip: pc2.lan"),
        "host 'beta': field 'compute_ip': 'pc2.lan' is not an IPv4 address",
    ),
    (
        "missing compute_ip",
        VALID.replace("          compute_ip: 10.9.0.2\n", ""),
        "host 'beta': field 'compute_ip' is missing",
    ),
    (
        "missing compute_interface",
        VALID.replace(
            "          compute_interface: eth1\n          gpus: 2\n", "          gpus: 2\n"
        ),
        "host 'alpha': field 'compute_interface' is missing",
    ),
    (
        "missing gpus",
        VALID.replace("          gpus: 0\n", ""),
        "host 'beta': field 'gpus' is missing",
    ),
    (
        "missing ansible_host",
        VALID.replace("          ansible_host: 10.9.0.1\n", ""),
        "host 'alpha': field 'ansible_host' is missing",
    ),
    (
        "negative gpus",
        VALID.replace("gpus: 0", "gpus: -1"),
        "host 'beta': field 'gpus': -1 is not a whole number >= 0",
    ),
    (
        "missing compute subnet",
        VALID.replace("    compute_subnet: 10.9.0.0/24\n", ""),
        "cluster field 'compute_subnet' is missing (set it in all.vars)",
    ),
    (
        "subnet with host bits",
        VALID.replace("compute_subnet: 10.9.0.0/24", "compute_subnet: 10.9.0.5/24"),
        "cluster field 'compute_subnet': '10.9.0.5/24' is not an IPv4 network "
        "(10.9.0.5/24 has host bits set) (try a form like 192.168.1.0/24)",
    ),
    (
        "port out of range",
        VALID.replace("rendezvous_port: 29511", "rendezvous_port: 70000"),
        "cluster: field 'rendezvous_port': 70000 is not a port number (1-65535)",
    ),
    (
        "no nodes group",
        VALID.replace("    nodes:", "    gpus:"),
        "no hosts under all.children.nodes.hosts (try listing the nodes as in "
        "inventory.example.yml)",
    ),
    (
        "not a mapping at the top",
        "- just\n- a list\n",
        "the top level must be a mapping with an 'all' key (try the layout of "
        "inventory.example.yml)",
    ),
    (
        "not YAML",
        "all:\n  vars: [unclosed\n",
        "is not valid YAML at line 3 column 1: expected ',' or ']', but got '<stream end>'",
    ),
]


@pytest.mark.parametrize(
    "text, message", [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS]
)
def test_rejection_is_one_line_naming_host_and_field(tmp_path, text, message):
    path = write(tmp_path, text)
    proc = check(path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    if message.startswith("is not valid YAML"):
        assert proc.stderr == f"Error: inventory {path} {message}\n"
    else:
        assert proc.stderr == f"Error: inventory {path}: {message}\n"


@pytest.mark.parametrize(
    "nnodes, message",
    [
        ("3", "NNODES=3 but inventory {path} lists 2 host(s) (try NNODES=2 or add hosts to the "
              "inventory)"),
        ("0", "NNODES=0 is below 1 (try NNODES=1 or more)"),
        ("-1", "NNODES=-1 is below 1 (try NNODES=1 or more)"),
        ("two", "NNODES='two' is not a whole number"),
    ],
)  # fmt: skip
def test_nnodes_outside_the_inventory_is_rejected(tmp_path, nnodes, message):
    path = write(tmp_path, VALID)
    proc = check(path, "--nnodes", nnodes)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"Error: {message.format(path=path)}\n"


def test_missing_file_and_missing_argument(tmp_path):
    proc = check(tmp_path / "nope.yml")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"Error: inventory {tmp_path / 'nope.yml'} does not exist (try a path to an existing file)\n"
    )
    proc = run_cli("cluster", "check")
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: no inventory given (try INVENTORY=path/to/inventory.yml")


def test_make_stops_before_touching_anything_on_a_bad_inventory(tmp_path):
    """`make provision` validates first: a bad file never reaches ansible-playbook."""
    path = write(tmp_path, VALID.replace("compute_ip: 10.9.0.2", "compute_ip: 10.9.1.2"))
    import subprocess

    proc = subprocess.run(
        ["make", "--no-print-directory", "provision", f"INVENTORY={path}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"Error: inventory {path}: host 'beta': field 'compute_ip'" in proc.stderr
    assert "ansible-playbook" not in proc.stdout.split("cluster check")[-1]


def test_example_inventory_is_valid_documentation():
    loaded = inventory.load(REPO_ROOT / "inventory.example.yml")
    assert [h.name for h in loaded.hosts] == ["pc1", "pc2"]


def test_select_keeps_rank_order(tmp_path):
    loaded = inventory.load(write(tmp_path, VALID))
    assert [h.name for h in loaded.select(1)] == ["alpha"]
    with pytest.raises(ClusterError, match=r"NNODES=5 but inventory"):
        loaded.select(5)
