"""Filters that let the validate play word its messages exactly as cluster/inventory.py does."""

from __future__ import annotations

import ipaddress


def _plain(value):
    """The plain Python value behind Ansible's tagged str/int/float/bool/None."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def python_repr(value) -> str:
    """repr() of the value, as inventory.py quotes values in its messages ('pc2.lan', 5)."""
    return repr(_plain(value))


def ipv4_network_problem(value) -> str:
    """Why the value is not an IPv4 network, in ipaddress's words ('' when it is one)."""
    try:
        ipaddress.IPv4Network(str(value), strict=True)
    except ValueError as exc:
        return str(exc)
    return ""


class FilterModule:
    def filters(self):
        return {"python_repr": python_repr, "ipv4_network_problem": ipv4_network_problem}
