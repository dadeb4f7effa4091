"""The one inventory: an Ansible YAML file that provisioning, netcheck and the launcher all read.

Layout (see inventory.example.yml):

    all:
      vars:                       # cluster-wide
        compute_subnet: 192.168.1.0/24
        rendezvous_port: 29500
      children:
        nodes:
          hosts:                  # in rank order: the first host is the master (rank 0)
            pc1:
              ansible_host: 192.168.1.10    # where SSH reaches the node
              compute_ip: 192.168.1.10      # the address training traffic uses
              compute_interface: enp3s0
              gpus: 1

Variables merge the way Ansible merges them: all.vars, then nodes.vars, then the host's own.
An inventory that only Ansible's own reading resolves (INI, group_vars/ or host_vars/ beside
it, host ranges, groups nested in `nodes`) is read through ansible-core's inventory loader and
variable manager, so provisioning, netcheck and the launcher see the same values; a plain YAML
file reads the same either way and is read directly, for errors with line numbers.
Validation happens entirely here, before any caller acts, in one pass: every problem found is
one `Error:` line naming the host and the field (raised together: InventoryErrors where there
were several, whose lines() the CLIs print); a name within a typo of one the project reads is a
`Warning:` line.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import ipaddress
import os
import posixpath
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

import yaml

from torch_multinode.cluster.errors import UserError, printable, shown

NODES_GROUP = "nodes"
DEFAULT_RENDEZVOUS_PORT = 29500
DEFAULT_TRAINING_IMAGE = "torch-multinode/train:latest"
# The controller's image registry (ansible/roles/image_registry, provision/ship.py).
DEFAULT_IMAGE_REGISTRY_PORT = 5000
# Node-local directories a job keeps, the same on every node and mounted at the same path in
# its container (ansible/roles/job_storage makes them; a test keeps its defaults equal).
DEFAULT_CHECKPOINT_ROOT = "/var/lib/torch-multinode/checkpoints"
DEFAULT_DATA_ROOT = "/var/lib/torch-multinode/data"
DEFAULT_WORKDIR_ROOT = "/var/lib/torch-multinode/work"
STORAGE_ROOTS = {
    "checkpoint_root": DEFAULT_CHECKPOINT_ROOT,
    "data_root": DEFAULT_DATA_ROOT,
    "workdir_root": DEFAULT_WORKDIR_ROOT,
}
# Cluster-wide only: the launcher reads one value for every node, so a host of its own would
# have Ansible make one directory there and the job use another.
CLUSTER_ONLY_FIELDS = (*STORAGE_ROOTS, "container_mounts")
READ_ONLY_SUFFIX = ":ro"
LAUNCH_MODES = ("container", "host")
# How jobs reach the nodes: the launcher over SSH, or Slurm from the distribution's packages.
SCHEDULERS = ("ssh", "slurm")
REQUIRED_HOST_FIELDS = ("ansible_host", "compute_ip", "compute_interface", "gpus")
REQUIRED_CLUSTER_FIELDS = ("compute_subnet",)
# RFC 1123 host label: letters, digits and hyphens, 1-63 long, no hyphen at either end.
# Matched whole (fullmatch): with match() and `$`, "pc1\n" passed as a valid name.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Linux interface names: at most 15 bytes, no slash, whitespace, colon or control character.
_IFNAME = re.compile(r"[^/\s:\x00-\x1f\x7f]{1,15}")
IFNAME_BYTES = 15
# More GPUs than any one machine holds; also keeps counts and indices short enough to print.
MAX_GPUS = 1024
# setrlimit takes a 64-bit value; docker's --ulimit a signed one.
MAX_MEMLOCK = 2**63 - 1
# Host keys are always checked (README, ansible.cfg): an inventory may not switch that off for
# Ansible through the SSH options it passes, nor trust a key on first use.
SSH_OPTION_FIELDS = (
    "ansible_ssh_common_args",
    "ansible_ssh_extra_args",
    "ansible_ssh_args",
    "ansible_scp_extra_args",
    "ansible_sftp_extra_args",
)
_UNCHECKED_HOST_KEYS = re.compile(
    r"StrictHostKeyChecking\s*=?\s*[\"']?(no|off|false|accept-new)\b"
    r"|(UserKnownHostsFile|GlobalKnownHostsFile)\s*=?\s*[\"']?/dev/null",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Host:
    """One node, with every field the project uses resolved and checked."""

    name: str
    ssh_address: str
    ssh_port: int
    ssh_user: str | None
    ssh_key: Path | None
    compute_ip: ipaddress.IPv4Address
    compute_interface: str
    gpus: int
    python: str = "python3"
    """The interpreter on the node that has torch (host mode; jobs in a container use its own)."""
    visible_gpus: tuple[int, ...] | None = None
    """This node's own GPU selection (host var cuda_visible_devices), over the job's GPUS."""


@dataclass(frozen=True)
class Mount:
    """A node directory mounted into every job's container at the same path."""

    path: str
    read_only: bool = False


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: tuple[Host, ...]
    compute_subnet: ipaddress.IPv4Network
    rendezvous_port: int
    known_hosts: Path | None
    launch_mode: str = "container"
    """'container': jobs run in training_image on each node; 'host': with each node's Python."""
    training_image: str = DEFAULT_TRAINING_IMAGE
    container_memlock: str = "unlimited"
    """Locked-memory limit for the training container: 'unlimited' (what RDMA wants) or bytes."""
    checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT
    """Node-local directory for checkpoints; a relative --checkpoint-dir lands under it."""
    data_root: str = DEFAULT_DATA_ROOT
    """Node-local directory for datasets; a relative --data-dir lands under it."""
    workdir_root: str = DEFAULT_WORKDIR_ROOT
    """Where the project's code is synced on each node."""
    container_mounts: tuple[Mount, ...] = ()
    """More node directories for the job's container (inventory: "PATH" or "PATH:ro")."""
    group: str = NODES_GROUP
    """The Ansible group whose hosts are the nodes (--group, make GROUP=)."""
    scheduler: str = "ssh"
    """'ssh': the launcher starts jobs over SSH; 'slurm': provisioning also sets Slurm up."""
    image_registry: bool = True
    """Whether the training image travels through the controller's registry (by layers)."""
    image_registry_port: int = DEFAULT_IMAGE_REGISTRY_PORT
    image_base_from_nodes: bool = False
    """Each node pulls the image's base (e.g. NVIDIA's, from nvcr.io) itself; the controller
    sends only the layers above it."""

    @property
    def known_hosts_file(self) -> Path:
        """The file every SSH client of ours checks the nodes' host keys against (paramiko,
        OpenSSH for rsync, bootstrap): ssh_known_hosts_file, else ~/.ssh/known_hosts."""
        return known_hosts_file(self.known_hosts)

    @property
    def master(self) -> Host:
        """Rank 0's node: the first host, where the rendezvous store runs."""
        return self.hosts[0]

    def first(self, nnodes: object) -> Inventory:
        """The same inventory narrowed to its first `nnodes` hosts, in rank order (None or '':
        all of them), checked once here; a job, netcheck or a copy then takes it whole."""
        if nnodes is None or nnodes == "":
            return self
        return replace(self, hosts=self.hosts[: check_nnodes(nnodes, len(self.hosts), self.path)])


