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
              compute_interface: enp3s0     # or auto: the interface that holds compute_ip
              gpus: 1                       # or auto: nvidia-smi's count on the node

compute_ip may be left out where ansible_host is an address inside compute_subnet: it is then
that address. `auto` values are found on the node (cluster/autodetect.py) by the commands that
reach the nodes (provision, netcheck, the launcher); the checks here leave them None.
Variables merge the way Ansible merges them: all.vars, then nodes.vars, then the host's own.
An inventory that only Ansible's own reading resolves (INI, group_vars/ or host_vars/ beside
it, host ranges, groups nested in `nodes`) is read through ansible-core's inventory loader and
variable manager, so provisioning, netcheck and the launcher see the same values; a plain YAML
file reads the same either way and is read directly, for errors with line numbers.
Validation happens entirely in these modules, before any caller acts, in one pass: every
problem found is one `Error:` line naming the host and the field (raised together:
InventoryErrors where there were several, whose lines() the CLIs print); a name within a typo
of one the project reads is a `Warning:` line.

This module owns the data model (Host, Inventory), the entry points (load, parse) and the
assembly of a checked Inventory from a document (_validate, _host, in the order errors are
reported). Its neighbours: cluster/inventory_read.py turns a file into that document (YAML,
ansible-core), cluster/inventory_checks.py holds the field vocabulary, each value's check and
the gathering of problems.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.cluster.inventory_checks import (
    AUTO,
    AUTO_FIELDS,
    CLUSTER_ONLY_FIELDS,
    DEFAULT_CHECKPOINT_ROOT,
    DEFAULT_DATA_ROOT,
    DEFAULT_WORKDIR_ROOT,
    MAX_GPUS,
    NODES_GROUP,
    REQUIRED_HOST_FIELDS,
    STORAGE_ROOTS,
    Mount,
    _boolean,
    _check_distinct,
    _check_host_keys_stay_checked,
    _directory,
    _mapping,
    _missing,
    _mounts,
    _optional_path,
    _port,
    _Problems,
    _subnet,
    _text,
    _typo_of,
    is_word,
    nccl_ib_hca,
    parse_gpu_list,
    vars_field,
)
from torch_multinode.cluster.inventory_read import (
    _check_defined_once,
    _needs_ansible,
    _sources,
    _yaml,
    resolve_with_ansible,
)

DEFAULT_RENDEZVOUS_PORT = 29500
DEFAULT_TRAINING_IMAGE = "torch-multinode/train:latest"
# The controller's image registry (ansible/roles/image_registry, provision/ship.py).
DEFAULT_IMAGE_REGISTRY_PORT = 5000
LAUNCH_MODES = ("container", "host")
# How jobs reach the nodes: the launcher over SSH, or Slurm from the distribution's packages.
SCHEDULERS = ("ssh", "slurm")
REQUIRED_CLUSTER_FIELDS = ("compute_subnet",)
# RFC 1123 host label: letters, digits and hyphens, 1-63 long, no hyphen at either end.
# Matched whole (fullmatch): with match() and `$`, "pc1\n" passed as a valid name.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Linux interface names: at most 15 bytes, no slash, whitespace, colon or control character.
_IFNAME = re.compile(r"[^/\s:\x00-\x1f\x7f]{1,15}")
IFNAME_BYTES = 15
# setrlimit takes a 64-bit value; docker's --ulimit a signed one.
MAX_MEMLOCK = 2**63 - 1


@dataclass(frozen=True)
class Host:
    """One node, with every field the project uses resolved and checked."""

    name: str
    ssh_address: str
    ssh_port: int
    ssh_user: str | None
    ssh_key: Path | None
    compute_ip: ipaddress.IPv4Address
    compute_interface: str | None
    """The NIC that holds compute_ip; None where the inventory says auto, until
    cluster.autodetect.resolve has found it on the node."""
    gpus: int | None
    """None where the inventory says auto, until cluster.autodetect.resolve has asked the node."""
    python: str = "python3"
    """The interpreter on the node that has torch (host mode; jobs in a container use its own)."""
    visible_gpus: tuple[int, ...] | None = None
    """This node's own GPU selection (host var cuda_visible_devices), over the job's GPUS."""
    nccl_ib_hca: str | None = None
    """The RDMA devices NCCL may use for training (NCCL_IB_HCA's form); None: all of them."""
    auto: frozenset[str] = frozenset()
    """The fields the inventory leaves to the node (`auto`, of AUTO_FIELDS): None until found
    there, then the values found, still named here for the outputs that say so."""
    compute_ip_default: bool = False
    """compute_ip is the host's ansible_host: the inventory gives none, and that address is in
    compute_subnet."""


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
        return trust.known_hosts_file(self.known_hosts)

    @property
    def unresolved(self) -> tuple[Host, ...]:
        """The hosts with an `auto` value not yet found on the node (cluster.autodetect)."""
        return tuple(h for h in self.hosts if h.compute_interface is None or h.gpus is None)

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
    problems = _Problems()  # a duplicate key is one of them: the rest is checked too
    try:
        data = _yaml(text, f"inventory {path}", problems)
    except UserError:
        if yaml_file:
            raise
        return _through_ansible(path, group)
    if (not isinstance(data, dict) and not yaml_file) or _needs_ansible(data, group):
        return _through_ansible(path, group, problems)
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


