"""Fast tests of netcheck's arithmetic, parsers and judgements: no network, no Docker."""

from __future__ import annotations

import json
import os

import pytest

from tests.netcheck.netcheck_fakes import (
    FakeCluster,
    facts_text,
    fake_transport,
    inventory,
    link,
    nccl_log,
    ping_lost,
    ping_ok,
)
from torch_multinode.cluster import nccl_transport
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import ContainerContext
from torch_multinode.netcheck import attempts, bandwidth, collective, envfile, facts, preflight
from torch_multinode.netcheck.checks import addressing, reach, software, traffic
from torch_multinode.netcheck.report import (
    Finding,
    Link,
    Measurement,
    Report,
    Status,
    human_bytes,
    render,
)

INV = inventory()
N1, N2, N3 = INV.hosts
SUBNET = "10.9.0.0/24"


def healthy_facts(host, hosts=(N1, N2), **change):
    me = str(host.compute_ip)
    resolved = {"own hostname": [me], "own FQDN": [me], str(N1.compute_ip): [str(N1.compute_ip)]}
    resolved.update({h.name: [str(h.compute_ip)] for h in hosts})
    resolved.update(change.pop("resolved", {}))
    links = change.pop("links", [link("lo", "127.0.0.1", 65536), link("eth1", me)])
    routes = {str(h.compute_ip): {"dev": "eth1", "prefsrc": me} for h in hosts if h != host}
    routes.update(change.pop("routes", {}))
    pings = {h.name: ping_ok(str(h.compute_ip)) for h in hosts if h != host}
    pings.update(change.pop("pings", {}))
    text = facts_text(change.pop("hostname", host.name), resolved, links, routes, pings, **change)
    return facts.parse(text)


def only(findings, node, check=None, status=None):
    found = [f for f in findings if f.node == node and (check is None or f.check == check)]
    if status is not None:
        found = [f for f in found if f.status is status]
    return found


# --- bandwidth arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_gather", 2, 0.5),
        ("all_gather", 4, 0.75),
        ("broadcast", 2, 1.0),
        ("broadcast", 8, 1.0),
        ("all_reduce", 1, 0.0),
    ],
)
def test_bus_factors_are_nccl_tests_formulas(op, n, factor):
    assert bandwidth.bus_factor(op, n) == pytest.approx(factor)


def test_algbw_and_busbw_in_gigabytes_per_second():
    # 64 MiB in 0.5 s over 4 ranks: algbw 0.134217728 GB/s, all_reduce busbw x 1.5.
    assert bandwidth.algbw(64 << 20, 0.5) == pytest.approx(0.134217728)
    assert bandwidth.busbw("all_reduce", 64 << 20, 0.5, 4) == pytest.approx(0.201326592)
    assert bandwidth.busbw("all_gather", 64 << 20, 0.5, 4) == pytest.approx(0.100663296)
    assert bandwidth.busbw("broadcast", 64 << 20, 0.5, 4) == pytest.approx(0.134217728)


def test_unknown_op_and_bad_rank_count_are_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        bandwidth.bus_factor("reduce_scatter_v", 2)
    with pytest.raises(ValueError, match="at least 1"):
        bandwidth.bus_factor("all_reduce", 0)


def test_sizes_elements_and_iterations():
    assert bandwidth.SWEEP_SIZES[0] == 1024 and bandwidth.SWEEP_SIZES[-1] == 64 << 20
    assert bandwidth.elements("all_reduce", 1 << 20, 4) == 262144
    # all_gather's size is the gathered whole, as in nccl-tests: each rank holds 1/n of it.
    assert bandwidth.elements("all_gather", 1 << 20, 4) == 65536
    assert bandwidth.iterations(1024) == bandwidth.MAX_ITERATIONS
    assert bandwidth.iterations(64 << 20) == bandwidth.MIN_ITERATIONS


def test_measurements_apply_the_formulas():
    rows = [{"op": "all_reduce", "bytes": 1 << 20, "seconds": 0.01, "mismatches": 0}]
    (m,) = traffic.measurements(rows, 2)
    assert m.algbw == pytest.approx(0.1048576) and m.busbw == pytest.approx(0.1048576)


# --- parsers --------------------------------------------------------------------------------


def test_parse_ping_success_loss_and_error():
    ok = facts.parse_ping(ping_ok("10.9.0.12", 0.25))
    assert (ok.transmitted, ok.received, ok.loss, ok.rtt_avg_ms) == (5, 5, 0.0, 0.25)
    assert ok.rtt_min_ms == 0.2
    lost = facts.parse_ping(ping_lost("10.9.0.12"))
    assert lost.loss == 100.0 and lost.rtt_avg_ms is None and lost.error is None
    partial = facts.parse_ping(
        "5 packets transmitted, 4 received, 20% packet loss, time 1ms\n"
        "rtt min/avg/max/mdev = 0.1/0.2/0.3/0.1 ms"
    )
    assert partial.loss == 20.0 and partial.rtt_avg_ms == 0.2 and partial.rtt_min_ms == 0.1
    broken = facts.parse_ping("sh: 1: ping: not found")
    assert broken.error == "sh: 1: ping: not found"


def test_parse_getent_keeps_order_and_drops_repeats():
    text = "172.30.0.11 STREAM debian-1\n172.30.0.11 DGRAM\n172.29.0.11 STREAM\n"
    assert facts.parse_getent(text) == ["172.30.0.11", "172.29.0.11"]
    assert facts.parse_getent("") == []


def test_parse_route_and_speed():
    assert facts.parse_route('[{"dst":"1.2.3.4","dev":"eth1","prefsrc":"1.2.3.5"}]') == facts.Route(
        "eth1", "1.2.3.5"
    )
    assert (
        facts.parse_route("RTNETLINK answers: Network is unreachable").error
        == "RTNETLINK answers: Network is unreachable"
    )
    assert facts.parse_speed("10000\n") == 10000
    assert facts.parse_speed("-1") is None and facts.parse_speed("") is None


# What `ethtool eno1` printed on a desktop whose gigabit NIC negotiated 100 Mb/s (a worn cable),
# after the facts script's "physical".
ETHTOOL_GIGABIT_AT_100 = """physical
Settings for eno1:
\tSupported ports: [ TP ]
\tSupported link modes:   10baseT/Half 10baseT/Full
\t                        100baseT/Half 100baseT/Full
\t                        1000baseT/Full
\tSupported pause frame use: No
\tSupports auto-negotiation: Yes
\tSupported FEC modes: Not reported
\tAdvertised link modes:  10baseT/Half 10baseT/Full
\t                        100baseT/Half 100baseT/Full
\t                        1000baseT/Full
\tSpeed: 100Mb/s
\tDuplex: Full
\tAuto-negotiation: on
\tLink detected: yes
"""


def test_parse_rated_reads_the_fastest_supported_mode():
    assert facts.parse_rated(ETHTOOL_GIGABIT_AT_100) == 1000
    server = (
        "\tSupported link modes:   10000baseKR/Full\n\t  25000baseCR/Full\n\tSpeed: 25000Mb/s\n"
    )
    assert facts.parse_rated(server) == 25000
    # No ethtool, or a virtual NIC: nothing to compare with.
    assert facts.parse_rated("physical") is None
    assert facts.parse_rated("\tSupported link modes:   Not reported\n") is None


