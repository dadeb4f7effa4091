"""What a job takes to the nodes and what comes back, decided on the controller.

- The project travels, not one file: the directory of the script (or the git work tree it is
  in, or WORKDIR) is mirrored to every node, and this project's own packages beside it, so
  every node runs the controller's current code. The job runs in the project, with both on
  its import path, at the same paths on the node and inside the container.
- Nothing written is lost with the container: the checkpoint root, the data root and the
  inventory's extra mounts are node directories mounted at the same paths. A relative
  --checkpoint-dir or --data-dir resolves under its root; in a container, a checkpoint or data
  directory outside every mount is refused before anything starts. A job without an inventory
  follows the same rule under this machine's roots (`local_roots`: checkpoints/ and data/ where
  `train` is typed, beside .runs/), so a command means the same here and on the nodes, and
  outputs never land in the project's work tree (nor in a rerun's temporary copy of it).
- Settings and secrets (--env) reach the job through a file only its user can read, handed
  over on SSH's standard input and deleted once read: never on a command line, in `docker
  inspect`, in the launcher's output or in the saved logs. Which names --env may set, and how
  they rank against the launcher's own variables, is launch/environment.py's.
- The project's Python dependencies travel as an image: in containers they become a layer on
  the training image, which the job then runs in (`Project.image`, made by
  provision.dependencies; `job_image`), and every node's copy of that image is checked against
  this machine's before anything starts (launch/image_check.py). Which requirements a project has,
  and host mode's check of each node's training_python, are launch/requirements.py's.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import subprocess
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from torch_multinode.cluster import sync, trust
from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch import stragglers
from torch_multinode.launch.requirements import Requirements, requirements
from torch_multinode.launch.spec import JobSpec

# The directory of the sitecustomize that starts the ranks' helpers in any script
# (training.distributed.site), within our packages: last on the import path of a job that runs
# a script or module of the user's (Project.import_path; a local job's too).
SITE_PATH = "training/distributed/site"

REMOTE_RUN_ROOT = "/tmp/torch-multinode/runs"
REMOTE_SECRETS_ROOT = "/tmp/torch-multinode/secrets"
SECRETS_FILE = "env"
# Flags of our workloads (and of many scripts) that name node-local directories.
ROOTED_FLAGS = {"--checkpoint-dir": "checkpoint_root", "--data-dir": "data_root"}
# This machine's roots for them, a job without an inventory's: these directories in the one
# `train` is typed in (beside .runs/), never in the project that runs.
LOCAL_ROOTS = {"checkpoint_root": "checkpoints", "data_root": "data"}
# Flags of our workloads (and of many scripts) that name what a job writes: a rerun gives each
# a place of its own (launch.runs), the record names them (launch.record) and the code snapshot
# leaves them out (launch.snapshot). --data-dir is read, not written.
OUTPUT_FLAGS = ("--checkpoint-dir", "--run-dir", "--out-dir", "--out")


@dataclass(frozen=True)
class Project:
    """The trees a job takes to every node, where each lives there, and how the job runs."""

    trees: tuple[tuple[sync.Tree, str], ...]  # (tree, directory on every node)
    workdir: str  # the job's working directory on the node (and in the container)
    script: str | None  # the script's path on the node, when the job runs a script
    requirements: Requirements | None = None  # the project's Python dependencies
    image: str | None = None
    """The image a job in containers runs in, where not the inventory's training image: the
    layer of the project's dependencies on it (provision.dependencies)."""
    image_ready: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """What makes that layer ready on the nodes (provision.dependencies.begin_for_inventory's
    second half), called before their images are checked."""

    @property
    def python_path(self) -> str:
        """The job's import path: its project first, then the parent of our packages'
        torch_multinode/ directory (nothing of ours under a generic name)."""
        return ":".join(
            sync.tool_import_path(remote) if remote.endswith("/" + sync.TOOL_PACKAGE) else remote
            for _, remote in self.trees
        )

    def import_path(self, spec: JobSpec) -> str:
        """python_path, then, for a job that runs a script or module of the user's
        (stragglers.watched), the directory of our sitecustomize on the nodes (SITE_PATH:
        the ranks' helpers started in any script)."""
        if not stragglers.watched(spec):
            return self.python_path
        sites = [
            site_import_path(remote)
            for _, remote in self.trees
            if remote.endswith("/" + sync.TOOL_PACKAGE)
        ]
        return ":".join([self.python_path, *sites[:1]])


