"""The table of known failure signatures: each error string users meet, as torch, NCCL and gloo
print it, is named with its cause and remedy, in a failed job's summary on every backend."""

from __future__ import annotations

import collections

import pytest

from tests.helpers import inventory, node
from torch_multinode.launch.ending import local_summary, summary
from torch_multinode.launch.signatures import SIGNATURES, known_problems
from torch_multinode.launch.spec import JobResult, NodeOutcome

# Lines as torch 2.x, NCCL and gloo print them (a rank's prefix kept where torchrun adds one).
PRINTED = {
    "cuda-out-of-memory": "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to "
    "allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free.",
    "no-kernel-image": "[rank0]: RuntimeError: CUDA error: no kernel image is available for "
    "execution on the device",
    # torch 2.14's libc10_cuda, CUDA 13's libcudart (after "CUDA error: ")
    "gpu-driver-too-old": "UserWarning: CUDA initialization: The NVIDIA driver on your system is "
    "too old (found version 12080). Please update your GPU driver by downloading and "
    "installing a new version from the URL: http://www.nvidia.com/Download/index.aspx",
    "gpu-busy": "[rank1]: torch.AcceleratorError: CUDA error: CUDA-capable device(s) is/are "
    "busy or unavailable",
    "gpu-fault": "[rank0]: torch.AcceleratorError: CUDA error: an illegal memory access was "
    "encountered",
    "shared-memory": "ERROR: Unexpected bus error encountered in worker. This might be caused "
    "by insufficient shared memory (shm).",
    "address-in-use": "torch.distributed.DistNetworkError: The server socket has failed to "
    "listen on any local network address. port: 29500, useIpv6: false, code: -98, name: "
    "EADDRINUSE, message: address already in use",
    # torch 2.14 retries a refused connection quietly (libtorch_cpu's socket.cpp), then:
    "rendezvous-unreachable": "The client socket has timed out after 900000ms while trying to "
    "connect to (10.7.0.1, 29500).",
    "rendezvous-timeout": "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
    # NCCL 2.30's IB transport (libnccl.so.2's format string)
    "ib-transport-error": "node2:81:95 [0] NCCL WARN NET/IB: Got completion from peer "
    "10.7.0.1<52811> with status=transport retry counter exceeded(12) opcode=SEND(0) "
    "vendor_err=129",
    "nccl-system-error": "[rank1]: torch.distributed.DistBackendError: NCCL error in: "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5",
    "nodes-differ": "[rank1]: RuntimeError: DDP expects same model across all ranks, but "
    "Rank 1 has 62 params, while rank 0 has inconsistent 61 params.",
    "collective-mismatch": "[rank0]: RuntimeError: Detected mismatch between collectives on "
    "ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=12, "
    "OpType=ALLREDUCE)",
    "collective-timeout": "[rank0]:[E1126 01:02:03.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600001 milliseconds before timing out.",
    "peer-reset": "[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:561] Connection closed by peer [10.0.0.2]:30129",
    # torch 2.14.1, as a node's torchrun printed it in CI when the master's had gone
    "rendezvous-store-lost": "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. "
    "Connection was likely closed. Did the remote server shutdown or crash?",
}


def test_every_signature_has_a_printed_example_here():
    assert [s.name for s in SIGNATURES] == list(PRINTED)


@pytest.mark.parametrize("name", list(PRINTED))
def test_each_error_string_is_named_by_its_own_signature_alone(name):
    found = known_problems(["rank 0 ready", PRINTED[name], "step 3/60"])
    assert [s.name for s in found] == [name]
    line = found[0].line()
    assert line.startswith("Known problem: ") and " (try " in line and line.endswith(")")


@pytest.mark.parametrize(
    "line",
    [
        "[rank1]: ValueError: bad batch shape (3, 5)",
        "step 5/60  loss 2.1844  acc  22.5%",
        "Saved checkpoint to /var/lib/torch-multinode/checkpoints/exp1",
    ],
)
def test_an_ordinary_error_or_progress_line_matches_none(line):
    assert known_problems([line]) == []


def test_nccl_receiving_other_sizes_than_it_sent_means_the_nodes_differ():
    # NCCL 2.27's socket transport, as libnccl.so.2 spells it
    nccl = (
        "node2:81:95 [0] NCCL WARN NET/Socket : peer 192.0.2.1<43210> message truncated : "
        "receiving 524288 bytes instead of 65536. If you believe your socket network is in a "
        "healthy state, there may be a mismatch in collective sizes or environment settings "
        "(e.g. NCCL_PROTO, NCCL_ALGO) between ranks"
    )
    ib = "NCCL WARN Message truncated : received 1048576 bytes instead of 65536"
    assert [s.name for s in known_problems([nccl])] == ["nodes-differ"]
    assert [s.name for s in known_problems([ib])] == ["nodes-differ"]


