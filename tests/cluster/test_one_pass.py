"""Issue 49, the first hour: `make check-inventory` lists every problem in one pass. A YAML
duplicate key no longer hides the rest, two hosts at one address are said whatever else is
wrong with them (with a hint), and a typo in a group's variables ([nodes:vars], nodes.vars,
group_vars/nodes.yml) is said once, naming the group, not once per host."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli
from torch_multinode.cluster import inventory_read
from torch_multinode.cluster.errors import UserError

VALID = """\
all:
  vars:
    compute_subnet: 10.9.0.0/24
  children:
    nodes:
      hosts:
        pc1:
          ansible_host: 10.9.0.1
          compute_ip: 10.9.0.1
          compute_interface: eth1
          gpus: 1
        pc2:
          ansible_host: 10.9.0.2
          compute_ip: 10.9.0.2
          compute_interface: eth1
          gpus: 1
        pc3:
          ansible_host: 10.9.0.3
          compute_ip: 10.9.0.3
          compute_interface: eth1
          gpus: 1
"""


def write(tmp_path: Path, text: str, name: str = "inventory.yml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path) -> tuple[list[str], list[str]]:
    """The `Error:` lines load raises, and the `Warning:` lines it prints."""
    with pytest.raises(UserError) as raised:
        inventory_read.load(path)
    return raised.value.lines()


def test_a_duplicate_key_is_said_with_everything_else_wrong(tmp_path):
    """The first hour's inventory: a host block copied and left under its old name, a field
    given twice, a typo'd field and an address outside the subnet: every one, in one run of
    the real CLI."""
    text = """\
        all:
          vars:
            compute_subnet: 10.9.0.0/24
          children:
            nodes:
              hosts:
                pc1:
                  ansible_host: 10.9.0.1
                  compute_ip: 10.8.0.1
                  compute_interfce: eth1
                  gpus: 1
                pc2:
                  ansible_host: 10.9.0.2
                  compute_ip: 10.9.0.2
                  compute_interface: eth1
                  gpus: 2
                  gpus: 1
                pc2:
                  ansible_host: 10.9.0.3
                  compute_ip: 10.9.0.3
                  compute_interface: eth1
                  gpus: 1
        """
    path = write(tmp_path, text)
    done = run_cli("cluster", "check", "-i", str(path))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"Error: inventory {path}: line 17: duplicate key 'gpus' (first on line 16) (try "
        "keeping one of them: Ansible reads the last, and so do the checks)",
        f"Error: inventory {path}: line 18: duplicate key 'pc2' (first on line 12) (try giving "
        "each host a unique name)",
        f"Error: inventory {path}: host 'pc1': field 'compute_interface' is missing; "
        "'compute_interfce' looks like a typo of it (try renaming compute_interfce to "
        "compute_interface)",
        f"Error: inventory {path}: host 'pc1': field 'compute_ip': 10.8.0.1 is outside "
        "compute_subnet 10.9.0.0/24 (try an address inside the subnet, or correct "
        "compute_subnet)",
    ]


def test_two_hosts_at_one_address_are_said_whatever_else_is_wrong(tmp_path):
    text = VALID.replace("ansible_host: 10.9.0.2", "ansible_host: 10.9.0.1")
    text = text.replace("compute_ip: 10.9.0.2", "compute_ip: 10.8.0.2")
    text = text.replace("compute_ip: 10.9.0.3", "compute_ip: 10.9.0.1")
    text = text.replace("          gpus: 1\n        pc3", "          gpus: -1\n        pc3")
    path = write(tmp_path, text)
    assert problems(path) == [
        f"Error: inventory {path}: host 'pc2': field 'compute_ip': 10.8.0.2 is outside "
        "compute_subnet 10.9.0.0/24 (try an address inside the subnet, or correct "
        "compute_subnet)",
        f"Error: inventory {path}: host 'pc2': field 'gpus': -1 is not a whole number >= 0",
        f"Error: inventory {path}: host 'pc2': field 'ansible_host': 10.9.0.1:22 is already "
        "used by host 'pc1' (try pc2's own address, or its own ansible_port where nodes share "
        "one address)",
        f"Error: inventory {path}: host 'pc3': field 'compute_ip': 10.9.0.1 is already used by "
        "host 'pc1' (try pc3's own address on the compute network)",
    ]


def test_nodes_sharing_an_address_on_their_own_ports_are_accepted(tmp_path):
    text = VALID.replace(
        "ansible_host: 10.9.0.2", "ansible_host: 10.9.0.1\n          ansible_port: 2202"
    )
    assert [h.ssh_port for h in inventory_read.load(write(tmp_path, text)).hosts] == [22, 2202, 22]


def test_a_host_missing_a_field_has_its_other_fields_checked(tmp_path):
    text = VALID.replace("          gpus: 1\n        pc2", "        pc2", 1)
    text = text.replace("compute_ip: 10.9.0.1", "compute_ip: 10.8.0.1")
    path = write(tmp_path, text)
    assert problems(path) == [
        f"Error: inventory {path}: host 'pc1': field 'gpus' is missing",
        f"Error: inventory {path}: host 'pc1': field 'compute_ip': 10.8.0.1 is outside "
        "compute_subnet 10.9.0.0/24 (try an address inside the subnet, or correct "
        "compute_subnet)",
    ]


INI = """\
[nodes]
pc1 ansible_host=10.9.0.1 compute_ip=10.9.0.1 gpus=1
pc2 ansible_host=10.9.0.2 compute_ip=10.9.0.2 gpus=1
pc3 ansible_host=10.9.0.3 compute_ip=10.9.0.3 gpus=1

