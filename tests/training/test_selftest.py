"""`make selftest` on this machine (2 CPU processes): every check run or SKIPPED with its reason,
one table; a failed check is one `Error:` line naming the check, the node and the remedy, exit 1.
The GPU-only decisions (NCCL's transport, the 2-GPU checks) with torch.cuda faked."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, make
from tests.helpers import ERROR_LINE
from tests.training.conftest import local_nodes
from torch_multinode.cluster.errors import UserError
from torch_multinode.training import selftest
from torch_multinode.training.distributed import parallel
from torch_multinode.training.selftesting import checks, node_gpus
from torch_multinode.training.settings import arguments

GPU_ONLY = ("amp-fp16", "data-parallel", "model-parallel", "nccl-transport")


def _row(out: str, check: str) -> str:
    found = re.search(rf"^{re.escape(check)} +\S+ +(.*)$", out, re.M)
    assert found, f"no row for {check}:\n{out}"
    return found.group(1)


def test_make_selftest_passes_locally_with_the_gpu_checks_skipped_with_reasons():
    run = make("selftest", timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "selftest: 2 rank(s) on 1 node(s), gloo, cpu" in out
    assert re.search(r"^check +node +result +time +what it proves$", out, re.M), out
    for check in ("device", "comm-in-node", "amp-bf16", "ddp-checkpoint", "compile"):
        assert _row(out, check).startswith("PASS"), out
    assert "resharded to 1" in _row(out, "fsdp2-dcp"), out
    assert re.match(r"SKIPPED +- +one node in this job", _row(out, "comm-across-nodes")), out
    assert re.match(r"SKIPPED +- +fp16 with GradScaler is the GPU path", _row(out, "amp-fp16"))
    assert re.match(r"SKIPPED +- +needs 2\+ GPUs on the node", _row(out, "model-parallel"))
    assert re.match(r"SKIPPED +- +no NCCL on a CPU node", _row(out, "nccl-transport")), out
    # the hang report's trace, read back from gloo's recorder (NCCL's on a GPU node)
    assert re.search(r"\(gloo:all_reduce #\d+\)$", _row(out, "flight-recorder")), out
    assert re.match(r"SKIPPED +- +one node's disk", _row(out, "fsdp2-replicas")), out
    assert "selftest passed on 1 node(s)" in out
    assert not ERROR_LINE.search(out), out


def test_a_missing_compiler_is_one_line_naming_the_check_the_node_and_the_remedy():
    run = make("selftest", timeout=600, env={"CXX": "/nonexistent/g++"})
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: selftest check compile failed on {socket.gethostname()} (rank 0): "
        "torch.compile on CPUs needs a C++ compiler to build torch.compile's kernels, and "
        "/nonexistent/g++ does not run here (try apt-get install g++ (or CXX=<compiler>) on the "
        "node, or the training image (make image), which has them)"
    ], out
    assert re.match(r"FAIL +[\d.]+s", _row(out, "compile")), out
    assert _row(out, "ddp-checkpoint").startswith("PASS"), out  # the others still ran
    assert "Traceback" not in out, out


def test_the_fail_hook_fails_the_last_rank_only_and_the_table_names_its_node():
    results = [
        selftest.Result("compile", 0, "node1", "PASS", 1.0, "inductor on cpu"),
        selftest.Result("compile", 1, "node2", "FAIL", 2.0, "failed on purpose", "leaving out"),
        selftest.Result("nccl-transport", 0, "node1", "WARN", 0.0, "NCCL used TCP sockets"),
        selftest.Result("amp-fp16", 0, "node1", "SKIPPED", 0.0, "no GPU"),
        selftest.Result("ddp-checkpoint", 1, "node2", "STOPPED", 0.5, "rank 0 on node1 failed"),
        selftest.Result("ddp-checkpoint", 0, "node1", "FAIL", 0.5, "disk full", "more room"),
    ]
    table = selftest.rows(results)
    assert ("amp-fp16", "node1", "SKIPPED", "-", "no GPU") in table
    assert table[1][:4] == ("compile", "node2", "FAIL", "2.0s")
    errors, warnings = selftest.problems(results)
    assert errors == [
        "Error: selftest check compile failed on node2 (rank 1): failed on purpose "
        "(try leaving out)",
        "Error: selftest check ddp-checkpoint failed on node1 (rank 0): disk full (try more room)",
    ]
    assert warnings == ["Warning: nccl-transport on node1: NCCL used TCP sockets"]


def test_arguments_are_checked_on_the_controller():
    assert arguments.CHECKS["training.selftest"] is arguments.selftest
    assert arguments.selftest(["--fail", "compile"]).fail == "compile"
    with pytest.raises(UserError, match="invalid choice"):
        arguments.selftest(["--fail", "everything"])
    assert selftest.CHECK_NAMES == arguments.SELFTEST_CHECKS


def _job(tmp_path: Path, device: str, nodes: list[str], rank: int = 0) -> checks.Job:
    env = parallel.DistEnv(
        rank=rank,
        world_size=len(nodes),
        launched=True,
        backend="nccl" if device.startswith("cuda") else "gloo",
        device=torch.device(device),
    )
    job = checks.Job(env, nodes[rank], tmp_path, None)
    job.nodes = nodes
    return job


def test_nccl_transport_is_read_from_the_ranks_own_debug_file(tmp_path, monkeypatch):
    job = _job(tmp_path, "cuda:0", ["node1", "node2"])
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    job.nccl_log = selftest._nccl_log(job.env, tmp_path)
    assert os.environ["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-rank0.log")
    assert os.environ["NCCL_DEBUG"] == "INFO"
    job.nccl_log.write_text("node1:1:1 [0] NCCL INFO Using network Socket\n")
    monkeypatch.setattr(checks.nccl_transport, "rdma_devices", lambda: [])
    assert checks.check_nccl_transport(job)[0] == "PASS"
    monkeypatch.setattr(checks.nccl_transport, "rdma_devices", lambda: ["mlx5_0"])
    status, detail = checks.check_nccl_transport(job)
    assert status == "WARN" and "mlx5_0" in detail
    with pytest.raises(checks.Skip, match="one node"):
        checks.check_nccl_transport(_job(tmp_path, "cuda:0", ["node1", "node1"]))
    with pytest.raises(checks.Skip, match="no NCCL on a CPU node"):
        checks.check_nccl_transport(_job(tmp_path, "cpu", ["node1", "node2"]))


def test_no_nccl_log_is_set_up_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    assert selftest._nccl_log(_job(tmp_path, "cpu", ["a", "b"]).env, tmp_path) is None
    assert "NCCL_DEBUG_FILE" not in os.environ


@pytest.mark.parametrize(
    ("device", "gpus", "rank", "reason"),
    [
        ("cpu", 0, 0, "needs 2\\+ GPUs on the node; it has none"),
        ("cuda:0", 1, 0, "needs 2\\+ GPUs on the node; this process sees 1"),
        ("cuda:1", 2, 1, "run by local rank 0 of the node"),
    ],
)
def test_the_two_gpu_checks_say_why_they_skip(tmp_path, monkeypatch, device, gpus, rank, reason):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    job = _job(tmp_path, device, ["n", "n"], rank=rank)
    job = checks.Job(
        parallel.DistEnv(**{**job.env.__dict__, "local_rank": rank}), "n", tmp_path, None
    )
    for check in (node_gpus.check_data_parallel, node_gpus.check_model_parallel):
        with pytest.raises(checks.Skip, match=reason):
            check(job)


def test_the_fail_hook_reports_a_check_that_ran_as_failed_on_the_last_rank(tmp_path):
    job = checks.Job(parallel.DistEnv(), "node1", tmp_path, "amp-bf16")  # one plain process
    result = selftest.run_check(job, "amp-bf16")
    assert (result.check, result.node, result.status) == ("amp-bf16", "node1", "FAIL")
    assert result.detail == "failed on purpose (--fail, a test hook)"
    assert selftest.run_check(job, "amp-fp16").status == "SKIPPED"


def test_replicas_on_two_nodes_disks_are_copied_and_a_wiped_one_restored(tmp_path):
    """Two "nodes" here, each its own temporary directory (its disk): the fsdp2-replicas check
    copies each node's shards to the other beside the job's all_reduces, wipes node-1's copy
    and resumes it from node-0's, with the same parameters."""
    disks = [tmp_path / f"disk{index}" for index in (0, 1)]
    for disk in disks:
        disk.mkdir()
    done = local_nodes(
        REPO_ROOT,
        "torch_multinode.training.selftest",
        2,
        lambda index: ["--only", "fsdp2-replicas"],
        lambda index: {"TMPDIR": str(disks[index])},
    )
    out = done[0].stdout + done[0].stderr
    assert [node.returncode for node in done] == [0, 0], out + done[1].stdout + done[1].stderr
    row = re.search(r"^fsdp2-replicas +node-1 +(.*)$", out, re.M)
    assert row and row.group(1).startswith("PASS"), out
    assert (
        "2 nodes' shards copied beside gloo; node-1's wiped copy restored from node-0, same "
        "parameters"
    ) in row.group(1), out
    assert "node-1's directory lacked " in out, out  # the resume said what it copied
    # What the checks wrote on each disk is gone (torchrun's own directory stays).
    for disk in disks:
        assert [p.name for p in disk.iterdir() if not p.name.startswith("torchelastic_")] == []