def known_hosts_file(named: Path | None) -> Path:
    """The known_hosts file named, else ~/.ssh/known_hosts (OpenSSH's default), expanded."""
    return Path(os.path.expanduser(named or Path("~/.ssh/known_hosts")))


def check_nnodes(nnodes: object, available: int, path: Path | str) -> int:
    if isinstance(nnodes, str):
        try:
            nnodes = int(nnodes)
        except ValueError:
            raise UserError(f"NNODES={nnodes!r} is not a whole number") from None
    if not isinstance(nnodes, int) or isinstance(nnodes, bool):
        raise UserError(f"NNODES={nnodes!r} is not a whole number")
    if nnodes < 1:
        raise UserError(f"NNODES={nnodes} is below 1", hint="NNODES=1 or more")
    if nnodes > available:
        raise UserError(
            f"NNODES={nnodes} but inventory {path} lists {available} host(s)",
            hint=f"NNODES={available} or add hosts to the inventory",
        )
    return nnodes


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; a duplicated host name must be an error."""

    def construct_mapping(self, node, deep=False):
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # let SafeLoader report an unhashable key itself
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first_line, line):
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


def load(path: str | os.PathLike | None, group: str = NODES_GROUP) -> Inventory:
    """Read and validate an inventory file; the nodes are the hosts of `group`. Raises
    UserError (InventoryErrors, all of them, where there are several) after checking it all."""
    check_group(group)
    if path is None or str(path).strip() == "":
        raise UserError(
            "no inventory given",
            hint="INVENTORY=path/to/inventory.yml (see inventory.example.yml), or "
            "'make sim-up' and INVENTORY=.sim/inventory.yml for the simulated cluster",
        )
    path = Path(path)
    if path.is_dir():
        # A directory, as Ansible takes one: every inventory file in it, with the group_vars/
        # and host_vars/ it holds.
        return _through_ansible(path, group)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"inventory {path} does not exist", hint="a path to an existing file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"inventory {path} cannot be read: {exc}") from None
    except ValueError as exc:  # a NUL in the path, possible only from inside Python
        raise UserError(f"inventory {shown(str(path))} cannot be read: {exc}") from None
    # Only Ansible's own reading gives the values of an inventory with group_vars/ or
    # host_vars/ beside it, in INI, with a host range (node[01:04]) or groups inside the nodes
    # group. A plain YAML file reads the same either way, and reading it directly keeps its
    # errors precise (line numbers, duplicate keys).
    if any((path.parent / name).is_dir() for name in ("group_vars", "host_vars")):
        return _through_ansible(path, group)
    yaml_file = path.suffix.lower() in YAML_SUFFIXES
    try:
        data = _yaml(text, f"inventory {path}")
    except UserError:
        if yaml_file:
            raise
        return _through_ansible(path, group)
    if (not isinstance(data, dict) and not yaml_file) or _needs_ansible(data, group):
        return _through_ansible(path, group)
    problems = _Problems()
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


def _through_ansible(path: Path, group: str) -> Inventory:
    problems = _Problems()
    _check_defined_once(_sources(path), f"inventory {path}", problems)
    return _validate(resolve_with_ansible(path, group, problems), path, group, problems)


def check_group(group: object) -> str:
    """An Ansible group name: letters, digits and underscores, not starting with a digit."""
    if not isinstance(group, str) or not _GROUP.fullmatch(group):
        raise UserError(
            f"--group {shown(group)} is not an Ansible group name",
            hint="letters, digits and underscores, such as GROUP=gpu_nodes",
        )
    return group


_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GROUP_HELP = (
    f"the inventory group whose hosts are the nodes, in rank order (default: {NODES_GROUP}; "
    "make GROUP=...)"
)


def _needs_ansible(data, group: str = NODES_GROUP) -> bool:
    """Whether a YAML inventory has what only Ansible resolves: a host range in the group of
    the nodes, or groups nested in it; or, for a group other than the default, the group not
    directly under all.children (Ansible finds it wherever it is)."""
    top = data.get("all") if isinstance(data, dict) else None
    children = top.get("children") if isinstance(top, dict) else None
    found = children.get(group) if isinstance(children, dict) else None
    if not isinstance(found, dict):
        return group != NODES_GROUP and isinstance(top, dict)
    hosts = found.get("hosts") if isinstance(found.get("hosts"), dict) else {}
    return "children" in found or any(_HOST_RANGE.search(str(name)) for name in hosts)


# Ansible's host range: node[01:04], node[a:c], node[0:10:2].
_HOST_RANGE = re.compile(r"\[[0-9A-Za-z]+:[0-9A-Za-z]+(:[0-9]+)?\]")
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
    *CLUSTER_ONLY_FIELDS,
)
YAML_SUFFIXES = (".yml", ".yaml", ".json")


def _plain(value):
    """A value as plain Python types (Ansible tags its strings and numbers)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolve_with_ansible(
    path: Path, group: str = NODES_GROUP, problems: _Problems | None = None
) -> dict:
    """The inventory as ansible-playbook sees it (ansible-core's inventory loader and variable
    manager: YAML or INI, group_vars/ and host_vars/, ranges, nested groups), as a document in
    the plain layout: the hosts of `group` in order, each with every variable it resolves to,
    and the cluster-wide fields once (refused where two hosts disagree). Errors go into
    `problems` where given (raised with the others), else are raised here."""
    where = f"inventory {path}"
    own_problems = problems is None
    problems = _Problems() if problems is None else problems
    saved = {key: os.environ.get(key) for key in _ANSIBLE_SETTINGS}
    os.environ.update(_ANSIBLE_SETTINGS)
    try:
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager

        loader = DataLoader()
        said = io.StringIO()  # Ansible's own warnings: the reason goes into our one line
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                manager = InventoryManager(loader=loader, sources=[str(path)])
            variables = VariableManager(loader=loader, inventory=manager)
            nodes = manager.groups.get(group)
            hosts = nodes.get_hosts() if nodes is not None else []
            resolved = {
                host.name: {
                    key: _plain(value)
                    for key, value in variables.get_vars(host=host, include_hostvars=False).items()
                    if key not in _ANSIBLE_MAGIC
                }
                for host in hosts
            }
        except AnsibleError:
            reasons = re.findall(
                r"Failed to parse inventory with '\w+' plugin: (?:Failed to parse inventory: )?(.+)",
                said.getvalue(),
            )
            problems.fatal(
                UserError(
                    f"{where}: Ansible cannot read it as YAML or INI"
                    + (f": {reasons[-1]}" if reasons else ""),
                    hint=f"the layout of inventory.example.yml, or an INI inventory with a "
                    f"[{group}] group",
                )
            )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if not resolved:
        problems.fatal(
            UserError(
                f"{where}: no hosts in group '{group}' as Ansible reads it",
                hint=f"listing the nodes in a group named {group} (inventory.example.yml)",
            )
        )
    cluster: dict = {}
    first_name = next(iter(resolved))
    for field in CLUSTER_FIELDS:
        values = {name: own[field] for name, own in resolved.items() if field in own}
        if not values:
            continue
        distinct = {repr(value) for value in values.values()}
        if len(distinct) > 1 or len(values) != len(resolved):
            other = next(n for n in resolved if repr(values.get(n)) != repr(values.get(first_name)))
            here, there = (
                shown(values[name]) if name in values else "unset" for name in (other, first_name)
            )
            problems.add(
                UserError(
                    f"{where}: host '{printable(other)}': field '{field}' is cluster-wide: "
                    f"the same on every node ({here} here, {there} on '{printable(first_name)}')",
                    hint="setting it once, for all (group_vars/all.yml or all.vars)",
                )
            )
            continue
        cluster[field] = values[first_name]
    # A variable the project does not read, the same on every host (set for a group, or in
    # group_vars/all.yml), is one cluster-wide value: a typo in it is reported once, not per host.
    for key, value in next(iter(resolved.values())).items():
        if (
            key not in CLUSTER_FIELDS
            and isinstance(key, str)
            and key not in _known_fields()
            and all(key in own and repr(own[key]) == repr(value) for own in resolved.values())
        ):
            cluster[key] = value
    hosts_doc = {
        name: {key: value for key, value in own.items() if key not in CLUSTER_FIELDS}
        for name, own in resolved.items()
    }
    hosts_doc = {
        name: {key: value for key, value in own.items() if key not in cluster}
        for name, own in hosts_doc.items()
    }
    if own_problems:
        problems.raise_if_any()
    return {"all": {"vars": cluster, "children": {group: {"hosts": hosts_doc}}}}


