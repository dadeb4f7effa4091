"""An inventory document checked whole and made into an Inventory: every check, in the order
their errors are reported, on a document in the plain layout (from the file itself, or as
Ansible resolved it: cluster/inventory_read.py). Every problem is found in one pass: each
check that does not depend on another's value runs, and all their errors are raised together
(_Problems).

The inventory flows read -> check -> model: this module imports the model
(cluster/inventory.py) and the value checks (cluster/inventory_checks.py), never the reading.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.cluster.inventory import (
    DEFAULT_IMAGE_REGISTRY_PORT,
    DEFAULT_LIGHTHOUSE_PORT,
    DEFAULT_RENDEZVOUS_PORT,
    DEFAULT_TRAINING_IMAGE,
    LAUNCH_MODES,
    NODES_GROUP,
    SCHEDULERS,
    Host,
    Inventory,
    Mount,
)
from torch_multinode.cluster.inventory_checks import (
    AUTO,
    CLUSTER_ONLY_FIELDS,
    REQUIRED_HOST_FIELDS,
    STORAGE_ROOTS,
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
    _typo_of,
    is_word,
    vars_field,
)
from torch_multinode.cluster.inventory_host import _LABEL, _host, _ipv4, _no_compute_ip
from torch_multinode.cluster.inventory_static_ip import static_ip_fields

REQUIRED_CLUSTER_FIELDS = ("compute_subnet",)
# setrlimit takes a 64-bit value; docker's --ulimit a signed one.
MAX_MEMLOCK = 2**63 - 1


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
    cluster_vars, group_vars, group_hosts = _groups(data, where, group_name, problems)
    merged = {**cluster_vars, **group_vars}
    if origins is None:
        origins = {**dict.fromkeys(cluster_vars, "all"), **dict.fromkeys(group_vars, group_name)}
    typos: set[str] = set()  # names reported as a missing field's typo: not warned about too
    cluster_warnings_at = len(problems.warnings)

    _check_required_cluster_fields(merged, where, typos, problems)
    cluster = _cluster(merged, where, problems)
    hosts = _HostsPass(where, merged, cluster, typos, problems)
    hosts_errors_at = len(problems.errors)
    for key, own in group_hosts.items():
        hosts.check(key, own)
    problems.errors[hosts_errors_at:hosts_errors_at] = hosts.group_errors(origins, len(group_hosts))
    memlock = _memlock(merged, where, problems)
    _warn_unknown_cluster_fields(merged, where, origins, typos, problems, cluster_warnings_at)
    problems.raise_if_any()
    # Every check passed: each field of `cluster` holds a value, the names are strings.
    assert cluster.subnet is not None and cluster.port is not None
    assert cluster.registry is not None and cluster.base_from_nodes is not None
    assert cluster.registry_port is not None and isinstance(cluster.image, str)
    assert cluster.lighthouse_port is not None
    assert isinstance(cluster.launch_mode, str) and isinstance(cluster.scheduler, str)
    return Inventory(
        path,
        tuple(hosts.valid),
        cluster.subnet,
        cluster.port,
        cluster.known_hosts,
        cluster.launch_mode,
        cluster.image,
        str(memlock),
        checkpoint_root=cluster.roots["checkpoint_root"],
        data_root=cluster.roots["data_root"],
        workdir_root=cluster.roots["workdir_root"],
        container_mounts=cluster.mounts,
        group=group_name,
        scheduler=cluster.scheduler,
        image_registry=cluster.registry,
        image_registry_port=cluster.registry_port,
        image_base_from_nodes=cluster.base_from_nodes,
        lighthouse_port=cluster.lighthouse_port,
    )


def _groups(data, where: str, group_name: str, problems: _Problems) -> tuple[dict, dict, dict]:
    """The document's shape: all.vars, the nodes group's vars and its hosts (a problem here
    ends the pass: nothing else can be checked without them)."""
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
    return cluster_vars, group_vars, group["hosts"]


def _check_required_cluster_fields(
    merged: dict, where: str, typos: set[str], problems: _Problems
) -> None:
    for field_name in REQUIRED_CLUSTER_FIELDS:
        if merged.get(field_name) in (None, ""):
            problems.add(
                _missing(
                    f"{where}: cluster field '{field_name}' is missing", field_name, merged, typos
                )
                or UserError(
                    f"{where}: cluster field '{field_name}' is missing (set it in all.vars)"
                )
            )


@dataclass
class _Cluster:
    """The cluster-wide values, each None (a root absent) where its check failed."""

    subnet: ipaddress.IPv4Network | None = None
    port: int | None = None
    known_hosts: Path | None = None
    launch_mode: object = None
    scheduler: object = None
    image: object = None
    registry: bool | None = None
    base_from_nodes: bool | None = None
    registry_port: int | None = None
    lighthouse_port: int | None = None
    roots: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()


def _cluster(merged: dict, where: str, problems: _Problems) -> _Cluster:
    """The cluster-wide fields' checks, in the order their errors are said."""
    cluster = _Cluster()
    if "compute_subnet" in merged and merged["compute_subnet"] not in (None, ""):
        with problems.check():
            cluster.subnet = _subnet(merged["compute_subnet"], where)
    with problems.check():
        _check_host_keys_stay_checked(merged, f"{where}: cluster")
    with problems.check():
        cluster.port = _port(
            merged.get("rendezvous_port", DEFAULT_RENDEZVOUS_PORT), f"{where}: cluster"
        )
    with problems.check():
        cluster.known_hosts = _optional_path(
            merged.get("ssh_known_hosts_file"), where, "ssh_known_hosts_file"
        )
    cluster.launch_mode = _one_of(merged, "launch_mode", "container", LAUNCH_MODES, where, problems)
    cluster.scheduler = _one_of(merged, "scheduler", "ssh", SCHEDULERS, where, problems)
    cluster.image = merged.get("training_image", DEFAULT_TRAINING_IMAGE)
    if not is_word(cluster.image):
        problems.add(
            UserError(
                f"{where}: cluster field 'training_image': {shown(cluster.image)} is not an "
                "image name"
            )
        )
    with problems.check():
        cluster.registry = _boolean(merged, "image_registry", True, where)
    with problems.check():
        cluster.base_from_nodes = _boolean(merged, "image_base_from_nodes", False, where)
    with problems.check():
        cluster.registry_port = _port(
            merged.get("image_registry_port", DEFAULT_IMAGE_REGISTRY_PORT),
            f"{where}: cluster",
            "image_registry_port",
        )
    with problems.check():
        cluster.lighthouse_port = _port(
            merged.get("lighthouse_port", DEFAULT_LIGHTHOUSE_PORT),
            f"{where}: cluster",
            "lighthouse_port",
        )
    _storage(merged, where, cluster, problems)
    static_ip_fields(merged, f"{where}: cluster field", cluster.subnet, problems)
    return cluster