def test_a_nic_that_negotiated_below_what_it_supports_is_a_warning():
    slow = healthy_facts(N2, speed="100", device=ETHTOOL_GIGABIT_AT_100)
    assert slow.physical and slow.rated_mbps == 1000
    fast = healthy_facts(N1, speed="1000", device=ETHTOOL_GIGABIT_AT_100)
    verdict = addressing.interface_findings([N1, N2], {"node1": fast, "node2": slow}, N1)
    warns = only(verdict.findings, "node2", status=Status.WARN)
    assert [w.detail for w in warns] == [
        "node2's eth1 runs at 100 Mb/s, others at 1000 Mb/s",
        "node2's eth1 negotiated 100 Mb/s, below the 1000 Mb/s it supports",
    ]
    assert warns[1].remedy.startswith("on node2: a cable rated for 1000 Mb/s")
    assert only(verdict.findings, "node1")[0].status is Status.PASS
    # A virtual NIC (no device: the facts script prints nothing) is never judged so.
    virtual = healthy_facts(N2, speed="100")
    assert not virtual.physical and virtual.rated_mbps is None


def test_raw_tcp_far_below_the_negotiated_speed_is_a_warning():
    # 10^8 bytes: node2 sends them in 10 s, 0.01 GB/s (80 Mb/s) over gigabit links, 8 %; node1
    # in 0.91 s, 0.11 GB/s (88 %).
    ring = [Link("node1", "node2", 10**8, 10 / 11), Link("node2", "node1", 10**8, 10.0)]
    found = traffic.bandwidth_findings(
        [N1, N2], N1, [], ring, [], {}, {"node1": 1000, "node2": 1000}
    )
    (warn,) = only(found, "node2", status=Status.WARN)
    assert warn.detail == (
        "node2 sends raw TCP over eth1 at 8% at best of the speed its links negotiated "
        "(1 Gbit/s here)"
    )
    assert warn.remedy.startswith("on node2: errors and drops (ip -s link show eth1)")
    assert only(found, "node1")[0].status is Status.PASS
    # Judged against the slower end: node1's gigabit NIC sending to a 100 Mb/s peer at 80 Mb/s
    # is not slow; nor is a virtual NIC (not in `negotiated`), nor one above 10 Gbit/s, where a
    # single TCP stream is bound by a CPU core.
    for negotiated in ({"node1": 1000, "node2": 100}, {}, {"node1": 100_000, "node2": 100_000}):
        slow_peer = [Link("node1", "node2", 10**8, 10.0), Link("node2", "node1", 10**8, 10.0)]
        found = traffic.bandwidth_findings([N1, N2], N1, [], slow_peer, [], {}, negotiated)
        assert not only(found, "node1", status=Status.WARN), negotiated


def test_parse_facts_sections():
    f = healthy_facts(N1, infiniband="mlx5_0\n")
    assert f.hostname == "node1" and f.resolved["node2"] == ["10.9.0.12"]
    assert f.interfaces["eth1"].mtu == 1500 and f.interfaces["eth1"].up
    assert f.routes["10.9.0.12"].dev == "eth1" and f.pings["node2"].loss == 0.0
    assert f.speed_mbps == 10000 and f.infiniband == ["mlx5_0"]
    assert facts.parse("@@links\nnot json\n").errors == ["ip -j addr show: not JSON: not json"]


def test_facts_script_asks_for_everything_with_quoting():
    text = facts.script(N1, [N1, N2, N3], "10.9.0.11")
    assert "ping -n -q -c 5 -i 0.2 -W 1 -w 3 10.9.0.12" in text
    assert "getent ahostsv4 node3" in text and "ip -j route get 10.9.0.13" in text
    assert "cat /sys/class/net/eth1/speed" in text and "/sys/class/infiniband" in text
    assert "[ -e /sys/class/net/eth1/device ] && echo physical && { ethtool eth1" in text
    assert "10.9.0.11 >" not in text  # never pings itself


# --- names ----------------------------------------------------------------------------------


def test_names_healthy_pass():
    found = addressing.name_findings(
        [N1, N2], {"node1": healthy_facts(N1), "node2": healthy_facts(N2)}, "10.9.0.11", N1
    )
    assert [f.status for f in found] == [Status.PASS, Status.PASS]


def test_own_name_on_loopback_fails_on_that_node_with_the_fix():
    bad = healthy_facts(
        N2,
        resolved={"node2": ["127.0.1.1", "10.9.0.12"], "own hostname": ["127.0.1.1", "10.9.0.12"]},
    )
    found = addressing.name_findings(
        [N1, N2], {"node1": healthy_facts(N1), "node2": bad}, "10.9.0.11", N1
    )
    (fail,) = only(found, "node2", status=Status.FAIL)
    assert fail.detail == "node2 resolves its own name node2 to 127.0.1.1"
    assert fail.remedy == (
        "on node2: in /etc/hosts map node2 to 10.9.0.12, not 127.0.1.1 "
        "(change or remove the 127.0.1.1 line)"
    )
    assert only(found, "node1")[0].status is Status.PASS


def test_unresolvable_peer_and_wrong_first_address():
    f = healthy_facts(N1, resolved={"node2": [], "node1": ["10.8.0.11", "10.9.0.11"]})
    found = addressing.name_findings([N1, N2], {"node1": f}, "10.9.0.11", N1)
    details = sorted(x.detail for x in found)
    assert details == [
        "node1 cannot resolve node2",
        "node1 resolves node1 to 10.8.0.11, 10.9.0.11, not its compute IP 10.9.0.11",
    ]
    remedies = {x.detail: x.remedy for x in found}
    assert remedies["node1 cannot resolve node2"] == (
        "on node1: add '10.9.0.12 node2' to /etc/hosts (provisioning does this)"
    )


def test_rendezvous_address_must_resolve_to_the_masters_ip():
    f = healthy_facts(N2, resolved={"master": ["10.9.0.99"]})
    found = addressing.name_findings([N1, N2], {"node2": f}, "master", N1)
    (fail,) = found
    assert fail.detail == (
        "node2 resolves the rendezvous address master to 10.9.0.99, not "
        "node1's compute IP 10.9.0.11"
    )


def test_hostname_unlike_inventory_name_warns():
    found = addressing.name_findings(
        [N1], {"node1": healthy_facts(N1, hosts=(N1,), hostname="pc7")}, "10.9.0.11", N1
    )
    (warn,) = found
    assert warn.status is Status.WARN and warn.remedy == "on node1: hostnamectl set-hostname node1"


# --- interfaces -----------------------------------------------------------------------------


def test_interfaces_healthy_give_exact_socket_env():
    verdict = addressing.interface_findings(
        [N1, N2], {"node1": healthy_facts(N1), "node2": healthy_facts(N2)}, N1
    )
    assert [f.status for f in verdict.findings] == [Status.PASS, Status.PASS]
    assert verdict.env["node2"] == {
        "NCCL_SOCKET_IFNAME": "=eth1",
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_IB_DISABLE": "1",
    }
    assert verdict.broken == set() and verdict.speeds == {"node1": 10000, "node2": 10000}


