"""What travels to the nodes (cluster.sync) and how a job is staged there (launch.staging, its
image checked by launch.image_check): pure parts, and rsync between two local directories. No
network."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers import inventory_text, node
from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.launch import environment, image_check, staging


def _inventory_text(**cluster_vars) -> str:
    """One node, SSH on port 2222 as trainer with its own key and known_hosts file."""
    return inventory_text(
        {"n1": node(1, compute_ip="10.7.0.9", ansible_port=2222)},
        ansible_user="trainer",
        ansible_ssh_private_key_file="/keys/id",
        ssh_known_hosts_file="/keys/known_hosts",
        **cluster_vars,
    )


INVENTORY = _inventory_text()


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def _project(root: Path) -> Path:
    for name, text in {
        "train.py": "print('hi')\n",
        "mylib/__init__.py": "",
        "mylib/model.py": "VERSION = 1\n",
        "config.yaml": "name: x\n",
        "outputs/big.bin": "x" * 1000,
        "notes.log": "ignored\n",
        "mylib/__pycache__/model.cpython-311.pyc": "cache",
        "env/pyvenv.cfg": "home = /usr/bin\n",
        "env/lib/site.py": "",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_git_project_travels_without_what_git_ignores_caches_and_environments(tmp_path):
    root = _project(tmp_path / "proj")
    (root / ".gitignore").write_text("outputs/\n*.log\n")
    _git(root, "init", "-q")
    _git(root, "add", "train.py", ".gitignore")  # the rest untracked: it travels all the same
    tree = sync.project_tree(root)
    assert tree.files == (
        ".gitignore",
        "config.yaml",
        "mylib/__init__.py",
        "mylib/model.py",
        "train.py",
    )
    # What git ignores is excluded (so also kept on the node, never deleted there).
    assert "/outputs/" in tree.excludes and "/notes.log" in tree.excludes
    assert "/env/" in tree.excludes and "__pycache__/" in tree.excludes and ".git/" in tree.excludes
    assert sync.git_root(root / "mylib") == root.resolve()


def test_a_project_outside_git_leaves_caches_and_environments_behind(tmp_path):
    root = _project(tmp_path / "plain")
    tree = sync.project_tree(root)
    assert tree.files == (
        "config.yaml",
        "mylib/__init__.py",
        "mylib/model.py",
        "notes.log",
        "outputs/big.bin",
        "train.py",
    )
    assert tree.size == sum((root / name).stat().st_size for name in tree.files)


def test_the_digest_changes_with_one_byte_and_the_node_script_agrees(tmp_path):
    root = _project(tmp_path / "proj")
    before = sync.project_tree(root)
    listing = "\0".join(before.files)
    node = subprocess.run(
        ["python3", "-c", sync._NODE_DIGEST, str(root)],
        input=listing,
        capture_output=True,
        text=True,
        check=True,
    )
    assert node.stdout.split()[0] == before.digest
    (root / "mylib" / "model.py").write_text("VERSION = 2\n")
    assert sync.project_tree(root).digest != before.digest


def test_a_workdir_over_the_limit_names_what_is_big(tmp_path):
    root = _project(tmp_path / "proj")
    tree = sync.project_tree(root)
    with pytest.raises(UserError) as raised:
        sync.check_size(tree, 500)
    assert str(raised.value) == (
        f"workdir {root.resolve()} holds 1.0 KB in 6 files, over the 500 B limit; the biggest: "
        "outputs/ 1.0 KB, mylib/ 12 B, train.py 12 B"
    )
    assert "make data SRC=dir" in raised.value.hint
    sync.check_size(tree, 10_000)  # under the limit: nothing said


def test_rsync_goes_through_ssh_with_host_keys_checked(tmp_path):
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    host = inventory.hosts[0]
    tree = sync.Tree(tmp_path, (), (), (), ())
    command = sync.rsync_command(inventory, host, tree, "/var/lib/x/proj-1", None)
    ssh = shlex.split(command[command.index("-e") + 1])
    assert ssh[:3] == ["ssh", "-p", "2222"]
    assert "StrictHostKeyChecking=yes" in ssh and "BatchMode=yes" in ssh
    assert "UserKnownHostsFile=/keys/known_hosts" in ssh and ["-i", "/keys/id"] == ssh[-4:-2]
    assert command[-2:] == [f"{tmp_path}/", "trainer@10.1.0.1:/var/lib/x/proj-1/"]
    assert "--delete" in command


def test_the_same_directory_always_goes_to_the_same_place(tmp_path):
    first = sync.remote_dir("/var/lib/w", tmp_path / "my proj")
    assert first == sync.remote_dir("/var/lib/w", tmp_path / "my proj")
    assert first.startswith("/var/lib/w/my_proj-") and first != sync.remote_dir(
        "/var/lib/w", tmp_path
    )


def test_a_second_transfer_with_nothing_changed_sends_no_file(tmp_path):
    source = _project(tmp_path / "src")
    tree = sync.data_tree(source)
    target = tmp_path / "dst"
    command = [
        "rsync",
        "--recursive",
        "--links",
        "--times",
        "--delete",
        "--stats",
        "--info=progress2",
        f"{source}/",
        f"{target}/",
    ]
    lines: list[str] = []
    host = parse(INVENTORY).hosts[0]
    first, error = sync._run_rsync(command, host, lines.append, "data")
    assert error == "" and first["Number of regular files transferred"] == len(tree.files)
    second, error = sync._run_rsync(command, host, lines.append, "data")
    assert error == "" and second["Number of regular files transferred"] == 0
    assert second["Total file size"] == tree.size


def test_env_names_values_and_refusals():
    environ = {"HF_TOKEN": "abc def"}
    assert environment.parse_env(["HF_TOKEN WANDB_MODE=offline", "X=1=2"], environ) == (
        ("HF_TOKEN", "abc def"),
        ("WANDB_MODE", "offline"),
        ("X", "1=2"),
    )
    for items, message in [
        (["MISSING"], "ENV: MISSING is not set on this machine, so there is no value to pass"),
        (["TMN_RUN_ID=x"], "ENV: TMN_RUN_ID is set by the launcher itself"),
        (["PYTHONPATH=/x"], "ENV: PYTHONPATH is set by the launcher itself"),
        (["1BAD=x"], "ENV: '1BAD' is not a variable name"),
    ]:
        with pytest.raises(UserError) as raised:
            environment.parse_env(items, environ)
        assert str(raised.value) == message
    with pytest.raises(UserError, match="holds a newline"):
        environment.parse_env(["A"], {"A": "x\ny"})


def test_secrets_reach_the_shell_quoted_and_never_a_command_line():
    text = staging.secrets_text((("TOKEN", "it's $secret"),))
    assert text == "export TOKEN='it'\"'\"'s $secret'\n"
    out = subprocess.run(
        ["sh", "-c", text + 'printf %s "$TOKEN"'], capture_output=True, text=True, check=True
    ).stdout
    assert out == "it's $secret"
    assert "it's" not in staging.write_secrets_command("tmn-a")
    assert staging.load_secrets("tmn-a") == (
        ". /tmp/torch-multinode/secrets/tmn-a/env && rm -f /tmp/torch-multinode/secrets/tmn-a/env"
    )


def _container_inventory(**cluster_vars):
    return parse(_inventory_text(**cluster_vars), "/nonexistent/inv.yml")


def test_relative_checkpoint_and_data_dirs_resolve_under_their_roots():
    inventory = _container_inventory()
    project = staging.Project((), "/w/proj", None)
    args, notes = staging.resolve_paths(
        ("--checkpoint-dir", "exp1", "--data-dir=cifar", "--lr", "0.1"), inventory, project, "/r"
    )
    assert args == (
        "--checkpoint-dir",
        f"{inventory.checkpoint_root}/exp1",
        f"--data-dir={inventory.data_root}/cifar",
        "--lr",
        "0.1",
    )
    assert (
        notes[0]
        == f"--checkpoint-dir exp1 is {inventory.checkpoint_root}/exp1 on every node (checkpoint_root)"
    )
    with pytest.raises(UserError, match="leaves checkpoint_root"):
        staging.resolve_paths(("--checkpoint-dir", "../x"), inventory, project, "/r")


def test_in_a_container_a_checkpoint_dir_outside_every_mount_is_refused():
    inventory = _container_inventory(container_mounts=["/scratch"])
    project = staging.Project((), "/w/proj", None)
    with pytest.raises(UserError) as raised:
        staging.resolve_paths(("--checkpoint-dir", "/var/tmp/ckpt"), inventory, project, "/r")
    assert "it would vanish with the container" in str(raised.value)
    assert "/scratch" in str(raised.value)
    kept, _ = staging.resolve_paths(("--checkpoint-dir=/scratch/c",), inventory, project, "/r")
    assert kept == ("--checkpoint-dir=/scratch/c",)
    host_mode = _container_inventory(launch_mode="host")
    assert staging.resolve_paths(("--checkpoint-dir", "/var/tmp/c"), host_mode, project, "/r")[0]


def test_an_image_that_differs_or_is_missing_names_the_node_and_the_fix():
    inventory = _container_inventory()
    host = inventory.hosts[0]
    wanted = "sha256:" + "a" * 64
    assert image_check.image_mismatch(host, inventory, wanted, wanted + " torch=2.14.1\n") is None
    other = image_check.image_mismatch(
        host, inventory, wanted, "sha256:" + "b" * 64 + " torch=2.14.1"
    )
    assert other == (
        "on n1: the training image torch-multinode/train:latest is bbbbbbbbbbbb, not this "
        "machine's aaaaaaaaaaaa (try make ship INVENTORY=/nonexistent/inv.yml)"
    )
    missing = image_check.image_mismatch(
        host, inventory, wanted, "Error: No such image: torch-multinode/train:latest"
    )
    assert missing.startswith("on n1: the training image torch-multinode/train:latest is missing")
    down = image_check.image_mismatch(
        host,
        inventory,
        wanted,
        "Cannot connect to the Docker daemon at "
        "unix:///var/run/docker.sock. Is the docker daemon running?",
    )
    assert down == (
        "on n1: its Docker engine did not answer within 30 s (try 'sudo systemctl start docker' "
        "there, or make provision INVENTORY=/nonexistent/inv.yml)"
    )


class _Node:
    """A stand-in for cluster.remote.Remote that runs the node's commands here."""

    def __init__(self, root: Path):
        from torch_multinode.cluster.inventory_read import parse as parse_inventory

        self.host = parse_inventory(INVENTORY).hosts[0]
        self.root = root

    def run(self, command: str, timeout: float = 60, check: bool = False, stdin: str = ""):
        from torch_multinode.cluster.remote import Result

        done = subprocess.run(
            ["sh", "-c", command], input=stdin, capture_output=True, text=True, check=False
        )
        return Result(self.host.name, command, done.returncode, done.stdout, done.stderr)