# Read by ansible-core when it is first imported: only the inventory formats a user writes by
# hand (no executable inventory script runs), and a file it cannot parse is an error.
_ANSIBLE_SETTINGS = {
    "ANSIBLE_INVENTORY_ENABLED": "yaml,ini",
    "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
    "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
    "ANSIBLE_LOCALHOST_WARNING": "False",
}


def parse(text: str, path: Path | str = "<inventory>", group: str = NODES_GROUP) -> Inventory:
    """An inventory in the plain YAML layout, from its text."""
    path = Path(path)
    data = _yaml(text, f"inventory {path}")
    group = check_group(group)
    problems = _Problems()
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


def _yaml(text: str, where: str):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except _DuplicateKey as dup:
        raise UserError(
            f"{where}: line {dup.line}: duplicate key {shown(dup.key)} (first on line "
            f"{dup.first_line})",
            hint="giving each host a unique name",
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where} is not valid YAML{at}: {problem}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively: a few hundred '[' exhaust the stack.
        raise UserError(f"{where} is nested too deeply to be an inventory") from None
    except ValueError as exc:
        # What SafeLoader's constructors let through: a date like 2024-02-30, or an integer of
        # more digits than Python converts (its message goes on to suggest a Python setting).
        reason = str(exc).split(";")[0]
        raise UserError(f"{where} holds a value YAML cannot read: {reason}") from None


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
    *SSH_OPTION_FIELDS,
)
# How close a name must be to one of ours to be taken for its typo (difflib's ratio):
# 'compute_interfce' 0.97, 'lanch_mode' 0.95, 'gpu' 0.86; 'gpu_count' (0.46) is the user's own.
TYPO_CUTOFF = 0.8
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
    """The field of ours `name` is within a typo of, or None."""
    found = difflib.get_close_matches(name.lower(), _our_fields(), n=1, cutoff=TYPO_CUTOFF)
    return found[0] if found else None


