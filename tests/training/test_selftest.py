"""`make selftest` on this machine (2 CPU processes): every check run or SKIPPED with its reason,
one table; a failed check is one `Error:` line naming the check, the node and the remedy, exit 1.
The GPU-only decisions (NCCL's transport, the 2-GPU checks) with torch.cuda faked."""

from __future__ import annotations

import io
import json
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
from torch_multinode.launch import signatures
from torch_multinode.training import selftest
from torch_multinode.training.distributed import parallel
from torch_multinode.training.selftesting import checks, nccl_log, node_gpus
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
    # FT=1's path: each rank a replica group, torchft averaging across them
    assert re.search(r"^PASS .*\(3 steps committed by 2 groups, within ", _row(out, "ft-replicas"))
    assert re.match(r"SKIPPED +- +gloo's waits are timed by its hooks", _row(out, "nccl-waits"))
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
    environ = {"TMN_RUN_DIR": str(tmp_path / "run")}
    job.nccl_log = nccl_log.place("cuda", 0, tmp_path / "scratch", environ)
    assert environ["NCCL_DEBUG_FILE"] == str(tmp_path / "run" / "nccl-rank0.log")
    assert (environ["NCCL_DEBUG"], environ["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert (tmp_path / "run").is_dir()  # made for NCCL, which makes no directory
    job.nccl_log.path.write_text("node1:1:1 [0] NCCL INFO Using network Socket\n")
    monkeypatch.setattr(checks.nccl_transport, "rdma_devices", lambda: [])
    assert checks.check_nccl_transport(job)[0] == "PASS"
    monkeypatch.setattr(checks.nccl_transport, "rdma_devices", lambda: ["mlx5_0"])
    status, detail = checks.check_nccl_transport(job)
    assert status == "WARN" and "mlx5_0" in detail
    # No "Using network" line (a network plugin that words it otherwise): SKIPPED with why,
    # in the table's word (netcheck's SKIP was not one, and the table raised on it).
    job.nccl_log.path.write_text("node1:1:1 [0] NCCL INFO Bootstrap: Using eth0\n")
    with pytest.raises(checks.Skip, match="NCCL did not say which network it used"):
        checks.check_nccl_transport(job)
    with pytest.raises(checks.Skip, match="one node"):
        checks.check_nccl_transport(_job(tmp_path, "cuda:0", ["node1", "node1"]))
    with pytest.raises(checks.Skip, match="no NCCL on a CPU node"):
        checks.check_nccl_transport(_job(tmp_path, "cpu", ["node1", "node2"]))


def test_no_nccl_log_is_set_up_on_the_cpu(tmp_path):
    environ: dict[str, str] = {}
    assert nccl_log.place("cpu", 0, tmp_path, environ) is None
    assert environ == {}


# -- NCCL's own words: what an NCCL 2.30 rank writes with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
# (src/debug.cc's prefix "host:pid:tid [dev]", a WARN's "file:line (function)" and the blank
# line before it; the messages' formats from NCCL 2.30.7's sources and its shipped libnccl.so.2).

IB_INIT = (
    "node1:4242:4242 [0] NCCL INFO Bootstrap: Using ens1f0:10.7.0.1<0>\n"
    "node1:4242:4242 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; "
    "OOB ens1f0:10.7.0.1<0>\n"
    "node1:4242:4242 [0] NCCL INFO Using network IB\n"
)
IB_COMPLETION_ERROR = (
    "\n[2026-11-28 10:12:31] node1:4242:4301 [0] transport/net_ib/p2p.cc:688 "
    "(ncclIbCompletionError) NCCL WARN NET/IB: Got completion from peer 10.7.0.2<47311> with "
    "status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_SEND(0) vendor_err=129 localGid "
    "fe80::ba59:9f03:c2:8e0a remoteGidsfe80::ba59:9f03:c2:8e12 hca mlx5_0\n"
    "node1:4242:4301 [0] NCCL INFO transport/net_ib/p2p.cc:744 -> 6\n"
)
TORCH_NCCL_ERROR = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3691, unhandled "
    "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.30.7\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
    "device error. \nLast error:\nsocketStartConnect: Connect to 10.7.0.2<58123> failed : "
    "Software caused connection abort"
)


class DistBackendError(RuntimeError):
    """torch.distributed.DistBackendError's place: its message is what matters here."""


def _gpu_job(tmp_path, monkeypatch, rank: int = 1) -> checks.Job:
    """A rank of an NCCL job on a faked GPU (node2's), its NCCL log in the run directory."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    job = _job(tmp_path, f"cuda:{rank}", ["node1", "node2"], rank=rank)
    (tmp_path / "run").mkdir(exist_ok=True)
    environ = {"TMN_RUN_DIR": str(tmp_path / "run")}
    job.nccl_log = nccl_log.place("cuda", rank, tmp_path / "scratch", environ)
    return job


def test_a_failed_nccl_check_shows_nccls_own_warn_lines_and_the_known_failure(
    tmp_path, monkeypatch
):
    """torch's first line says only "unhandled system error"; the row, the Error line and the
    launcher's table of known failures get NCCL's WARN line, written while the check ran."""
    job = _gpu_job(tmp_path, monkeypatch)
    log = job.nccl_log.path
    log.write_text(IB_INIT + "\n[2026-11-28 10:11:02] node2:1:1 [1] misc.cc:1 NCCL WARN earlier\n")

    def communicate(job):
        with open(log, "a") as file:  # NCCL writes while the collective fails
            file.write(IB_COMPLETION_ERROR)
        raise DistBackendError(TORCH_NCCL_ERROR)

    monkeypatch.setitem(selftest.RUNS, "comm-across-nodes", communicate)
    result = selftest.run_check(job, "comm-across-nodes")
    assert result.status == "FAIL"
    assert result.detail.endswith(
        "DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:3691, unhandled system error (run with NCCL_DEBUG=INFO for "
        "details), NCCL version 2.30.7 (NCCL: NET/IB: Got completion from peer 10.7.0.2<47311> "
        "with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_SEND(0) vendor_err=129 localGid "
        "fe80::ba59:9f03:c2:8e0a remoteGidsfe80::ba59:9f03:c2:8e12 hca mlx5_0)"
    ), result.detail
    assert "earlier" not in result.detail  # a warning of an earlier check is not this one's
    assert result.remedy.endswith(f"; NCCL's whole log: {log} on node2")
    (error,), _ = selftest.problems([result])
    assert error.startswith("Error: selftest check comm-across-nodes failed on node2 (rank 1): ")
    assert "(NCCL: NET/IB: Got completion from peer 10.7.0.2<47311>" in error
    row = [r for r in selftest.rows([result]) if r[0] == "comm-across-nodes"][0]
    assert row[2] == "FAIL" and "NET/IB: Got completion from peer" in row[4]
    # What the launcher's summary matches against the node's last lines.
    known = [s.name for s in signatures.known_problems([error])]
    assert known == ["ib-transport-error", "nccl-system-error"]
    assert log.parent == tmp_path / "run"  # kept where the launcher copies it home from


def test_without_warn_lines_in_the_log_the_row_carries_torchs_last_error(tmp_path, monkeypatch):
    job = _gpu_job(tmp_path, monkeypatch)

    def communicate(job):
        raise DistBackendError(TORCH_NCCL_ERROR)

    monkeypatch.setitem(selftest.RUNS, "comm-in-node", communicate)
    result = selftest.run_check(job, "comm-in-node")
    assert result.detail.endswith(
        "NCCL version 2.30.7 (NCCL: socketStartConnect: Connect to 10.7.0.2<58123> failed : "
        "Software caused connection abort)"
    ), result.detail
    # A check that fails on its own, NCCL silent: its row as before, no word of NCCL's log.
    monkeypatch.setitem(selftest.RUNS, "comm-in-node", lambda job: ("PASS", "fine"))
    job.fail = "comm-in-node"
    plain = selftest.run_check(job, "comm-in-node")
    assert (plain.detail, plain.remedy) == (
        "failed on purpose (--fail, a test hook)",
        "leaving out --fail",
    )


def test_a_rank_that_cannot_form_its_first_communicator_says_why_in_one_line(tmp_path, monkeypatch):
    """Under NCCL the job's group forms at once (bound to the rank's GPU): a failure there is
    one Error line with NCCL's own WARN lines, exit 1, not a traceback ending in torch's first
    line."""
    job = _gpu_job(tmp_path, monkeypatch, rank=0)
    job.nccl_log.path.write_text(
        "\n[2026-11-28 10:11:02] node1:7:9 [0] misc/socket.cc:568 (socketStartConnect) NCCL WARN "
        "socketStartConnect: Connect to 10.7.0.2<58123> failed : Software caused connection "
        "abort\n"
    )
    error = selftest.start_failed(job, DistBackendError(TORCH_NCCL_ERROR))
    assert error.exit_code == 1
    assert error.line().startswith(
        "Error: selftest could not join the job's process group on node1 (rank 0): "
        "DistBackendError: NCCL error in: "
    )
    assert "(NCCL: socketStartConnect: Connect to 10.7.0.2<58123> failed" in error.line()
    assert error.line().endswith(f"NCCL's whole log: {job.nccl_log.path} on node1)")


@pytest.mark.parametrize(
    ("asked", "echoed"),
    [
        ({}, "warnings"),  # NCCL_DEBUG unset: what NCCL_DEBUG=WARN would print
        ({"NCCL_DEBUG": "WARN"}, "warnings"),  # the training image's setting
        ({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}, "all"),  # DEBUG=1
        ({"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "COLL"}, "all"),
    ],
)
def test_nccls_log_reaches_the_console_warnings_always_everything_under_debug(
    tmp_path, asked, echoed
):
    environ = {"TMN_RUN_DIR": str(tmp_path), **asked}
    log = nccl_log.place("cuda", 3, tmp_path / "scratch", environ)
    assert environ["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-rank3.log")
    assert environ["NCCL_DEBUG"] == ("TRACE" if asked.get("NCCL_DEBUG") == "TRACE" else "INFO")
    wanted = {"COLL": "COLL,INIT,NET"}.get(asked.get("NCCL_DEBUG_SUBSYS", ""), "INIT,NET")
    assert environ["NCCL_DEBUG_SUBSYS"] == wanted
    out = io.StringIO()
    log.out = out
    log.start()
    log.path.write_text(IB_INIT + IB_COMPLETION_ERROR + "node1:4242:4301 [0] NCCL INFO half a li")
    log.stop()  # its last look takes what the thread had not yet
    printed = out.getvalue().splitlines()
    warn = [line for line in printed if " NCCL WARN " in line]
    assert len(warn) == 1 and "NET/IB: Got completion from peer 10.7.0.2<47311>" in warn[0]
    assert "half a li" not in out.getvalue()  # an incomplete line waits for its end
    if echoed == "all":
        assert printed[:3] == IB_INIT.splitlines() and len(printed) == 5
    else:
        assert printed == warn
    assert signatures.known_problems(printed)[0].name == "ib-transport-error"


def test_the_transport_check_reports_gpudirect_rdma_from_nccls_info_lines(tmp_path, monkeypatch):
    """Recorded lines of NCCL 2.30's formats: GDRDMA on each connection over the network, or
    not; where NCCL found the HCAs unable (no nvidia-peermem, no DMA-BUF), a warning."""
    job = _gpu_job(tmp_path, monkeypatch, rank=0)
    monkeypatch.setattr(checks.nccl_transport, "rdma_devices", lambda: ["mlx5_0", "mlx5_1"])
    monkeypatch.setattr(checks.nccl_transport, "peermem_loaded", lambda: False)
    enabled = (
        "node1:4242:4242 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'\n"
        "node1:4242:4242 [0] NCCL INFO DMA-BUF is available on GPU device 0\n"
    )
    with_gdr = (
        "node1:4242:4300 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA\n"
        "node1:4242:4300 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA\n"
    )
    job.nccl_log.path.write_text(IB_INIT + enabled + with_gdr)
    assert checks.check_nccl_transport(job) == (
        "PASS",
        "NCCL used IB on mlx5_0:1, mlx5_1:1, with GPUDirect RDMA",
    )
    disabled = (
        "node1:4242:4242 [0] NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'\n"
        "node1:4242:4242 [0] NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 1 'mlx5_1'\n"
    )
    through_host = with_gdr.replace("/GDRDMA", "")
    job.nccl_log.path.write_text(IB_INIT + disabled + through_host)
    status, detail = checks.check_nccl_transport(job)
    assert status == "WARN"
    assert detail.startswith(
        "NCCL used IB on mlx5_0:1, mlx5_1:1 without GPUDirect RDMA: NCCL found mlx5_0, mlx5_1 "
        "unable to reach GPU memory (nvidia-peermem is not loaded; NCCL found no DMA-BUF on the "
        "GPU), so every transfer is copied through host memory"
    ), detail
    assert "modprobe nvidia-peermem" in detail
    # The HCAs could, but NCCL chose host memory for this GPU (their distance on PCIe): no
    # warning, said as it is.
    job.nccl_log.path.write_text(IB_INIT + enabled + through_host)
    status, detail = checks.check_nccl_transport(job)
    assert status == "PASS" and "without GPUDirect RDMA: NCCL's choice" in detail


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


@pytest.mark.extended
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


def test_the_nccl_waits_check_reads_its_collectives_timed_from_the_trace(tmp_path, monkeypatch):
    """The GPU-only check, on what it would read: NCCL's Flight Recorder entries in the fields an
    H200 wrote (`record_id`, `state`, `process_group`, `input_sizes`, `duration_ms`). Its three
    all_reduces are marked completed by the watchdog a moment after the GPU finishes them, so
    the check reads again until they are; entries never timed fail it with the remedy."""
    from torch_multinode.training.distributed import flight

    job = _job(tmp_path, "cpu", ["node1", "node2"])
    job.gather = lambda value: [value]  # type: ignore[method-assign]  # one rank here
    monkeypatch.setattr(checks.dist, "get_backend", lambda: "nccl")
    issued: list[list[int]] = []
    monkeypatch.setattr(checks.dist, "all_reduce", lambda tensor: issued.append(list(tensor.shape)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(checks, "WAITS_READ_FOR", 2.0)
    monkeypatch.setattr(checks.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "256")
    reads = []

    def entry(record: int, size: int, state: str, duration: float | None) -> dict:
        timed = {"duration_ms": duration} if duration is not None else {}
        return {
            "record_id": record,
            "state": state,
            "is_p2p": False,
            "process_group": ["0", "default_pg"],
            "input_sizes": [[size]],
            **timed,
        }

    def trace(backend=None) -> bytes:
        reads.append(backend)
        done = len(reads) >= 2  # the watchdog has retired them by the second read
        entries = [entry(40, 7, "completed", 0.5)]  # another check's, not counted
        entries += [
            entry(41 + i, checks.WAITS_MARK_SIZE, "completed" if done else "started", 0.25)
            for i in range(3)
        ]
        return json.dumps({"entries": entries}).encode()

    monkeypatch.setattr(flight, "trace_json", trace)
    assert checks.check_waits(job) == "3 collectives timed, 0.75 ms"
    assert issued == [[checks.WAITS_MARK_SIZE]] * 3 and reads == ["nccl", "nccl"]

    def untimed(backend=None) -> bytes:
        entries = [entry(41 + i, checks.WAITS_MARK_SIZE, "completed", None) for i in range(3)]
        return json.dumps({"entries": entries}).encode()

    monkeypatch.setattr(flight, "trace_json", untimed)
    with pytest.raises(checks.Failed, match="holds 0 timed, completed collective") as failed:
        checks.check_waits(job)
    assert "TORCH_NCCL_ENABLE_TIMING=1" in failed.value.remedy
    # The Flight Recorder off, timing off in the job's environment, or gloo: skipped, saying why.
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    with pytest.raises(checks.Skip, match="the Flight Recorder is off"):
        checks.check_waits(job)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "256")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "0")
    with pytest.raises(checks.Skip, match="TORCH_NCCL_ENABLE_TIMING is off"):
        checks.check_waits(job)
    monkeypatch.setattr(checks.dist, "get_backend", lambda: "gloo")
    with pytest.raises(checks.Skip, match="gloo's waits are timed by its hooks"):
        checks.check_waits(job)