def _through_ansible(path: Path, group: str, problems: _Problems | None = None) -> Inventory:
    problems = problems if problems is not None else _Problems()
    _check_defined_once(_sources(path), f"inventory {path}", problems)
    origins: dict[str, str] = {}
    document = resolve_with_ansible(path, group, problems, origins)
    return _validate(document, path, group, problems, origins)


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


YAML_SUFFIXES = (".yml", ".yaml", ".json")


def parse(text: str, path: Path | str = "<inventory>", group: str = NODES_GROUP) -> Inventory:
    """An inventory in the plain YAML layout, from its text."""
    path = Path(path)
    problems = _Problems()
    data = _yaml(text, f"inventory {path}", problems)
    group = check_group(group)
    _check_defined_once([(path, data)], f"inventory {path}", problems)
    return _validate(data, path, group, problems)


def _validate(
    data,
    path: Path,
    group_name: str = NODES_GROUP,
    problems: _Problems | None = None,
    origins: dict[str, str] | None = None,
) -> Inventory:
    """Every check, on an inventory document in the plain layout (from the file itself, or as
    Ansible resolved it). Every problem is found in one pass: each check that does not depend
    on another's value runs, and all their errors are raised together (_Problems). `origins`:
    the group whose variables set each of all.vars' values, as Ansible resolved them (else
    all.vars' are all's, the nodes group's vars its own); a problem in one is said once, for
    that group, not for each host."""
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
    if origins is None:
        origins = {**dict.fromkeys(cluster_vars, "all"), **dict.fromkeys(group_vars, group_name)}
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
    # A required field no group sets, whose typo one does: said once, for that group, after
    # the hosts have been seen (which of them lack it), before their own problems.
    inherited = {
        field: (typo, [])
        for field in REQUIRED_HOST_FIELDS
        if merged.get(field) in (None, "") and (typo := _typo_of(field, merged)) is not None
    }
    hosts_errors_at = len(problems.errors)
    for key, own in group["hosts"].items():
        try:
            name = str(key)
        except ValueError:  # an int of more digits than Python converts
            problems.add(UserError(f"{where}: host {shown(key)}: name is not a hostname"))
            continue
        host_where = f"{where}: host '{printable(name)}'"
        named = _LABEL.fullmatch(name) is not None
        if not named:  # its fields are checked all the same
            problems.add(
                UserError(
                    f"{host_where}: name is not a valid RFC 1123 hostname label "
                    "(letters, digits and '-', 1-63 characters, no '-' at either end)"
                )
            )
        elif name.lower() in names:
            problems.add(
                UserError(
                    f"{host_where}: name duplicates host '{names[name.lower()]}' "
                    "(hostnames are case-insensitive)"
                )
            )
            continue
        else:
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
        defaulted = False
        for field in missing:
            message = f"{host_where}: field '{field}' is missing"
            error = _missing(message, field, own, typos)
            if error is None and field in inherited and field not in own:
                inherited[field][1].append(name)
                continue
            if error is None and field == "compute_ip":
                # A host with one address for both: its ansible_host, where that is in the
                # compute subnet (a typo of compute_ip, said above, never defaults).
                address = _ipv4(values.get("ansible_host"))
                if address is not None and subnet is not None and address in subnet:
                    values["compute_ip"], defaulted = str(address), True
                    continue
                error = _no_compute_ip(message, values.get("ansible_host"), subnet)
            problems.add(error or UserError(message))
        if defaulted:
            missing.remove("compute_ip")
        problems.warn_unknown(own, f"{host_where}: field", skip={*merged, *typos})
        host = _host(name, values, subnet, host_where, problems, defaulted)
        if scheduler == "slurm" and values.get("gpus") == AUTO:
            # Slurm's configuration (ansible/roles/slurm) is written from each node's count,
            # which the playbook does not find on the node: refused, not written as 0.
            problems.add(
                UserError(
                    f"{host_where}: field 'gpus': auto is not read under scheduler: slurm, "
                    "whose configuration needs each node's count",
                    hint="gpus: N, the count nvidia-smi -L lists on the node",
                )
            )
        # Two hosts at one address are said whatever else is wrong with either of them.
        compute_ip = _ipv4(values.get("compute_ip"))
        if compute_ip is not None:
            if compute_ip in ips:
                its = ", its ansible_host," if defaulted else ""
                problems.add(
                    UserError(
                        f"{host_where}: field 'compute_ip': {compute_ip}{its} is already used by "
                        f"host '{ips[compute_ip]}'",
                        hint=f"{printable(name)}'s own address on the compute network",
                    )
                )
            ips.setdefault(compute_ip, name)
        address, ssh_port = values.get("ansible_host"), values.get("ansible_port", 22)
        if is_word(address) and isinstance(ssh_port, int) and not isinstance(ssh_port, bool):
            target = (address, ssh_port)
            if target in ssh_targets:
                problems.add(
                    UserError(
                        f"{host_where}: field 'ansible_host': {address}:{ssh_port} is already "
                        f"used by host '{ssh_targets[target]}'",
                        hint=f"{printable(name)}'s own address, or its own ansible_port where "
                        "nodes share one address",
                    )
                )
            ssh_targets.setdefault(target, name)
        if host is not None and named and not missing:
            hosts.append(host)
    group_errors = []
    for field, (typo, lacking) in inherited.items():
        if not lacking:
            continue  # every host sets its own: the group's name is only warned about
        typos.add(typo)
        group_errors.append(
            UserError(
                f"{vars_field(where, origins.get(typo, 'all'))} '{printable(typo)}' looks like a "
                f"typo of '{field}', which {_which(lacking, len(group['hosts']))}",
                hint=f"renaming {printable(typo)} to {field}",
            )
        )
    problems.errors[hosts_errors_at:hosts_errors_at] = group_errors
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
    for name in merged:
        cluster.warn_unknown({name: None}, vars_field(where, origins.get(name, "all")), skip=typos)
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


