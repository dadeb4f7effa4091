"""make queue and make cancel against fake nodes: the table, an empty queue, a controller that
does not answer, a job ID that is not one, and an inventory without Slurm."""

from __future__ import annotations

import pytest

from tests.fakes import FakeNodes
from tests.helpers import inventory, node
from torch_multinode.cluster import slurm
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.remote import Result

HOSTS = {"n1": node(1), "n2": node(2)}


def _nodes(stdout: str = "", code: int = 0, stderr: str = "") -> FakeNodes:
    inv = inventory(HOSTS, scheduler="slurm")
    return FakeNodes(
        list(inv.hosts),
        responder=lambda host, command: Result(host.name, command, code, stdout, stderr),
    )


def test_the_queue_is_a_table_asked_of_the_controller():
    inv = inventory(HOSTS, scheduler="slurm")
    nodes = _nodes("41|train|ana|RUNNING|1:02|2|n[1-2]\n42|sweep|bo|PENDING|0:00|2|(Resources)\n")
    assert slurm.queue(inv, nodes) == [
        "JOB  NAME   USER  STATE    TIME  NODES  NODELIST (REASON)",
        "41   train  ana   RUNNING  1:02  2      n[1-2]",
        "42   sweep  bo    PENDING  0:00  2      (Resources)",
    ]
    assert nodes.commands == [("n1", slurm.SQUEUE)]
    assert slurm.queue(inv, _nodes("")) == ["No jobs in Slurm's queue on n1."]


def test_a_controller_that_does_not_answer_a_bad_id_and_no_slurm_are_one_line_each():
    inv = inventory(HOSTS, scheduler="slurm")
    with pytest.raises(UserError) as caught:
        slurm.queue(inv, _nodes(code=1, stderr="squeue: error: Unable to contact slurm controller"))
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        "Slurm's controller on n1 does not answer squeue: squeue: error: Unable to contact "
        "slurm controller"
    )
    nodes = _nodes()
    with pytest.raises(UserError, match=r"JOB='12; rm' is not a Slurm job ID"):
        slurm.cancel(inv, nodes, "12; rm")
    assert nodes.commands == []  # nothing was sent
    with pytest.raises(UserError) as caught:
        slurm.cancel(inv, _nodes(code=1, stderr="scancel: error: Invalid job id 7"), "7")
    assert str(caught.value) == "Slurm did not cancel job 7: Invalid job id 7"
    assert slurm.cancel(inv, _nodes(stderr="scancel: Terminating job 7"), "7") == (
        "Cancelled Slurm job 7 on n1's controller."
    )
    with pytest.raises(UserError, match=r"does not use Slurm \(scheduler: ssh\)"):
        slurm.queue(inventory(HOSTS), _nodes())
