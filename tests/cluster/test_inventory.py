"""Every inventory rejection, through the real CLI: the exact error line and the exit code."""

from __future__ import annotations

import ipaddress
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, run_cli
from torch_multinode.cluster import inventory, inventory_checks, inventory_read, inventory_validate
from torch_multinode.cluster.errors import UserError

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
    loaded = inventory_read.load(write(tmp_path, VALID))
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
    loaded = inventory_read.load(write(tmp_path, text))
    assert [h.gpus for h in loaded.hosts] == [2, 4]


def with_cluster_vars(*lines: str) -> str:
    """VALID with these lines added to all.vars."""
    added = "".join(f"    {line}\n" for line in lines)
    return VALID.replace("    rendezvous_port: 29511\n", f"    rendezvous_port: 29511\n{added}")


def test_storage_roots_default_to_var_lib_and_no_mounts(tmp_path):
    loaded = inventory_read.load(write(tmp_path, VALID))
    assert loaded.checkpoint_root == inventory.DEFAULT_CHECKPOINT_ROOT
    assert loaded.checkpoint_root == "/var/lib/torch-multinode/checkpoints"
    assert loaded.data_root == inventory.DEFAULT_DATA_ROOT == "/var/lib/torch-multinode/data"
    assert loaded.workdir_root == inventory.DEFAULT_WORKDIR_ROOT == "/var/lib/torch-multinode/work"
    assert loaded.container_mounts == ()


def test_storage_fields_are_read_and_nodes_vars_win_over_all_vars(tmp_path):
    text = with_cluster_vars(
        "checkpoint_root: /srv/ckpt",
        "data_root: /srv/data",
        "workdir_root: /srv/work",
        "container_mounts: [/mnt/datasets:ro, /scratch]",
    ).replace("    nodes:\n", "    nodes:\n      vars:\n        data_root: /data\n")
    loaded = inventory_read.load(write(tmp_path, text))
    assert (loaded.checkpoint_root, loaded.data_root, loaded.workdir_root) == (
        "/srv/ckpt",
        "/data",
        "/srv/work",
    )
    assert loaded.container_mounts == (
        inventory.Mount("/mnt/datasets", read_only=True),
        inventory.Mount("/scratch", read_only=False),
    )


def test_container_mounts_left_empty_means_none(tmp_path):
    loaded = inventory_read.load(write(tmp_path, with_cluster_vars("container_mounts:")))
    assert loaded.container_mounts == ()
    loaded = inventory_read.load(write(tmp_path, with_cluster_vars("container_mounts: []")))
    assert loaded.container_mounts == ()


def test_job_storage_role_defaults_to_the_inventory_defaults():
    """The role falls back to the same directories the launcher does when the inventory leaves
    a field out."""
    defaults = yaml.safe_load(
        (REPO_ROOT / "ansible/roles/job_storage/defaults/main.yml").read_text()
    )
    found = {}
    for field in inventory_checks.STORAGE_ROOTS:
        template = defaults[f"job_storage_{field}"]
        match = re.fullmatch(r"\{\{ (\w+) \| default\('([^']*)'\) \}\}", template)
        assert match, template
        found[match.group(1)] = match.group(2)
    assert found == {
        "checkpoint_root": inventory.DEFAULT_CHECKPOINT_ROOT,
        "data_root": inventory.DEFAULT_DATA_ROOT,
        "workdir_root": inventory.DEFAULT_WORKDIR_ROOT,
    }