def test_a_node_without_rdma_beside_one_with_it_gives_every_node_sockets_and_a_warning():
    """Mixed, NCCL would take InfiniBand on node1 and sockets on node2, and its set-up would
    wait for ever: one network for all, said on the node whose RDMA stays unused."""
    verdict = addressing.interface_findings(
        [N1, N2],
        {"node1": healthy_facts(N1, infiniband="mlx5_0"), "node2": healthy_facts(N2)},
        N1,
    )
    # The file keeps each node's own finding: a job on node1 alone keeps InfiniBand. A job on
    # both (the launcher), and netcheck's own collective, disable it on both.
    assert {node: env.get("NCCL_IB_DISABLE") for node, env in verdict.env.items()} == {
        "node1": None,
        "node2": "1",
    }
    joined, without = envfile.one_network(verdict.env)
    assert without == ["node2"] and joined["node1"]["NCCL_IB_DISABLE"] == "1"
    warned = only(verdict.findings, "node1", status=Status.WARN)
    assert [f.detail for f in warned] == [
        "node1 has RDMA devices, node2 none: NCCL uses TCP sockets on every node (one job's "
        "nodes must share one network; mixed, NCCL's set-up waits for ever)"
    ]
    assert only(verdict.findings, "node2", status=Status.WARN) == []
    # Alike, nothing changes: both with RDMA keep it, both without are as before.
    both = addressing.interface_findings(
        [N1, N2],
        {
            "node1": healthy_facts(N1, infiniband="mlx5_0"),
            "node2": healthy_facts(N2, infiniband="mlx5_0"),
        },
        N1,
    )
    assert [env.get("NCCL_IB_DISABLE") for env in both.env.values()] == [None, None]
    assert [f.status for f in both.findings] == [Status.PASS, Status.PASS]


def test_infiniband_present_leaves_ib_enabled():
    assert addressing.socket_env("ib0", ["mlx5_0"]) == {
        "NCCL_SOCKET_IFNAME": "=ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
    }


