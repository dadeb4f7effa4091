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


def static_ip_fields(
    values: dict, field_of: str, subnet: ipaddress.IPv4Network | None, problems: _Problems
) -> None:
    """The static_ip role's fields among `values` (the cluster's, or one host's own; `field_of`
    says whose, "inventory X: cluster field"): its stack, and the gateway and resolvers of a
    compute interface that is the node's only one (the gateway inside compute_subnet)."""
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


def _is_ipv4(value: object) -> bool:
    try:
        ipaddress.IPv4Address(str(value))
    except ValueError:
        return False
    return True
