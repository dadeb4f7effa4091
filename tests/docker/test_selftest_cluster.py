"""`make selftest INVENTORY=...` on the provisioned simulated cluster, as README writes it (the
shared `cluster_selftest` run): every check on both nodes, in the training image's containers
(launch_mode: container), as a job through the launcher. The image's gcc and Python headers let
torch.compile build its kernels there; the checkpoint checks write to each container's own
temporary directory (node-local disks): the distributed checkpoint is saved and loaded but not
resharded (tests/training/test_selftest.py reshards it on storage both ranks see), and the
replicas' check copies each node's shards to the other's disk and restores a wiped one. The GPU
checks are SKIPPED with their reasons (the nodes have no GPU).

Here (tests/docker/) because that directory runs in the `image` group, whose provisioned cluster
the test shares.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import ERROR_LINE, on_node

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]


def _row(out: str, check: str, node: str) -> str:
    """The table row of `check` on `node`, printed by rank 0 (on node1)."""
    found = re.search(rf"^\[node1\] {re.escape(check)} +{node} +(.*)$", out, re.M)
    assert found, f"no row for {check} on {node}:\n{out}"
    return found.group(1)


def test_selftest_passes_on_two_nodes_in_containers(provisioned, cluster_selftest):
    run = cluster_selftest
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "[node1] selftest: 2 rank(s) on 2 node(s), gloo, cpu" in out, out
    for node in ("node1", "node2"):
        assert _row(out, "comm-across-nodes", node).startswith("PASS"), out
        assert _row(out, "compile", node).startswith("PASS"), out
        assert "not resharded: node-local disks" in _row(out, "fsdp2-dcp", node), out
        # Each node's shards copied to the other's own disk, in its container; node2's wiped.
        assert _row(out, "fsdp2-replicas", node).startswith("PASS"), out
        assert "node2's wiped copy restored from node1" in _row(out, "fsdp2-replicas", node), out
        assert _row(out, "ddp-checkpoint", node).startswith("PASS"), out
        # torchft across the nodes' ranks, its lighthouse in node1's container
        assert "3 steps committed by 2 groups" in _row(out, "ft-replicas", node), out
        assert _row(out, "amp-bf16", node).startswith("PASS"), out
        assert re.match(r"SKIPPED +- +1 rank on this node", _row(out, "comm-in-node", node)), out
        gpu_only_checks = (
            "amp-fp16",
            "data-parallel",
            "model-parallel",
            "nccl-transport",
            "nccl-waits",
        )
        for gpu_only in gpu_only_checks:
            assert re.match(r"SKIPPED +- +\S", _row(out, gpu_only, node)), out
    assert "[node1] selftest passed on 2 node(s)" in out, out
    assert not ERROR_LINE.search(out), out
    # Nothing of the job is left: its containers (and their temporary directories) are gone.
    for index in (1, 2):
        assert on_node(provisioned.cluster, index, "docker ps -aq").strip() == "", index