def test_example_inventory_documents_the_storage_defaults():
    text = (REPO_ROOT / "inventory.example.yml").read_text()
    documented = dict(re.findall(r"^ +# (\w+_root|container_mounts): (\S+)$", text, re.M))
    assert documented == {**inventory_checks.STORAGE_ROOTS, "container_mounts": "[]"}


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
        "host 'beta': field 'compute_ip': 10.9.0.1 is already used by host 'alpha' (try beta's "
        "own address on the compute network)",
    ),
    (
        "duplicate SSH address",
        VALID.replace("ansible_host: 10.9.0.2", "ansible_host: 10.9.0.1"),
        "host 'beta': field 'ansible_host': 10.9.0.1:22 is already used by host 'alpha' (try "
        "beta's own address, or its own ansible_port where nodes share one address)",
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
        # Where ansible_host is in compute_subnet, it stands for a missing compute_ip
        # (tests/cluster/test_inventory_from_other_tools.py); here it is not.
        "missing compute_ip",
        VALID.replace("          compute_ip: 10.9.0.2\n", "").replace(
            "ansible_host: 10.9.0.2", "ansible_host: 192.168.0.2"
        ),
        "host 'beta': field 'compute_ip' is missing, and its ansible_host 192.168.0.2 is outside "
        "compute_subnet 10.9.0.0/24 (try compute_ip: its address in compute_subnet)",
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
    (
        "relative checkpoint_root",
        with_cluster_vars("checkpoint_root: ckpt"),
        "cluster field 'checkpoint_root': 'ckpt' is not an absolute path (try a path from /, "
        "such as /var/lib/torch-multinode/checkpoints)",
    ),
    (
        "data_root not normalised",
        with_cluster_vars("data_root: /data/./sets/"),
        "cluster field 'data_root': '/data/./sets/' is not a normalised path (try /data/sets)",
    ),
    (
        "workdir_root with a leading double slash",
        with_cluster_vars("workdir_root: //work"),
        "cluster field 'workdir_root': '//work' is not a normalised path (try /work)",
    ),
    (
        "data_root the root directory",
        with_cluster_vars("data_root: /"),
        "cluster field 'data_root': '/' is the root directory (try a directory of its own, such "
        "as /var/lib/torch-multinode/data)",
    ),
    (
        "checkpoint_root with a space",
        with_cluster_vars('checkpoint_root: "/my checkpoints"'),
        "cluster field 'checkpoint_root': '/my checkpoints' holds whitespace or a control "
        "character",
    ),
    (
        "workdir_root with a colon",
        with_cluster_vars("workdir_root: /work:rw"),
        "cluster field 'workdir_root': '/work:rw' holds ':' or ',', which docker run -v cannot "
        "mount (try a directory whose path has neither)",
    ),
    (
        "data_root with a comma",
        with_cluster_vars("data_root: /data,x"),
        "cluster field 'data_root': '/data,x' holds ':' or ',', which docker run -v cannot "
        "mount (try a directory whose path has neither)",
    ),
    (
        "checkpoint_root left empty",
        with_cluster_vars("checkpoint_root:"),
        "cluster field 'checkpoint_root': None is not a directory path (try an absolute path "
        "such as /var/lib/torch-multinode/checkpoints)",
    ),
    (
        "data_root the same as checkpoint_root",
        with_cluster_vars("checkpoint_root: /srv/jobs", "data_root: /srv/jobs"),
        "cluster field 'data_root': '/srv/jobs' is also checkpoint_root (try a directory of its "
        "own)",
    ),
    (
        "container_mounts not a list",
        with_cluster_vars("container_mounts: /datasets"),
        "cluster field 'container_mounts': '/datasets' is not a list (try a list such as "
        '["/datasets:ro"])',
    ),
    (
        "mount with a suffix other than :ro",
        with_cluster_vars("container_mounts: [/datasets:rw]"),
        "cluster field 'container_mounts': '/datasets:rw' is neither PATH nor PATH:ro (try "
        "PATH:ro for read-only, PATH alone for read-write)",
    ),
    (
        "mount with :ro twice",
        with_cluster_vars("container_mounts: [/datasets:ro:ro]"),
        "cluster field 'container_mounts': '/datasets:ro:ro' is neither PATH nor PATH:ro (try "
        "PATH:ro for read-only, PATH alone for read-write)",
    ),
    (
        "relative mount",
        with_cluster_vars("container_mounts: [datasets:ro]"),
        "cluster field 'container_mounts': 'datasets:ro' is not an absolute path (try a path "
        "from /, such as /datasets:ro)",
    ),
    (
        "mount not normalised",
        with_cluster_vars("container_mounts: [/datasets/:ro]"),
        "cluster field 'container_mounts': '/datasets/:ro' is not a normalised path (try "
        "/datasets:ro)",
    ),
    (
        "mount of the root directory",
        with_cluster_vars('container_mounts: ["/:ro"]'),
        "cluster field 'container_mounts': '/:ro' is the root directory (try a directory of its "
        "own, such as /datasets:ro)",
    ),
    (
        "mount with a comma",
        with_cluster_vars('container_mounts: ["/a,b:ro"]'),
        "cluster field 'container_mounts': '/a,b:ro' holds ':' or ',', which docker run -v "
        "cannot mount (try a directory whose path has neither)",
    ),
    (
        "mount with a space",
        with_cluster_vars('container_mounts: ["/my data:ro"]'),
        "cluster field 'container_mounts': '/my data:ro' holds whitespace or a control character",
    ),
    (
        "mount that is not a string",
        with_cluster_vars("container_mounts: [3]"),
        "cluster field 'container_mounts': 3 is not a directory path (try an absolute path such "
        "as /datasets:ro)",
    ),
    (
        "the same path mounted twice",
        with_cluster_vars("container_mounts: [/datasets:ro, /scratch, /datasets]"),
        "cluster field 'container_mounts': '/datasets' mounts /datasets a second time",
    ),
    (
        "mount of a storage root",
        with_cluster_vars("container_mounts: [/var/lib/torch-multinode/data:ro]"),
        "cluster field 'container_mounts': '/var/lib/torch-multinode/data:ro' is the cluster's "
        "data_root (try removing it from container_mounts)",
    ),
    (
        "a storage root set for one host",
        VALID.replace("          gpus: 0\n", "          gpus: 0\n          checkpoint_root: /x\n"),
        "host 'beta': field 'checkpoint_root' is cluster-wide: the same on every node (try "
        "setting it once, in all.vars)",
    ),
    (
        "container_mounts set for one host",
        VALID.replace("          gpus: 2\n", "          gpus: 2\n          container_mounts: []\n"),
        "host 'alpha': field 'container_mounts' is cluster-wide: the same on every node (try "
        "setting it once, in all.vars)",
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
        (
            "3",
            "NNODES=3 but inventory {path} lists 2 host(s) (try NNODES=2 or add hosts to the "
            "inventory)",
        ),
        ("0", "NNODES=0 is below 1 (try NNODES=1 or more)"),
        ("-1", "NNODES=-1 is below 1 (try NNODES=1 or more)"),
        ("two", "NNODES='two' is not a whole number"),
    ],
)
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
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert f"Error: inventory {path}: host 'beta': field 'compute_ip'" in proc.stderr
    assert "ansible-playbook" not in proc.stdout.split("cluster check")[-1]


