"""Issue 50, "Inventories as Ansible reads them": an inventory kept for another tool, here laid
out as DeepOps' example is (INI with dashed groups such as slurm-node, [all:vars], group_vars/
full of DeepOps' own settings), works as it is once the compute fields are given or set to
auto: group names Ansible accepts are accepted (its own warning passed on, one line), other
tools' settings are never taken for typos of ours, and a host without compute_ip takes its
ansible_host where that is in compute_subnet. Through the real CLI (make check-inventory
GROUP=slurm-node runs `cluster check -i ... --group slurm-node`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli
from torch_multinode.cluster import inventory_checks, inventory_read
from torch_multinode.cluster.errors import UserError

# DeepOps' example inventory (config.example/inventory), its hosts filled in.
DEEPOPS_INVENTORY = """\
######
# ALL NODES
######
[all]
mgmt01     ansible_host=10.0.0.1
login01    ansible_host=10.0.1.1
gpu01      ansible_host=10.0.2.1{gpu01}
gpu02      ansible_host=10.0.2.2{gpu02}

######
# KUBERNETES
######
[kube-master]
mgmt01

[etcd]
mgmt01

[kube_node]
gpu01
gpu02

[k8s-cluster:children]
kube-master
kube_node

######
# SLURM
######
[slurm-master]
login01

[slurm-node]
gpu01
gpu02

[slurm-cluster:children]
slurm-master
slurm-node

[nfs-server]
login01

[nfs-clients:children]
slurm-node

