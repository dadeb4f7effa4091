"""What a valid inventory field is: the field vocabulary that the checks and the reading share
(field names, node directories and their defaults, limits), each value's check with the
message that names the fix, the group name's check, the typo help (a name within a typo of
one the project reads), and _Problems, which gathers every error and warning of one pass so
they are raised together (InventoryErrors where there are several).

The inventory flows read -> check -> model: this module imports the model
(cluster/inventory.py: the defaults, Mount), never the reading; cluster/inventory_validate.py
assembles Host and Inventory from these checks; cluster/inventory_read.py turns a file into the
document they are run on.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import ipaddress
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import NoReturn, TypeGuard

import yaml

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.cluster.inventory import (
    DEFAULT_CHECKPOINT_ROOT,
    DEFAULT_DATA_ROOT,
    DEFAULT_WORKDIR_ROOT,
    NODES_GROUP,
    Mount,
)

# The node-local directories a job keeps (cluster/inventory.py), each with its default.
STORAGE_ROOTS = {
    "checkpoint_root": DEFAULT_CHECKPOINT_ROOT,
    "data_root": DEFAULT_DATA_ROOT,
    "workdir_root": DEFAULT_WORKDIR_ROOT,
}
# Cluster-wide only: the launcher reads one value for every node, so a host of its own would
# have Ansible make one directory there and the job use another.
CLUSTER_ONLY_FIELDS = (*STORAGE_ROOTS, "container_mounts")
READ_ONLY_SUFFIX = ":ro"
REQUIRED_HOST_FIELDS = ("ansible_host", "compute_ip", "compute_interface", "gpus")
# Host fields that may say `auto`: found on the node itself (cluster/autodetect.py, by the
# commands that reach the nodes), the interface that holds compute_ip and nvidia-smi's count.
AUTO = "auto"
AUTO_FIELDS = ("compute_interface", "gpus")
# More GPUs than any one machine holds; also keeps counts and indices short enough to print.
MAX_GPUS = 1024
# Host keys are always checked (README, ansible.cfg): an inventory may not switch that off for
# Ansible through the SSH options it passes, nor trust a key on first use.
SSH_OPTION_FIELDS = (
    "ansible_ssh_common_args",
    "ansible_ssh_extra_args",
    "ansible_ssh_args",
    "ansible_scp_extra_args",
    "ansible_sftp_extra_args",
)


# Ansible's own variables, which every host has and no check reads.
_ANSIBLE_MAGIC = frozenset(
    {
        "ansible_config_file",
        "ansible_facts",
        "ansible_playbook_python",
        "ansible_python_interpreter",
        "ansible_version",
        "group_names",
        "groups",
        "inventory_dir",
        "inventory_file",
        "inventory_hostname",
        "inventory_hostname_short",
        "playbook_dir",
        "omit",
        "ansible_check_mode",
    }
)
# What the launcher reads once for the whole cluster: one value on every node.
CLUSTER_FIELDS = (
    "compute_subnet",
    "rendezvous_port",
    "ssh_known_hosts_file",
    "launch_mode",
    "scheduler",
    "training_image",
    "container_memlock",
    "image_registry",
    "image_registry_port",
    "image_base_from_nodes",
    "lighthouse_port",
    *CLUSTER_ONLY_FIELDS,
)


class InventoryErrors(UserError):
    """Several problems found in one pass. Its own message is the last one's; `lines()` gives
    every one of them, in order, which is what the CLIs print (one `Error: ...` line each)."""

    def __init__(self, errors: list[UserError]):
        super().__init__(str(errors[-1]), hint=errors[-1].hint)
        self.errors = errors

    def lines(self) -> list[str]:
        return [error.line() for error in self.errors]


class _Problems:
    """What one pass over an inventory found: errors (all raised together at the end) and
    warnings (printed, one line each, whatever the outcome)."""

    def __init__(self) -> None:
        self.errors: list[UserError] = []
        self.warnings: list[str] = []

    def add(self, error: UserError) -> None:
        self.errors.append(error)

    @contextlib.contextmanager
    def check(self):
        """A check whose UserError is recorded and the pass goes on."""
        try:
            yield
        except UserError as error:
            self.add(error)

    def fatal(self, error: UserError) -> NoReturn:
        """A problem after which nothing else can be checked: raised with those found so far."""
        self.add(error)
        self.raise_if_any()
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def fatal_on_error(self):
        try:
            yield
        except UserError as error:
            self.fatal(error)

    def warn_unknown(self, values: dict, where: str, skip=()) -> None:
        """A warning for each name the project does not read that is within a typo of one it
        does (Ansible's own variables and unrelated ones stay silent)."""
        for name in values:
            if not isinstance(name, str) or name in skip or name in _our_fields():
                continue
            close = _close_field(name)
            if close is not None and name not in _known_fields():
                self.warnings.append(
                    f"Warning: {where} '{printable(name)}' is not one the project reads; "
                    f"did you mean '{close}'?"
                )

    def raise_if_any(self) -> None:
        for line in self.warnings:
            print(printable(line), file=sys.stderr)
        self.warnings = []
        if not self.errors:
            return
        if len(self.errors) == 1:
            raise self.errors[0]
        raise InventoryErrors(self.errors)


# Host fields the project reads beyond the required ones.
OPTIONAL_HOST_FIELDS = (
    "ansible_port",
    "ansible_user",
    "ansible_ssh_private_key_file",
    "ansible_host_key_checking",
    "training_python",
    "cuda_visible_devices",
    "nccl_ib_hca",
    *SSH_OPTION_FIELDS,
)
# A name is taken for a typo of one of ours only when it is a near-miss of it in both ways:
# - difflib's ratio at least TYPO_CUTOFF: 'compute_interfce' 0.97, 'lanch_mode' 0.95, 'gpu'
#   0.86; 'gpu_count' (0.46) and 'cpus' (0.75, to gpus) are the user's own;
# - at most TYPO_EDITS slips of the finger over the whole name (a character added, dropped or
#   changed, two neighbours swapped), and not our name with whole words added or dropped.
# Other tools keep their own settings beside ours in the same group_vars: DeepOps'
# nvidia_driver_force_install is 0.88 like nvidia_driver_install, but a word more (six
# edits), so it is that tool's setting, never said to be a typo of ours; nor is a name of
# ours behind another tool's prefix (kube_gpus, deepops_gpus).
TYPO_CUTOFF = 0.8
TYPO_EDITS = 2
_ROLES = Path(__file__).resolve().parent.parent / "ansible" / "roles"


@functools.cache
def _our_fields() -> tuple[str, ...]:
    """Every variable the project reads: the inventory's fields, and the roles' defaults (an
    inventory may override them), where this checkout has the roles."""
    names = {*REQUIRED_HOST_FIELDS, *CLUSTER_FIELDS, *OPTIONAL_HOST_FIELDS, "node_group"}
    for defaults in sorted(_ROLES.glob("*/defaults/main.yml")):
        with contextlib.suppress(OSError, yaml.YAMLError, UnicodeDecodeError):
            found = yaml.safe_load(defaults.read_text(encoding="utf-8"))
            if isinstance(found, dict):
                names.update(name for name in found if isinstance(name, str))
    return tuple(sorted(names))


@functools.cache
def _known_fields() -> frozenset[str]:
    """Ours, and Ansible's own: its magic variables and its names for a host's connection
    (ansible.constants.MAGIC_VARIABLE_MAPPING), which are silent even where close to one of ours
    (ansible_ssh_user is ansible_user's older name, not a typo of it). Asked only of a name
    close to one of ours, or where Ansible read the inventory: Ansible's constants take 0.3 s
    to import."""
    from ansible import constants

    theirs = {name for names in constants.MAGIC_VARIABLE_MAPPING.values() for name in names}
    return frozenset(_our_fields()) | frozenset(theirs) | _ANSIBLE_MAGIC


def _close_field(name: str) -> str | None:
    """The field of ours `name` is within a typo of (the rule at TYPO_CUTOFF), or None."""
    lowered = name.lower()
    for found in difflib.get_close_matches(lowered, _our_fields(), n=3, cutoff=TYPO_CUTOFF):
        if _edits(lowered, found) <= TYPO_EDITS and not _words_added(lowered, found):
            return found
    return None


def _edits(a: str, b: str) -> int:
    """Single-character edits from `a` to `b`: inserts, deletes, changes, and swaps of two
    neighbours (the optimal string alignment distance)."""
    before, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            cost = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, row = row, current
    return row[-1]


def _words_added(name: str, ours: str) -> bool:
    """Whether `name` is `ours` with whole words ('_'-separated) added or dropped."""
    theirs, mine = set(name.split("_")) - {""}, set(ours.split("_")) - {""}
    return theirs != mine and (theirs <= mine or mine <= theirs)


def _typo_of(field: str, values: dict) -> str | None:
    """The name among `values` that looks like a typo of `field`, or None."""
    for name in values:
        if isinstance(name, str) and _close_field(name) == field and name not in _known_fields():
            return name
    return None


def _missing(message: str, field: str, values: dict, typos: set[str]) -> UserError | None:
    """`message` (a required field is missing) naming the variable that looks like its typo
    (added to `typos`), or None where there is none."""
    name = _typo_of(field, values)
    if name is None:
        return None
    typos.add(name)
    return UserError(
        f"{message}; '{printable(name)}' looks like a typo of it",
        hint=f"renaming {printable(name)} to {field}",
    )


def vars_field(where: str, group: str) -> str:
    """How a message names a variable set for a whole group: `where` followed by "cluster
    field" for all's (all.vars, [all:vars], group_vars/all.yml), else by "vars of group 'G':
    field" ([G:vars], all.children.G.vars, group_vars/G.yml)."""
    if group == "all":
        return f"{where}: cluster field"
    return f"{where}: vars of group '{printable(group)}': field"


def check_group(group: object) -> str:
    """A group name as Ansible reads it in an inventory and in a host pattern (the playbook's
    `hosts:`): letters, digits, '_', '-' and '.', starting with a letter, digit or '_'.
    Ansible reads '-' and '.' (DeepOps' slurm-node) with a warning, which the reading passes
    on (cluster/inventory_read.py); what a pattern or the command line would take apart
    (',', ':', '!', '&', '*', '[', whitespace, a leading '-') is refused."""
    if not isinstance(group, str) or not _GROUP.fullmatch(group):
        raise UserError(
            f"--group {shown(group)} is not an Ansible group name",
            hint="letters, digits, '_' and '-', such as GROUP=gpu_nodes or GROUP=slurm-node",
        )
    return group


_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
GROUP_HELP = (
    f"the inventory group whose hosts are the nodes, in rank order (default: {NODES_GROUP}; "
    "make GROUP=...)"
)


def is_word(value) -> TypeGuard[str]:
    """A non-empty string with no whitespace or control character: an address, a path, a
    user, an image name. Such values reach command lines and environment variables."""
    return (
        isinstance(value, str)
        and value != ""
        and not any(c.isspace() or not c.isprintable() for c in value)
    )


def _directory(value, where: str, example: str, suffix: str = "") -> str:
    """A node directory as `docker run -v` takes it: absolute, normalised, not '/', no
    whitespace, and no ':' or ',' (they separate -v's and --mount's parts). `suffix` is what
    followed the path in the inventory (':ro'), shown with it in the error."""
    given = shown(value + suffix if isinstance(value, str) else value)
    if not isinstance(value, str) or value == "":
        raise UserError(
            f"{where}: {given} is not a directory path", hint=f"an absolute path such as {example}"
        )
    if not is_word(value):
        raise UserError(f"{where}: {given} holds whitespace or a control character")
    if ":" in value or "," in value:
        raise UserError(
            f"{where}: {given} holds ':' or ',', which docker run -v cannot mount",
            hint="a directory whose path has neither",
        )
    if not value.startswith("/"):
        raise UserError(
            f"{where}: {given} is not an absolute path", hint=f"a path from /, such as {example}"
        )
    # normpath keeps a leading '//' (POSIX leaves its meaning open); Linux reads it as '/'.
    normal = "/" + posixpath.normpath(value).lstrip("/")
    if normal == "/":
        raise UserError(
            f"{where}: {given} is the root directory",
            hint=f"a directory of its own, such as {example}",
        )
    if value != normal:
        raise UserError(f"{where}: {given} is not a normalised path", hint=normal + suffix)
    return value


def _check_distinct(roots: dict[str, str], where: str) -> None:
    seen: dict[str, str] = {}
    for field, path in roots.items():
        if path in seen:
            raise UserError(
                f"{where}: cluster field '{field}': {shown(path)} is also {seen[path]}",
                hint="a directory of its own",
            )
        seen[path] = field


def _mounts(value, where: str, roots: dict[str, str]) -> tuple[Mount, ...]:
    """container_mounts: a list of "PATH" or "PATH:ro"; absent or empty for none. A path
    mounted twice (or one of the roots, which jobs get anyway) would stop `docker run`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise UserError(
            f"{where}: {shown(value)} is not a list", hint='a list such as ["/datasets:ro"]'
        )
    found: list[Mount] = []
    for item in value:
        read_only = isinstance(item, str) and item.endswith(READ_ONLY_SUFFIX)
        path = item[: -len(READ_ONLY_SUFFIX)] if read_only else item
        if isinstance(path, str) and ":" in path:
            raise UserError(
                f"{where}: {shown(item)} is neither PATH nor PATH:ro",
                hint="PATH:ro for read-only, PATH alone for read-write",
            )
        suffix = READ_ONLY_SUFFIX if read_only else ""
        path = _directory(path, where, "/datasets:ro", suffix)
        for other in found:
            if other.path == path:
                raise UserError(f"{where}: {shown(item)} mounts {path} a second time")
        for field, root in roots.items():
            if path == root:
                raise UserError(
                    f"{where}: {shown(item)} is the cluster's {field}",
                    hint="removing it from container_mounts",
                )
        found.append(Mount(path, read_only))
    return tuple(found)


def _check_host_keys_stay_checked(values: dict, where: str) -> None:
    checking = values.get("ansible_host_key_checking", True)
    if checking is False or _text(checking).strip().lower() in ("false", "no", "0", "off"):
        raise UserError(
            f"{where}: field 'ansible_host_key_checking': {shown(checking)} turns off SSH "
            "host-key checking",
            hint="removing it, and each node's key in known_hosts",
        )
    for field in SSH_OPTION_FIELDS:
        found = trust.host_keys_turned_off(_text(values.get(field) or ""))
        if found:
            raise UserError(
                f"{where}: field '{field}': {shown(found)} turns off SSH host-key checking",
                hint=trust.CHECKED_HOST_KEYS_HINT,
            )


def _text(value) -> str:
    """str(value) as Ansible would see it; '' for an int too long to convert."""
    try:
        return str(value)
    except ValueError:
        return ""


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping, not {type(value).__name__}")
    return value


def _subnet(value, where: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(str(value), strict=True)
    except ValueError as exc:
        raise UserError(
            f"{where}: cluster field 'compute_subnet': {shown(value)} is not an IPv4 network "
            f"({printable(str(exc))})",
            hint="a form like 192.168.1.0/24",
        ) from None


def _boolean(values: dict, field: str, default: bool, where: str) -> bool:
    value = values.get(field, default)
    if not isinstance(value, bool):
        raise UserError(
            f"{where}: cluster field '{field}': {shown(value)} is neither true nor false"
        )
    return value


def _port(value, where: str, field: str = "rendezvous_port") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise UserError(f"{where}: field '{field}': {shown(value)} is not a port number (1-65535)")
    return value


def _optional_path(value, where: str, field: str) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.isprintable():
        raise UserError(f"{where}: field '{field}': {shown(value)} is not a file path")
    return Path(os.path.expanduser(value))


# NCCL_IB_HCA as NCCL 2.30.7 parses it (net_ib/init.cc, misc/utils.cc): "^" to exclude, "=" for
# exact names, then comma-separated device names, each with an optional ":port".
_IB_HCA = re.compile(r"\^?=?[A-Za-z0-9_.-]+(?::\d+)?(?:,[A-Za-z0-9_.-]+(?::\d+)?)*")


def nccl_ib_hca(value, where: str) -> str | None:
    """nccl_ib_hca: the RDMA devices NCCL may use for training (NCCL_IB_HCA), or None."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _IB_HCA.fullmatch(value):
        raise UserError(
            f"{where}: field 'nccl_ib_hca': {shown(value)} is not an NCCL_IB_HCA list",
            hint="device names separated by commas, each with an optional :port, such as "
            "=mlx5_0:1,mlx5_1:1 (= for exact names, ^ first to exclude them)",
        )
    return value


def parse_gpu_list(value, where: str = "GPUS") -> tuple[int, ...] | None:
    """'0,2' (or [0, 2], or 3) -> (0, 2); None or '' -> None (no selection)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, list):
        items = value
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]  # not str(value): an int of over 4300 digits has no str()
    else:
        items = str(value).split(",")
    indices = []
    for item in items:
        index = _gpu_index(item)
        if index is None:
            raise UserError(
                f"{where}: {shown(value)} is not a list of GPU indices", hint="a form like 0,2"
            )
        if index >= MAX_GPUS:
            raise UserError(
                f"{where}: {shown(value)} names a GPU beyond what one node holds "
                f"(indices 0-{MAX_GPUS - 1})"
            )
        indices.append(index)
    if len(set(indices)) != len(indices):
        raise UserError(f"{where}: {shown(value)} names a GPU twice")
    return tuple(indices)


def _gpu_index(item) -> int | None:
    """A GPU index, MAX_GPUS for any index beyond it, or None when `item` is not one."""
    if isinstance(item, int) and not isinstance(item, bool):
        return min(item, MAX_GPUS) if item >= 0 else None
    text = str(item).strip()
    # ASCII only: '²' is a digit to str.isdigit() but not to int().
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"  # int() refuses strings of over 4300 digits
    return int(digits) if len(digits) <= len(str(MAX_GPUS)) else MAX_GPUS