def test_example_inventory_is_valid_documentation():
    loaded = inventory_read.load(REPO_ROOT / "inventory.example.yml")
    assert [h.name for h in loaded.hosts] == ["pc1", "pc2"]


def test_first_narrows_the_inventory_once_in_rank_order(tmp_path):
    loaded = inventory_read.load(write(tmp_path, VALID))
    narrowed = loaded.first(1)
    assert [h.name for h in narrowed.hosts] == ["alpha"] and narrowed.master.name == "alpha"
    # Everything else is the same inventory; no count means every node.
    assert narrowed.path == loaded.path and narrowed.rendezvous_port == loaded.rendezvous_port
    assert loaded.first(None) is loaded and loaded.first("") is loaded
    assert [h.name for h in loaded.first("2").hosts] == ["alpha", "beta"]
    with pytest.raises(UserError, match=r"NNODES=5 but inventory"):
        loaded.first(5)


def test_make_uses_every_node_unless_nnodes_is_given(tmp_path):
    """`make check-inventory`, `make netcheck` and `make train` share NNODES: empty means every
    node of the inventory (it once defaulted to 2, silently); more than it has is one line."""
    from tests.conftest import make

    path = write(tmp_path, VALID)
    every = make("check-inventory", f"INVENTORY={path}", timeout=120)
    assert every.returncode == 0, every.stderr
    assert [line.split()[2] for line in every.stdout.splitlines() if "node_rank" in line] == [
        "alpha",
        "beta",
    ]
    first = make("check-inventory", f"INVENTORY={path}", "NNODES=1", timeout=120)
    assert [line.split()[2] for line in first.stdout.splitlines() if "node_rank" in line] == [
        "alpha"
    ]
    over = make("check-inventory", f"INVENTORY={path}", "NNODES=3", timeout=120)
    assert over.returncode != 0
    assert f"Error: NNODES=3 but inventory {path} lists 2 host(s)" in over.stderr
    # What netcheck and train are handed (make -n prints the commands without running them).
    for target in ("netcheck", "train"):
        planned = make("-n", target, f"INVENTORY={path}", timeout=60).stdout
        assert f'-i "{path}"' in planned and "--nnodes" not in planned, planned
        planned = make("-n", target, f"INVENTORY={path}", "NNODES=1", timeout=60).stdout
        assert "--nnodes 1" in planned, planned


def test_hostfile_lists_the_nodes_with_one_slot_per_usable_gpu(tmp_path):
    path = write(tmp_path, VALID)
    done = run_cli("cluster", "hostfile", "-i", str(path))
    assert (done.returncode, done.stdout, done.stderr) == (0, "alpha slots=2\nbeta slots=1\n", "")
    assert run_cli("cluster", "hostfile", "-i", str(path), "-n", "1").stdout == "alpha slots=2\n"
    selected = write(
        tmp_path, VALID.replace("gpus: 2", "gpus: 2\n          cuda_visible_devices: '1'")
    )
    assert (
        run_cli("cluster", "hostfile", "-i", str(selected)).stdout
        == "alpha slots=1\nbeta slots=1\n"
    )
    over = run_cli("cluster", "hostfile", "-i", str(path), "-n", "3")
    assert over.returncode == 2 and over.stdout == ""
    assert over.stderr.startswith("Error: NNODES=3 but inventory")