[nodes:vars]
compute_interfce=eth1
trainig_image=mine:1

[all:vars]
compute_subnet=10.9.0.0/24
"""


def test_a_typo_in_an_ini_groups_vars_is_said_once_naming_the_group(tmp_path):
    path = write(tmp_path, INI, "cluster.ini")
    done = run_cli("cluster", "check", "-i", str(path))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"Warning: inventory {path}: vars of group 'nodes': field 'trainig_image' is not one "
        "the project reads; did you mean 'training_image'?",
        f"Error: inventory {path}: vars of group 'nodes': field 'compute_interfce' looks like a "
        "typo of 'compute_interface', which every host lacks (try renaming compute_interfce to "
        "compute_interface)",
    ]


def test_the_hosts_that_set_the_field_themselves_are_left_out(tmp_path):
    text = INI.replace("pc2 ansible_host", "pc2 compute_interface=eth1 ansible_host")
    path = write(tmp_path, text, "cluster.ini")
    assert problems(path) == [
        f"Error: inventory {path}: vars of group 'nodes': field 'compute_interfce' looks like a "
        "typo of 'compute_interface', which hosts 'pc1', 'pc3' lack (try renaming "
        "compute_interfce to compute_interface)",
    ]


def test_a_typo_in_group_vars_files_and_yaml_group_vars_is_said_for_its_group(tmp_path, capsys):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "nodes.yml").write_text("lanch_mode: host\ngpu: 1\n")
    text = VALID.replace("          gpus: 1\n", "")
    path = write(tmp_path, text)
    assert problems(path) == [
        f"Error: inventory {path}: vars of group 'nodes': field 'gpu' looks like a typo of "
        "'gpus', which every host lacks (try renaming gpu to gpus)",
    ]
    assert capsys.readouterr().err.splitlines() == [
        f"Warning: inventory {path}: vars of group 'nodes': field 'lanch_mode' is not one the "
        "project reads; did you mean 'launch_mode'?",
    ]
    # The same in the plain YAML layout, read directly; all.vars' own is the cluster's.
    lone = tmp_path / "lone"
    lone.mkdir()
    text = text.replace(
        "    nodes:\n", "    nodes:\n      vars:\n        gpu: 1\n        lanch_mode: host\n"
    )
    text = text.replace("    compute_subnet:", "    trainig_python: /x\n    compute_subnet:")
    path = write(lone, text)
    assert problems(path) == [
        f"Error: inventory {path}: vars of group 'nodes': field 'gpu' looks like a typo of "
        "'gpus', which every host lacks (try renaming gpu to gpus)",
    ]
    assert capsys.readouterr().err.splitlines() == [
        f"Warning: inventory {path}: cluster field 'trainig_python' is not one the project "
        "reads; did you mean 'training_python'?",
        f"Warning: inventory {path}: vars of group 'nodes': field 'lanch_mode' is not one the "
        "project reads; did you mean 'launch_mode'?",
    ]


def test_a_typo_in_a_groups_vars_that_every_host_overrides_is_a_warning(tmp_path, capsys):
    text = INI.replace(" gpus=1", " gpus=1 compute_interface=eth1")
    path = write(tmp_path, text, "cluster.ini")
    assert [h.compute_interface for h in inventory_read.load(path).hosts] == ["eth1"] * 3
    assert capsys.readouterr().err.splitlines() == [
        f"Warning: inventory {path}: vars of group 'nodes': field 'compute_interfce' is not "
        "one the project reads; did you mean 'compute_interface'?",
        f"Warning: inventory {path}: vars of group 'nodes': field 'trainig_image' is not one "
        "the project reads; did you mean 'training_image'?",
    ]
