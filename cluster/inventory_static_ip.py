"""The static_ip role's inventory fields (ansible/roles/static_ip), checked with the rest of the
inventory by cluster.inventory_validate, for the cluster and for each host that sets its own:
the stack it names, the gateway and resolvers of a compute interface that is a node's only one,
and the netplan role's old names, which would otherwise be ignored."""

from __future__ import annotations

import ipaddress

from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory_checks import _Problems

# The static_ip role's switches that were the netplan role's before it covered NetworkManager
# and ifupdown: an old name would be ignored, and netplan_enabled: false (leave my network
# alone) must never be.
_RENAMED = {
    f"netplan_{name}": f"static_ip_{name}"
    for name in ("enabled", "mtu", "nameservers", "confirm_timeout", "check_from_controller")
} | {"netplan_default_gateway": "static_ip_gateway"}
STATIC_IP_STACKS = ("auto", "netplan", "networkmanager", "ifupdown")
# An MTU a link can carry IPv4 on (0 leaves the interface's own); the NIC's own limit is found
# when the node applies it, and a value it refuses is rolled back.
MTU_RANGE = (576, 65535)


def static_ip_fields(
    values: dict, field_of: str, subnet: ipaddress.IPv4Network | None, problems: _Problems
) -> None:
    """The static_ip role's fields among `values` (the cluster's, or one host's own; `field_of`
    says whose, "inventory X: cluster field"): its stack, the prefix length and MTU, and the
    gateway and resolvers of a compute interface that is the node's only one (the gateway inside
    compute_subnet). Not every stack's own check refuses a bad prefix or MTU: ifupdown takes a
    /33 as netmask 0.0.0.0, and NetworkManager's keyfile reader drops what it cannot read."""
    for old, new in _RENAMED.items():
        if old in values:
            problems.add(
                UserError(
                    f"{field_of} '{old}' is now '{new}' (the static_ip role sets the address with "
                    "netplan, NetworkManager or ifupdown)",
                    hint=f"'{new}' in its place",
                )
            )
    stack = values.get("static_ip_stack", "auto")
    if stack not in STATIC_IP_STACKS:
        problems.add(
            UserError(
                f"{field_of} 'static_ip_stack': {shown(stack)} is not one of "
                f"{', '.join(STATIC_IP_STACKS)}"
            )
        )
    if "static_ip_prefix_length" in values:
        prefix = _integer(values["static_ip_prefix_length"])
        if prefix is None or not 1 <= prefix <= 32:
            problems.add(
                UserError(
                    f"{field_of} 'static_ip_prefix_length': "
                    f"{shown(values['static_ip_prefix_length'])} is not a prefix length from 1 to 32",
                    hint="removing it: it follows compute_subnet",
                )
            )
    if "static_ip_mtu" in values:
        mtu = _integer(values["static_ip_mtu"])
        low, high = MTU_RANGE
        if mtu is None or not (mtu == 0 or low <= mtu <= high):
            problems.add(
                UserError(
                    f"{field_of} 'static_ip_mtu': {shown(values['static_ip_mtu'])} is not an MTU "
                    f"from {low} to {high}",
                    hint="9000 for jumbo frames, where every port on the switch takes them, or 0 "
                    "to leave the interface's own",
                )
            )
    gateway = values.get("static_ip_gateway", "")
    if gateway not in ("", None):
        if not _is_ipv4(gateway):
            problems.add(
                UserError(
                    f"{field_of} 'static_ip_gateway': {shown(gateway)} is not an IPv4 address"
                )
            )
        elif subnet is not None and ipaddress.IPv4Address(str(gateway)) not in subnet:
            problems.add(
                UserError(
                    f"{field_of} 'static_ip_gateway': {gateway} is not in compute_subnet "
                    f"{subnet}, so the compute interface could not reach it",
                    hint='a gateway on the compute subnet, or none ("")',
                )
            )
    resolvers = values.get("static_ip_nameservers", [])
    if not isinstance(resolvers, list) or not all(_is_ipv4(item) for item in resolvers):
        problems.add(
            UserError(
                f"{field_of} 'static_ip_nameservers': {shown(resolvers)} is not a list of IPv4 "
                "addresses"
            )
        )


def _integer(value: object) -> int | None:
    """An integer as YAML gives it, or a string of digits; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _is_ipv4(value: object) -> bool:
    try:
        ipaddress.IPv4Address(str(value))
    except ValueError:
        return False
    return True
