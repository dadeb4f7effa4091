"""Every operation of the communication demo, on 2 ranks and on 2 "nodes" x 2 ranks, and a
wrong value caught on every rank."""

from __future__ import annotations

import pytest

from tests.training.conftest import run_main, two_node_launch
from torch_multinode.training import comm_demo

EXPECTED_2 = [
    "send_recv       pairs: ping 10*r+1, pong +1        r0=[2]  r1=[1]",
    "isend_irecv     ring: receive the left rank        r0=[1]  r1=[0]",
    "broadcast       from rank 0                        r0=[42, 43]  r1=[42, 43]",
    "scatter         rank r gets 100*r from rank 0      r0=[0]  r1=[100]",
    "gather          rank+1 to rank 0                   r0=[1, 2]  r1=-",
    "reduce          SUM of rank+1 to rank 0            r0=[3]  r1=-",
    "all_gather      every rank's rank                  r0=[0, 1]  r1=[0, 1]",
    "all_reduce      SUM of rank+1                      r0=[3, 3]  r1=[3, 3]",
    "all_reduce      MAX of rank                        r0=[1]  r1=[1]",
]
EXPECTED_4 = [
    "send_recv       pairs: ping 10*r+1, pong +1        r0=[2]  r1=[1]  r2=[22]  r3=[21]",
    "isend_irecv     ring: receive the left rank        r0=[3]  r1=[0]  r2=[1]  r3=[2]",
    "scatter         rank r gets 100*r from rank 0      r0=[0]  r1=[100]  r2=[200]  r3=[300]",
    "gather          rank+1 to rank 0                   r0=[1, 2, 3, 4]  r1=-  r2=-  r3=-",
    "reduce          SUM of rank+1 to rank 0            r0=[10]  r1=-  r2=-  r3=-",
    "all_reduce      MAX of rank                        r0=[3]  r1=[3]  r2=[3]  r3=[3]",
    "new_group       SUM of rank within even/odd ranks  r0=[2]  r1=[4]  r2=[2]  r3=[4]",
]


def reduce_scatter_line(output: str, world: int) -> str:
    """gloo gained reduce_scatter at some version: either it is right, or it is a SKIP."""
    (line,) = [line for line in output.splitlines() if line.startswith("reduce_scatter")]
    if "SKIP" in line:
        assert line.startswith("reduce_scatter  SKIP: not supported by gloo: ")
    else:
        values = "  ".join(f"r{r}=[{world * (world - 1) // 2 + world * r}]" for r in range(world))
        assert line == f"reduce_scatter  chunk j = r+j, SUM to rank j       {values}"
    return line


@pytest.mark.extended
def test_two_ranks(torchrun):
    run = torchrun("training.comm_demo", nproc=2)
    assert run.returncode == 0, run.explain()
    lines = run.stdout.splitlines()
    for expected in EXPECTED_2:
        assert expected in lines
    skipped = "SKIP" in reduce_scatter_line(run.stdout, 2)
    assert lines[-1] == f"all {11 - skipped} checks passed on 2 ranks" + (
        ", 1 skipped" if skipped else ""
    )


@pytest.mark.extended
def test_two_nodes_of_two_ranks(tmp_path):
    agents = two_node_launch("training.comm_demo", cwd=tmp_path, nproc=2)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(a.explain() for a in agents)
    (report,) = [agent.stdout for agent in agents if "checks passed" in agent.stdout]
    lines = report.splitlines()
    for expected in EXPECTED_4:
        assert expected in lines
    reduce_scatter_line(report, 4)
    nodes = [line.split("node ")[1] for line in lines if line.startswith("rank ")]
    assert nodes == ["0  local rank 0", "0  local rank 1", "1  local rank 0", "1  local rank 1"]


@pytest.mark.extended
def test_a_wrong_value_fails_every_rank_loudly(torchrun):
    run = torchrun("training.comm_demo", "--corrupt", "all_reduce", nproc=2)
    assert run.returncode != 0
    error = "Error: all_reduce is wrong on rank 1: expected [3, 3], got [4, 4]"
    assert run.stderr.count(error + "\n") == 2  # both ranks stop, with the same line
    assert "exitcode  : 1" in run.stderr
    # Rank 0 printed what every rank held, and nothing ran after the failed check.
    assert run.stdout.splitlines()[-1] == (
        "all_reduce      SUM of rank+1                      r0=[3, 3]  r1=[4, 4]"
    )


def test_one_process_is_not_enough(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, err = run_main(comm_demo.main, [], capsys)
    assert (code, err) == (
        2,
        (
            "Error: comm_demo needs at least 2 processes (try python -m torch.distributed.run "
            "--nproc-per-node 2 -m training.comm_demo)\n"
        ),
    )