def _no_compute_ip(message: str, address, subnet: ipaddress.IPv4Network | None) -> UserError:
    """compute_ip is missing, and the host's ansible_host cannot stand for it: why not."""
    if subnet is None or address in (None, ""):
        return UserError(message)  # the subnet's or ansible_host's own error says the rest
    if _ipv4(address) is None:
        why = f"its ansible_host {shown(address)} is not an IPv4 address in compute_subnet"
    else:
        why = f"its ansible_host {_ipv4(address)} is outside compute_subnet {subnet}"
    return UserError(f"{message}, and {why}", hint="compute_ip: its address in compute_subnet")


def _host(
    name: str,
    values: dict,
    subnet: ipaddress.IPv4Network | None,
    where: str,
    problems: _Problems,
    compute_ip_default: bool = False,
) -> Host | None:
    """The host's fields, each checked on its own: every bad one is added to `problems`, and
    None returned where any was, or where a required one is missing (said by the caller: the
    others are checked all the same). A field of AUTO_FIELDS that says `auto` is None in the
    Host, to be found on the node (cluster/autodetect.py)."""
    before = len(problems.errors)
    given = {field for field in REQUIRED_HOST_FIELDS if values.get(field) not in (None, "")}
    auto = frozenset(field for field in AUTO_FIELDS if values.get(field) == AUTO)
    compute_ip = _ipv4(values.get("compute_ip"))
    if compute_ip is None and "compute_ip" in given:
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
    interface = values.get("compute_interface")
    if "compute_interface" in given - auto and (
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
    gpus = values.get("gpus")
    whole = isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0
    if "gpus" in given - auto and not whole:
        problems.add(UserError(f"{where}: field 'gpus': {shown(gpus)} is not a whole number >= 0"))
    elif whole and gpus > MAX_GPUS:
        problems.add(
            UserError(
                f"{where}: field 'gpus': {shown(gpus)} is more than one node holds (at most "
                f"{MAX_GPUS})"
            )
        )
    address = values.get("ansible_host")
    if "ansible_host" in given and not is_word(address):
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
    visible = ssh_port = ssh_key = ib_hca = None
    with problems.check():
        ib_hca = nccl_ib_hca(values.get("nccl_ib_hca"), where)
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
    if len(problems.errors) > before or len(given) < len(REQUIRED_HOST_FIELDS):
        return None
    return Host(
        name=name,
        ssh_address=address,
        ssh_port=ssh_port,
        ssh_user=user,
        ssh_key=ssh_key,
        compute_ip=compute_ip,
        compute_interface=None if "compute_interface" in auto else interface,
        gpus=None if "gpus" in auto else gpus,
        python=python,
        visible_gpus=visible,
        nccl_ib_hca=ib_hca,
        auto=auto,
        compute_ip_default=compute_ip_default,
    )


def _ipv4(value) -> ipaddress.IPv4Address | None:
    """`value` as an IPv4 address, or None where it is not one."""
    try:
        return ipaddress.IPv4Address(_text(value))
    except ValueError:
        return None


def _which(hosts: list[str], every: int) -> str:
    """'every host lacks', "host 'pc2' lacks", "hosts 'pc1', 'pc2' lack"."""
    if len(hosts) == every:
        return "every host lacks"
    named = ", ".join(f"'{printable(name)}'" for name in hosts)
    return f"host {named} lacks" if len(hosts) == 1 else f"hosts {named} lack"
