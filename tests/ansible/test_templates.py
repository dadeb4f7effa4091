"""What the roles write, checked without a cluster: NCCL's configuration file, the static_ip files,
the /etc/hosts edit, GPU detection and the Docker runtime merge of the nvidia role (no GPU
needed)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml

from tests.ansible.conftest import ANSIBLE_DIR, PLAYBOOKS, ansible_playbook

LOCAL = ["-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]


def run_local(playbook: str, variables: dict):
    run = ansible_playbook(
        "localhost,", *LOCAL, "-e", json.dumps(variables), playbook=PLAYBOOKS / playbook
    )
    assert run.returncode == 0, run.describe()
    return run


# --- nccl.conf -------------------------------------------------------------------------------


def test_nccl_conf_names_the_training_hcas_only_where_the_inventory_does(tmp_path):
    """NAME=VALUE lines only (NCCL documents nothing else in the file)."""
    dest = tmp_path / "nccl.conf"
    run_local("render_nccl_conf.yml", {"compute_interface": "ens1f0", "dest": str(dest)})
    assert dest.read_text() == "NCCL_SOCKET_IFNAME==ens1f0\n"
    variables = {"compute_interface": "ens1f0", "nccl_ib_hca": "=mlx5_0:1,mlx5_1:1"}
    run_local("render_nccl_conf.yml", {**variables, "dest": str(dest)})
    assert dest.read_text() == "NCCL_SOCKET_IFNAME==ens1f0\nNCCL_IB_HCA==mlx5_0:1,mlx5_1:1\n"


# --- static_ip: each stack's file --------------------------------------------------------------


def render(tmp_path, stack: str, **variables) -> str:
    dest = tmp_path / f"compute.{stack}"
    base = {
        "stack": stack,
        "compute_interface": "enp3s0",
        "compute_ip": "192.168.1.10",
        "compute_subnet": "192.168.1.0/24",
        "static_ip_netplan_renderer": "networkd",
        "inventory_hostname": "node1",
        "dest": str(dest),
    }
    run_local("render_static_ip.yml", {**base, **variables})
    return dest.read_text()


HEADER = (
    "# Managed by Ansible (torch-multinode, static_ip role): the compute interface's static "
    "address.\n"
    "# Edits here are overwritten on the next provisioning run.\n"
)
ONLY_ONE_NIC = {
    "compute_subnet": "10.20.0.0/16",
    "compute_ip": "10.20.3.4",
    "static_ip_mtu": 9000,
    "static_ip_gateway": "10.20.0.1",
    "static_ip_nameservers": ["10.20.0.1", "10.20.0.2"],
}


def test_netplan_file_gives_the_compute_interface_its_static_address(tmp_path):
    assert render(tmp_path, "netplan") == HEADER + (
        "network:\n"
        "  version: 2\n"
        "  ethernets:\n"
        "    enp3s0:\n"
        "      renderer: networkd\n"
        "      dhcp4: false\n"
        "      dhcp6: false\n"
        "      addresses:\n"
        "        - 192.168.1.10/24\n"
    )


def test_netplan_file_carries_mtu_gateway_and_resolvers_when_given(tmp_path):
    text = render(tmp_path, "netplan", static_ip_netplan_renderer="NetworkManager", **ONLY_ONE_NIC)
    assert yaml.safe_load(text) == {
        "network": {
            "version": 2,
            "ethernets": {
                "enp3s0": {
                    "renderer": "NetworkManager",
                    "dhcp4": False,
                    "dhcp6": False,
                    "addresses": ["10.20.3.4/16"],
                    "mtu": 9000,
                    "routes": [{"to": "default", "via": "10.20.0.1"}],
                    "nameservers": {"addresses": ["10.20.0.1", "10.20.0.2"]},
                }
            },
        }
    }


def test_networkmanager_profile_binds_the_interface_and_never_takes_the_default_route(tmp_path):
    text = render(tmp_path, "networkmanager")
    assert text.startswith(HEADER)
    lines = text.splitlines()
    assert "id=torch-multinode-compute" in lines and "interface-name=enp3s0" in lines
    assert "autoconnect-priority=100" in lines
    assert "address1=192.168.1.10/24" in lines and "method=manual" in lines
    assert "never-default=true" in lines
    assert not any(line.startswith(("mtu=", "gateway=", "dns=")) for line in lines)
    # The same profile (UUID) on every run: an unchanged file is not rewritten.
    uuid = [line for line in lines if line.startswith("uuid=")]
    assert len(uuid) == 1 and uuid[0] in render(tmp_path, "networkmanager").splitlines()


def test_networkmanager_profile_carries_mtu_gateway_and_resolvers_when_given(tmp_path):
    lines = render(tmp_path, "networkmanager", **ONLY_ONE_NIC).splitlines()
    assert {"mtu=9000", "gateway=10.20.0.1", "dns=10.20.0.1;10.20.0.2;"} <= set(lines)
    assert "never-default=true" not in lines


def test_ifupdown_stanza_gives_the_compute_interface_its_static_address(tmp_path):
    assert render(tmp_path, "ifupdown") == HEADER + (
        "auto enp3s0\niface enp3s0 inet static\n    address 192.168.1.10/24\n"
    )
    assert render(tmp_path, "ifupdown", **ONLY_ONE_NIC) == HEADER + (
        "auto enp3s0\n"
        "iface enp3s0 inet static\n"
        "    address 10.20.3.4/16\n"
        "    mtu 9000\n"
        "    gateway 10.20.0.1\n"
        "    dns-nameservers 10.20.0.1 10.20.0.2\n"
    )


# --- /etc/hosts ------------------------------------------------------------------------------

MARKER = "torch-multinode cluster nodes (managed by Ansible)"
ENTRIES = [["10.9.0.1", "node1"], ["10.9.0.2", "node2"]]
BLOCK = f"# BEGIN {MARKER}\n10.9.0.1\tnode1\n10.9.0.2\tnode2\n# END {MARKER}\n"


@pytest.fixture(scope="module")
def hosts_file():
    path = ANSIBLE_DIR / "roles" / "hostname" / "filter_plugins" / "hosts_file.py"
    spec = importlib.util.spec_from_file_location("hosts_file_plugin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hosts_file


def test_hosts_block_is_appended_and_other_entries_kept(hosts_file):
    current = "127.0.0.1\tlocalhost\n192.0.2.7\tprinter # office\n"
    assert hosts_file(current, ENTRIES, MARKER) == current + BLOCK


def test_a_nodes_own_name_is_taken_off_loopback_and_stale_lines(hosts_file):
    current = (
        "127.0.0.1\tlocalhost node1\n"
        "127.0.1.1\tnode1.lan node1\n"
        "127.0.1.1\tNODE2\n"
        "192.0.2.9\tnode2 # old address\n"
        "# 127.0.1.1 node1 (a comment stays as it is)\n"
    )
    assert hosts_file(current, ENTRIES, MARKER) == (
        "127.0.0.1\tlocalhost\n"
        "127.0.1.1\tnode1.lan\n"
        "# 127.0.1.1 node1 (a comment stays as it is)\n" + BLOCK
    )


def test_hosts_block_is_replaced_in_place_and_the_edit_is_a_fixed_point(hosts_file):
    current = (
        "127.0.0.1\tlocalhost\n"
        f"# BEGIN {MARKER}\n10.9.0.99\tnode1\n10.9.0.98\tnode9\n# END {MARKER}\n"
        "192.0.2.7\tprinter\n"
    )
    once = hosts_file(current, ENTRIES, MARKER)
    assert once == "127.0.0.1\tlocalhost\n" + BLOCK + "192.0.2.7\tprinter\n"
    assert hosts_file(once, ENTRIES, MARKER) == once


def test_an_unterminated_block_is_an_error_not_a_truncated_file(hosts_file):
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="has no '# END"):
        hosts_file(f"127.0.0.1 localhost\n# BEGIN {MARKER}\n10.9.0.1 node1\n", ENTRIES, MARKER)


# --- nvidia ----------------------------------------------------------------------------------


def fake_pci(root, devices: dict[str, tuple[str, str]]):
    root.mkdir()
    for address, (vendor, device_class) in devices.items():
        (root / address).mkdir(parents=True)
        (root / address / "vendor").write_text(vendor + "\n")
        (root / address / "class").write_text(device_class + "\n")
    return root


@pytest.mark.parametrize(
    "devices, expected",
    [
        ({}, []),
        (
            {
                "0000:01:00.0": ("0x10de", "0x030000"),  # NVIDIA VGA controller
                "0000:01:00.1": ("0x10de", "0x040300"),  # its HDMI audio function
                "0000:03:00.0": ("0x8086", "0x030000"),  # Intel integrated graphics
                "0000:41:00.0": ("0x10de", "0x030200"),  # NVIDIA 3D controller (A100)
            },
            ["0000:01:00.0", "0000:41:00.0"],
        ),
    ],
    ids=["no-gpu", "two-gpus-among-other-devices"],
)
def test_gpus_are_found_by_pci_vendor_and_class(tmp_path, devices, expected):
    pci = fake_pci(tmp_path / "pci", devices)
    result = tmp_path / "found.json"
    run_local("nvidia_local.yml", {"nvidia_pci_devices_dir": str(pci), "result_file": str(result)})
    assert json.loads(result.read_text()) == expected


def test_nvidia_runtime_is_merged_into_daemon_json_once(tmp_path):
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text(
        json.dumps({"log-driver": "local", "runtimes": {"crun": {"path": "/usr/bin/crun"}}})
    )
    variables = {
        "nvidia_pci_devices_dir": str(tmp_path),
        "result_file": str(tmp_path / "r"),
        "merge_runtime": True,
        "nvidia_docker_daemon_config": str(daemon_json),
    }
    first = run_local("nvidia_local.yml", variables)
    assert json.loads(daemon_json.read_text()) == {
        "log-driver": "local",
        "runtimes": {
            "crun": {"path": "/usr/bin/crun"},
            "nvidia": {"path": "nvidia-container-runtime", "args": []},
        },
    }
    assert (tmp_path / "daemon.json.restarted").exists(), first.describe()
    (tmp_path / "daemon.json.restarted").unlink()
    again = run_local("nvidia_local.yml", {**variables, "nvidia_docker_default_runtime": False})
    assert not (tmp_path / "daemon.json.restarted").exists(), again.describe()
    assert again.changed() == {"localhost": 0}, again.describe()
    default = run_local("nvidia_local.yml", {**variables, "nvidia_docker_default_runtime": True})
    assert json.loads(daemon_json.read_text())["default-runtime"] == "nvidia", default.describe()


@pytest.mark.parametrize(
    "installed, install",
    [
        ("", True),
        ("1.17.0-1", True),
        ("1.17.8-1", False),
        ("1.18.0-1", False),
        ("1.17.10-1", False),
    ],
    ids=["absent", "older", "the-pin", "newer", "newer-patch"],
)
def test_the_toolkit_pin_is_a_floor_so_a_newer_toolkit_is_never_downgraded(
    tmp_path, installed, install
):
    # apt refuses to downgrade without --allow-downgrades: a node with a newer toolkit made the
    # whole provisioning run fail, and forcing it would undo NVIDIA's security fixes.
    result = tmp_path / "decision.json"
    run_local(
        "nvidia_toolkit.yml", {"nvidia_toolkit_installed": installed, "result_file": str(result)}
    )
    assert json.loads(result.read_text()) is install
    setup = yaml.safe_load((ANSIBLE_DIR / "roles" / "nvidia" / "tasks" / "setup.yml").read_text())
    (apt,) = [t for t in setup if "apt" in str(t) and "container_toolkit_packages" in str(t)]
    assert apt["when"] == "nvidia_toolkit_install | bool"


def test_the_default_driver_branch_runs_the_cuda_of_the_pinned_torch():
    # torch 2.14.1's wheels are CUDA 13 builds: NVIDIA's compatibility table asks for 580+.
    import torch

    from torch_multinode.cluster.versions import driver_needed

    defaults = yaml.safe_load(
        (ANSIBLE_DIR / "roles" / "nvidia" / "defaults" / "main.yml").read_text()
    )
    needed = driver_needed(torch.version.cuda)
    assert needed == 580
    assert int(defaults["nvidia_driver_branch"]) >= needed