def _missing(message: str, field: str, values: dict, typos: set[str]) -> UserError | None:
    """`message` (a required field is missing) naming the variable that looks like its typo
    (added to `typos`), or None where there is none."""
    for name in values:
        if isinstance(name, str) and _close_field(name) == field and name not in _known_fields():
            typos.add(name)
            return UserError(
                f"{message}; '{printable(name)}' looks like a typo of it",
                hint=f"renaming {printable(name)} to {field}",
            )
    return None


def _sources(path: Path) -> list[tuple[Path, object]]:
    """The inventory files Ansible reads for `path` (the file, or each file of a directory but
    group_vars/ and host_vars/), each with its YAML document, or None where it is not YAML
    (then INI)."""
    files = (
        [path]
        if not path.is_dir()
        else sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    )
    found = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        try:
            document = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError, RecursionError):
            document = None
        found.append((file, document if isinstance(document, dict) else text))
    return found


def _check_defined_once(sources, where: str, problems: _Problems) -> None:
    """A host given values in two places (two groups, two lines of an INI file, two files)
    where they disagree: Ansible keeps one of them without a word, so it is refused, naming
    both places."""
    seen: dict[str, list[tuple[str, dict]]] = {}
    several = len(sources) > 1
    for file, document in sources:
        definitions = (
            _yaml_definitions(document)
            if isinstance(document, dict)
            else _ini_definitions(document)
            if isinstance(document, str)
            else ()
        )
        for name, place, values in definitions:
            place = f"{file.name} {place}" if several else place
            for other_place, other in seen.get(name, []):
                for field, value in values.items():
                    if field in other and repr(other[field]) != repr(value):
                        problems.add(
                            UserError(
                                f"{where}: host '{printable(name)}': field "
                                f"'{printable(str(field))}': defined twice, "
                                f"{shown(other[field])} {other_place} and {shown(value)} {place}",
                                hint="giving the host's values once, and its name alone in its "
                                "other groups",
                            )
                        )
            seen.setdefault(name, []).append((place, values))