def test_the_inventorys_training_hcas_reach_nccl_and_one_naming_none_is_said():
    """nccl_ib_hca (NCCL_IB_HCA's form) goes into the env file where the node has RDMA
    devices; one that leaves NCCL none of them (a typo, another node's names) is a warning."""
    assert addressing.socket_env("ib0", ["mlx5_0", "mlx5_2"], "=mlx5_0:1")["NCCL_IB_HCA"] == (
        "=mlx5_0:1"
    )
    assert "NCCL_IB_HCA" not in addressing.socket_env("eth1", [], "=mlx5_0")  # IB off anyway
    named = N1.__class__(**{**N1.__dict__, "nccl_ib_hca": "=mlx5_0:1"})
    verdict = addressing.interface_findings(
        [named], {"node1": healthy_facts(named, infiniband="mlx5_0 mlx5_1")}, named
    )
    assert verdict.env["node1"]["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert [f.status for f in verdict.findings] == [Status.PASS]
    wrong = N1.__class__(**{**N1.__dict__, "nccl_ib_hca": "^mlx5"})
    verdict = addressing.interface_findings(
        [wrong], {"node1": healthy_facts(wrong, infiniband="mlx5_0 mlx5_1")}, wrong
    )
    (warned,) = only(verdict.findings, "node1", status=Status.WARN)
    assert warned.detail == (
        "node1's nccl_ib_hca ^mlx5 leaves NCCL none of its RDMA devices (mlx5_0, mlx5_1): "
        "NCCL would use TCP sockets"
    )


@pytest.mark.parametrize(
    ("spec", "taken"),
    [
        ("mlx5", ["mlx5_0", "mlx5_1", "mlx5_10"]),  # a prefix
        ("=mlx5_1", ["mlx5_1"]),  # exact: not mlx5_10
        ("mlx5_1:1", ["mlx5_1", "mlx5_10"]),  # a port narrows ports, not devices
        ("^=mlx5_1", ["mlx5_0", "mlx5_10", "rocep1s0f0"]),
        ("^mlx5", ["rocep1s0f0"]),
        ("=mlx5_0:1,rocep1s0f0", ["mlx5_0", "rocep1s0f0"]),
        ("bnxt_re", []),
    ],
)
def test_nccl_ib_hca_picks_devices_as_nccl_does(spec, taken):
    devices = ["mlx5_0", "mlx5_1", "mlx5_10", "rocep1s0f0"]
    assert nccl_transport.hcas_named(spec, devices) == taken


def test_interface_down_fails_once_with_the_command():
    down = healthy_facts(
        N2,
        links=[link("eth1", "10.9.0.12", flags=("BROADCAST",))],
        routes={"10.9.0.11": {"dev": "eth0"}},
    )
    verdict = addressing.interface_findings(
        [N1, N2], {"node1": healthy_facts(N1), "node2": down}, N1
    )
    (fail,) = only(verdict.findings, "node2")
    assert fail.detail == "node2's eth1 is down"
    assert fail.remedy == "on node2: ip link set eth1 up (make provision makes it persistent)"
    assert verdict.broken == {"node2"}


def test_route_through_the_wrong_interface_fails():
    f = healthy_facts(N2, routes={"10.9.0.11": {"dev": "eth0", "prefsrc": "10.8.0.12"}})
    verdict = addressing.interface_findings([N1, N2], {"node1": healthy_facts(N1), "node2": f}, N1)
    (fail,) = only(verdict.findings, "node2")
    assert fail.detail == "node2's route to node1 (10.9.0.11) leaves through eth0, not eth1"
    assert fail.remedy.startswith("on node2: remove the route that sends 10.9.0.11 through eth0")


def test_missing_interface_points_at_the_one_holding_the_ip():
    f = healthy_facts(N2, links=[link("enp3s0", "10.9.0.12")])
    verdict = addressing.interface_findings([N2], {"node2": f}, N1)
    (fail,) = verdict.findings
    assert fail.detail == "node2 has no interface eth1 (it has enp3s0)"
    assert (
        fail.remedy
        == "on node2: set compute_interface: enp3s0 in the inventory (10.9.0.12 is there)"
    )
    assert "node2" not in verdict.env


def test_mtu_mismatch_blames_the_minority_and_the_master_breaks_ties():
    odd = healthy_facts(N2, hosts=(N1, N2, N3), links=[link("eth1", "10.9.0.12", 1400)])
    trio = {
        "node1": healthy_facts(N1, hosts=(N1, N2, N3)),
        "node2": odd,
        "node3": healthy_facts(N3, hosts=(N1, N2, N3)),
    }
    verdict = addressing.interface_findings([N1, N2, N3], trio, N1)
    (fail,) = only(verdict.findings, "node2", status=Status.FAIL)
    assert fail.detail == "node2's eth1 MTU is 1400, not 1500 as on node1, node3"
    assert fail.remedy.startswith("on node2: ip link set eth1 mtu 1500")
    pair = {
        "node1": healthy_facts(N1),
        "node2": healthy_facts(N2, links=[link("eth1", "10.9.0.12", 9000)]),
    }
    verdict = addressing.interface_findings([N1, N2], pair, N1)
    assert [f.node for f in verdict.findings if f.status is Status.FAIL] == ["node2"]


def test_interface_names_and_speeds_compared_across_nodes():
    f2 = healthy_facts(N2, links=[link("eth1", "10.9.0.12")], speed="1000")
    verdict = addressing.interface_findings([N1, N2], {"node1": healthy_facts(N1), "node2": f2}, N1)
    (warn,) = only(verdict.findings, "node2", status=Status.WARN)
    assert warn.detail == "node2's eth1 runs at 1000 Mb/s, others at 10000 Mb/s"


# --- ping -----------------------------------------------------------------------------------


def test_lost_pings_are_reported_on_the_node_at_fault():
    f1 = healthy_facts(N1, pings={"node2": ping_lost("10.9.0.12")})
    f2 = healthy_facts(N2, pings={"node1": ping_lost("10.9.0.11")})
    found = reach.ping_findings([N1, N2], {"node1": f1, "node2": f2}, {"node2"}, SUBNET)
    assert only(found, "node1")[0].status is Status.PASS
    fails = only(found, "node2", status=Status.FAIL)
    assert len(fails) == 2
    assert all(f.remedy == "on node2: fix eth1 first (see interfaces)" for f in fails)


def test_a_node_ssh_cannot_reach_is_named_in_its_ping_failure():
    f1 = healthy_facts(N1, pings={"node2": ping_lost("10.9.0.12")})
    found = reach.ping_findings([N1, N2], {"node1": f1}, set(), SUBNET, {"node2"})
    (fail,) = only(found, "node2")
    assert (
        fail.detail
        == "no reply from node2 (10.9.0.12) to ping from node1 (nor does SSH reach node2)"
    )
    assert fail.remedy == "on node2: check that the node is up and on the network"


def test_partial_loss_and_high_rtt():
    text = (
        "5 packets transmitted, 4 received, 20% packet loss, time 1ms\n"
        "rtt min/avg/max/mdev = 0.1/0.2/0.3/0.1 ms"
    )
    found = reach.ping_findings(
        [N1, N2],
        {
            "node1": healthy_facts(N1, pings={"node2": text}),
            "node2": healthy_facts(N2, pings={"node1": ping_ok("10.9.0.11", 7.5)}),
        },
        set(),
        SUBNET,
    )
    (loss,) = only(found, "node2", status=Status.FAIL)
    assert loss.detail == "20% packet loss from node1 to node2 (10.9.0.12)"
    (slow,) = only(found, "node2", status=Status.WARN)
    assert slow.detail.startswith("rtt 6.00 ms at best (avg 7.50 ms) from node2 to node1")


def test_a_few_slow_replies_on_a_busy_node_are_no_slow_path():
    """A loaded CPU at either end delays some replies (an average of 2.15 ms was seen in CI on
    the simulated nodes); a slow path delays every one: only the fastest reply is judged."""
    busy = ping_ok("10.9.0.12", 2.15, best=0.09)
    slow = ping_ok("10.9.0.11", 2.4, best=2.1)
    found = reach.ping_findings(
        [N1, N2],
        {
            "node1": healthy_facts(N1, pings={"node2": busy}),
            "node2": healthy_facts(N2, pings={"node1": slow}),
        },
        set(),
        SUBNET,
    )
    assert [f.node for f in found if f.status is not Status.PASS] == ["node2"], found
    (warned,) = only(found, "node2", status=Status.WARN)
    assert warned.detail.startswith("rtt 2.10 ms at best (avg 2.40 ms) from node2 to node1")


# --- ports ----------------------------------------------------------------------------------


def listening(node, *ports):
    return reach.Listening(node, [{"requested": p, "ok": True, "port": p or 41000} for p in ports])


def test_firewalled_high_port_fails_on_the_target():
    listeners = {"node1": listening("node1", 29500, 0), "node2": listening("node2", 29500, 0)}
    connects = {
        "node1": [
            {"name": "node2", "port": 29500, "ok": True},
            {"name": "node2", "port": 41000, "ok": False, "error": "timed out"},
        ],
        "node2": [
            {"name": "node1", "port": 29500, "ok": True},
            {"name": "node1", "port": 41000, "ok": True},
        ],
    }
    found = reach.port_findings([N1, N2], N1, 29500, listeners, connects, set(), SUBNET)
    (fail,) = only(found, "node2")
    assert fail.status is Status.FAIL
    assert fail.detail == "node1 cannot connect to node2:41000 (random high port, timed out)"
    assert fail.remedy == (
        "on node2: allow TCP on all ports from 10.9.0.0/24 in the firewall "
        "(e.g. ufw allow from 10.9.0.0/24); NCCL and gloo use random high ports"
    )
    assert only(found, "node1")[0].status is Status.PASS


def test_rendezvous_port_in_use_on_the_master_names_the_process():
    held = {
        "requested": 29500,
        "ok": False,
        "error": "Address already in use",
        "in_use": True,
        "holders": [{"pid": 77, "name": "python3", "command": "python3 train.py"}],
    }
    listeners = {
        "node1": reach.Listening("node1", [held, {"requested": 0, "ok": True, "port": 41000}]),
        "node2": listening("node2", 29500, 0),
    }
    found = reach.port_findings([N1, N2], N1, 29500, listeners, {}, set(), SUBNET)
    (fail,) = only(found, "node1")
    assert fail.detail == (
        "rendezvous port 29500 on the master node1 is in use: used by python3 "
        "(pid 77: python3 train.py)"
    )
    assert fail.remedy == (
        "on node1: stop it (kill 77), or set rendezvous_port to a free port in the inventory"
    )
    # On a worker the same is only a warning: just the master listens there.
    listeners = {"node1": listening("node1", 29500, 0), "node2": reach.Listening("node2", [held])}
    found = reach.port_findings([N1, N2], N1, 29500, listeners, {}, set(), SUBNET)
    assert only(found, "node2")[0].status is Status.WARN


# --- software -------------------------------------------------------------------------------


def probe(**change):
    base = {
        "python": "3.11.2",
        "torch": "2.14.1",
        "cuda": "13.0",
        "nccl": "2.30.7",
        "gloo": True,
        "netcheck": True,
        "gpus": 0,
        "shm_bytes": 64 << 20,
        "memlock_bytes": 8 << 20,
        "cuda_available": False,
        "nccl_backend": True,
    }
    base.update(change)
    return base


def test_version_mismatch_fails_on_the_odd_node():
    found = software.software_findings(
        [N1, N2, N3], {"node1": probe(), "node2": probe(torch="2.15.0"), "node3": probe()}, N1
    )
    (fail,) = only(found, "node2")
    assert fail.detail == "torch 2.15.0 on node2, 2.14.1 on node1, node3"
    assert (
        fail.remedy == "on node2: install torch 2.14.1 in /opt/venv/bin/python (as on node1, node3)"
    )
    assert only(found, "node1")[0].status is Status.PASS


def test_a_torch_older_than_the_minimum_fails_on_every_node_that_has_it():
    # NVIDIA's pytorch:25.12 image carries 2.10.0a0: the same on every node is no excuse.
    old = "2.10.0a0+b558c986e8.nv25.12"
    found = software.software_findings(
        [N1, N2],
        {"node1": probe(torch=old), "node2": probe(torch=old)},
        N1,
        ContainerContext("train:1"),
    )
    for node in ("node1", "node2"):
        (fail,) = only(found, node)
        assert fail.detail == (
            f"torch {old} in the training image train:1 on {node} is older than the 2.14 this "
            f"project needs"
        )
        assert fail.remedy == (
            f"on {node}: make image (it installs the pinned torch), then make provision"
        )


def test_a_driver_older_than_the_images_cuda_needs_is_named_with_the_branch():
    # torch 2.14's CUDA 13 build on a 570 driver: CUDA does not answer.
    gpu = {"cuda_available": False, "gpus": 0}  # the GPU count is not what this test is about
    found = software.software_findings(
        [N1, N2],
        {"node1": probe(driver="570.172.08", **gpu), "node2": probe(driver="580.95.05", **gpu)},
        N1,
    )
    (fail,) = only(found, "node1")
    assert fail.detail == (
        "NVIDIA driver 570.172.08 on node1 is older than torch's CUDA 13.0 needs (branch 580 or "
        "newer)"
    )
    assert fail.remedy == (
        "on node1: install driver branch 580 or newer (nvidia_driver_install: true, "
        'nvidia_driver_branch: "580" in the inventory; make provision; reboot)'
    )
    (ok,) = only(found, "node2")
    assert ok.status is Status.PASS and "driver 580.95.05" in ok.detail
    # Where CUDA still answers on the old driver (an NGC image's forward-compatibility
    # libraries), jobs run: a warning, with the same remedy.
    found = software.software_findings(
        [N1], {"node1": probe(driver="570.172.08", cuda_available=True, gpus=1)}, N1
    )
    (warned,) = only(found, "node1", status=Status.WARN)
    assert warned.detail.endswith("(CUDA answers, through forward-compatibility libraries)")
    assert warned.remedy == fail.remedy
    # A CUDA 12 build runs on 570.
    found = software.software_findings([N1], {"node1": probe(driver="570.1", cuda="12.8")}, N1)
    assert only(found, "node1")[0].status is Status.PASS


def test_what_a_failing_nvidia_smi_prints_is_taken_for_no_driver_and_no_gpus(monkeypatch):
    from torch_multinode.netcheck import softprobe

    answers = {
        "-L": "GPU 0: NVIDIA H200 (UUID: GPU-1)\n",
        "--query-gpu=driver_version": "580.95.05\n",
        "--query-gpu=name,compute_cap": "NVIDIA H200, 9.0\n",
    }
    monkeypatch.setattr(softprobe.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(softprobe, "_nvidia_smi", lambda *args: answers[args[0]])
    monkeypatch.setattr(softprobe, "fabric", lambda: {})
    found = softprobe.probe()
    assert (found["driver"], found["gpu_capabilities"]) == ("580.95.05", [["NVIDIA H200", "9.0"]])
    failed = (
        "Failed to initialize NVML: Driver/library version mismatch\n"
        "NVML library version: 580.95, driver 570.1\n"
    )
    answers.update({key: failed for key in answers})
    found = softprobe.probe()
    assert (found["nvidia_smi_gpus"], found["driver"], found["gpu_capabilities"]) == (0, None, [])


def test_a_gpu_older_than_the_torch_build_is_named_with_its_compute_capability():
    archs = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"
    gpu = {"cuda_available": True, "gpus": 0, "cuda_archs": archs}
    found = software.software_findings(
        [N1, N2],
        {
            "node1": probe(gpu_capabilities=[["Tesla V100-SXM2-16GB", "7.0"]], **gpu),
            "node2": probe(gpu_capabilities=[["NVIDIA L4", "8.9"], ["Tesla T4", "7.5"]], **gpu),
        },
        N1,
        ContainerContext("train:1"),
    )
    (fail,) = only(found, "node1")
    assert fail.detail == (
        "GPU 0 (Tesla V100-SXM2-16GB, compute capability 7.0) on node1 cannot run torch 2.14.1 "
        f"in the training image train:1: its kernels are built for compute capability 7.5 and "
        f"newer ({archs})"
    )
    assert fail.remedy == (
        "on node1: GPUs of compute capability 7.5 or newer (CUDA 13 builds of torch dropped "
        "Volta, Pascal and Maxwell), or gpus: 0 for that node in the inventory (it then trains "
        "on its CPU, and so does the whole job)"
    )
    assert only(found, "node2")[0].status is Status.PASS
    # A CPU build has no architectures to hold a GPU against: nothing said.
    found = software.software_findings(
        [N1], {"node1": probe(gpu_capabilities=[["Tesla V100", "7.0"]], cuda_archs=None)}, N1
    )
    assert only(found, "node1")[0].status is Status.PASS


def test_gpu_count_shm_and_missing_torch():
    found = software.software_findings(
        [N1, N2],
        {
            "node1": probe(gpus=1, shm_bytes=32 << 20),
            "node2": "exit 125: Unable to find image 'train:1' locally",
        },
        N1,
        ContainerContext("train:1"),
    )
    details = [f.detail for f in only(found, "node1")]
    assert details == [
        "torch sees 1 GPU(s) on node1, the inventory says 0",
        "/dev/shm is 32 MiB (container mode), below 64 MiB",
    ]
    (fail,) = only(found, "node2")
    assert fail.detail == (
        "the training image train:1 did not answer: exit 125: Unable to find "
        "image 'train:1' locally"
    )
    assert fail.remedy == (
        "on node2: check that docker runs the training image train:1 there (docker image ls)"
    )


def test_backend_is_nccl_only_when_every_rank_has_usable_gpus():
    gpu = probe(cuda_available=True, gpus=1)
    assert collective.choose_backend([gpu, gpu], allow_nccl=True) == "nccl"
    assert collective.choose_backend([gpu, probe()], allow_nccl=True) == "gloo"
    assert collective.choose_backend([gpu, gpu], allow_nccl=False) == "gloo"
    assert collective.choose_backend([gpu, {**gpu, "nccl_backend": False}], True) == "gloo"


# --- collective and bandwidth ---------------------------------------------------------------


def test_collective_mismatch_and_timeouts_name_the_failing_node():
    results = {
        "node1": {
            "rank": 0,
            "ok": False,
            "error": "all_reduce of 1024 bytes did not finish within 30 s",
        },
        "node2": "exit 1: /usr/bin/python3: No module named netcheck.collective",
        "node3": {
            "rank": 2,
            "ok": False,
            "results": [{"op": "broadcast", "bytes": 1024, "seconds": 0.1, "mismatches": 3}],
        },
    }
    rerun = {n: f"rerun-{n}" for n in results}
    stacks = {"node1": probe(), "node2": results["node2"], "node3": probe()}
    found = traffic.collective_findings([N1, N2, N3], results, "gloo", rerun, stacks)
    by_node = {f.node: f for f in found}
    assert by_node["node1"].detail.endswith("(waiting for node2, node3, which failed)")
    assert by_node["node1"].remedy == "on node2: fix the failure reported there"
    assert by_node["node2"].remedy == "on node2: run it by hand to see the whole error: rerun-node2"
    assert by_node["node2"].detail == (
        "the worker failed: exit 1: /usr/bin/python3: No module named netcheck.collective"
    )
    assert by_node["node3"].detail == "broadcast of 1024 bytes gave 3 wrong value(s) on node3"
    # A worker that cannot import torch points at the software check.
    found = traffic.collective_findings(
        [N1],
        {"node1": {"rank": 0, "ok": False, "error": "ImportError: libcudnn.so.9"}},
        "gloo",
        {"node1": "x"},
        {"node1": probe(torch_error="ImportError: libcudnn.so.9")},
    )
    assert (found[0].detail, found[0].remedy) == (
        "the worker cannot import torch: ImportError: libcudnn.so.9",
        "on node1: fix the software FAIL first",
    )


def test_busbw_far_below_raw_tcp_warns_and_slow_sender_is_named():
    measured = [Measurement("all_reduce", 64 << 20, 1.0, 0.067, 0.05)]
    ring = [Link("node1", "node2", 1 << 27, 1.0), Link("node2", "node1", 1 << 27, 1.0)]
    pairwise = [
        Link("node1", "node2", 1 << 26, 0.1),
        Link("node2", "node1", 1 << 26, 0.1),
        Link("node1", "node3", 1 << 26, 0.1),
        Link("node3", "node1", 1 << 26, 1.0),
        Link("node2", "node3", 1 << 26, 0.1),
        Link("node3", "node2", 1 << 26, 1.0),
    ]
    found = traffic.bandwidth_findings([N1, N2, N3], N1, measured, ring, pairwise, {})
    (ratio,) = only(found, "node1", status=Status.WARN)
    assert ratio.detail == "all_reduce busbw 0.050 GB/s at 64 MiB is 37% of raw TCP 0.134 GB/s"
    slow = only(found, "node3", status=Status.WARN)
    assert [f.detail.split(":")[0] for f in slow] == [
        "slow link node3 -> node1",
        "slow link node3 -> node2",
    ]
    assert all(
        "(node3 is slow sending)" in f.detail and f.remedy.startswith("on node3:") for f in slow
    )
    assert only(found, "node2")[0].status is Status.PASS


# --- report and env file --------------------------------------------------------------------


def sample_report():
    report = Report("inv.yml", ["node1", "node2"], "node1", "10.9.0.11:29500")
    for check in ("ssh", "ping", "names", "ports", "interfaces", "software", "collective"):
        report.findings.append(Finding(check, "node1", Status.PASS, "fine"))
        report.findings.append(Finding(check, "node2", Status.PASS, "fine"))
    return report


def test_report_cells_exit_code_and_json_shape():
    report = sample_report()
    assert report.ok and report.exit_code == 0
    report.findings.append(Finding("ports", "node2", Status.FAIL, "blocked", "on node2: open it"))
    report.findings.append(Finding("ports", "node2", Status.WARN, "meh"))
    assert report.cell("node2", "ports") is Status.FAIL and report.exit_code == 1
    data = json.loads(json.dumps(report.as_dict()))
    assert data["ok"] is False and data["exit_code"] == 1
    assert data["checks"] == [
        "ssh",
        "ping",
        "names",
        "ports",
        "interfaces",
        "software",
        "collective",
    ]
    assert data["results"]["node2"]["ports"] == {
        "status": "FAIL",
        "detail": "fine; blocked; meh",
        "remedies": ["on node2: open it"],
    }
    assert data["counts"] == {"PASS": 14, "WARN": 1, "FAIL": 1, "SKIP": 0}


def test_render_table_and_problems():
    report = sample_report()
    report.findings.append(Finding("names", "node2", Status.FAIL, "loopback", "on node2: fix it"))
    report.measurements = [Measurement("all_reduce", 1 << 20, 0.01, 0.105, 0.105)]
    report.backend = "gloo"
    text = render(report)
    assert "node   ssh   ping  names  ports  interfaces  software  collective" in text
    assert "node2  PASS  PASS  FAIL   PASS   PASS        PASS      PASS" in text
    assert "  all_reduce      1 MiB   10.00 ms  0.105 GB/s  0.105 GB/s" in text
    assert "  FAIL names node2: loopback\n       try on node2: fix it" in text
    assert text.endswith("NOT ready: 1 FAIL, 0 WARN, 0 SKIP in 0.0 s")
    assert human_bytes(1 << 20) == "1 MiB" and human_bytes(1000) == "1000 B"


def test_env_file_round_trip_and_errors(tmp_path):
    env = {
        "node1": {
            "NCCL_SOCKET_IFNAME": "=eth1",
            "GLOO_SOCKET_IFNAME": "eth1",
            "NCCL_IB_DISABLE": "1",
        }
    }
    path = envfile.write(tmp_path / "netcheck-env.json", env)
    assert envfile.load(path) == env
    assert set(json.loads(path.read_text())) == {"nodes", "written_at"}
    assert envfile.default_path(tmp_path / "inv.yml") == tmp_path / "netcheck-env.json"
    with pytest.raises(UserError) as missing:
        envfile.load(tmp_path / "nope.json")
    assert missing.value.line() == (
        f"Error: the netcheck env file {tmp_path / 'nope.json'} does "
        "not exist (try 'make netcheck' first: it writes the file "
        "next to the inventory)"
    )
    (tmp_path / "bad.json").write_text('{"nodes": {"node1": {"X": 1}}}')
    with pytest.raises(UserError, match="no valid 'nodes' mapping"):
        envfile.load(tmp_path / "bad.json")


def test_ubuntu_style_loopback_hostname_fails_once_and_warns_about_the_name():
    f = healthy_facts(
        N1,
        hosts=(N1,),
        hostname="pc7",
        resolved={"own hostname": ["127.0.1.1"], "own FQDN": ["127.0.1.1"]},
    )
    found = addressing.name_findings([N1], {"node1": f}, "10.9.0.11", N1)
    assert [(x.status, x.detail) for x in found] == [
        (Status.FAIL, "node1's own hostname 'pc7' resolves to 127.0.1.1"),
        (Status.WARN, "node1's hostname is 'pc7', the inventory calls it node1"),
    ]
    assert found[0].remedy == "on node1: in /etc/hosts map pc7 to 10.9.0.11, not 127.0.1.1"


def test_worker_command_pins_the_interface_and_runs_under_a_wall_clock():
    from torch_multinode.netcheck import stages

    env = addressing.socket_env("eth1", [])
    command = stages.worker_command(
        N2, 1, [N1, N2], 45555, (1024,), 30.0, env, N2.python, "netcheck-abc"
    )
    assert command == (
        "env GLOO_SOCKET_IFNAME=eth1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME==eth1 "
        "/opt/venv/bin/python -m torch_multinode.netcheck.collective --rank 1 --world-size 2 --master-addr "
        "10.9.0.11 --master-port 45555 --sizes 1024 --timeout 30 --token netcheck-abc"
    )
    gpus = [h.__class__(**{**h.__dict__, "gpus": 1}) for h in (N1, N2)]
    assert " --allow-nccl " in stages.worker_command(gpus[0], 0, gpus, 1, (1,), 1.0, {}, "p", "t")
    wrapped = stages.wall_clock(command, 150, "/tmp/netcheck-abc-collective.pid")
    assert wrapped.startswith("timeout -k 5 150 env ")
    assert wrapped.endswith(
        "& echo $! > /tmp/netcheck-abc-collective.pid; wait $!; rc=$?; "
        "rm -f /tmp/netcheck-abc-collective.pid; exit $rc"
    )


def test_slurm_findings_when_the_controller_does_not_answer_and_sinfo_parsing():
    from torch_multinode.netcheck import slurm

    inv = inventory()
    hosts = list(inv.hosts[:2])
    found = slurm.findings(inv, hosts, hosts[0], (None, "exit 1: slurm_load_node error"), {})
    assert [(f.node, f.status) for f in found] == [("node1", Status.FAIL), ("node2", Status.FAIL)]
    assert found[0].detail == (
        "Slurm's controller on node1 does not answer sinfo: exit 1: slurm_load_node error"
    )
    assert found[0].remedy.startswith("on node1: check slurmctld")
    # A node in two partitions is listed twice: the first line counts; 'none' is no reason.
    assert slurm.node_states("n1|idle|none\nn2|mixed|none\nn1|idle|none\nbad line\n") == {
        "n1": ("idle", ""),
        "n2": ("mixed", ""),
    }


# --- NCCL's transport (issue 27): which network the collective used -------------------------


def test_the_network_nccl_used_is_read_from_its_info_lines():
    assert nccl_transport.transport_used(nccl_log("IB", ("mlx5_0",))) == "IB"
    assert nccl_transport.transport_used(nccl_log("Socket")) == "Socket"
    assert nccl_transport.transport_used(nccl_log(None)) is None
    assert nccl_transport.transport_used("") is None


def test_rdma_devices_and_verbs_are_what_the_directories_hold(tmp_path):
    sys_class, dev = tmp_path / "class", tmp_path / "dev"
    assert nccl_transport.rdma_devices(sys_class) == []
    assert not nccl_transport.verbs_usable(dev)
    sys_class.mkdir()
    (sys_class / "mlx5_1").mkdir()
    (sys_class / "mlx5_0").mkdir()
    dev.mkdir()
    assert nccl_transport.rdma_devices(sys_class) == ["mlx5_0", "mlx5_1"]
    assert not nccl_transport.verbs_usable(dev)  # the directory alone: no device to open
    (dev / "uverbs0").touch()
    assert nccl_transport.verbs_usable(dev)


def test_the_worker_reads_the_transport_from_its_nccl_log(tmp_path, monkeypatch):
    monkeypatch.setattr(collective, "rdma_devices", lambda: ["mlx5_0"])
    monkeypatch.setattr(collective, "verbs_usable", lambda: False)
    log = tmp_path / "nccl.log"
    log.write_text(nccl_log("Socket"))
    monkeypatch.setattr(collective, "peermem_loaded", lambda: False)
    assert collective.read_transport("nccl", str(log)) == {
        "rdma": ["mlx5_0"],
        "verbs": False,
        "used": "Socket",
        "hcas": [],
        "gdr": {"used": None, "off": [], "dmabuf": False},
        "peermem": False,
    }
    # Over InfiniBand: the HCA ports NCCL took, and GPUDirect RDMA on its connections.
    log.write_text(
        nccl_log("IB", ("mlx5_0", "mlx5_1"))
        + "node1:4242:4300 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/1/GDRDMA\n"
    )
    seen = collective.read_transport("nccl", str(log))
    assert (seen["used"], seen["hcas"], seen["gdr"]["used"]) == (
        "IB",
        ["mlx5_0:1", "mlx5_1:1"],
        True,
    )
    # No log (NCCL never started, or wrote nowhere): nothing said, nothing invented.
    assert collective.read_transport("nccl", str(tmp_path / "absent"))["used"] is None
    gloo = collective.read_transport("gloo", None)
    assert gloo["used"] is None and "gloo" in gloo["reason"] and gloo["rdma"] == ["mlx5_0"]


def test_an_nccl_failure_carries_nccls_own_last_warnings_from_the_workers_log(tmp_path):
    """torch's NCCL error says "unhandled system error (run with NCCL_DEBUG=INFO for details)"
    on its first line; the cause is in NCCL's WARN lines, which the worker's log holds."""
    log = tmp_path / "nccl.log"
    log.write_text(
        "node1:101:101 [0] NCCL INFO Bootstrap: Using eth1:10.7.0.1<0>\n"
        "node1:101:120 [0] NCCL WARN socketProgress: Connection closed by remote peer\n"
        "node1:101:120 [0] NCCL INFO misc/socket.cc:64 -> 6\n"
        "node1:101:120 [0] NCCL WARN socketStartConnect: Connect to 10.7.0.2<40123> failed : "
        "Connection refused\n"
    )
    error = "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3011, unhandled system error"
    assert collective.with_nccl_warnings(error, str(log)) == (
        f"{error} (NCCL: socketProgress: Connection closed by remote peer; socketStartConnect: "
        "Connect to 10.7.0.2<40123> failed : Connection refused)"
    )
    log.write_text("node1:101:101 [0] NCCL INFO Using network Socket\n")
    assert collective.with_nccl_warnings(error, str(log)) == error  # nothing to add
    assert collective.with_nccl_warnings(error, str(tmp_path / "absent")) == error
    assert collective.with_nccl_warnings(error, None) == error  # gloo: no NCCL log


def test_sockets_on_a_node_with_infiniband_warn_and_name_what_is_missing():
    hosts = list(inventory().hosts[:3])
    results = {
        "node1": {"ok": True, "transport": fake_transport("IB", ("mlx5_0",), verbs=True)},
        "node2": {"ok": True, "transport": fake_transport("Socket", ("mlx5_0",), verbs=False)},
        "node3": "exit 1: boom",
    }
    found = traffic.transport_findings(hosts, results, "nccl")
    assert [(f.check, f.node, f.status) for f in found] == [
        ("transport", "node1", Status.PASS),
        ("transport", "node2", Status.WARN),
        ("transport", "node3", Status.SKIP),
    ]
    assert found[0].detail == "NCCL used IB (mlx5_0)"
    assert found[1].detail.startswith(
        "NCCL used TCP sockets although the node has RDMA devices (mlx5_0): inter-node traffic "
        "is an order of magnitude slower than it could be (this process cannot open "
        "/dev/infiniband"
    )
    assert found[1].remedy.startswith("on node2: give NCCL the RDMA devices (mlx5_0): ")
    assert "modprobe ib_uverbs rdma_ucm" in found[1].remedy
    assert found[2].detail == "not checked: the collective did not finish on node3"
    # Sockets without RDMA hardware are right; the device there but sockets used anyway: the
    # image (libibverbs) or NCCL_IB_DISABLE.
    plain = {"node1": {"ok": True, "transport": fake_transport("Socket")}}
    (only_one,) = traffic.transport_findings(hosts[:1], plain, "nccl")
    assert only_one.status is Status.PASS and "no RDMA device" in only_one.detail
    opened = {"node1": {"ok": True, "transport": fake_transport("Socket", ("mlx5_0",), True)}}
    (warned,) = traffic.transport_findings(hosts[:1], opened, "nccl")
    assert warned.status is Status.WARN and "libibverbs in the image" in warned.remedy
    # gloo on CPU nodes: nothing to judge, no column.
    assert traffic.transport_findings(hosts, results, "gloo") == []


def test_infiniband_without_gpudirect_rdma_warns_where_the_hcas_could_not_reach_gpu_memory():
    """NCCL over IB, every transfer through host memory, its HCAs found unable ("GPU Direct
    RDMA Disabled for HCA", no nvidia-peermem, no DMA-BUF): a warning naming the module."""
    hosts = list(inventory().hosts[:2])
    off = {"used": False, "off": ["mlx5_0"], "dmabuf": False}
    results = {
        "node1": {
            "ok": True,
            "transport": {
                **fake_transport("IB", ("mlx5_0",), verbs=True),
                "hcas": ["mlx5_0:1"],
                "gdr": {"used": True, "off": [], "dmabuf": True},
                "peermem": True,
            },
        },
        "node2": {
            "ok": True,
            "transport": {
                **fake_transport("IB", ("mlx5_0",), verbs=True),
                "hcas": ["mlx5_0:1"],
                "gdr": off,
                "peermem": False,
            },
        },
    }
    first, second = traffic.transport_findings(hosts, results, "nccl")
    assert (first.status, first.detail) == (
        Status.PASS,
        "NCCL used IB on mlx5_0:1, with GPUDirect RDMA",
    )
    assert second.status is Status.WARN
    assert second.detail.startswith(
        "NCCL used IB on mlx5_0:1 without GPUDirect RDMA: NCCL found mlx5_0 unable to reach GPU "
        "memory (nvidia-peermem is not loaded; NCCL found no DMA-BUF on the GPU)"
    )
    assert second.remedy.startswith("on node2: modprobe nvidia-peermem on the node")
    report = sample_report()
    report.backend = "nccl"
    report.transport = {name: r["transport"] for name, r in results.items()}
    assert (
        "NCCL transport: node1 IB on mlx5_0:1 with GPUDirect RDMA, node2 IB on mlx5_0:1 without "
        "GPUDirect RDMA"
    ) in render(report)


def test_a_nccl_run_reports_its_transport_column_line_and_json():
    hosts = list(inventory().hosts[:2])
    cluster = FakeCluster(
        hosts,
        nccl_transport={
            "node1": fake_transport("IB", ("mlx5_0",), verbs=True),
            "node2": fake_transport("Socket", ("mlx5_0",), verbs=False),
        },
    )
    report = preflight.preflight(inventory(), attempts.Options(nnodes=2), cluster)
    assert cluster.surprises == []
    assert report.backend == "nccl" and "transport" in report.checks
    assert report.cell("node1", "transport") is Status.PASS
    assert report.cell("node2", "transport") is Status.WARN
    text = render(report)
    assert (
        "collective (nccl, 2 node(s))\n  NCCL transport: node1 IB (mlx5_0), node2 Socket (mlx5_0)"
        in text
    )
    assert "  WARN transport node2: NCCL used TCP sockets although" in text
    data = json.loads(json.dumps(report.as_dict()))
    assert data["collective"]["transport"]["node2"]["used"] == "Socket"


def test_a_gloo_run_says_why_its_transport_is_not_judged():
    report = sample_report()
    report.backend = "gloo"
    reason = "gloo on CPU nodes: TCP sockets, no NCCL"
    report.transport = {
        n: {"rdma": [], "verbs": False, "used": None, "reason": reason} for n in report.nodes
    }
    assert "transport" not in report.checks
    assert f"collective (gloo, 2 node(s))\n  transport: not checked ({reason})" in render(report)


class _FakeGroupMaker:
    """torch.distributed's new_group, as NCCL would behave: writing its INFO lines where
    NCCL_DEBUG_FILE says, at communicator creation."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(({k: os.environ.get(k) for k in NCCL_KEYS}, kwargs))
        with open(os.environ["NCCL_DEBUG_FILE"], "w") as log:
            log.write(nccl_log("IB", ("mlx5_0",)))
        return "nccl-group"


NCCL_KEYS = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


class _NoWatchdog:
    def __init__(self, *args):
        pass

    def start(self, *args):
        pass

    def stop(self):
        pass


def test_the_worker_binds_its_nccl_group_to_its_gpu_and_reports_the_transport(
    monkeypatch, capsys, tmp_path
):
    """Defect 6 and the node side of defect 3, without a GPU: torch.distributed and the CUDA
    calls are faked. The NCCL group is made with device_id= (torch 2.14 then forms the
    communicator at once and barriers know their device), after NCCL was told to log its
    network to a file of the worker's own, which it reads and removes."""
    import torch
    import torch.distributed as dist

    for key in NCCL_KEYS:  # recorded, so that what the worker sets is undone afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(collective.tempfile, "gettempdir", lambda: str(tmp_path))
    stack = {"torch": "2.14.1", "cuda_available": True, "gpus": 1, "nccl_backend": True}
    monkeypatch.setattr(collective, "probe", lambda: dict(stack))
    monkeypatch.setattr(collective, "Watchdog", _NoWatchdog)  # its timers would os._exit
    monkeypatch.setattr(collective, "rdma_devices", lambda: ["mlx5_0"])
    monkeypatch.setattr(collective, "verbs_usable", lambda: True)
    monkeypatch.setattr(collective, "peermem_loaded", lambda: False)
    monkeypatch.setattr(collective, "run_op", lambda *a, **k: (1e-3, 0))
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    made = _FakeGroupMaker()
    monkeypatch.setattr(dist, "new_group", made)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(0, obj))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    args = ["--rank", "0", "--world-size", "1", "--master-addr", "127.0.0.1"]
    args += ["--master-port", "1", "--allow-nccl", "--sizes", "1024", "--token", "tok"]
    assert collective.main(args) == 0
    ((env, kwargs),) = made.calls
    assert kwargs == {"backend": "nccl", "device_id": torch.device("cuda", 0)}
    assert devices == [torch.device("cuda", 0)]
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert env["NCCL_DEBUG_FILE"].startswith(f"{tmp_path}/tok-nccl-")
    assert list(tmp_path.iterdir()) == []  # the log is removed
    lines = [json.loads(x.removeprefix("NETCHECK ")) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["backend"] == "nccl"
    assert lines[-1]["transport"] == {
        "rdma": ["mlx5_0"],
        "verbs": True,
        "used": "IB",
        "hcas": ["mlx5_0:1"],
        "gdr": {"used": None, "off": [], "dmabuf": False},
        "peermem": False,
    }
