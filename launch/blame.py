"""Which node caused a failure: the one that stopped answering, then the one cut off from the
master, then one where a rank raised its own exception, then one whose own output shows no
sign of a peer's death."""

from __future__ import annotations

from torch_multinode.cluster.inventory import Host
from torch_multinode.launch.ending import cause_and_knock_ons, exceptions
from torch_multinode.launch.spec import _COLLATERAL


def blame(failures: list[str], outcomes: dict, hosts: tuple[Host, ...]) -> str | None:
    """The node that caused the failure. A node that stopped answering comes first, then one
    whose SSH session broke, then a node cut off from the master over the compute network.
    Peers of a crashed rank fail too, often first ("Connection closed by peer"): prefer a node
    where a rank raised its own exception (launch.ending.exceptions), then one whose own output
    shows no such sign, then a node that such messages name, then simply the first to fail."""
    if not failures:
        return None
    for name in failures:
        if outcomes[name].unreachable:
            return name
    # then one whose SSH session ended with no exit status (the node went down before the
    # liveness watcher said so): its peers' ranks may have exited first, and silently
    for name in failures:
        if outcomes[name].session_lost:
            return name
    linkless = cut_off(hosts, outcomes)
    if linkless is not None:
        return linkless
    for name in failures:  # a rank's own exception, not a peer's knock-on error
        if cause_and_knock_ons(exceptions(list(outcomes[name].tail)))[0] is not None:
            return name
    for name in failures:
        outcome = outcomes[name]
        if outcome.error or not any(_COLLATERAL.search(line) for line in outcome.tail):
            return name
    by_ip = {str(h.compute_ip): h.name for h in hosts}
    for name in failures:
        for line in outcomes[name].tail:
            match = _COLLATERAL.search(line)
            if match and match.group("peer") in by_ip:
                return by_ip[match.group("peer")]
    return failures[0]


def cut_off(hosts: tuple[Host, ...], outcomes: dict) -> str | None:
    """The node whose compute link is down: one that cannot reach the master, or the master
    itself when none of (at least two) others can reach it."""
    others = hosts[1:]
    down = [h.name for h in others if outcomes[h.name].link_down]
    if not down:
        return None
    return hosts[0].name if len(others) >= 2 and len(down) == len(others) else down[0]