def _yaml_definitions(document: dict):
    """(host, "group 'G'", values) for each host given values in a YAML inventory."""

    def walk(group, body, depth=0):
        if not isinstance(body, dict) or depth > 50:
            return
        hosts = body.get("hosts")
        if isinstance(hosts, dict):
            for name, values in hosts.items():
                if isinstance(values, dict) and values:
                    yield _text(name), f"in group '{printable(_text(group))}'", values
        children = body.get("children")
        if isinstance(children, dict):
            for child, child_body in children.items():
                yield from walk(child, child_body, depth + 1)

    for group, body in document.items():
        yield from walk(group, body)


_INI_SECTION = re.compile(r"\[([^:\]\s]+)(?::(\w+))?\]\s*(?:[#;].*)?")


def _ini_definitions(text: str):
    """(host, "line N (group 'G')", values) for each INI host line that gives values, its
    range expanded as Ansible expands it."""
    group, kind = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        section = _INI_SECTION.fullmatch(line)
        if section:
            group, kind = section.group(1), section.group(2) or "hosts"
            continue
        if kind != "hosts":
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(tokens) < 2 or not all("=" in token for token in tokens[1:]):
            continue
        values = dict(token.split("=", 1) for token in tokens[1:])
        for name in _expanded(tokens[0]):
            yield name, f"on line {number} (group '{printable(group)}')", values