# --- read the way Ansible reads it ------------------------------------------------------------


def _ini_cluster(tmp_path: Path) -> Path:
    """An INI inventory with a host range, a nested group, and its values in group_vars/ and
    host_vars/ beside it."""
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text(
        "compute_subnet: 10.9.0.0/24\nlaunch_mode: host\n"
    )
    (tmp_path / "group_vars" / "gpu.yml").write_text("gpus: 2\n")
    for number in (1, 2, 3):
        (tmp_path / "host_vars" / f"node{number}.yml").write_text(
            f"ansible_host: 10.9.0.{number}\ncompute_ip: 10.9.0.{number}\n"
        )
    path = tmp_path / "cluster.ini"
    path.write_text(
        "[gpu]\nnode[1:2]\n\n[cpu]\nnode3 gpus=0\n\n[nodes:children]\ngpu\ncpu\n\n"
        "[nodes:vars]\ncompute_interface=eth1\nrendezvous_port=29611\n"
    )
    return path


def test_an_ini_inventory_with_group_and_host_vars_ranges_and_nested_groups(tmp_path):
    loaded = inventory_read.load(_ini_cluster(tmp_path))
    assert [(h.name, h.ssh_address, str(h.compute_ip), h.gpus) for h in loaded.hosts] == [
        ("node1", "10.9.0.1", "10.9.0.1", 2),
        ("node2", "10.9.0.2", "10.9.0.2", 2),
        ("node3", "10.9.0.3", "10.9.0.3", 0),
    ]
    assert (loaded.rendezvous_port, loaded.launch_mode) == (29611, "host")
    assert loaded.compute_subnet == ipaddress.IPv4Network("10.9.0.0/24")


def test_an_inventory_directory_reads_as_ansible_reads_it(tmp_path):
    """INVENTORY=dir/, as ansible-playbook -i dir/ takes it: the files in it and its
    group_vars/ and host_vars/; netcheck's environment file goes inside it."""
    from torch_multinode.netcheck import envfile

    in_file = inventory_read.load(_ini_cluster(tmp_path))
    in_directory = inventory_read.load(tmp_path)
    assert in_directory.hosts == in_file.hosts and in_directory.path == tmp_path
    assert in_directory.rendezvous_port == in_file.rendezvous_port == 29611
    assert envfile.default_path(tmp_path) == tmp_path.resolve() / envfile.FILENAME
    assert envfile.default_path(tmp_path / "cluster.ini") == tmp_path.resolve() / envfile.FILENAME


def test_a_value_only_in_group_vars_beside_a_yaml_inventory_is_seen(tmp_path):
    """group_vars/all.yml beside the plain YAML layout: ansible-playbook sees it, and so does
    every tool of the project (before, the YAML file alone was read)."""
    path = write(tmp_path, VALID.replace("    rendezvous_port: 29511\n", ""))
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text(
        "rendezvous_port: 29777\ntraining_image: mine:1\n"
    )
    loaded = inventory_read.load(path)
    assert (loaded.rendezvous_port, loaded.training_image) == (29777, "mine:1")
    assert [h.name for h in loaded.hosts] == ["alpha", "beta"]


@pytest.mark.parametrize("example", ["inventory.example.yml", "VALID"])
def test_the_plain_layout_reads_the_same_through_ansible(tmp_path, example):
    path = REPO_ROOT / example if example != "VALID" else write(tmp_path, VALID)
    direct = inventory_read.load(path)
    through_ansible = inventory_validate._validate(inventory_read.resolve_with_ansible(path), path)
    assert through_ansible == direct


def test_a_cluster_field_two_hosts_disagree_on_is_named(tmp_path):
    path = _ini_cluster(tmp_path)
    (tmp_path / "host_vars" / "node3.yml").write_text(
        "ansible_host: 10.9.0.3\ncompute_ip: 10.9.0.3\ndata_root: /elsewhere\n"
    )
    with pytest.raises(UserError) as raised:
        inventory_read.load(path)
    assert raised.value.line() == (
        f"Error: inventory {path}: host 'node3': field 'data_root' is cluster-wide: the same on "
        "every node ('/elsewhere' here, unset on 'node1') (try setting it once, for all "
        "(group_vars/all.yml or all.vars))"
    )


