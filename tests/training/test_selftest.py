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


def test_a_check_local_rank_0_runs_for_its_node_shows_its_result_not_the_others_skip():
    """data-parallel on a node of 2 GPUs: local rank 0 runs it over both, local rank 1 skips;
    the node's row is rank 0's result (it read SKIPPED on every node where it ran)."""
    skip = "run by local rank 0 of the node, over all its GPUs"
    results = [
        selftest.Result("data-parallel", 0, "node1", "PASS", 1.0, "over 2 GPUs, within 1e-07"),
        selftest.Result("data-parallel", 1, "node1", "SKIPPED", 0.0, skip),
        selftest.Result("data-parallel", 2, "node2", "FAIL", 1.0, "differs by 0.1", "debug"),
        selftest.Result("data-parallel", 3, "node2", "SKIPPED", 0.0, skip),
        selftest.Result("model-parallel", 0, "node1", "SKIPPED", 0.0, "needs 2+ GPUs"),
        selftest.Result("model-parallel", 1, "node1", "SKIPPED", 0.0, "needs 2+ GPUs"),
    ]
    table = {row[:2]: row[2:] for row in selftest.rows(results)}
    assert table["data-parallel", "node1"][:2] == ("PASS", "1.0s")
    assert table["data-parallel", "node1"][2].endswith("(over 2 GPUs, within 1e-07)")
    assert table["data-parallel", "node2"][0] == "FAIL"
    assert table["model-parallel", "node1"] == ("SKIPPED", "-", "needs 2+ GPUs")


class _Plain(torch.nn.Module):
    """DDP's place on one process without a group: the module, as DDP holds it."""

    def __init__(self, module, device_ids=None):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_a_failed_checkpoint_save_stops_every_rank_before_ddps_next_collective(
    tmp_path, monkeypatch
):
    """One rank's disk full: it and every other rank leave the check at the meeting point
    after the save; under NCCL the others would wait for it in DDP's next all_reduce until
    the collective timeout ended the process, and the table with it."""
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", _Plain)
    events = []
    step = checks._ddp_step
    monkeypatch.setattr(checks, "_ddp_step", lambda *args: events.append("step") or step(*args))
    failing = _job(tmp_path / "rank0", "cpu", ["node1", "node2"])
    monkeypatch.setattr(failing, "gather", lambda value: events.append(value) or [value, None])

    def save(self, step, state):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(checks.checkpoint.CheckpointStore, "save", save)
        with pytest.raises(checks.Failed, match="No space left on device"):
            checks.check_ddp_checkpoint(failing)
    assert events[:2] == ["step", "step"] and len(events) == 3, events
    assert events[2].startswith("Failed: saving or resuming a checkpoint failed: OSError")

    # The rank whose save succeeded hears of it at the same point, before its third step.
    events.clear()
    other = _job(tmp_path / "rank1", "cpu", ["node1", "node2"], rank=1)
    monkeypatch.setattr(other, "gather", lambda value: events.append(value) or ["Failed", value])
    with pytest.raises(checks.Stopped, match="rank 0 on node1 failed first"):
        checks.check_ddp_checkpoint(other)
    assert events == ["step", "step", None]


def test_the_model_parallel_check_runs_the_workload_under_a_torchrun_of_its_own(
    tmp_path, monkeypatch
):
    """What the model-parallel check starts on a node of 2+ GPUs (DDP over a module on two of
    them, on NCCL), run here on the CPU: the nested torchrun takes none of the selftest rank's
    own names, writes nothing in the run directory, and a failure is the worker's own line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rank_env = {
        **os.environ,
        "RANK": "3",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "selftest",
        "TMN_RUN_DIR": str(run_dir),
        "TMN_NODE_NAME": "node7",
        "TORCH_FR_BUFFER_SIZE": "256",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": str(tmp_path / "nccl-rank3.log"),
    }
    command, env = node_gpus.workload_run(rank_env)
    assert command[1:8] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "torch_multinode.training.model_parallel",
    ]
    inherited = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    inherited |= {"TORCHELASTIC_RUN_ID", "TMN_RUN_DIR", "NCCL_DEBUG_FILE"}
    assert not inherited & set(env)
    assert (env["TMN_NODE_NAME"], env["NCCL_DEBUG"]) == ("node7", "WARN")
    assert node_gpus.run_workload(rank_env) == "training.model_parallel's DDP over both: 2 steps"
    assert list(run_dir.iterdir()) == []

    monkeypatch.setattr(node_gpus, "WORKLOAD", "torch_multinode.training.no_such_workload")
    with pytest.raises(checks.Failed) as failed:
        node_gpus.run_workload(rank_env)
    assert str(failed.value).startswith(
        "training.model_parallel under torchrun (DDP over two GPUs) exited 1: "
    ), failed.value
    assert str(failed.value).endswith("No module named torch_multinode.training.no_such_workload")


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
    # No "Using network" line (a network plugin that words it otherwise): SKIPPED with why,
    # in the table's word (netcheck's SKIP was not one, and the table raised on it).
    job.nccl_log.write_text("node1:1:1 [0] NCCL INFO Bootstrap: Using eth0\n")
    with pytest.raises(checks.Skip, match="NCCL did not say which network it used"):
        checks.check_nccl_transport(job)
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