def _expanded(pattern: str) -> list[str]:
    if pattern.count(":") == 1 and not _HOST_RANGE.search(pattern):
        pattern = pattern.split(":")[0]  # host:port
    if not _HOST_RANGE.search(pattern):
        return [pattern]
    try:
        from ansible.plugins.inventory import expand_hostname_range

        return list(expand_hostname_range(pattern))
    except Exception:  # noqa: BLE001 - Ansible reports a bad range itself
        return [pattern]


def _validate(
    data, path: Path, group_name: str = NODES_GROUP, problems: _Problems | None = None
) -> Inventory:
    """Every check, on an inventory document in the plain layout (from the file itself, or as
    Ansible resolved it). Every problem is found in one pass: each check that does not depend
    on another's value runs, and all their errors are raised together (_Problems)."""
    problems = problems if problems is not None else _Problems()
    where = f"inventory {path}"
    if not isinstance(data, dict) or not isinstance(data.get("all"), dict):
        problems.fatal(
            UserError(
                f"{where}: the top level must be a mapping with an 'all' key",
                hint="the layout of inventory.example.yml",
            )
        )
    top = data["all"]
    with problems.fatal_on_error():
        cluster_vars = _mapping(top.get("vars"), f"{where}: all.vars")
        children = _mapping(top.get("children"), f"{where}: all.children")
    group = children.get(group_name)
    if (
        not isinstance(group, dict)
        or not isinstance(group.get("hosts"), dict)
        or not group["hosts"]
    ):
        problems.fatal(
            UserError(
                f"{where}: no hosts under all.children.{group_name}.hosts",
                hint="listing the nodes as in inventory.example.yml",
            )
        )
    with problems.fatal_on_error():
        group_vars = _mapping(group.get("vars"), f"{where}: all.children.{group_name}.vars")
    merged = {**cluster_vars, **group_vars}
    typos: set[str] = set()  # names reported as a missing field's typo: not warned about too
    cluster_warnings_at = len(problems.warnings)

    for field in REQUIRED_CLUSTER_FIELDS:
        if merged.get(field) in (None, ""):
            problems.add(
                _missing(f"{where}: cluster field '{field}' is missing", field, merged, typos)
                or UserError(f"{where}: cluster field '{field}' is missing (set it in all.vars)")
            )
    subnet = None
    if "compute_subnet" in merged and merged["compute_subnet"] not in (None, ""):
        with problems.check():
            subnet = _subnet(merged["compute_subnet"], where)
    with problems.check():
        _check_host_keys_stay_checked(merged, f"{where}: cluster")
    port = known_hosts = launch_mode = scheduler = image = registry = base_from_nodes = None
    registry_port = memlock = None
    with problems.check():
        port = _port(merged.get("rendezvous_port", DEFAULT_RENDEZVOUS_PORT), f"{where}: cluster")
    with problems.check():
        known_hosts = _optional_path(
            merged.get("ssh_known_hosts_file"), where, "ssh_known_hosts_file"
        )
    launch_mode = merged.get("launch_mode", "container")
    if launch_mode not in LAUNCH_MODES:
        problems.add(
            UserError(
                f"{where}: cluster field 'launch_mode': {shown(launch_mode)} is not one of "
                f"{', '.join(LAUNCH_MODES)}"
            )
        )
    scheduler = merged.get("scheduler", "ssh")
    if scheduler not in SCHEDULERS:
        problems.add(
            UserError(
                f"{where}: cluster field 'scheduler': {shown(scheduler)} is not one of "
                f"{', '.join(SCHEDULERS)}"
            )
        )
    image = merged.get("training_image", DEFAULT_TRAINING_IMAGE)
    if not is_word(image):
        problems.add(
            UserError(
                f"{where}: cluster field 'training_image': {shown(image)} is not an image name"
            )
        )
    with problems.check():
        registry = _boolean(merged, "image_registry", True, where)
    with problems.check():
        base_from_nodes = _boolean(merged, "image_base_from_nodes", False, where)
    with problems.check():
        registry_port = _port(
            merged.get("image_registry_port", DEFAULT_IMAGE_REGISTRY_PORT),
            f"{where}: cluster",
            "image_registry_port",
        )
    roots: dict[str, str] = {}
    for field, default in STORAGE_ROOTS.items():
        with problems.check():
            roots[field] = _directory(
                merged.get(field, default), f"{where}: cluster field '{field}'", default
            )
    with problems.check():
        _check_distinct(roots, where)
    mounts: tuple[Mount, ...] = ()
    with problems.check():
        mounts = _mounts(
            merged.get("container_mounts"), f"{where}: cluster field 'container_mounts'", roots
        )

    hosts: list[Host] = []
    names: dict[str, str] = {}
    ips: dict[object, str] = {}
    ssh_targets: dict[tuple[str, int], str] = {}
    for key, own in group["hosts"].items():
        try:
            name = str(key)
        except ValueError:  # an int of more digits than Python converts
            problems.add(UserError(f"{where}: host {shown(key)}: name is not a hostname"))
            continue
        host_where = f"{where}: host '{printable(name)}'"
        if not _LABEL.fullmatch(name):
            problems.add(
                UserError(
                    f"{host_where}: name is not a valid RFC 1123 hostname label "
                    "(letters, digits and '-', 1-63 characters, no '-' at either end)"
                )
            )
            continue
        if name.lower() in names:
            problems.add(
                UserError(
                    f"{host_where}: name duplicates host '{names[name.lower()]}' "
                    "(hostnames are case-insensitive)"
                )
            )
            continue
        names[name.lower()] = name
        try:
            own = _mapping(own, host_where)
        except UserError as error:
            problems.add(error)
            continue
        for field in CLUSTER_ONLY_FIELDS:
            if field in own:
                problems.add(
                    UserError(
                        f"{host_where}: field '{field}' is cluster-wide: the same on every node",
                        hint="setting it once, in all.vars",
                    )
                )
        values = {**merged, **own}
        with problems.check():
            _check_host_keys_stay_checked(values, host_where)
        missing = [field for field in REQUIRED_HOST_FIELDS if values.get(field) in (None, "")]
        for field in missing:
            message = f"{host_where}: field '{field}' is missing"
            problems.add(_missing(message, field, values, typos) or UserError(message))
        problems.warn_unknown(own, f"{host_where}: field", skip={*merged, *typos})
        if missing:
            continue
        host = _host(name, values, subnet, host_where, problems)
        if host is None:
            continue
        if host.compute_ip in ips:
            problems.add(
                UserError(
                    f"{host_where}: field 'compute_ip': {host.compute_ip} is already used by "
                    f"host '{ips[host.compute_ip]}'"
                )
            )
        ips.setdefault(host.compute_ip, name)
        target = (host.ssh_address, host.ssh_port)
        if target in ssh_targets:
            problems.add(
                UserError(
                    f"{host_where}: field 'ansible_host': {host.ssh_address}:{host.ssh_port} is "
                    f"already used by host '{ssh_targets[target]}'"
                )
            )
        ssh_targets.setdefault(target, name)
        hosts.append(host)
    memlock = merged.get("container_memlock", "unlimited")
    if memlock != "unlimited" and (
        isinstance(memlock, bool) or not isinstance(memlock, int) or not 0 <= memlock <= MAX_MEMLOCK
    ):
        problems.add(
            UserError(
                f"{where}: cluster field 'container_memlock': {shown(memlock)} is neither "
                f"'unlimited' nor a number of bytes (0 to 2**63-1)"
            )
        )
    cluster = _Problems()
    cluster.warn_unknown(merged, f"{where}: cluster field", skip=typos)
    problems.warnings[cluster_warnings_at:cluster_warnings_at] = cluster.warnings
    problems.raise_if_any()
    return Inventory(
        path,
        tuple(hosts),
        subnet,
        port,
        known_hosts,
        launch_mode,
        image,
        str(memlock),
        checkpoint_root=roots["checkpoint_root"],
        data_root=roots["data_root"],
        workdir_root=roots["workdir_root"],
        container_mounts=mounts,
        group=group_name,
        scheduler=scheduler,
        image_registry=registry,
        image_registry_port=registry_port,
        image_base_from_nodes=base_from_nodes,
    )