def site_import_path(destination: str) -> str:
    """SITE_PATH in our packages sent to `destination` (or in sync.TOOL_ROOT, here)."""
    return posixpath.join(destination.rstrip("/"), SITE_PATH)


def project_root(script: Path | None, workdir: Path | None) -> Path | None:
    """The directory that travels: WORKDIR, else the git work tree holding the script, else the
    script's own directory; None for a module job without WORKDIR (this project's packages)."""
    if workdir is not None:
        root = workdir.resolve()
        if not root.is_dir():
            raise UserError(f"WORKDIR={workdir} is not a directory", hint="WORKDIR=a directory")
        if script is not None and not script.resolve().is_relative_to(root):
            raise UserError(
                f"SCRIPT={script} is not inside WORKDIR={workdir}",
                hint="a WORKDIR that holds the script, or no WORKDIR",
            )
        return root
    if script is None:
        return None
    directory = script.resolve().parent
    return sync.git_root(directory) or directory


def job_image(inventory: Inventory, project: Project | None) -> str:
    """The image a job in containers runs in: its project's dependency layer where it has one,
    else the inventory's training image."""
    return project.image if project is not None and project.image else inventory.training_image


def plan(
    inventory: Inventory,
    script: Path | None,
    workdir: Path | None,
    limit: int = sync.DEFAULT_WORKDIR_LIMIT,
    given_requirements: str | None = None,
) -> Project:
    """The job's trees, listed and hashed once on the controller, and its requirements; a
    workdir over `limit` bytes stops here, naming what is big."""
    root = project_root(script, workdir)
    tool = sync.tool_tree()
    tool_remote = sync.tool_destination(inventory)
    wanted = requirements(root, given_requirements)
    if root is None:
        # It runs in the parent of the torch_multinode/ directory: `python -m` puts the working
        # directory on the import path, and there it adds no generic name.
        return Project(((tool, tool_remote),), sync.tool_import_path(tool_remote), None, wanted)
    tree = sync.project_tree(root)
    sync.check_size(tree, limit)
    remote = sync.remote_dir(inventory.workdir_root, root)
    on_node = None
    if script is not None:
        on_node = f"{remote}/{script.resolve().relative_to(root).as_posix()}"
        if on_node.removeprefix(remote + "/") not in tree.files:
            raise UserError(
                f"SCRIPT={script} would not travel with its project: git ignores it, or it sits "
                "in a directory that never does (a cache, a virtual environment)",
                hint="a script that is part of the project",
            )
    if root == sync.TOOL_ROOT:
        return Project(((tree, remote),), remote, on_node, wanted)  # our packages are in it
    return Project(((tree, remote), (tool, tool_remote)), remote, on_node, wanted)


def mounts(inventory: Inventory, project: Project, run_dir: str) -> list[tuple[str, bool]]:
    """(path, read-only) of every node directory a job's container sees at the same path."""
    found = [(remote, False) for _, remote in project.trees]
    found += [(run_dir, False), (inventory.checkpoint_root, False), (inventory.data_root, False)]
    found += [(mount.path, mount.read_only) for mount in inventory.container_mounts]
    return found


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def flag_values(
    args: tuple[str, ...] | list[str], flags: Collection[str]
) -> list[tuple[int, str, str, bool]]:
    """(index, flag, value, with '=') of each of `flags` given a value in `args` (`--flag value`
    or `--flag=value`); `index` is where the value is, the flag's own word for `--flag=value`."""
    found = []
    for index, argument in enumerate(args):
        flag, equals, value = argument.partition("=")
        if flag not in flags:
            continue
        if not equals:
            if index + 1 >= len(args):
                continue  # the workload reports its own missing value
            found.append((index + 1, flag, args[index + 1], False))
        else:
            found.append((index, flag, value, True))
    return found


def _rooted(flag: str, value: str, field: str, root: str, here: bool) -> str:
    """`value` of `flag` made absolute under `root` (its `field`) where relative: refused with
    '~', and where it leaves the root."""
    where = "this machine's " if here else ""
    if value.startswith("~"):
        raise UserError(
            f"{flag} {shown(value)}: '~' would mean the home directory of whoever runs the "
            "job on each node"
            + (", and a job on this machine follows the nodes' rule" if here else ""),
            hint=f"a path relative to {where}{field} ({root}), or an absolute one",
        )
    path = posixpath.normpath(value if posixpath.isabs(value) else posixpath.join(root, value))
    if not posixpath.isabs(value) and not _under(path, root):
        raise UserError(f"{flag} {shown(value)} leaves {where}{field} {root}")
    return path


