"""Which source wins each contested variable of a job's environment (launch/environment.py)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import inventory, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import environment, staging
from torch_multinode.launch.commands import remote_command, run_dir
from torch_multinode.launch.spec import JobSpec
from torch_multinode.netcheck import envfile


def test_precedence_on_a_node(tmp_path):
    """Job variables < debug variables < interface settings < TMN_BACKEND < extra_env."""
    found = inventory({"n1": node(1, gpus=4), "n2": node(2)})
    host = found.hosts[0]
    env_file = envfile.write(
        tmp_path / "netcheck-env.json",
        {
            "n1": {
                "GLOO_SOCKET_IFNAME": "bond0",
                "NCCL_SOCKET_IFNAME": "=bond0",
                "NCCL_DEBUG": "WARN",  # over DEBUG=1's INFO
                "CUDA_VISIBLE_DEVICES": "3",  # over GPUS=0,2
                "TMN_BACKEND": "gloo",  # under the job's backend
            }
        },
    )
    spec = JobSpec(
        run_id="tmn-prec",
        gpus=(0, 2),
        debug="detail",
        extra_env=(("NCCL_SOCKET_IFNAME", "=eth9"),),
    )
    settings, note = environment.node_settings(found, env_file, "nccl")
    assert note is None
    # n2 is not in the file: the inventory's compute_interface, exact-match form for NCCL.
    assert settings["n2"] == {
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_SOCKET_IFNAME": "=eth1",
        "TMN_BACKEND": "nccl",
    }
    env = environment.node_environment(host, spec, settings["n1"], "/run/dir", "/proj")
    assert env["TMN_RUN_ID"] == "tmn-prec"
    assert env["TMN_NODE_NAME"] == "n1"
    assert env["TMN_RUN_DIR"] == "/run/dir"
    assert env["PYTHONPATH"] == "/proj"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"  # the level over DEBUG_ENV's INFO
    assert env["NCCL_DEBUG"] == "WARN"  # interface settings over debug variables
    assert env["CUDA_VISIBLE_DEVICES"] == "3"  # interface settings over job variables
    assert env["TMN_BACKEND"] == "nccl"  # the job's backend over the interface settings
    assert env["GLOO_SOCKET_IFNAME"] == "bond0"
    assert env["NCCL_SOCKET_IFNAME"] == "=eth9"  # extra_env over everything
    # Without the file's override, GPUS= gives CUDA_VISIBLE_DEVICES.
    plain = environment.node_environment(host, spec, settings["n2"])
    assert plain["CUDA_VISIBLE_DEVICES"] == "0,2" and "TMN_RUN_DIR" not in plain
    # A restart on fewer nodes (MIN_NODES) hands the workloads the first run's world size.
    assert "TMN_PLANNED_WORLD_SIZE" not in plain
    fewer = environment.node_environment(host, replace(spec, planned_world=3), settings["n2"])
    assert fewer["TMN_PLANNED_WORLD_SIZE"] == "3"


def test_a_job_whose_nodes_differ_in_rdma_uses_sockets_on_every_node_and_says_so(tmp_path):
    """netcheck found RDMA on n1 only: NCCL would take InfiniBand there and sockets on n2, and
    its set-up would wait for ever. The job's nodes get one network; a job on n1 alone keeps
    InfiniBand."""
    env_file = envfile.write(
        tmp_path / "netcheck-env.json",
        {
            "n1": {"NCCL_SOCKET_IFNAME": "=ib0", "GLOO_SOCKET_IFNAME": "ib0"},
            "n2": {
                "NCCL_SOCKET_IFNAME": "=eth1",
                "GLOO_SOCKET_IFNAME": "eth1",
                "NCCL_IB_DISABLE": "1",
            },
        },
    )
    both = inventory({"n1": node(1, gpus=1), "n2": node(2, gpus=1)})
    settings, note = environment.node_settings(both, env_file, "nccl")
    assert [settings[name]["NCCL_IB_DISABLE"] for name in ("n1", "n2")] == ["1", "1"]
    assert settings["n1"]["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert note == (
        "NCCL uses TCP sockets on every node: n2 has no RDMA device, and one job's nodes must "
        "share one network (InfiniBand/RoCE stays unused on n1)"
    )
    assert environment.node_settings(both, env_file, "gloo")[1] is None  # no NCCL to speak of
    alone, note = environment.node_settings(inventory({"n1": node(1, gpus=1)}), env_file, "nccl")
    assert "NCCL_IB_DISABLE" not in alone["n1"] and note is None


def test_env_wins_over_the_launchers_variables_in_both_modes():
    """The secrets file is sourced after the launcher's variables are set (`exec env NAME=...`
    on the host, `docker run -e` for the container), just before torchrun: ENV= wins."""
    found = inventory({"n1": node(1, gpus=2)})
    host = found.hosts[0]
    spec = JobSpec(run_id="tmn-sec", gpus=(1,), secret_env=(("CUDA_VISIBLE_DEVICES", "0"),))
    on_host = remote_command(host, host, 1, spec, 29500, {})
    assert "CUDA_VISIBLE_DEVICES=1 " in on_host
    inside = remote_command(host, host, 1, spec, 29500, {}, mode="container", image="img")
    for command, launchers in ((on_host, "exec env "), (inside, "CUDA_VISIBLE_DEVICES=1")):
        sourced = command.index(". /tmp/torch-multinode/secrets/")
        assert command.index(launchers) < sourced < command.index("torch.distributed.run")


def test_env_wins_when_the_host_command_runs(tmp_path):
    """The host command run for real by a shell, with a python that prints its environment:
    the variable set both by the launcher (GPUS=1) and by ENV= (0) is ENV='s, the file gone."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec env\n")
    python.chmod(0o755)
    found = inventory({"n1": node(1, gpus=2)})
    host = replace(found.hosts[0], python=str(python))
    spec = JobSpec(run_id="tmn-secrun", gpus=(1,), secret_env=(("CUDA_VISIBLE_DEVICES", "0"),))
    secrets = Path(staging.secrets_dir(spec.run_id)) / staging.SECRETS_FILE
    secrets.parent.mkdir(parents=True, exist_ok=True)
    secrets.write_text(staging.secrets_text(spec.secret_env))
    try:
        command = remote_command(host, host, 1, spec, 29500, {}).replace(
            f"cd {shlex.quote(run_dir(spec))}", f"cd {tmp_path}"
        )
        done = subprocess.run(
            ["sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        shutil.rmtree(secrets.parent, ignore_errors=True)
        shutil.rmtree(run_dir(spec), ignore_errors=True)
    assert "CUDA_VISIBLE_DEVICES=0" in done.stdout.splitlines(), done.stdout + done.stderr
    assert not secrets.exists()


def test_precedence_on_this_machine(tmp_path):
    """This process's environment < OMP_NUM_THREADS=1 default < the job's variables."""
    here = inventory({"here": node(1, gpus=2)}).hosts[0]
    spec = JobSpec(run_id="tmn-local", gpus=(1,), debug="info")
    environ = {"TMN_RUN_DIR": "/stale", "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN"}
    env = environment.local_environment(here, spec, "/runs/x", "/proj", "nccl", environ)
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["TMN_RUN_DIR"] == "/runs/x"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TMN_BACKEND"] == "nccl"
    kept = environment.local_environment(here, spec, "/r", "/p", "gloo", {"OMP_NUM_THREADS": "8"})
    assert kept["OMP_NUM_THREADS"] == "8"


def test_env_wins_on_this_machine_as_on_the_nodes():
    """ENV= over everything a local job's ranks get: this process's own environment, the
    OMP_NUM_THREADS default, the job's variables (GPUS='s CUDA_VISIBLE_DEVICES, the Flight
    Recorder's buffer); the launcher's own names stay its own (parse_env refuses them)."""
    here = inventory({"here": node(1, gpus=2)}).hosts[0]
    given = environment.parse_env(
        ["PROJECT_TOKEN CUDA_VISIBLE_DEVICES=0", "TORCH_FR_BUFFER_SIZE=0 OMP_NUM_THREADS=4"],
        {"PROJECT_TOKEN": "s3cret"},
    )
    spec = JobSpec(run_id="tmn-local", gpus=(1,), secret_env=given)
    environ = {"PROJECT_TOKEN": "s3cret", "OMP_NUM_THREADS": "2", "HOME": "/home/me"}
    env = environment.local_environment(here, spec, "/runs/x", "/proj", "gloo", environ)
    assert env["PROJECT_TOKEN"] == "s3cret"  # a bare name: this machine's value
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # over GPUS=1's
    assert env["TORCH_FR_BUFFER_SIZE"] == "0"  # over the launcher's 256
    assert env["OMP_NUM_THREADS"] == "4"  # over this process's own
    assert (env["TMN_RUN_DIR"], env["HOME"]) == ("/runs/x", "/home/me")
    with pytest.raises(UserError, match="ENV: TMN_RUN_DIR is set by the launcher itself"):
        environment.parse_env(["TMN_RUN_DIR=/elsewhere"], {})


def test_gpus_beside_the_shells_own_cuda_visible_devices_is_refused_on_this_machine(tmp_path):
    """GPUS= counts as nvidia-smi does; under the shell's CUDA_VISIBLE_DEVICES torch counts only
    what that leaves: one of the two, said before anything starts. Without GPUS= the shell's
    pick stands, in its own order (no PCI_BUS_ID laid over it)."""
    from torch_multinode.launch import local

    spec = JobSpec(run_id="tmn-local", gpus=(1,), script=tmp_path / "train.py")
    with pytest.raises(UserError) as caught:
        local.environment(spec, 2, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert caught.value.line() == (
        "Error: GPUS=1 and this shell's CUDA_VISIBLE_DEVICES=2,3 both pick GPUs (try one of "
        "them: unset CUDA_VISIBLE_DEVICES, or leave out GPUS=)"
    )
    here = inventory({"here": node(1, gpus=2)}).hosts[0]
    picked = {"CUDA_VISIBLE_DEVICES": "2,3"}
    env = environment.local_environment(here, replace(spec, gpus=None), "/r", "/p", "nccl", picked)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "CUDA_DEVICE_ORDER" not in env
    env = environment.local_environment(here, replace(spec, gpus=None), "/r", "/p", "nccl", {})
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_every_reserved_name_is_refused_in_env():
    here = inventory({"n1": node(1, gpus=2)}).hosts[0]
    own = environment.job_environment(here, JobSpec(), "/r", "/p", "nccl")
    reserved = {name for name in own if environment.reserved(name)}
    assert reserved == {
        "TMN_RUN_ID",
        "TMN_NODE_NAME",
        "TMN_RUN_DIR",
        "TMN_BACKEND",
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
    }
    for name in sorted(reserved | set(environment.RESERVED_NAMES) | {"TMN_ANYTHING"}):
        with pytest.raises(UserError, match=f"ENV: {name} is set by the launcher itself"):
            environment.parse_env([f"{name}=x"], {})
    # Not reserved: the node's GPU selection and interface may be given (see the docstring).
    assert environment.parse_env(["CUDA_VISIBLE_DEVICES=0 NCCL_DEBUG=WARN"], {}) == (
        ("CUDA_VISIBLE_DEVICES", "0"),
        ("NCCL_DEBUG", "WARN"),
    )