def _one_of(
    merged: dict, name: str, default: str, allowed: tuple[str, ...], where: str, problems: _Problems
) -> object:
    """A cluster field that names one of `allowed` (its value returned whatever it is)."""
    value = merged.get(name, default)
    if value not in allowed:
        problems.add(
            UserError(
                f"{where}: cluster field '{name}': {shown(value)} is not one of "
                f"{', '.join(allowed)}"
            )
        )
    return value


def _storage(merged: dict, where: str, cluster: _Cluster, problems: _Problems) -> None:
    """The node directories a job keeps (the roots) and the container's other mounts."""
    for name, default in STORAGE_ROOTS.items():
        with problems.check():
            cluster.roots[name] = _directory(
                merged.get(name, default), f"{where}: cluster field '{name}'", default
            )
    with problems.check():
        _check_distinct(cluster.roots, where)
    with problems.check():
        cluster.mounts = _mounts(
            merged.get("container_mounts"),
            f"{where}: cluster field 'container_mounts'",
            cluster.roots,
        )


class _HostsPass:
    """The nodes group's hosts, each checked in the document's order (`valid`: the hosts with
    no problem), and what no two of them may share (a name, a compute IP, an SSH target)."""

    def __init__(
        self, where: str, merged: dict, cluster: _Cluster, typos: set[str], problems: _Problems
    ) -> None:
        self.where, self.merged, self.cluster = where, merged, cluster
        self.typos, self.problems = typos, problems
        self.valid: list[Host] = []
        self.names: dict[str, str] = {}
        self.ips: dict[object, str] = {}
        self.ssh_targets: dict[tuple[str, int], str] = {}
        # A required field no group sets, whose typo one does: said once, for that group, after
        # the hosts have been seen (which of them lack it), before their own problems.
        self.inherited: dict[str, tuple[str, list[str]]] = {
            name: (typo, [])
            for name in REQUIRED_HOST_FIELDS
            if merged.get(name) in (None, "") and (typo := _typo_of(name, merged)) is not None
        }

    def check(self, key, own) -> None:
        """One host: its name, its own fields, those it lacks, its values and what it shares."""
        named = self._name(key)
        if named is None:
            return
        name, host_where, label = named
        own = self._own(own, host_where)
        if own is None:
            return
        values = {**self.merged, **own}
        with self.problems.check():
            _check_host_keys_stay_checked(values, host_where)
        missing, defaulted = self._lacking(name, own, values, host_where)
        self.problems.warn_unknown(own, f"{host_where}: field", skip={*self.merged, *self.typos})
        static_ip_fields(own, f"{host_where}: field", self.cluster.subnet, self.problems)
        host = _host(name, values, self.cluster.subnet, host_where, self.problems, defaulted)
        if self.cluster.scheduler == "slurm" and values.get("gpus") == AUTO:
            # Slurm's configuration (ansible/roles/slurm) is written from each node's count,
            # which the playbook does not find on the node: refused, not written as 0.
            self.problems.add(
                UserError(
                    f"{host_where}: field 'gpus': auto is not read under scheduler: slurm, "
                    "whose configuration needs each node's count",
                    hint="gpus: N, the count nvidia-smi -L lists on the node",
                )
            )
        self._shared(name, values, host_where, defaulted)
        if host is not None and label and not missing:
            self.valid.append(host)

    def _name(self, key) -> tuple[str, str, bool] | None:
        """The host's name, where it is said in messages, and whether it is a valid label; None
        where the host is not checked further (no name, or another host's)."""
        try:
            name = str(key)
        except ValueError:  # an int of more digits than Python converts
            self.problems.add(UserError(f"{self.where}: host {shown(key)}: name is not a hostname"))
            return None
        host_where = f"{self.where}: host '{printable(name)}'"
        label = _LABEL.fullmatch(name) is not None
        if not label:  # its fields are checked all the same
            self.problems.add(
                UserError(
                    f"{host_where}: name is not a valid RFC 1123 hostname label "
                    "(letters, digits and '-', 1-63 characters, no '-' at either end)"
                )
            )
        elif name.lower() in self.names:
            self.problems.add(
                UserError(
                    f"{host_where}: name duplicates host '{self.names[name.lower()]}' "
                    "(hostnames are case-insensitive)"
                )
            )
            return None
        else:
            self.names[name.lower()] = name
        return name, host_where, label

    def _own(self, own, host_where: str) -> dict | None:
        """The host's own fields (None where they are not a mapping); a cluster-wide one among
        them is refused."""
        try:
            own = _mapping(own, host_where)
        except UserError as error:
            self.problems.add(error)
            return None
        for name in CLUSTER_ONLY_FIELDS:
            if name in own:
                self.problems.add(
                    UserError(
                        f"{host_where}: field '{name}' is cluster-wide: the same on every node",
                        hint="setting it once, in all.vars",
                    )
                )
        return own

    def _lacking(
        self, name: str, own: dict, values: dict, host_where: str
    ) -> tuple[list[str], bool]:
        """The required fields the host lacks, and whether its compute_ip is its ansible_host
        (then set in `values`, and not among them)."""
        missing = [f for f in REQUIRED_HOST_FIELDS if values.get(f) in (None, "")]
        defaulted = False
        subnet = self.cluster.subnet
        for field_name in missing:
            message = f"{host_where}: field '{field_name}' is missing"
            error = _missing(message, field_name, own, self.typos)
            if error is None and field_name in self.inherited and field_name not in own:
                self.inherited[field_name][1].append(name)
                continue
            if error is None and field_name == "compute_ip":
                # A host with one address for both: its ansible_host, where that is in the
                # compute subnet (a typo of compute_ip, said above, never defaults).
                address = _ipv4(values.get("ansible_host"))
                if address is not None and subnet is not None and address in subnet:
                    values["compute_ip"], defaulted = str(address), True
                    continue
                error = _no_compute_ip(message, values.get("ansible_host"), subnet)
            self.problems.add(error or UserError(message))
        if defaulted:
            missing.remove("compute_ip")
        return missing, defaulted

    def _shared(self, name: str, values: dict, host_where: str, defaulted: bool) -> None:
        """Two hosts at one address are said whatever else is wrong with either of them."""
        compute_ip = _ipv4(values.get("compute_ip"))
        if compute_ip is not None:
            if compute_ip in self.ips:
                its = ", its ansible_host," if defaulted else ""
                self.problems.add(
                    UserError(
                        f"{host_where}: field 'compute_ip': {compute_ip}{its} is already used by "
                        f"host '{self.ips[compute_ip]}'",
                        hint=f"{printable(name)}'s own address on the compute network",
                    )
                )
            self.ips.setdefault(compute_ip, name)
        address, ssh_port = values.get("ansible_host"), values.get("ansible_port", 22)
        if is_word(address) and isinstance(ssh_port, int) and not isinstance(ssh_port, bool):
            target = (address, ssh_port)
            if target in self.ssh_targets:
                self.problems.add(
                    UserError(
                        f"{host_where}: field 'ansible_host': {address}:{ssh_port} is already "
                        f"used by host '{self.ssh_targets[target]}'",
                        hint=f"{printable(name)}'s own address, or its own ansible_port where "
                        "nodes share one address",
                    )
                )
            self.ssh_targets.setdefault(target, name)

    def group_errors(self, origins: dict[str, str], every: int) -> list[UserError]:
        """A required field no group sets, whose typo a group does: one error for that group,
        naming the hosts that lack the field (its typo then not warned about too)."""
        errors = []
        for name, (typo, lacking) in self.inherited.items():
            if not lacking:
                continue  # every host sets its own: the group's name is only warned about
            self.typos.add(typo)
            errors.append(
                UserError(
                    f"{vars_field(self.where, origins.get(typo, 'all'))} '{printable(typo)}' "
                    f"looks like a typo of '{name}', which {_which(lacking, every)}",
                    hint=f"renaming {printable(typo)} to {name}",
                )
            )
        return errors


def _memlock(merged: dict, where: str, problems: _Problems) -> object:
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
    return memlock


def _warn_unknown_cluster_fields(
    merged: dict,
    where: str,
    origins: dict[str, str],
    typos: set[str],
    problems: _Problems,
    at: int,
) -> None:
    """A warning for each cluster-wide name within a typo of one the project reads, said for
    the group that sets it, before the hosts' own (at `at` among the warnings)."""
    cluster = _Problems()
    for name in merged:
        cluster.warn_unknown({name: None}, vars_field(where, origins.get(name, "all")), skip=typos)
    problems.warnings[at:at] = cluster.warnings


def _which(hosts: list[str], every: int) -> str:
    """'every host lacks', "host 'pc2' lacks", "hosts 'pc1', 'pc2' lack"."""
    if len(hosts) == every:
        return "every host lacks"
    named = ", ".join(f"'{printable(name)}'" for name in hosts)
    return f"host {named} lacks" if len(hosts) == 1 else f"hosts {named} lack"