def test_what_the_first_table_missed_is_named_and_the_exit_barrier_is_not_a_collective():
    """torch 2.14 / NCCL 2.30 / CUDA 13 as they print it (their libraries' format strings)."""

    def named(*lines: str) -> list[str]:
        return [s.name for s in known_problems(lines)]

    assert named(
        "Mismatched NCCL version detected : rank 0 version 23007 rank 1 version 22705"
    ) == ["nodes-differ"]
    assert named(
        "RuntimeError: params[3] in this process with sizes [64, 3, 7, 7] appears not to match "
        "sizes of the same param in process 0."
    ) == ["nodes-differ"]
    assert named("node1:5:9 [0] NCCL WARN Cuda failure 2 'out of memory'") == ["cuda-out-of-memory"]
    assert named("Signal 7 (SIGBUS) received by PID 4242") == ["shared-memory"]
    assert named("Error 803: system has unsupported display driver / cuda driver combination") == [
        "gpu-driver-too-old"
    ]
    assert named("CUDA error: uncorrectable ECC error encountered") == ["gpu-fault"]
    # A node that succeeded and waited out torchrun's exit barrier: no collective timed out.
    assert named("torch.distributed.DistStoreError: Timed out waiting on barrier on rank 0") == []


def test_the_masters_own_port_taken_is_not_also_a_node_that_cannot_reach_it():
    """The master's rendezvous wraps its own failure to listen in a RendezvousConnectionError:
    the port in use explains it; "could not reach the master" would point at the firewall."""
    wrapped = "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection"
    assert [s.name for s in known_problems([PRINTED["address-in-use"], wrapped])] == [
        "address-in-use"
    ]
    assert [s.name for s in known_problems([wrapped])] == ["rendezvous-unreachable"]


def test_a_store_lost_mid_run_is_no_node_that_could_not_reach_the_master():
    """A node's torchrun asks the master's rendezvous store, all the job long, whether nodes
    wait to join; when the master's torchrun has ended, that question fails wrapped in the same
    RendezvousConnectionError as a store never reached. It follows from the master's end: a
    knock-on, said only when no rank's own exception was found."""
    wrapped = "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection"
    lost = [PRINTED["rendezvous-store-lost"], wrapped]
    assert [s.name for s in known_problems(lost)] == ["rendezvous-store-lost"]
    assert known_problems(lost, cause_found=True) == []


def test_gloo_timing_out_is_a_collective_timeout():
    gloo = (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete"
    )
    assert [s.name for s in known_problems([gloo])] == ["collective-timeout"]


def test_a_signature_is_said_once_however_often_it_appears():
    found = known_problems([PRINTED["peer-reset"]] * 3 + [PRINTED["cuda-out-of-memory"]])
    # In the table's order: the cause before what follows from it.
    assert [s.name for s in found] == ["cuda-out-of-memory", "peer-reset"]


def test_a_failed_nodes_summary_says_the_known_problem_after_the_cause():
    hosts = inventory({"node1": node(1), "node2": node(2)}).hosts
    tails = {
        "node1": ["[rank0]: Traceback (most recent call last):", PRINTED["peer-reset"]],
        "node2": [
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "/home/t/p/train.py", line 42, in <module>',
            PRINTED["cuda-out-of-memory"].replace("[rank0]", "[rank1]"),
        ],
    }
    outcomes = {
        name: NodeOutcome(host=name, exit_code=1, tail=collections.deque(tail))
        for name, tail in tails.items()
    }
    result = JobResult("tmn-3", outcomes, "node2", interrupted=False, seconds=4.0)
    lines = summary(result, hosts)
    assert lines[1].startswith("Cause: node2 rank 1 raised torch.OutOfMemoryError: CUDA out")
    known = [line for line in lines if line.startswith("Known problem: ")]
    # node1's "Connection closed by peer" is the cause's consequence, said as such already.
    assert known == [next(s for s in SIGNATURES if s.name == "cuda-out-of-memory").line()]
    assert lines.index(known[0]) < lines.index("  node1        exit 1")


def test_a_peer_reset_with_no_rank_exception_found_is_said_to_be_a_knock_on():
    assert [s.name for s in known_problems([PRINTED["peer-reset"]], cause_found=False)] == [
        "peer-reset"
    ]
    assert known_problems([PRINTED["peer-reset"]], cause_found=True) == []


def test_a_local_jobs_summary_says_the_known_problem_too():
    tail = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/work/p/train.py", line 9, in <module>',
        PRINTED["no-kernel-image"],
    ]
    lines = local_summary("tmn-4", 1, 2.0, tail)
    assert lines[0].startswith("Job tmn-4 FAILED on this machine after 2.0 s")
    assert next(s for s in SIGNATURES if s.name == "no-kernel-image").line() in lines