def test_a_copy_that_differs_from_the_controllers_is_refused_naming_node_and_file(tmp_path):
    here = _project(tmp_path / "here")
    there = tmp_path / "there"
    subprocess.run(["cp", "-a", str(here), str(there)], check=True)
    tree = sync.project_tree(here)
    sync.verify(_Node(there), tree, str(there))  # the same files: nothing said
    (there / "mylib" / "model.py").write_text("VERSION = 'stale'\n")
    with pytest.raises(UserError) as raised:
        sync.verify(_Node(there), tree, str(there))
    assert str(raised.value) == (
        f"on n1: the copy of {here.resolve()} in {there} differs from this machine's "
        "(mylib/model.py first); a file changed while it was being sent, or the node's disk is "
        "failing"
    )


def _local_rsync(inventory, tree: sync.Tree, destination: str, scratch: Path) -> None:
    """sync.rsync_command's transfer, between two local directories (no SSH)."""
    excludes = scratch / "excludes"
    excludes.write_text("".join(f"{pattern}\n" for pattern in tree.excludes))
    command = sync.rsync_command(inventory, inventory.hosts[0], tree, destination, excludes)
    at = command.index("-e")
    del command[at : at + 2]
    command = [part for part in command if not part.startswith("--rsync-path=")]
    Path(destination).mkdir(parents=True, exist_ok=True)
    subprocess.run([*command[:-1], destination + "/"], check=True, capture_output=True)