def is_word(value) -> bool:
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
        found = _UNCHECKED_HOST_KEYS.search(_text(values.get(field) or ""))
        if found:
            raise UserError(
                f"{where}: field '{field}': {shown(found.group(0))} turns off SSH host-key "
                "checking",
                hint="-o StrictHostKeyChecking=yes and each node's key in known_hosts",
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


def _host(
    name: str,
    values: dict,
    subnet: ipaddress.IPv4Network | None,
    where: str,
    problems: _Problems,
) -> Host | None:
    """The host's fields, each checked on its own: every bad one is added to `problems`, and
    None returned where any was."""
    before = len(problems.errors)
    compute_ip = None
    try:
        compute_ip = ipaddress.IPv4Address(str(values["compute_ip"]))
    except ValueError:
        problems.add(
            UserError(
                f"{where}: field 'compute_ip': {shown(values['compute_ip'])} is not an IPv4 address"
            )
        )
    if compute_ip is not None and subnet is not None and compute_ip not in subnet:
        problems.add(
            UserError(
                f"{where}: field 'compute_ip': {compute_ip} is outside compute_subnet {subnet}",
                hint="an address inside the subnet, or correct compute_subnet",
            )
        )
    interface = values["compute_interface"]
    if (
        not isinstance(interface, str)
        or not _IFNAME.fullmatch(interface)
        or len(interface.encode()) > IFNAME_BYTES
        or interface in (".", "..")
    ):
        problems.add(
            UserError(
                f"{where}: field 'compute_interface': {shown(interface)} is not a network "
                "interface name"
            )
        )
    gpus = values["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        problems.add(UserError(f"{where}: field 'gpus': {shown(gpus)} is not a whole number >= 0"))
    elif gpus > MAX_GPUS:
        problems.add(
            UserError(
                f"{where}: field 'gpus': {shown(gpus)} is more than one node holds (at most "
                f"{MAX_GPUS})"
            )
        )
    address = values["ansible_host"]
    if not is_word(address):
        problems.add(
            UserError(f"{where}: field 'ansible_host': {shown(address)} is not a host address")
        )
    user = values.get("ansible_user")
    if user is not None and not is_word(user):
        problems.add(UserError(f"{where}: field 'ansible_user': {shown(user)} is not a user name"))
    python = values.get("training_python", "python3")
    if not is_word(python):
        problems.add(
            UserError(f"{where}: field 'training_python': {shown(python)} is not a program path")
        )
    visible = ssh_port = ssh_key = None
    with problems.check():
        visible = parse_gpu_list(
            values.get("cuda_visible_devices"), f"{where}: field 'cuda_visible_devices'"
        )
    with problems.check():
        ssh_port = _port(values.get("ansible_port", 22), where, "ansible_port")
    with problems.check():
        ssh_key = _optional_path(
            values.get("ansible_ssh_private_key_file"), where, "ansible_ssh_private_key_file"
        )
    if len(problems.errors) > before:
        return None
    return Host(
        name=name,
        ssh_address=address,
        ssh_port=ssh_port,
        ssh_user=user,
        ssh_key=ssh_key,
        compute_ip=compute_ip,
        compute_interface=interface,
        gpus=gpus,
        python=python,
        visible_gpus=visible,
    )


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
