"""Jinja tests for the inventory checks, on Python's ipaddress: no netaddr needed.

They accept exactly what cluster/inventory.py accepts, so `cluster check` and the validate
play agree on every inventory.
"""

from __future__ import annotations

import ipaddress


def _address(value):
    try:
        return ipaddress.IPv4Address(str(value))
    except ValueError:
        return None


def _network(value):
    try:
        return ipaddress.IPv4Network(str(value), strict=True)
    except ValueError:
        return None


def ipv4_address(value) -> bool:
    """`x is ipv4_address`: a dotted-quad IPv4 address."""
    return _address(value) is not None


def ipv4_network(value) -> bool:
    """`x is ipv4_network`: an IPv4 network in CIDR form with no host bits set."""
    return _network(value) is not None


def ipv4_in_network(value, network) -> bool:
    """`x is ipv4_in_network(subnet)`: the address lies inside the network."""
    address, net = _address(value), _network(network)
    return address is not None and net is not None and address in net


class TestModule:
    def tests(self):
        return {
            "ipv4_address": ipv4_address,
            "ipv4_network": ipv4_network,
            "ipv4_in_network": ipv4_in_network,
        }
