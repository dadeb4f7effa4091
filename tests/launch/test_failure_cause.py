"""A failed job's summary leads with its root cause: the rank that raised its own exception
(type, message, the user's file:line), with every peer's knock-on error (gloo's "Connection
closed by peer", NCCL's, torchrun's SIGTERM of the survivors) marked as its consequence, even
when a peer printed its error last or exited first."""

from __future__ import annotations

import collections
import re

from tests.conftest import run_cli
from tests.helpers import SCRIPTS, inventory, node
from torch_multinode.launch.blame import blame
from torch_multinode.launch.ending import exceptions, local_summary, summary
from torch_multinode.launch.spec import JobResult, NodeOutcome

GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
    "Connection closed by peer [127.0.0.1]:30129. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error."
)
TORCH = "/work/main/.venv/lib/python3.11/site-packages/torch/distributed"
# What a local job printed (measured): rank 1 raised, rank 0 then died in its all_reduce, printed
# its error last and exited first.
TAIL = [
    "rank 0 ready",
    "rank 1 ready",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/work/main/train.py", line 17, in <module>',
    '[rank1]:     raise ValueError("bad batch shape (3, 5)")',
    "[rank1]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "[rank1]: ValueError: bad batch shape (3, 5)",
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/work/main/train.py", line 18, in <module>',
    "[rank0]:     dist.all_reduce(torch.ones(1))",
    f'[rank0]:   File "{TORCH}/c10d_logger.py", line 83, in wrapper',
    "[rank0]:     return func(*args, **kwargs)",
    f'[rank0]:   File "{TORCH}/distributed_c10d.py", line 3913, in all_reduce',
    "[rank0]:     work.wait()",
    f"[rank0]: {GLOO}",
    "W1125 21:37:04.617000 30481 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
    "multiprocessing/api.py:1028] Sending process 30575 closing signal SIGTERM",
    "[torchrun] rank 0 failed first (exit 1)",
]


def test_a_local_summary_leads_with_the_rank_that_raised_not_the_peer_that_printed_last():
    lines = local_summary("tmn-1", 1, 40.5, TAIL)
    assert lines[:2] == [
        "Job tmn-1 FAILED on this machine after 40.5 s (rank 1; rank 0 exited first, exit 1).",
        "Cause: rank 1 raised ValueError: bad batch shape (3, 5) (at /work/main/train.py:17)",
    ]
    # the knock-on error, marked, its message cut at 200 characters
    assert lines[2] == "Consequence (of rank 1's failure): rank 0's RuntimeError: " + (
        GLOO.removeprefix("RuntimeError: ")[:197] + "..."
    )
    assert lines[3] == "Last lines:"


def test_a_traceback_whose_first_line_was_glued_to_another_ranks_still_leads():
    """CI run 25: rank 0's "rank 0 ready" went out as its text, then its newline, and rank 1's
    first traceback line came in between: rank 1's ValueError is still the cause."""
    glued = ["rank 1 ready", "rank 0 ready[rank1]: Traceback (most recent call last):"]
    tail = glued + TAIL[3:]
    lines = local_summary("tmn-1", 1, 40.5, tail)
    assert lines[:2] == [
        "Job tmn-1 FAILED on this machine after 40.5 s (rank 1; rank 0 exited first, exit 1).",
        "Cause: rank 1 raised ValueError: bad batch shape (3, 5) (at /work/main/train.py:17)",
    ]


def test_exceptions_keep_a_chains_last_and_leave_out_torchruns_own_report():
    lines = [
        "Traceback (most recent call last):",
        '  File "/home/u/p/train.py", line 5, in <module>',
        "KeyError: 'x'",
        "During handling of the above exception, another exception occurred:",
        "Traceback (most recent call last):",
        '  File "/home/u/p/train.py", line 7, in <module>',
        "RuntimeError: no x",
        "Traceback (most recent call last):",
        '  File "/usr/bin/torchrun", line 8, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "[rank2]: Traceback (most recent call last):",
        '[rank2]:   File "/home/u/p/train.py", line 9, in <module>',
        "[rank2]: torch.distributed.elastic.multiprocessing.api.SignalException: "
        "Process 7 got signal: 15",
    ]
    found = [(r.rank, r.kind, r.message, r.where, r.knock_on) for r in exceptions(lines)]
    assert found == [
        (None, "RuntimeError", "no x", "/home/u/p/train.py:7", False),
        (
            "2",
            "torch.distributed.elastic.multiprocessing.api.SignalException",
            "Process 7 got signal: 15",
            "/home/u/p/train.py:9",
            True,
        ),
    ]


def test_on_the_nodes_the_node_whose_rank_raised_is_blamed_and_leads_the_summary():
    # node1's rank 0 failed first, of an NCCL error caused by node2's rank 1 dying.
    hosts = inventory({"node1": node(1), "node2": node(2)}).hosts
    nccl = (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote "
        "process exited or there was a network error, NCCL version 2.21.5"
    )
    tails = {
        "node1": [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/home/t/p/train.py", line 30, in <module>',
            f"[rank0]: {nccl}",
        ],
        "node2": [
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "/home/t/p/train.py", line 42, in <module>',
            "[rank1]: ValueError: bad batch shape (3, 5)",
        ],
    }
    outcomes = {
        name: NodeOutcome(host=name, exit_code=1, tail=collections.deque(tail))
        for name, tail in tails.items()
    }
    failed = blame(["node1", "node2"], outcomes, hosts)
    assert failed == "node2"
    result = JobResult("tmn-2", outcomes, failed, interrupted=False, seconds=9.0)
    lines = summary(result, hosts)
    assert lines[0].startswith("Job tmn-2 FAILED on node2 after 9.0 s")
    assert lines[1:3] == [
        "Cause: node2 rank 1 raised ValueError: bad batch shape (3, 5) (at /home/t/p/train.py:42)",
        "Consequence (of rank 1's failure): node1 rank 0's " + nccl,
    ]