def test_an_inventory_ansible_cannot_parse_is_one_line(tmp_path):
    path = tmp_path / "cluster.ini"
    path.write_text("[nodes\nnode1 x=\n")
    done = run_cli("cluster", "check", "-i", str(path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"Error: inventory {path}: Ansible cannot read it as YAML or INI: not enough values to "
        "unpack (expected 3, got 2) (try the layout of inventory.example.yml, or an INI "
        "inventory with a [nodes] group)"
    ]
    other = tmp_path / "other.ini"
    other.write_text("[gpus]\nnode1\n")
    done = run_cli("cluster", "check", "-i", str(other))
    assert done.stderr.splitlines() == [
        f"Error: inventory {other}: no hosts in group 'nodes' as Ansible reads it (try listing "
        "the nodes in a group named nodes (inventory.example.yml))"
    ]


def test_the_nodes_are_the_hosts_of_the_group_named_by_group(tmp_path):
    """--group picks the Ansible group whose hosts are the nodes, in an INI inventory (nested
    groups) and in the plain YAML layout alike; every tool takes it, and a bad name or an
    absent group is one line."""
    ini = _ini_cluster(tmp_path)
    gpu_only = inventory_read.load(ini, "gpu")
    assert [h.name for h in gpu_only.hosts] == ["node1", "node2"] and gpu_only.group == "gpu"
    assert inventory_read.load(ini).group == "nodes"

    (tmp_path / "lab").mkdir()  # away from the INI's group_vars/
    yaml_path = tmp_path / "lab" / "lab.yml"
    example = yaml.safe_load((REPO_ROOT / "inventory.example.yml").read_text())
    nodes = example["all"]["children"].pop("nodes")
    example["all"]["children"]["workstations"] = {"children": {"gpu_boxes": nodes}}
    yaml_path.write_text(yaml.safe_dump(example))
    nested = inventory_read.load(yaml_path, "gpu_boxes")  # found where Ansible finds it
    assert [h.name for h in nested.hosts] == list(nodes["hosts"])
    example["all"]["children"] = {"gpu_boxes": nodes}
    yaml_path.write_text(yaml.safe_dump(example))
    assert inventory_read.load(yaml_path, "gpu_boxes").hosts == nested.hosts

    for command in (["cluster", "check"], ["cluster", "hostfile"], ["netcheck"], ["train"]):
        done = run_cli(*command, "-i", str(ini), "--group", "nope", timeout=60)
        assert (done.returncode, done.stdout) == (2, ""), done
        assert done.stderr.splitlines() == [
            f"Error: inventory {ini}: no hosts in group 'nope' as Ansible reads it (try listing "
            "the nodes in a group named nope (inventory.example.yml))"
        ], command
    hostfile = run_cli("cluster", "hostfile", "-i", str(ini), "--group", "gpu")
    assert hostfile.stdout == "node1 slots=2\nnode2 slots=2\n"
    bad = run_cli("cluster", "check", "-i", str(ini), "--group", "gpu nodes")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "Error: --group 'gpu nodes' is not an Ansible group name (try letters, digits, '_' and "
        "'-', such as GROUP=gpu_nodes or GROUP=slurm-node)"
    ]


def test_the_scheduler_is_ssh_unless_the_inventory_says_slurm():
    from tests.helpers import inventory as built
    from tests.helpers import inventory_text, node

    hosts = {"n1": node(1), "n2": node(2)}
    assert built(hosts).scheduler == "ssh"
    assert built(hosts, scheduler="slurm").scheduler == "slurm"
    with pytest.raises(UserError) as caught:
        inventory_read.parse(inventory_text(hosts, scheduler="pbs"), "inv.yml")
    assert str(caught.value) == (
        "inventory inv.yml: cluster field 'scheduler': 'pbs' is not one of ssh, slurm"
    )


def test_every_problem_is_reported_in_one_pass_the_roots_in_their_order_then_the_mounts(
    tmp_path,
):
    """Each bad field is its own line (it was the first alone), then exit 2."""
    path = write(
        tmp_path,
        with_cluster_vars("workdir_root: work", "checkpoint_root: ckpt", "container_mounts: 1"),
    )
    proc = check(path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        f"Error: inventory {path}: cluster field 'checkpoint_root': 'ckpt' is not an absolute "
        "path (try a path from /, such as /var/lib/torch-multinode/checkpoints)",
        f"Error: inventory {path}: cluster field 'workdir_root': 'work' is not an absolute path "
        "(try a path from /, such as /var/lib/torch-multinode/work)",
        f"Error: inventory {path}: cluster field 'container_mounts': 1 is not a list (try a list "
        'such as ["/datasets:ro"])',
    ]