def resolve_paths(
    args: tuple[str, ...], inventory: Inventory, project: Project, run_dir: str
) -> tuple[tuple[str, ...], list[str]]:
    """The job's arguments with a relative --checkpoint-dir/--data-dir made absolute under the
    inventory's root for it, and what was done, as lines to show. In a container, such a
    directory outside every mount is refused: it would vanish with the container, or be empty
    there."""
    result, notes = list(args), []
    visible = mounts(inventory, project, run_dir)
    for target, flag, value, equals in flag_values(args, ROOTED_FLAGS):
        field = ROOTED_FLAGS[flag]
        root = getattr(inventory, field)
        path = _rooted(flag, value, field, root, here=False)
        if not posixpath.isabs(value):
            notes.append(f"{flag} {value} is {path} on every node ({field})")
        if inventory.launch_mode == "container" and not any(_under(path, m) for m, _ in visible):
            roots = [inventory.checkpoint_root, inventory.data_root]
            where = ", ".join(roots + [mount.path for mount in inventory.container_mounts])
            what = (
                "would vanish with the container"
                if field == "checkpoint_root"
                else "is not visible in the container"
            )
            raise UserError(
                f"{flag} {path} is outside every directory mounted into the job's container "
                f"({where}): it {what}",
                hint=f"a relative {flag} (under {field} {root}), or adding {path} to the "
                "inventory's container_mounts",
            )
        result[target] = f"{flag}={path}" if equals else path
    return tuple(result), notes


def local_roots(here: Path | None = None) -> dict[str, Path]:
    """This machine's checkpoint and data roots, for a job without an inventory: checkpoints/
    and data/ in `here` (default: the directory `train` is typed in, beside .runs/)."""
    base = (Path.cwd() if here is None else here).absolute()
    return {field: base / name for field, name in LOCAL_ROOTS.items()}


def resolve_local_paths(
    args: tuple[str, ...], here: Path | None = None
) -> tuple[tuple[str, ...], list[str]]:
    """The nodes' rule on this machine: a relative --checkpoint-dir/--data-dir made absolute
    under this machine's root for it (`local_roots`), '~' and a path leaving its root refused
    as on the nodes; and what was done, as lines to show."""
    roots = local_roots(here)
    result, notes = list(args), []
    for target, flag, value, equals in flag_values(args, ROOTED_FLAGS):
        field = ROOTED_FLAGS[flag]
        path = _rooted(flag, value, field, str(roots[field]), here=True)
        if not posixpath.isabs(value):
            notes.append(f"{flag} {value} is {path} on this machine")
        result[target] = f"{flag}={path}" if equals else path
    return tuple(result), notes


def secrets_dir(run_id: str) -> str:
    return f"{REMOTE_SECRETS_ROOT}/{run_id}"


def secrets_text(variables: tuple[tuple[str, str], ...]) -> str:
    """The file a node's shell sources: `export NAME='value'` lines."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in variables)


def write_secrets_command(run_id: str) -> str:
    """Reads the file's text from standard input into a directory only the job's user can read."""
    directory = shlex.quote(secrets_dir(run_id))
    return f"umask 077 && mkdir -p {directory} && cat > {directory}/{SECRETS_FILE}"


def load_secrets(run_id: str) -> str:
    """Shell words that export the secrets, then delete the file: the job keeps them in its
    environment only."""
    path = shlex.quote(f"{secrets_dir(run_id)}/{SECRETS_FILE}")
    return f". {path} && rm -f {path}"


def fetch_run_dir(
    inventory: Inventory, master: Host, run_dir: str, local: Path
) -> tuple[int, str | None]:
    """Copy the master's run directory (what rank 0 wrote: TensorBoard events, traces, --out)
    into `local`: (files copied, None) or (0, why not)."""
    local.mkdir(parents=True, exist_ok=True)
    command = [
        "rsync",
        "--recursive",
        "--links",
        "--times",
        "--stats",
        f"--timeout={sync.RSYNC_TIMEOUT}",
        "-e",
        shlex.join(trust.openssh_command(inventory, master)),
        f"{sync.remote_target(master, run_dir)}/",
        f"{local}/",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, str(exc)
    if done.returncode != 0:
        return 0, sync.rsync_error(done.stderr.splitlines(), done.returncode)
    found = re.search(r"Number of regular files transferred: ([\d,]+)", done.stdout)
    return (int(found.group(1).replace(",", "")) if found else 0), None


def environment_names(variables: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(name for name, _ in variables)
