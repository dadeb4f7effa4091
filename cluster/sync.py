"""Sending a directory from the controller to every node: a job's project, or a dataset.

rsync over SSH with the inventory's key and known_hosts (host keys checked, batch mode), to all
nodes at once, so only what changed travels. What a project is comes from git where the
directory is in a repository (what git ignores stays behind) and from a short list of names
that never belong to a project (.git, virtual environments, caches). Before a job starts,
every node's copy is checked against the controller's digest of the same files.

This module runs on the controller; the digest check runs a few lines of stdlib Python on
the node (Ansible needs python3 there anyway).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all

if TYPE_CHECKING:
    from torch_multinode.cluster.execution import Session

Emit = Callable[[str], None]

# Never part of a project, wherever they sit in it.
ALWAYS_EXCLUDED_DIRS = (
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    ".runs",
    ".sim",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    ".tox",
    "node_modules",
)
ALWAYS_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
DEFAULT_WORKDIR_LIMIT = 200_000_000  # bytes (200 MB): code and configs, not datasets
PROGRESS_EVERY = 3.0  # seconds between a node's progress lines during a transfer
RSYNC_TIMEOUT = 30  # rsync's own I/O timeout: a node that stops answering ends the transfer
# What of this project runs on a node, and so travels there: per room, None for the whole room,
# else the modules directly in it that a node runs or imports (with the room's __init__.py).
# netcheck's collective workers run as `python -m torch_multinode.netcheck.collective` (its
# software and socket probes are sent as source, `python -c`, and need none of this); the
# workloads import cluster's stdlib-only node side. tests/test_rooms.py holds these modules to
# their import rules and checks that everything they import travels with them.
NODE_SIDE: dict[str, tuple[str, ...] | None] = {
    "cluster": ("durable", "errors", "jobenv", "nccl_transport", "versions"),
    "netcheck": ("bandwidth", "collective", "softprobe"),
    "training": None,
}
# They sit in a directory named TOOL_PACKAGE (the one name our code is imported by, in jobs too)
# alone in a node directory of its own, TOOL_DIR_NAME's (`tool_destination`).
TOOL_ROOT = Path(__file__).resolve().parents[1]
TOOL_PACKAGE = "torch_multinode"
# Not 'torch-multinode': nodes provisioned before the tree moved into TOOL_PACKAGE hold the
# rooms directly in that directory, where `cluster/` and `training/` would now be on a job's
# import path under their generic names.
TOOL_DIR_NAME = "torch-multinode-tool"

# Run on the node with the file list on stdin (NUL-separated): the same digest as `digest()`.
_NODE_DIGEST = """
import hashlib, os, sys
root = sys.argv[1]
names = [n for n in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").split("\\0") if n]
total, each = hashlib.sha256(), []
for name in names:
    path = os.path.join(root, name)
    try:
        if os.path.islink(path):
            value = "link:" + os.readlink(path)
        else:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:  # not file_digest: Ubuntu 22.04 has Python 3.10
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            value = digest.hexdigest()
    except OSError as exc:
        value = "missing:" + type(exc).__name__
    each.append(value)
    total.update(f"{name}\\0{value}\\n".encode("utf-8", "surrogateescape"))
print(total.hexdigest())
if "--each" in sys.argv:
    print("\\n".join(each))
"""


@dataclass(frozen=True)
class Tree:
    """A directory as it is sent: its files (relative POSIX paths, sorted), their digests, and
    the rsync patterns that keep everything else out (and protect it on the node)."""

    root: Path
    files: tuple[str, ...]
    hashes: tuple[str, ...]
    sizes: tuple[int, ...]
    excludes: tuple[str, ...]

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def digest(self) -> str:
        return _combined(self.files, self.hashes)

    def biggest(self, count: int = 3) -> list[tuple[str, int]]:
        """The largest top-level entries (a directory counts with everything in it)."""
        totals: dict[str, int] = {}
        for name, size in zip(self.files, self.sizes, strict=True):
            top = name.split("/", 1)[0] + ("/" if "/" in name else "")
            totals[top] = totals.get(top, 0) + size
        return sorted(totals.items(), key=lambda item: -item[1])[:count]


@dataclass(frozen=True)
class Sent:
    """What one rsync to one node did."""

    host: str
    files: int  # regular files that had to be sent (changed or new)
    bytes_sent: int  # everything rsync sent over the wire: file list, deltas, data
    seconds: float


def _combined(files: tuple[str, ...], hashes: tuple[str, ...]) -> str:
    total = hashlib.sha256()
    for name, value in zip(files, hashes, strict=True):
        total.update(f"{name}\0{value}\n".encode("utf-8", "surrogateescape"))
    return total.hexdigest()


def _file_hash(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _always_excluded(name: str, is_dir: bool) -> bool:
    return (is_dir and name in ALWAYS_EXCLUDED_DIRS) or name.endswith(ALWAYS_EXCLUDED_SUFFIXES)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    if shutil.which("git") is None:
        return None
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, check=False, timeout=120
    )


def git_root(path: Path) -> Path | None:
    """The top of the git work tree holding `path`, or None."""
    found = _git(path, "rev-parse", "--show-toplevel")
    if found is None or found.returncode != 0:
        return None
    return Path(os.fsdecode(found.stdout.strip()))


def _escape(name: str) -> str:
    """A path as an rsync pattern that matches only itself."""
    return re.sub(r"([*?\[\\])", r"\\\1", name)


def _listed(root: Path) -> tuple[list[str], list[str]] | None:
    """(files, ignored) as git sees `root`: tracked and untracked-but-not-ignored files, and the
    ignored paths (a wholly ignored directory as one entry ending in '/'). None outside git."""
    if git_root(root) is None:
        return None
    found = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    ignored = _git(
        root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"
    )
    if found is None or ignored is None or found.returncode or ignored.returncode:
        return None
    split = lambda out: sorted({os.fsdecode(n) for n in out.stdout.split(b"\0") if n})  # noqa: E731
    return split(found), split(ignored)


def _walked(root: Path) -> list[str]:
    files = []
    for directory, dirs, names in os.walk(root):
        here = Path(directory)
        kept = []
        for name in dirs:
            path = here / name
            if path.is_symlink():
                names.append(name)  # sent as the link it is, never followed
            elif not (_always_excluded(name, True) or (path / "pyvenv.cfg").exists()):
                kept.append(name)
        dirs[:] = kept
        files += [(here / name).relative_to(root).as_posix() for name in names]
    return files


def project_tree(root: Path) -> Tree:
    """The project under `root` as it travels to the nodes."""
    root = root.resolve()
    if not root.is_dir():
        raise UserError(f"workdir {root} is not a directory", hint="WORKDIR=a directory")
    listed = _listed(root)
    excludes = [f"{name}/" for name in ALWAYS_EXCLUDED_DIRS]
    excludes += [f"*{suffix}" for suffix in ALWAYS_EXCLUDED_SUFFIXES]
    if listed is None:
        candidates = _walked(root)
    else:
        candidates, ignored = listed
        excludes += ["/" + _escape(name) for name in ignored]
    files, hashes, sizes = [], [], []
    for name in sorted(candidates):
        parts = name.split("/")
        if any(_always_excluded(part, True) for part in parts[:-1]) or _always_excluded(
            parts[-1], False
        ):
            continue
        path = root / name
        if "\n" in name or not (path.is_file() or path.is_symlink()):
            continue  # deleted but still in git's index, a submodule, a socket
        if any((root / "/".join(parts[:i]) / "pyvenv.cfg").exists() for i in range(1, len(parts))):
            continue  # inside a virtual environment under another name
        try:
            digest = _file_hash(path)
            size = path.lstat().st_size if path.is_symlink() else path.stat().st_size
        except FileNotFoundError:
            continue  # deleted while the project was being listed: it is not part of it now
        files.append(name)
        hashes.append(digest)
        sizes.append(size)
    # Virtual environments by another name, found where git does not already ignore them.
    for name in {f.split("/")[0] for f in candidates}:
        if (root / name / "pyvenv.cfg").exists():
            excludes.append("/" + _escape(name) + "/")
    return Tree(root, tuple(files), tuple(hashes), tuple(sizes), tuple(excludes))


def data_tree(root: Path) -> Tree:
    """A dataset directory: every file in it, nothing left out."""
    root = root.resolve()
    if not root.is_dir():
        raise UserError(f"SRC={root} is not a directory", hint="SRC=path/to/dataset")
    files, sizes = [], []
    for directory, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = Path(directory) / name
            files.append(path.relative_to(root).as_posix())
            sizes.append(path.lstat().st_size)
    # Hashing a dataset would read all of it on every run; its digest is not needed.
    return Tree(root, tuple(files), ("",) * len(files), tuple(sizes), ())


def tool_files() -> list[str]:
    """The files of this project that travel to the nodes (NODE_SIDE), relative to TOOL_ROOT:
    found by walking the rooms, not asked of git, so an installed copy travels too."""
    files = []
    for room, modules in NODE_SIDE.items():
        if modules is None:
            names = _walked(TOOL_ROOT / room)
        else:
            names = ["__init__.py"]
            for module in modules:
                if (TOOL_ROOT / room / module).is_dir():
                    names += [f"{module}/{name}" for name in _walked(TOOL_ROOT / room / module)]
                else:
                    names.append(f"{module}.py")
        files += [
            f"{room}/{name}"
            for name in names
            if not _always_excluded(name.rsplit("/", 1)[-1], False)
            and os.path.lexists(TOOL_ROOT / room / name)
        ]
    return sorted(files)


def _tool_excludes() -> list[str]:
    """rsync patterns that keep all but tool_files() of TOOL_ROOT behind: the other rooms and
    files, and the modules of a listed room that run on the controller only. Like every
    excluded path, these are also kept where a node has them: a module taken off NODE_SIDE
    stays in the node's copy, where nothing that runs there imports it."""
    excludes = [f"{name}/" for name in ALWAYS_EXCLUDED_DIRS]
    excludes += [f"*{suffix}" for suffix in ALWAYS_EXCLUDED_SUFFIXES]
    excludes += [
        "/" + _escape(entry.name) + ("/" if entry.is_dir() else "")
        for entry in sorted(TOOL_ROOT.iterdir())
        if entry.name not in NODE_SIDE
    ]
    for room, modules in NODE_SIDE.items():
        if modules is None:
            continue
        # Those listed are taken, the rest of the room not ("+ " includes, "- " excludes).
        excludes.append(f"+ /{room}/__init__.py")
        for module in modules:
            is_dir = (TOOL_ROOT / room / module).is_dir()
            excludes.append(f"+ /{room}/{_escape(module)}" + ("/" if is_dir else ".py"))
        excludes.append(f"- /{room}/*")
    return excludes


def tool_tree() -> Tree:
    """What of this project runs on a node (NODE_SIDE: the workloads, training.legacy,
    netcheck's workers), as a job needs it."""
    files = tool_files()
    hashes = tuple(_file_hash(TOOL_ROOT / name) for name in files)
    sizes = tuple((TOOL_ROOT / name).lstat().st_size for name in files)
    return Tree(TOOL_ROOT, tuple(files), hashes, sizes, tuple(_tool_excludes()))


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def check_size(tree: Tree, limit: int, what: str = "workdir") -> None:
    if tree.size <= limit:
        return
    big = ", ".join(f"{name} {human(size)}" for name, size in tree.biggest())
    raise UserError(
        f"{what} {tree.root} holds {human(tree.size)} in {len(tree.files)} files, over the "
        f"{human(limit)} limit; the biggest: {big}",
        hint="'make data SRC=dir' for datasets (copied once to every node's data_root), "
        "ignoring large outputs in .gitignore, or a larger --workdir-limit",
    )


def safe_name(name: str) -> str:
    """A directory name as it is made on the nodes: no character a shell or Docker trips on."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "root"


def remote_dir(root_on_node: str, local: Path, name: str | None = None) -> str:
    """Where `local` lives on every node: one directory per controller and local path, so two
    projects (or two controllers) never share one, and the same project always reuses its own
    (only what changed travels). `name` tells two trees of one local directory apart."""
    local = local.resolve()
    key = hashlib.sha256(f"{socket.gethostname()}:{local}:{name}".encode()).hexdigest()[:10]
    name = safe_name(name or local.name)
    return f"{root_on_node}/{name}-{key}"


def tool_destination(inventory: Inventory) -> str:
    """Where this project's own packages live on every node (the launcher and netcheck): a
    torch_multinode/ directory alone in its parent, which goes on the import path
    (`tool_import_path`), so `torch_multinode.training` is importable there and no generic
    name (`training`, `cluster`) is."""
    return f"{remote_dir(inventory.workdir_root, TOOL_ROOT, TOOL_DIR_NAME)}/{TOOL_PACKAGE}"


def tool_import_path(destination: str) -> str:
    """The import path entry that makes the packages sent to `destination` importable."""
    return posixpath.dirname(destination.rstrip("/"))


def remote_target(host: Host, path: str) -> str:
    user = f"{host.ssh_user}@" if host.ssh_user else ""
    address = f"[{host.ssh_address}]" if ":" in host.ssh_address else host.ssh_address
    return f"{user}{address}:{path}"


def rsync_command(
    inventory: Inventory,
    host: Host,
    tree: Tree,
    destination: str,
    exclude_file: Path | None,
    all_at_once: bool = False,
) -> list[str]:
    """Mirror `tree` into `destination` on `host`: changed files by delta, files gone here
    removed there, excluded paths (ignored outputs, caches) neither sent nor removed.
    `all_at_once` (a dataset's copy): the changed files wait in DESTINATION/.~tmp~ until every
    one has arrived, then are renamed into place and the files gone here removed, so a copy
    stopped part way (Ctrl-C, a full disk, a lost link) leaves the node's previous copy as it
    was, not a mix of old and new files. It needs the changed files' size free beside them."""
    command = [
        "rsync",
        "--recursive",
        "--links",
        "--perms",
        "--times",
        "--delete",
        *(["--delay-updates", "--delete-delay"] if all_at_once else []),
        "--stats",
        "--info=progress2",
        "--no-inc-recursive",
        f"--timeout={RSYNC_TIMEOUT}",
        "-e",
        shlex.join(trust.openssh_command(inventory, host)),
        # rsync makes only the last component of the destination itself
        f"--rsync-path=mkdir -p {shlex.quote(destination)} && rsync",
    ]
    if exclude_file is not None:
        command.append(f"--exclude-from={exclude_file}")
    return [*command, f"{tree.root}/", remote_target(host, destination + "/")]


_STAT = re.compile(
    r"^(Number of regular files transferred|Total bytes sent|Total file size): ([\d,]+)"
)
_PROGRESS = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+(\S+/s)")


def _run_rsync(command: list[str], host: Host, emit: Emit, label: str) -> tuple[dict, str]:
    """Run one rsync; its progress as a line every few seconds, its statistics returned."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None and stderr is not None  # both PIPE
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(stderr), daemon=True)
    reader.start()
    stats: dict[str, int] = {}
    shown = time.monotonic()
    pending = ""
    while True:
        chunk = stdout.read(256)
        if not chunk:
            break
        pending += chunk
        *parts, pending = re.split(r"[\r\n]", pending)
        for part in parts:
            found = _STAT.match(part)
            if found:
                stats[found.group(1)] = int(found.group(2).replace(",", ""))
            progress = _PROGRESS.match(part)
            if progress and time.monotonic() - shown >= PROGRESS_EVERY:
                shown = time.monotonic()
                done = int(progress.group(1).replace(",", ""))
                emit(
                    f"[{label}] {host.name}: {progress.group(2)}% ({human(done)}, "
                    f"{progress.group(3)})"
                )
    code = process.wait()
    reader.join(5)
    if code != 0:
        return stats, rsync_error(errors, code)
    return stats, ""


def rsync_error(stderr: list[str], code: int) -> str:
    """Why a rsync failed, from its error output: a node without rsync first of all, else the
    first line (ssh's refusal, the receiver's "write failed ...: No space left on device
    (28)"), not the consequences reported after it (the other side's broken pipe, the "rsync
    error: ... (code 11)" summary)."""
    lines = [line.strip() for line in stderr if line.strip()]
    if any(_NO_RSYNC.search(line) for line in lines):
        return "rsync is not installed on the node"
    cause = next((line for line in lines if not _CONSEQUENCE.search(line)), None)
    return cause or (lines[-1] if lines else f"rsync exit {code}")


_NO_RSYNC = re.compile(r"rsync: (command )?not found")  # the node's shell: no rsync there
_CONSEQUENCE = re.compile(r"^rsync error: |Broken pipe|connection unexpectedly closed")


def push(
    inventory: Inventory,
    hosts: tuple[Host, ...] | list[Host],
    tree: Tree,
    destination: str,
    emit: Emit = print,
    label: str = "sync",
) -> dict[str, Sent]:
    """Mirror `tree` to `destination` on every host at once. A node that fails is one
    UserError naming it (the first such, after every transfer has ended)."""
    done = push_each(inventory, hosts, tree, destination, emit, label)
    raise_first_failure(done, tree, destination)
    return done  # type: ignore[return-value]


def raise_first_failure(
    done: dict[str, Sent | str], tree: Tree, destination: str, after: str = ""
) -> None:
    """push_each's first failed node as one UserError: rsync's cause, then `after`."""
    for name, outcome in done.items():
        if isinstance(outcome, str):
            raise UserError(
                f"on {name}: copying {tree.root} to {destination} failed: {outcome}{after}",
                hint=f"freeing space on {name}, then the same command again"
                if "No space left on device" in outcome
                else "'make provision' (it installs rsync and makes the directories), or "
                "'make netcheck' if the node is unreachable",
                exit_code=1,
            )


def push_each(
    inventory: Inventory,
    hosts: tuple[Host, ...] | list[Host],
    tree: Tree,
    destination: str,
    emit: Emit = print,
    label: str = "sync",
    all_at_once: bool = False,
) -> dict[str, Sent | str]:
    """Like `push`, but a node that fails gets the reason instead of its Sent."""
    if shutil.which("rsync") is None:
        raise UserError(
            "rsync is not installed on this machine", hint="apt-get install rsync", exit_code=1
        )
    with tempfile.TemporaryDirectory(prefix="tmn-sync-") as scratch:
        exclude_file = None
        if tree.excludes:
            exclude_file = Path(scratch) / "excludes"
            exclude_file.write_text("".join(f"{pattern}\n" for pattern in tree.excludes))

        def one(host: Host) -> Sent | str:
            started = time.monotonic()
            command = rsync_command(inventory, host, tree, destination, exclude_file, all_at_once)
            stats, error = _run_rsync(command, host, emit, label)
            if error:
                return error
            return Sent(
                host.name,
                stats.get("Number of regular files transferred", 0),
                stats.get("Total bytes sent", 0),
                time.monotonic() - started,
            )

        return on_all(list(hosts), one)


def summary_line(tree: Tree, destination: str, sent: dict[str, Sent]) -> str:
    """One line: what the tree is, where it went, and what each node had to be sent."""
    each = ", ".join(
        f"{name} {done.files} changed file(s), {done.bytes_sent:,} bytes sent in {done.seconds:.1f} s"
        for name, done in sent.items()
    )
    return f"{tree.root} ({len(tree.files)} files, {human(tree.size)}) -> {destination}: {each}"


def verify(remote: Session, tree: Tree, destination: str) -> None:
    """The node's copy must hold exactly the controller's files: a UserError naming the
    node and the first file that differs otherwise."""
    listing = "\0".join(tree.files)
    command = shlex.join(["python3", "-c", _NODE_DIGEST, destination])
    result = remote.run(command, timeout=120, stdin=listing)
    lines = result.stdout.split("\n")
    if result.ok and lines[0].strip() == tree.digest:
        return
    if not result.ok:
        raise UserError(
            f"on {remote.host.name}: could not check the copy of {tree.root} in {destination}: "
            f"{result.last_line or 'no output'}",
            exit_code=1,
        )
    found = remote.run(command + " --each", timeout=120, stdin=listing).stdout.split("\n")[1:]
    differing = next(
        (
            name
            for name, mine, theirs in zip(tree.files, tree.hashes, found, strict=False)
            if mine != theirs
        ),
        tree.files[0] if tree.files else "?",
    )
    raise UserError(
        f"on {remote.host.name}: the copy of {tree.root} in {destination} differs from this "
        f"machine's ({differing} first); a file changed while it was being sent, or the node's "
        "disk is failing",
        hint="running the job again",
        exit_code=1,
    )
