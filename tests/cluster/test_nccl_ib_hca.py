"""The inventory's nccl_ib_hca (issue 51): the RDMA devices NCCL may use for training, checked
where the other fields are, and set as NCCL_IB_HCA in every job's environment on that node, in
its container too (nccl.conf's line: tests/ansible/test_templates.py; netcheck's env file and
its warning: tests/netcheck/test_netcheck_units.py)."""

from __future__ import annotations

import shlex

import pytest

from tests.helpers import inventory, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import environment
from torch_multinode.launch.commands import remote_command
from torch_multinode.launch.spec import JobSpec


@pytest.mark.parametrize(
    "value", ["mlx5_0", "=mlx5_0:1,mlx5_1:1", "^=mlx5_2", "mlx5", "rocep1s0f0:1", "^mlx5_4,bnxt_re"]
)
def test_an_nccl_ib_hca_list_as_nccl_reads_it_is_taken(value):
    found = inventory({"n1": node(1, gpus=8, nccl_ib_hca=value), "n2": node(2, gpus=8)})
    assert [host.nccl_ib_hca for host in found.hosts] == [value, None]


@pytest.mark.parametrize(
    "value", ["mlx5_0 mlx5_1", "=", "mlx5_0:one", "mlx5_0,,mlx5_1", "$(id)", 5]
)
def test_anything_else_is_one_line_naming_the_host_and_the_field(value):
    with pytest.raises(UserError) as raised:
        inventory({"n1": node(1, gpus=8, nccl_ib_hca=value)})
    assert f"host 'n1': field 'nccl_ib_hca': {value!r} is not an NCCL_IB_HCA list" in str(
        raised.value
    ), raised.value
    assert raised.value.hint.startswith("device names separated by commas")


def test_the_training_hcas_reach_the_nodes_job_and_its_container():
    found = inventory(
        {"n1": node(1, gpus=8, nccl_ib_hca="=mlx5_0:1,mlx5_1:1"), "n2": node(2, gpus=8)}
    )
    settings, note = environment.node_settings(found, None, "nccl")
    assert note is None
    assert settings["n1"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    assert "NCCL_IB_HCA" not in settings["n2"]  # NCCL takes every device it finds there
    host = found.hosts[0]
    command = remote_command(
        host,
        host,
        2,
        JobSpec(run_id="tmn-hca"),
        29500,
        settings["n1"],
        mode="container",
        image="img",
    )
    assert "-e NCCL_IB_HCA==mlx5_0:1,mlx5_1:1 " in command, command
    on_host = remote_command(host, host, 2, JobSpec(run_id="tmn-hca"), 29500, settings["n1"])
    assert shlex.quote("NCCL_IB_HCA==mlx5_0:1,mlx5_1:1") in on_host


def test_a_node_netcheck_found_without_rdma_gets_no_hca_list(tmp_path):
    """netcheck's file says NCCL_IB_DISABLE=1 there (no RDMA device): the list would name
    nothing NCCL uses."""
    from torch_multinode.netcheck import envfile

    env_file = tmp_path / "netcheck-env.json"
    envfile.write(
        env_file,
        {
            "n1": {
                "NCCL_SOCKET_IFNAME": "=eth1",
                "GLOO_SOCKET_IFNAME": "eth1",
                "NCCL_IB_DISABLE": "1",
            }
        },
    )
    found = inventory({"n1": node(1, gpus=1, nccl_ib_hca="mlx5_0")})
    assert "NCCL_IB_HCA" not in environment.interface_env(found, env_file)["n1"]