def test_only_what_runs_on_a_node_arrives_alone_on_the_import_path(tmp_path):
    work = tmp_path / "work"
    inventory = parse(_inventory_text(workdir_root=str(work)), "/nonexistent/inv.yml")
    # A node provisioned before the tree moved into torch_multinode/: the rooms directly in
    # the tool's directory of that time, which must never be on a job's import path.
    old = Path(sync.remote_dir(str(work), sync.TOOL_ROOT, "torch-multinode"))
    for name in ("cluster/__init__.py", "training/__init__.py", "netcheck/__init__.py"):
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        (old / name).write_text("")
    tree = sync.tool_tree()
    destination = sync.tool_destination(inventory)
    _local_rsync(inventory, tree, destination, tmp_path)
    import_path = Path(sync.tool_import_path(destination))
    assert import_path != old and import_path.parent == work
    assert [entry.name for entry in import_path.iterdir()] == ["torch_multinode"]
    arrived = sorted(
        path.relative_to(destination).as_posix()
        for path in Path(destination).rglob("*")
        if not path.is_dir()
    )
    assert arrived == list(tree.files)
    assert {"cluster/errors.py", "netcheck/collective.py", "training/ddp.py"} <= set(arrived)
    assert not {"cluster/inventory.py", "cluster/sync.py", "netcheck/preflight.py"} & set(arrived)
    sync.verify(_Node(Path(destination)), tree, destination)


def test_a_failed_rsync_is_said_by_its_cause_not_its_consequences():
    # rsync 3.2's own lines, as it printed them here and in CI
    assert (
        sync.rsync_error(
            [
                "rsync: [sender] write error: Broken pipe (32)",
                'rsync: [receiver] write failed on "/x/e2.bin": No space left on device (28)',
                "rsync error: error in file IO (code 11) at receiver.c(657) [receiver=3.5.0]",
            ],
            11,
        )
        == 'rsync: [receiver] write failed on "/x/e2.bin": No space left on device (28)'
    )
    assert (
        sync.rsync_error(
            [
                "ssh: connect to host 192.0.2.1 port 22: Connection refused",
                "rsync: connection unexpectedly closed (0 bytes received so far) [Receiver]",
                "rsync error: unexplained error (code 255) at io.c(232) [Receiver=3.2.7]",
            ],
            255,
        )
        == "ssh: connect to host 192.0.2.1 port 22: Connection refused"
    )
    for shell in ("bash: line 1: rsync: command not found", "sh: 1: rsync: not found"):
        missing = [
            "rsync: connection unexpectedly closed (0 bytes received so far) [sender]",
            shell,
        ]
        assert sync.rsync_error(missing, 12) == "rsync is not installed on the node"
    assert sync.rsync_error(["rsync error: timeout in data send/receive (code 30)"], 30) == (
        "rsync error: timeout in data send/receive (code 30)"
    )
    assert sync.rsync_error([], 255) == "rsync exit 255"