# node2's torchrun in CI (torch 2.14.1): the master's torchrun, which holds the rendezvous store,
# had ended while node2's ranks still ran.
STORE_LOST = [
    "[W1128 00:25:54.347221660 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on "
    "SocketImpl(fd=4, addr=[node2]:54004, remote=[node1]:29500): Failed to recv, got 0 bytes. "
    "Connection was likely closed. Did the remote server shutdown or crash?",
    "Traceback (most recent call last):",
    f'  File "{TORCH}/elastic/rendezvous/c10d_rendezvous_backend.py", line 114, in _call_store',
    "    return getattr(self._store, store_op)(*args, **kwargs)",
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
    "closed. Did the remote server shutdown or crash?",
    "The above exception was the direct cause of the following exception:",
    "Traceback (most recent call last):",
    f'  File "{TORCH}/elastic/agent/server/api.py", line 959, in _invoke_run',
    "    num_nodes_waiting = rdzv_handler.num_nodes_waiting()",
    f'  File "{TORCH}/elastic/rendezvous/c10d_rendezvous_backend.py", line 116, in _call_store',
    "    raise RendezvousConnectionError(",
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
    "C10d store has failed. See inner exception for details.",
]


def test_a_node_that_lost_the_masters_store_is_a_knock_on_and_the_master_is_blamed():
    hosts = inventory({"node1": node(1), "node2": node(2)}).hosts
    tails = {
        "node1": [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/home/t/p/train.py", line 51, in <module>',
            "[rank0]: OSError: [Errno 28] No space left on device",
        ],
        "node2": STORE_LOST,
    }
    outcomes = {
        name: NodeOutcome(host=name, exit_code=1, tail=collections.deque(tail))
        for name, tail in tails.items()
    }
    (lost,) = exceptions(STORE_LOST)
    assert lost.knock_on
    # A rank's own exception raised from another lost connection stays a cause.
    (own,) = exceptions(
        [
            "Traceback (most recent call last):",
            "ConnectionResetError: [Errno 104] Connection reset by peer",
            "During handling of the above exception, another exception occurred:",
            "Traceback (most recent call last):",
            '  File "/home/t/p/data.py", line 9, in fetch',
            "RuntimeError: could not download the dataset",
        ]
    )
    assert not own.knock_on
    assert own.said() == (
        "RuntimeError: could not download the dataset (at /home/t/p/data.py:9), from "
        "ConnectionResetError: [Errno 104] Connection reset by peer"
    )
    assert lost.said().endswith(
        "(at " + TORCH + "/elastic/rendezvous/c10d_rendezvous_backend.py:116), from "
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
        "closed. Did the remote server shutdown or crash?"
    )
    # node2 ended first, of its torchrun's lost store; node1's rank is the cause.
    failed = blame(["node2", "node1"], outcomes, hosts)
    assert failed == "node1"
    lines = summary(JobResult("tmn-4", outcomes, failed, interrupted=False, seconds=3.0), hosts)
    assert lines[1:3] == [
        "Cause: node1 rank 0 raised OSError: [Errno 28] No space left on device "
        "(at /home/t/p/train.py:51)",
        "Consequence (of rank 0's failure): node2's torch.distributed.elastic.rendezvous.api."
        "RendezvousConnectionError: The connection to the C10d store has failed. See inner "
        "exception for details.",
    ]
    assert not any("could not reach the master" in line for line in lines)

    # The master's own lines show nothing (its torchrun killed): the store lost is said.
    outcomes["node1"] = NodeOutcome(host="node1", exit_code=None, tail=collections.deque())
    lines = summary(JobResult("tmn-5", outcomes, "node2", interrupted=False, seconds=3.0), hosts)
    assert not any(line.startswith("Cause:") for line in lines)
    known = [line for line in lines if line.startswith("Known problem: ")]
    assert known == [
        "Known problem: a node's torchrun lost the master's rendezvous store mid-run: the "
        "master's torchrun had ended (its ranks failed, or it was stopped) or its node went "
        "away (try the master node's own lines in this summary)"
    ]


def test_a_local_job_names_the_rank_that_raised_and_its_line_first():
    script = SCRIPTS / "peer_raises.py"
    raised_at = next(
        number
        for number, line in enumerate(script.read_text().splitlines(), 1)
        if "# RAISED HERE" in line
    )
    done = run_cli("train", "--script", str(script), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    summary_lines = output[output.index("Job tmn-") :].splitlines()
    assert re.fullmatch(
        r"Job tmn-\w+ FAILED on this machine after [\d.]+ s \(rank 1[;,].*\)\.", summary_lines[0]
    ), output
    assert summary_lines[1] == (
        f"Cause: rank 1 raised ValueError: bad batch shape (3, 5) (at {script}:{raised_at})"
    ), output
    assert re.match(
        r"Consequence \(of rank 1's failure\): rank 0's RuntimeError: .*Connection (closed|reset) by",
        summary_lines[2],
    ), output
