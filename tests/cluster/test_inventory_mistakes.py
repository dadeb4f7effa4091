"""Issue 28, finding 3: inventory mistakes that passed silently or were misreported. Typos of
the project's fields, a host defined twice with different values, and several errors at once,
through the real CLI."""

from __future__ import annotations

import textwrap
from pathlib import Path

import ansible.constants

from tests.conftest import run_cli
from torch_multinode.cluster import inventory_checks, inventory_read

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
"""


def write(tmp_path: Path, text: str, name: str = "inventory.yml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def check(path: Path):
    return run_cli("cluster", "check", "-i", str(path))


def test_a_typo_of_launch_mode_is_a_warning_naming_the_field(tmp_path):
    path = write(
        tmp_path, VALID.replace("    compute_subnet:", "    lanch_mode: host\n    compute_subnet:")
    )
    proc = check(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        f"Warning: inventory {path}: cluster field 'lanch_mode' is not one the project reads; "
        "did you mean 'launch_mode'?\n"
    )


def test_a_typo_of_a_host_field_is_a_warning_naming_host_and_field(tmp_path):
    path = write(
        tmp_path,
        VALID.replace(
            "          gpus: 1\n", "          gpus: 1\n          trainig_python: /opt/py\n", 1
        ),
    )
    proc = check(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        f"Warning: inventory {path}: host 'pc1': field 'trainig_python' is not one the project "
        "reads; did you mean 'training_python'?\n"
    )


def test_ansible_and_unrelated_variables_stay_silent(tmp_path):
    text = VALID.replace(
        "    compute_subnet:",
        "    ansible_ssh_user: admin\n    ansible_python_interpreter: /usr/bin/python3\n"
        "    gpu_count_note: many\n    owner: lab\n    firewall_allowed_tcp_ports: [22]\n"
        "    compute_subnet:",
    )
    proc = check(write(tmp_path, text))
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_missing_field_names_its_typo(tmp_path):
    text = VALID.replace(
        "          compute_interface: eth1\n          gpus: 1\n        pc2",
        "          compute_interface: eth1\n          gpus: 1\n        pc2",
        1,
    )
    text = text.rsplit("          compute_interface: eth1\n", 1)
    text = "          compute_interfce: enp3s0\n".join(text)
    path = write(tmp_path, text)
    proc = check(path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        f"Error: inventory {path}: host 'pc2': field 'compute_interface' is missing; "
        "'compute_interfce' looks like a typo of it (try renaming compute_interfce to "
        "compute_interface)\n"
    )


def test_several_errors_are_all_reported_one_line_each(tmp_path):
    text = VALID.replace("compute_ip: 10.9.0.1", "compute_ip: 10.8.0.1").replace(
        "          gpus: 1\n", "          gpus: -1\n"
    )
    text = text.replace(
        "    compute_subnet: 10.9.0.0/24\n",
        "    compute_subnet: 10.9.0.0/24\n    rendezvous_port: 0\n",
    )
    path = write(tmp_path, text)
    proc = check(path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        f"Error: inventory {path}: cluster: field 'rendezvous_port': 0 is not a port number "
        "(1-65535)",
        f"Error: inventory {path}: host 'pc1': field 'compute_ip': 10.8.0.1 is outside "
        "compute_subnet 10.9.0.0/24 (try an address inside the subnet, or correct "
        "compute_subnet)",
        f"Error: inventory {path}: host 'pc1': field 'gpus': -1 is not a whole number >= 0",
        f"Error: inventory {path}: host 'pc2': field 'gpus': -1 is not a whole number >= 0",
    ]


def test_the_raised_error_carries_every_problem(tmp_path):
    text = VALID.replace("          gpus: 1\n", "          gpus: x\n")
    try:
        inventory_read.load(write(tmp_path, text))
    except inventory_checks.InventoryErrors as caught:
        assert [str(error).rsplit(": ", 2)[-2] for error in caught.errors] == ["field 'gpus'"] * 2
    else:
        raise AssertionError("accepted")


def test_an_ini_host_defined_twice_with_different_values_is_refused_naming_both_lines(tmp_path):
    path = write(
        tmp_path,
        "[nodes]\n"
        "pc1 ansible_host=10.9.0.1 compute_ip=10.9.0.1 compute_interface=eth1 gpus=1\n"
        "pc2 ansible_host=10.9.0.2 compute_ip=10.9.0.2 compute_interface=eth1 gpus=1\n"
        "\n[gpu]\npc1 ansible_host=10.9.0.7 gpus=1\npc2\n"
        "\n[all:vars]\ncompute_subnet=10.9.0.0/24\n",
        "cluster.ini",
    )
    proc = check(path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        f"Error: inventory {path}: host 'pc1': field 'ansible_host': defined twice, '10.9.0.1' "
        "on line 2 (group 'nodes') and '10.9.0.7' on line 6 (group 'gpu') (try giving the "
        "host's values once, and its name alone in its other groups)\n"
    )


def test_a_yaml_host_defined_twice_with_different_values_is_refused_naming_both_groups(
    tmp_path,
):
    text = VALID + "    gpu:\n      hosts:\n        pc2:\n          gpus: 4\n"
    path = write(tmp_path, text)
    proc = check(path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        f"Error: inventory {path}: host 'pc2': field 'gpus': defined twice, 1 in group 'nodes' "
        "and 4 in group 'gpu' (try giving the host's values once, and its name alone in its "
        "other groups)\n"
    )


def test_ansibles_own_connection_variables_are_known_fields():
    theirs = {name for names in ansible.constants.MAGIC_VARIABLE_MAPPING.values() for name in names}
    assert theirs <= inventory_checks._known_fields()


# --- issue 52: the static_ip role's fields -------------------------------------------------------


def test_the_netplan_roles_old_switches_are_refused_naming_their_new_names(tmp_path):
    """netplan_enabled: false meant "leave my network alone": ignored, the static_ip role would
    change the address."""
    text = VALID.replace(
        "    compute_subnet:",
        "    netplan_enabled: false\n    netplan_mtu: 9000\n    compute_subnet:",
    )
    proc = check(write(tmp_path, text))
    assert proc.returncode == 2
    assert (
        "cluster field 'netplan_enabled' is now 'static_ip_enabled' (the static_ip role sets the "
        "address with netplan, NetworkManager or ifupdown) (try 'static_ip_enabled' in its place)"
    ) in proc.stderr
    assert "cluster field 'netplan_mtu' is now 'static_ip_mtu'" in proc.stderr


def test_a_gateway_outside_the_compute_subnet_and_bad_resolvers_are_refused(tmp_path):
    text = VALID.replace(
        "    compute_subnet:",
        "    static_ip_gateway: 10.8.0.1\n    static_ip_nameservers: [10.9.0.1, dns.lan]\n"
        "    static_ip_stack: wicked\n    compute_subnet:",
    )
    proc = check(write(tmp_path, text))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert any(
        "cluster field 'static_ip_gateway': 10.8.0.1 is not in compute_subnet 10.9.0.0/24, so the "
        "compute interface could not reach it" in line
        for line in lines
    ), proc.stderr
    assert any(
        "cluster field 'static_ip_nameservers': ['10.9.0.1', 'dns.lan'] is not a list of IPv4 "
        "addresses" in line
        for line in lines
    ), proc.stderr
    assert any(
        "cluster field 'static_ip_stack': 'wicked' is not one of auto, netplan, networkmanager, "
        "ifupdown" in line
        for line in lines
    ), proc.stderr


def test_a_gateway_on_the_compute_subnet_passes(tmp_path):
    text = VALID.replace(
        "    compute_subnet:",
        "    static_ip_gateway: 10.9.0.254\n    static_ip_nameservers: [10.9.0.254]\n"
        "    static_ip_stack: ifupdown\n    compute_subnet:",
    )
    proc = check(write(tmp_path, text))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_a_hosts_own_static_ip_fields_are_checked_too(tmp_path):
    text = VALID.replace(
        "          gpus: 1\n", "          gpus: 1\n          static_ip_gateway: 10.7.0.1\n", 1
    )
    text = text.replace("        pc2:\n", "        pc2:\n          netplan_enabled: false\n")
    proc = check(write(tmp_path, text))
    assert proc.returncode == 2
    assert (
        "host 'pc1': field 'static_ip_gateway': 10.7.0.1 is not in compute_subnet 10.9.0.0/24"
    ) in proc.stderr, proc.stderr
    assert "host 'pc2': field 'netplan_enabled' is now 'static_ip_enabled'" in proc.stderr


def test_a_prefix_length_or_mtu_no_link_takes_is_refused(tmp_path):
    """Not every stack's own check would refuse them: ifupdown takes a /33 as netmask 0.0.0.0,
    and NetworkManager's keyfile reader drops an MTU it cannot read."""
    text = VALID.replace(
        "    compute_subnet:",
        "    static_ip_prefix_length: 33\n    static_ip_mtu: 90000\n    compute_subnet:",
    )
    text = text.replace("        pc2:\n", "        pc2:\n          static_ip_mtu: jumbo\n")
    proc = check(write(tmp_path, text))
    assert proc.returncode == 2
    assert (
        "cluster field 'static_ip_prefix_length': 33 is not a prefix length from 1 to 32 (try "
        "removing it: it follows compute_subnet)"
    ) in proc.stderr, proc.stderr
    assert "cluster field 'static_ip_mtu': 90000 is not an MTU from 576 to 65535" in proc.stderr
    assert "host 'pc2': field 'static_ip_mtu': 'jumbo' is not an MTU from 576 to 65535" in (
        proc.stderr
    ), proc.stderr


def test_a_prefix_length_and_jumbo_frames_pass(tmp_path):
    text = VALID.replace(
        "    compute_subnet:",
        "    static_ip_prefix_length: 24\n    static_ip_mtu: 9000\n    compute_subnet:",
    )
    text = text.replace("        pc2:\n", "        pc2:\n          static_ip_mtu: 0\n")
    proc = check(write(tmp_path, text))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