######
# SSH connection configuration
######
[all:vars]
ansible_user=ubuntu
compute_subnet=10.0.2.0/24
"""

# Settings of DeepOps' own, as its group_vars carry them: none of them is ours, several share
# our prefixes (nvidia_driver_, slurm_, docker_, image_) or are close to our names.
DEEPOPS_GROUP_VARS = {
    "all.yml": """\
        chrony_install: yes
        chrony_timezone: "Etc/UTC"
        deepops_set_hostname: true
        docker_install: yes
        docker_version: '19.03'
        docker_storage_options: -s overlay2
        docker_iptables_enabled: true
        nvidia_driver_force_install: false
        nvidia_driver_skip_reboot: false
        nvidia_driver_ubuntu_branch: "535"
        cuda_version: cuda-toolkit-11-0
        gpu_clock_reset: no
        gpu_clock_lock: "1507,1507"
        enroot_runtime_path: '/run/enroot/user-$(id -u)'
        enroot_config: |
          ENROOT_RUNTIME_PATH {{ enroot_runtime_path }}
        install_dcgm: false
        deepops_dir: /opt/deepops
        deepops_venv: '{{ deepops_dir }}/venv'
        openmpi_version: 4.0.3
        standalone_container_registry_cache_enable: true
        standalone_container_registry_port: "5000"
        maas_dns_domain: 'deepops.local'
        users:
          - username: nvidia
            groups: ['sudo']
        """,
    "slurm-cluster.yml": """\
        slurm_version: 20.11.3
        slurm_install_prefix: /usr/local
        slurm_manage_gpus: true
        slurm_password: ReplaceWithASecurePasswordInTheVault
        slurm_enable_ha: false
        slurm_configure_etc_hosts: yes
        slurm_cluster_install_nvidia_driver: yes
        slurm_enable_nfs_server: true
        slurm_install_enroot: true
        slurm_install_pyxis: true
        slurm_enable_container_registry: true
        slurm_enable_monitoring: true
        hosts_add_ansible_managed_hosts_groups: ["slurm-cluster"]
        nfs_mounts:
          - mountpoint: /home
            server: '{{ groups["slurm-master"][0] }}'
        docker_insecure_registries: "{{ groups['slurm-master'] | list }}"
        """,
    "k8s-cluster.yml": """\
        ansible_become: true
        kubeadm_enabled: true
        kube_api_anonymous_auth: true
        container_manager: containerd
        deepops_gpu_operator_enabled: false
        k8s_gpu_mig_strategy: "mixed"
        k8s_nfs_server: '{{ groups["kube-master"][0] }}'
        kube_enable_container_registry: true
        """,
}

ANSIBLE_WARNING = (
    "Warning: inventory {path}: Ansible: Invalid characters were found in group names but not "
    "replaced, use -vvvv to see details (groups k8s-cluster, kube-master, nfs-clients, "
    "nfs-server, slurm-cluster, slurm-master, slurm-node)"
)


def deepops(tmp_path: Path, gpu01: str = "", gpu02: str = "", **group_vars: str) -> Path:
    """DeepOps' layout under tmp_path: its inventory, and its group_vars/ with `group_vars`
    (file name -> text) added to or replacing its own."""
    (tmp_path / "group_vars").mkdir()
    for name, text in {**DEEPOPS_GROUP_VARS, **group_vars}.items():
        (tmp_path / "group_vars" / name).write_text(textwrap.dedent(text))
    path = tmp_path / "inventory"
    path.write_text(DEEPOPS_INVENTORY.format(gpu01=gpu01, gpu02=gpu02))
    return path


def check(path: Path, group: str = "slurm-node"):
    return run_cli("cluster", "check", "-i", str(path), "--group", group)


def test_deepops_inventory_with_the_compute_fields_given_passes_with_ansibles_warning(tmp_path):
    path = deepops(
        tmp_path,
        gpu01=" compute_ip=10.0.2.1 compute_interface=ens5 gpus=8",
        gpu02=" compute_ip=10.0.2.2 compute_interface=ens5 gpus=8",
    )
    done = check(path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [ANSIBLE_WARNING.format(path=path)]  # no "did you mean"
    assert done.stdout.splitlines() == [
        f"inventory {path}: valid, 2 host(s), compute subnet 10.0.2.0/24, rendezvous port 29500",
        "  node_rank 0  gpu01            ssh 10.0.2.1         compute 10.0.2.1 (ens5)  gpus 8  "
        "master",
        "  node_rank 1  gpu02            ssh 10.0.2.2         compute 10.0.2.2 (ens5)  gpus 8  "
        "worker",
    ]


def test_deepops_inventory_with_auto_and_no_compute_ip_passes_found_at_provision(tmp_path):
    """The compute fields set once for the group, to auto; compute_ip left out: each host's
    ansible_host, in compute_subnet. GROUP=kube_node (no dash) reads the same hosts."""
    path = deepops(tmp_path, **{"slurm-node.yml": "compute_interface: auto\ngpus: auto\n"})
    done = check(path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [ANSIBLE_WARNING.format(path=path)]
    assert done.stdout.splitlines()[1:] == [
        "  node_rank 0  gpu01            ssh 10.0.2.1         compute 10.0.2.1 (auto, found at "
        "provision)  gpus auto (found at provision)  master",
        "  node_rank 1  gpu02            ssh 10.0.2.2         compute 10.0.2.2 (auto, found at "
        "provision)  gpus auto (found at provision)  worker",
        "compute_ip of gpu01, gpu02: the host's ansible_host (no compute_ip given, and that "
        "address is in compute_subnet 10.0.2.0/24)",
        "compute_interface of gpu01, gpu02: auto, the interface that holds compute_ip, found at "
        "provision on the node (and by netcheck and each job)",
        "gpus of gpu01, gpu02: auto, nvidia-smi's count, found at provision on the node (and by "
        "netcheck and each job)",
    ]
    loaded = inventory_read.load(path, "slurm-node")
    assert [(h.compute_ip_default, h.auto) for h in loaded.hosts] == [
        (True, {"compute_interface", "gpus"})
    ] * 2
    assert loaded.group == "slurm-node" and loaded.unresolved == loaded.hosts
    # kube_node (no dash) picks the same hosts, with the same variables (a host's, whichever
    # group picks it): the same nodes, the same warning (the file's other groups).
    kube = check(path, "kube_node")
    assert kube.returncode == 0, kube.stderr
    assert kube.stdout.splitlines()[1:] == done.stdout.splitlines()[1:]
    assert kube.stderr == done.stderr


def test_deepops_inventory_without_the_compute_fields_names_them_and_nothing_else(tmp_path):
    path = deepops(tmp_path)
    done = check(path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        ANSIBLE_WARNING.format(path=path),
        f"Error: inventory {path}: host 'gpu01': field 'compute_interface' is missing",
        f"Error: inventory {path}: host 'gpu01': field 'gpus' is missing",
        f"Error: inventory {path}: host 'gpu02': field 'compute_interface' is missing",
        f"Error: inventory {path}: host 'gpu02': field 'gpus' is missing",
    ]


def test_a_plain_yaml_inventory_with_a_dashed_group_reads_as_ansible_reads_it(tmp_path):
    path = tmp_path / "cluster.yml"
    path.write_text(
        textwrap.dedent(
            """\
            all:
              vars:
                compute_subnet: 10.9.0.0/24
              children:
                gpu-nodes:
                  hosts:
                    pc1: {ansible_host: 10.9.0.1, compute_interface: auto, gpus: 2}
                    pc2: {ansible_host: 10.9.0.2, compute_interface: eth1, gpus: auto}
            """
        )
    )
    done = check(path, "gpu-nodes")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"Warning: inventory {path}: Ansible: Invalid characters were found in group names but "
        "not replaced, use -vvvv to see details (groups gpu-nodes)"
    ]
    loaded = inventory_read.load(path, "gpu-nodes")
    assert [(h.compute_interface, h.gpus) for h in loaded.hosts] == [(None, 2), ("eth1", None)]


@pytest.mark.parametrize(
    "group", ["slurm-node", "kube_node", "gpu.nodes", "1st_rack", "nodes", "all", "a-b_c.d"]
)
def test_group_names_ansible_reads_are_accepted(group):
    assert inventory_checks.check_group(group) == group


@pytest.mark.parametrize(
    "group", ["gpu nodes", "a,b", "a:b", "!nodes", "nodes&gpu", "gpu*", "-nodes", ".x", "", "n[0]"]
)
def test_what_a_host_pattern_or_the_command_line_would_take_apart_is_refused(group):
    with pytest.raises(UserError) as raised:
        inventory_checks.check_group(group)
    assert raised.value.line().endswith(
        "is not an Ansible group name (try letters, digits, '_' and '-', such as "
        "GROUP=gpu_nodes or GROUP=slurm-node)"
    )


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        # near-misses of our own names: a slip of the finger or two
        ("compute_interfce", "compute_interface"),
        ("lanch_mode", "launch_mode"),
        ("gpu", "gpus"),
        ("trainig_image", "training_image"),
        ("nvidai_driver_install", "nvidia_driver_install"),
        ("launchmode", "launch_mode"),
        # other tools' settings: a word more or less than ours, or another tool's prefix
        ("nvidia_driver_force_install", None),
        ("nvidia_driver_skip_reboot", None),
        ("docker_install", None),
        ("slurm_enable_ha", None),
        ("slurm_install_prefix", None),
        ("kube_gpus", None),
        ("deepops_gpus", None),
        ("x_gpus", None),
        ("image_registry_cache", None),
        ("cpus", None),
        ("gpu_count", None),
    ],
)
def test_only_near_misses_of_our_own_names_are_taken_for_typos(name, ours):
    assert inventory_checks._close_field(name) == ours


def test_every_deepops_setting_here_is_silent():
    import yaml

    for text in DEEPOPS_GROUP_VARS.values():
        for name in yaml.safe_load(textwrap.dedent(text)):
            assert inventory_checks._close_field(name) is None, name


def test_a_missing_compute_ip_takes_ansible_host_only_inside_the_subnet(tmp_path):
    path = tmp_path / "cluster.ini"
    path.write_text(
        textwrap.dedent(
            """\
            [nodes]
            pc1 ansible_host=10.9.0.1 compute_interface=eth1 gpus=1
            pc2 ansible_host=192.168.7.2 compute_interface=eth1 gpus=1
            pc3 ansible_host=pc3.lab compute_interface=eth1 gpus=1
            pc4 ansible_host=10.9.0.1 ansible_port=2204 compute_interface=eth1 gpus=1
            pc5 ansible_host=10.9.0.5 compute_ipp=10.9.0.55 compute_interface=eth1 gpus=1

            [all:vars]
            compute_subnet=10.9.0.0/24
            """
        )
    )
    done = run_cli("cluster", "check", "-i", str(path))
    assert (done.returncode, done.stdout) == (2, "")
    where = f"Error: inventory {path}"
    assert done.stderr.splitlines() == [
        f"{where}: host 'pc2': field 'compute_ip' is missing, and its ansible_host 192.168.7.2 "
        "is outside compute_subnet 10.9.0.0/24 (try compute_ip: its address in compute_subnet)",
        f"{where}: host 'pc3': field 'compute_ip' is missing, and its ansible_host 'pc3.lab' is "
        "not an IPv4 address in compute_subnet (try compute_ip: its address in compute_subnet)",
        f"{where}: host 'pc4': field 'compute_ip': 10.9.0.1, its ansible_host, is already used "
        "by host 'pc1' (try pc4's own address on the compute network)",
        # a typo of compute_ip is said, never silently replaced by ansible_host
        f"{where}: host 'pc5': field 'compute_ip' is missing; 'compute_ipp' looks like a typo "
        "of it (try renaming compute_ipp to compute_ip)",
    ]


def test_gpus_auto_under_slurm_is_refused_rather_than_configured_as_none(tmp_path):
    """Slurm's configuration is written from each node's count, which the playbook does not
    find on the node: `gpus: auto` there would give Slurm no GPU."""
    path = deepops(
        tmp_path,
        **{"slurm-node.yml": "compute_interface: auto\ngpus: auto\nscheduler: slurm\n"},
    )
    done = check(path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[1:] == [
        f"Error: inventory {path}: host '{name}': field 'gpus': auto is not read under "
        "scheduler: slurm, whose configuration needs each node's count (try gpus: N, the "
        "count nvidia-smi -L lists on the node)"
        for name in ("gpu01", "gpu02")
    ]
