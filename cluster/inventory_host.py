"""One host of an inventory checked field by field into a Host: ansible_host, compute_ip (or
ansible_host standing for it), compute_interface and gpus (or `auto`, found on the node later),
the SSH, Python, GPU-list and HCA fields. Part of the inventory's check: inventory_validate.py
runs it for every host and checks what spans hosts (names, distinct addresses). It imports the
model and the value checks, never the reading.
"""

from __future__ import annotations

import ipaddress
import re

from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.inventory_checks import (
    AUTO,
    AUTO_FIELDS,
    MAX_GPUS,
    REQUIRED_HOST_FIELDS,
    _optional_path,
    _port,
    _Problems,
    _text,
    is_word,
    nccl_ib_hca,
    parse_gpu_list,
)

# RFC 1123 host label: letters, digits and hyphens, 1-63 long, no hyphen at either end.
# Matched whole (fullmatch): with match() and `$`, "pc1\n" passed as a valid name.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Linux interface names: at most 15 bytes, no slash, whitespace, colon or control character.
_IFNAME = re.compile(r"[^/\s:\x00-\x1f\x7f]{1,15}")
IFNAME_BYTES = 15


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
    given = {f for f in REQUIRED_HOST_FIELDS if values.get(f) not in (None, "")}
    auto = frozenset(f for f in AUTO_FIELDS if values.get(f) == AUTO)
    compute_ip = _compute_ip(values, subnet, "compute_ip" in given, where, problems)
    interface = _interface(values, "compute_interface" in given - auto, where, problems)
    gpus = _gpus(values, "gpus" in given - auto, where, problems)
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
    # Every required field is given and passed its check (else a problem was added above).
    assert is_word(address) and compute_ip is not None
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


def _compute_ip(
    values: dict,
    subnet: ipaddress.IPv4Network | None,
    given: bool,
    where: str,
    problems: _Problems,
) -> ipaddress.IPv4Address | None:
    """compute_ip: an IPv4 address (where it is `given`) inside compute_subnet."""
    compute_ip = _ipv4(values.get("compute_ip"))
    if compute_ip is None and given:
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
    return compute_ip


def _interface(values: dict, named: bool, where: str, problems: _Problems):
    """compute_interface: a Linux interface name, where one is `named` (not `auto`)."""
    interface = values.get("compute_interface")
    if named and (
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
    return interface


def _gpus(values: dict, counted: bool, where: str, problems: _Problems):
    """gpus: a whole number, where one is `counted` (not `auto`), at most MAX_GPUS."""
    gpus = values.get("gpus")
    if not (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0):
        if counted:
            problems.add(
                UserError(f"{where}: field 'gpus': {shown(gpus)} is not a whole number >= 0")
            )
    elif gpus > MAX_GPUS:
        problems.add(
            UserError(
                f"{where}: field 'gpus': {shown(gpus)} is more than one node holds (at most "
                f"{MAX_GPUS})"
            )
        )
    return gpus


def _ipv4(value) -> ipaddress.IPv4Address | None:
    """`value` as an IPv4 address, or None where it is not one."""
    try:
        return ipaddress.IPv4Address(_text(value))
    except ValueError:
        return None
