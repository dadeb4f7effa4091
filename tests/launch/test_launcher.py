"""The launcher: commands it generates, and jobs on the simulated cluster that succeed, fail,
lose a node or are interrupted, leaving no process or bound port behind."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, run_cli
from tests.fakes import FakeNodes
from tests.helpers import SCRIPTS, inventory_text, leftovers, node, run_id_in
from tests.training.conftest import kill_node
from torch_multinode.cluster.containers import NCCL_CONF_GUARD, rdma_options
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import load, parse
from torch_multinode.launch import stop
from torch_multinode.launch.backends import SshBackend
from torch_multinode.launch.commands import remote_command, stop_command, torchrun_command
from torch_multinode.launch.environment import interface_env
from torch_multinode.launch.nodes import rank_order_warning
from torch_multinode.launch.restarts import run_with_restarts
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import (
    LOST_NODE_PROBE,
    REMOTE_LOCK_ROOT,
    STOP_TIMEOUT,
    JobSpec,
)
from torch_multinode.launch.staging import Project
from torch_multinode.launch.survivors import survivors, wait_for_nodes
from torch_multinode.netcheck import envfile
from torch_multinode.sim import nodes as sim


def _inventory_text(**cluster_vars) -> str:
    hosts = {
        "n1": node(1, compute_ip="10.7.0.9", gpus=2),
        "n2": node(2, compute_ip="10.7.0.10", compute_interface="ens5"),
    }
    values = {"rendezvous_port": 29400, "training_python": "/opt/venv/bin/python", **cluster_vars}
    return inventory_text(hosts, **values)


INVENTORY = _inventory_text()


def test_torchrun_command_binds_rendezvous_to_the_compute_ip():
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    n1, n2 = inventory.hosts
    spec = JobSpec(module="training.ddp", args=("--epochs", "1"), run_id="tmn-x")
    command = torchrun_command(n2, n1, 2, spec, 29400, ["-m", "training.ddp"])
    assert command == [
        "/opt/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.7.0.9:29400",
        "--rdzv-id=tmn-x",
        "--rdzv-conf=join_timeout=60,is_host=false",
        "--local-addr=10.7.0.10",
        "--max-restarts=0",
        "--monitor-interval=1",
        "-m",
        "training.ddp",
        "--epochs",
        "1",
    ]
    master = torchrun_command(n1, n1, 2, spec, 29400, ["-m", "training.ddp"])
    assert "--nproc-per-node=2" in master and "--rdzv-conf=join_timeout=60,is_host=true" in master


def test_remote_command_sets_interfaces_and_the_run_marker():
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    n1, n2 = inventory.hosts
    envs = interface_env(inventory)
    assert envs["n2"] == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "=ens5"}
    spec = JobSpec(script=Path("/home/me/my train.py"), run_id="tmn-y")
    command = remote_command(n2, n1, 2, spec, 29400, envs["n2"])
    words = shlex.split(command)
    assert words[:5] == ["mkdir", "-p", "/tmp/torch-multinode/runs/tmn-y", "&&", "cd"]
    assert "TMN_RUN_ID=tmn-y" in words and "NCCL_SOCKET_IFNAME==ens5" in words
    assert words[-1] == "/tmp/torch-multinode/runs/tmn-y/my train.py"


def test_gpu_nodes_run_in_the_training_container_with_what_nccl_needs():
    text = _inventory_text(training_image="img:1")
    inventory = parse(text, "/nonexistent/inv.yml")
    assert inventory.launch_mode == "container"
    n1, n2 = inventory.hosts
    spec = JobSpec(run_id="tmn-z")
    envs = interface_env(inventory)
    command = remote_command(
        n1, n1, 2, spec, 29400, envs["n1"], inventory.launch_mode, inventory.training_image
    )
    # The node's RDMA devices are decided by its shell (tested below): one word here.
    words = shlex.split(command.replace(rdma_options(), "RDMA"))
    guard = shlex.split(NCCL_CONF_GUARD)
    assert (
        words[: 5 + len(guard)]
        == ["mkdir", "-p", "/tmp/torch-multinode/runs/tmn-z", "&&", *guard, "&&", "exec"][
            : 5 + len(guard)
        ]
    )
    assert words[words.index("img:1") - 1] == "RDMA"
    docker = words[words.index("exec") + 1 : words.index("RDMA")]
    assert docker == [
        "docker",
        "run",
        "--rm",
        "--init",
        "--pull",
        "never",
        "--label",
        "torch-multinode.run=tmn-z",
        "--network",
        "host",
        "--ipc",
        "host",
        "--ulimit",
        "memlock=-1:-1",
        "--ulimit",
        "stack=67108864",
        "-v",
        "/etc/nccl.conf:/etc/nccl.conf:ro",
        "--gpus",
        "all",
        "--cap-add",
        "SYS_PTRACE",
        "--name",
        "tmn-z-n1",
        "-v",
        "/tmp/torch-multinode/runs/tmn-z:/tmp/torch-multinode/runs/tmn-z",
        "-w",
        "/tmp/torch-multinode/runs/tmn-z",
        "-e",
        "TMN_RUN_ID=tmn-z",
        "-e",
        "PYTHONUNBUFFERED=1",
        "-e",
        "TMN_NODE_NAME=n1",
        "-e",
        "TORCH_FR_BUFFER_SIZE=256",
        "-e",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "-e",
        "TORCH_NCCL_ENABLE_TIMING=1",
        "-e",
        "GLOO_SOCKET_IFNAME=eth1",
        "-e",
        "NCCL_SOCKET_IFNAME==eth1",
    ]
    after = words[words.index("img:1") + 1 :]
    assert after[:3] == ["python3", "-m", "torch.distributed.run"]
    assert "--local-addr=10.7.0.9" in after and after[-2:] == ["-m", "torch_multinode.training.ddp"]
    # A CPU node gets no --gpus; stopping the job removes the container as well.
    cpu = shlex.split(remote_command(n2, n1, 2, spec, 29400, envs["n2"], "container", "img:1"))
    assert "--gpus" not in cpu and "--ipc" in cpu
    # Where memlock cannot be raised (the simulated cluster), the inventory says so.
    capped = remote_command(n2, n1, 2, spec, 29400, {}, "container", "img:1", "8388608")
    assert "memlock=8388608:8388608" in shlex.split(capped)
    assert "docker ps -q --filter label=torch-multinode.run=tmn-z" in stop_command("tmn-z")


def _docker_argv(
    command: str, tmp_path: Path, devices: list[str] | None, shell: tuple[str, ...] = ("sh",)
) -> list[str]:
    """What `docker` is given when the node's shell runs the container line of `command`, on a
    node whose /dev/infiniband holds `devices` (None: no such directory): the real shell, a
    fake docker that prints its arguments, the device directory swapped for a fake one."""
    tmp_path.mkdir()
    fake_dir = tmp_path / "infiniband"
    if devices is not None:
        fake_dir.mkdir()
        for name in devices:
            (fake_dir / name).touch()
    line = command.split(" && exec ", 1)[1] if " && exec " in command else command
    assert rdma_options() in line
    line = line.replace(rdma_options(), rdma_options(str(fake_dir)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run([*shell, "-c", line], env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("memlock", ["unlimited", "8388608"])
def test_a_job_container_gets_the_nodes_rdma_devices_where_it_has_them(tmp_path, memlock):
    """InfiniBand/RoCE in container mode: on a node with /dev/infiniband the job's container
    gets its verbs devices (uverbs*, rdma_cm, umad*; not the subnet manager's issm*) and
    IPC_LOCK; on a node without, neither. memlock is the inventory's either way (unlimited
    unless it says otherwise). Decided by the node's own shell when the container starts."""
    text = _inventory_text(training_image="img:1")
    inventory = parse(text, "/nonexistent/inv.yml")
    n1, n2 = inventory.hosts
    spec = JobSpec(run_id="tmn-ib")
    command = remote_command(n1, n1, 2, spec, 29400, {}, "container", "img:1", memlock)
    with_ib = _docker_argv(
        command, tmp_path / "ib", ["uverbs0", "uverbs1", "rdma_cm", "umad0", "issm0"]
    )
    image = with_ib.index("img:1")
    assert with_ib[:2] == ["run", "--rm"]
    assert with_ib[image - 10 : image] == [
        "--device",
        f"{tmp_path}/ib/infiniband/uverbs0",
        "--device",
        f"{tmp_path}/ib/infiniband/uverbs1",
        "--device",
        f"{tmp_path}/ib/infiniband/rdma_cm",
        "--device",
        f"{tmp_path}/ib/infiniband/umad0",
        "--cap-add",
        "IPC_LOCK",
    ]
    assert not any("issm" in word for word in with_ib)
    assert with_ib[image + 1 : image + 4] == ["python3", "-m", "torch.distributed.run"]
    limit = "-1:-1" if memlock == "unlimited" else "8388608:8388608"
    assert [w for w in with_ib if w.startswith("memlock=")] == [f"memlock={limit}"]
    for devices in (None, []):
        plain = _docker_argv(command, tmp_path / f"plain-{devices}", devices)
        assert "--device" not in plain and "IPC_LOCK" not in plain
        assert plain == with_ib[: image - 10] + with_ib[image:]
    # A login shell that fails a glob without matches (zsh's default; bash -O failglob does the
    # same): a RoCE node without umad* still gets its devices.
    roce = _docker_argv(
        command, tmp_path / "roce", ["uverbs0", "rdma_cm"], ("bash", "--norc", "-O", "failglob")
    )
    at = roce.index("img:1")
    assert roce[at - 6 : at] == [
        "--device",
        f"{tmp_path}/roce/infiniband/uverbs0",
        "--device",
        f"{tmp_path}/roce/infiniband/rdma_cm",
        "--cap-add",
        "IPC_LOCK",
    ], roce


def test_the_stop_command_kills_the_runs_processes_then_runs_what_follows(tmp_path):
    """Run here on this machine's own processes: one that dies on TERM, one that ignores it
    (KILLed after the grace), and one of another run, which is left alone."""
    marked = {**os.environ, "TMN_RUN_ID": "tmn-stoptest"}
    polite = subprocess.Popen(["sleep", "60"], env=marked)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"], env=marked)
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, "TMN_RUN_ID": "tmn-other"})
    try:
        time.sleep(0.2)  # the shell has installed its trap
        unlock = f"echo freed > {tmp_path / 'after'}"
        stop = stop_command("tmn-stoptest", then=unlock)
        subprocess.run(["sh", "-c", stop], check=True, timeout=30)
        assert polite.wait(1) == -signal.SIGTERM
        assert stubborn.wait(1) == -signal.SIGKILL
        assert other.poll() is None
        assert (tmp_path / "after").read_text() == "freed\n"
        # Nothing left to stop: the follow-up still runs, and the command succeeds.
        (tmp_path / "after").unlink()
        subprocess.run(["sh", "-c", stop], check=True, timeout=30)
        assert (tmp_path / "after").read_text() == "freed\n"
    finally:
        for process in (polite, stubborn, other):
            process.kill()
            process.wait()


def test_the_stop_waits_for_a_containers_processes_not_for_dockers_cleanup(tmp_path):
    """A stand-in `docker` whose `rm -f` kills the container at once and then, as Docker does on
    a busy disk, takes 30 s more to clean up. The container's init is a process of this test,
    unmarked (its environment unreadable to a user in the docker group)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    init = subprocess.Popen(["sleep", "60"])
    (tmp_path / "init.pid").write_text(f"{init.pid}\n")
    (bin_dir / "docker").write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path}/calls
case "$1" in
  ps) echo c1 ;;
  inspect) cat {tmp_path}/init.pid ;;
  rm) echo $$ > {tmp_path}/rm.pid; kill -KILL $(cat {tmp_path}/init.pid); exec sleep 30 ;;
esac
""")
    (bin_dir / "docker").chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    stop = stop_command("tmn-boxed", then=f"echo freed > {tmp_path / 'after'}")
    try:
        running = subprocess.Popen(["sh", "-c", stop], env=environment)
        while running.poll() is None:
            init.poll()  # reaps the killed init, as the container runtime would
            time.sleep(0.05)
        assert init.wait(1) == -signal.SIGKILL
        assert running.returncode == 0
        calls = (tmp_path / "calls").read_text().splitlines()
        assert calls[0] == "ps -q --filter label=torch-multinode.run=tmn-boxed"
        assert calls[1].startswith("inspect ") and calls[1].endswith(" c1")
        assert calls[2] == "rm -f c1"
        assert (tmp_path / "after").read_text() == "freed\n"
        # the 30 s cleanup goes on without the stop: it returned with its `rm` still running
        rm_pid = int((tmp_path / "rm.pid").read_text())
        assert Path(f"/proc/{rm_pid}").exists()
    finally:
        init.kill()
        init.wait()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int((tmp_path / "rm.pid").read_text()), signal.SIGKILL)


def test_a_restart_waits_until_every_node_answers_and_names_one_that_never_does():
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    nodes = FakeNodes(list(inventory.hosts), failing_first={"n2": 3})
    said: list[str] = []
    wait_for_nodes(inventory, 30, said.append, nodes, poll=0.01)
    assert collections.Counter(name for name, _ in nodes.commands) == {"n1": 1, "n2": 4}
    assert len(said) == 1 and said[0].startswith("[launcher] n2 answers again after ")

    nodes = FakeNodes(list(inventory.hosts), failing_first={"n2": 10**6})
    with pytest.raises(UserError) as caught:
        wait_for_nodes(inventory, 0.05, said.append, nodes, poll=0.01)
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        "n2 did not answer within --restart-wait 0.05 s: "
        "host 'n2': cannot SSH to 10.1.0.2:22: timed out"
    )


def _four_hosts():
    hosts = {f"n{i}": node(i, compute_ip=f"10.7.0.{i}") for i in (1, 2, 3, 4)}
    return parse(inventory_text(hosts, rendezvous_port=29400), "/nonexistent/inv.yml").hosts


@pytest.mark.parametrize(
    ("down", "min_nodes", "spares", "expected", "changes"),
    [
        # every node answers: the same nodes, nothing said
        (set(), 2, 0, ["n1", "n2", "n3"], []),
        # a lost node with a spare that answers: the spare takes its place in the rank order
        (
            {"n2"},
            3,
            1,
            ["n1", "n4", "n3"],
            ["n2 lost after step 12: replaced by spare n4"],
        ),
        # no spare: dropped while --min-nodes remain
        (
            {"n3"},
            2,
            0,
            ["n1", "n2"],
            [
                "n3 lost after step 12: dropped",
                "continuing on n1, n2: 2 of 3 nodes (--min-nodes 2)",
            ],
        ),
        # the master lost: the next node is rank 0's now
        (
            {"n1"},
            2,
            0,
            ["n2", "n3"],
            [
                "n1 lost after step 12: dropped",
                "continuing on n2, n3: 2 of 3 nodes (--min-nodes 2)",
            ],
        ),
        # a spare that does not answer either: dropped
        (
            {"n3", "n4"},
            2,
            1,
            ["n1", "n2"],
            [
                "n3 lost after step 12: dropped",
                "continuing on n1, n2: 2 of 3 nodes (--min-nodes 2)",
            ],
        ),
    ],
    ids=["all-answer", "spare", "dropped", "master-lost", "spare-silent"],
)
def test_a_restart_replaces_a_lost_node_by_a_spare_or_goes_on_with_min_nodes(
    down, min_nodes, spares, expected, changes
):
    n1, n2, n3, n4 = _four_hosts()
    job = parse(INVENTORY, "/nonexistent/inv.yml")
    job = replace(job, hosts=(n1, n2, n3))
    nodes = FakeNodes([n1, n2, n3, n4], down=down)
    found = survivors(
        job, [n4][:spares], min_nodes, 0.05, lambda _: None, nodes, 0.01, " after step 12"
    )
    assert [host.name for host in found.hosts] == expected
    assert found.changes == changes
    assert [host.name for host in found.spares] == (
        [] if "n4" in expected or not spares else ["n4"]
    )


def test_a_survivor_that_cannot_reach_the_new_masters_compute_ip_is_dropped_too():
    n1, n2, n3, n4 = _four_hosts()
    job = replace(parse(INVENTORY, "/nonexistent/inv.yml"), hosts=(n1, n2, n3, n4))

    def ping(host, command):  # n3's compute link is down; everything else answers
        if command.startswith("out=$(ping"):
            assert "10.7.0.2" in command  # n1 lost: n2 is the master now
            return "down no answer" if host.name == "n3" else "up"
        return ""

    nodes = FakeNodes([n1, n2, n3, n4], down={"n1"}, responder=ping)
    found = survivors(job, [], 2, 0.05, lambda _: None, nodes, 0.01, " after step 7")
    assert [host.name for host in found.hosts] == ["n2", "n4"]
    assert found.changes == [
        "n1 lost after step 7: dropped",
        "n3 cannot reach n2's compute IP (down no answer): dropped",
        "continuing on n2, n4: 2 of 4 nodes (--min-nodes 2)",
    ]


def test_fewer_nodes_than_min_nodes_answering_is_one_error_naming_the_lost_ones():
    n1, n2, n3, _ = _four_hosts()
    job = replace(parse(INVENTORY, "/nonexistent/inv.yml"), hosts=(n1, n2, n3))
    nodes = FakeNodes([n1, n2, n3], down={"n2", "n3"})
    with pytest.raises(UserError) as caught:
        survivors(job, [], 2, 0.05, lambda _: None, nodes, 0.01)
    assert caught.value.exit_code == 1
    assert str(caught.value).startswith(
        "n2, n3 did not answer within --restart-wait 0.05 s and 1 node(s) are fewer than "
        "--min-nodes 2: host 'n2': cannot SSH to "
    )


@pytest.mark.parametrize("n2_answers", [False, True], ids=["gone", "back"])
def test_the_stop_tries_ssh_on_a_lost_node_only_if_it_accepts_a_connection(n2_answers):
    # A dead node would hold the stop for SSH's whole connect timeout (5 s here, more under
    # load): a node already lost must first accept a TCP connection. Fakes only, no traffic.
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    nodes = FakeNodes(list(inventory.hosts), down=set() if n2_answers else {"n2"})
    job = RunningJob(JobSpec(), inventory.hosts, nodes, lambda _: None, 29500, container=False)
    job.outcomes["n2"].session_lost = True  # n1 is merely failed: no probe before its stop
    stopped = stop.everywhere(job, inventory.hosts[0])
    assert nodes.probes == [("n2", LOST_NODE_PROBE)]
    assert isinstance(stopped["n1"], float)
    sent_to = sorted(name for name, _ in nodes.commands)
    if n2_answers:
        assert sent_to == ["n1", "n2"] and isinstance(stopped["n2"], float)
        assert job.silent == set()
    else:
        assert sent_to == ["n1"] and stopped["n2"] == "unreachable"
        assert job.silent == {"n2"}


def test_the_stop_tells_a_node_it_could_not_reach_from_one_that_did_not_confirm():
    # Fakes only, no traffic: n1's SSH connection is refused; n2's stop command fails.
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    nodes = FakeNodes(list(inventory.hosts), refused={"n1"}, failing_first={"n2": 1})
    job = RunningJob(JobSpec(), inventory.hosts, nodes, lambda _: None, 29500, container=False)
    stopped = stop.everywhere(job, inventory.hosts[0])
    assert stopped == {
        "n1": "unreachable",
        "n2": f"not confirmed within {STOP_TIMEOUT:g} s",
    }


def test_bad_container_memlock_is_rejected():
    text = _inventory_text(container_memlock="lots")
    with pytest.raises(UserError, match=r"'container_memlock': 'lots' is neither 'unlimited'"):
        parse(text, "inv.yml")


def test_bad_launch_mode_is_rejected():
    text = _inventory_text(launch_mode="vm")
    with pytest.raises(UserError, match=r"cluster field 'launch_mode': 'vm' is not one of"):
        parse(text, "inv.yml")


def test_netcheck_findings_override_the_inventory(tmp_path):
    path = tmp_path / "inv.yml"
    path.write_text(INVENTORY)
    (tmp_path / envfile.FILENAME).write_text(
        json.dumps(
            {
                "nodes": {
                    "n1": {
                        "GLOO_SOCKET_IFNAME": "bond0",
                        "NCCL_SOCKET_IFNAME": "=bond0",
                        "NCCL_IB_DISABLE": "1",
                    }
                },
                "written_at": "now",
            }
        )
    )
    inventory = load(path)
    envs = interface_env(inventory)
    assert envs["n1"]["NCCL_SOCKET_IFNAME"] == "=bond0" and envs["n1"]["NCCL_IB_DISABLE"] == "1"
    assert envs["n2"]["GLOO_SOCKET_IFNAME"] == "ens5"


def test_the_launcher_reads_netchecks_file_where_netcheck_writes_it(tmp_path):
    """Through a symlinked inventory too (netcheck writes beside the file it resolves to), and
    from --env-file, as netcheck --env-file wrote it."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "inv.yml").write_text(INVENTORY)
    (tmp_path / "inv.yml").symlink_to(real / "inv.yml")
    inventory = load(tmp_path / "inv.yml")
    written = envfile.write(
        envfile.default_path(inventory.path), {"n1": {"GLOO_SOCKET_IFNAME": "bond0"}}
    )
    assert written == real / envfile.FILENAME
    assert interface_env(inventory)["n1"] == {"GLOO_SOCKET_IFNAME": "bond0"}
    elsewhere = envfile.write(tmp_path / "other.json", {"n1": {"GLOO_SOCKET_IFNAME": "eth9"}})
    envs = interface_env(inventory, elsewhere)
    assert envs["n1"] == {"GLOO_SOCKET_IFNAME": "eth9"}
    with pytest.raises(UserError, match=r"--env-file .*missing.json does not exist"):
        interface_env(inventory, tmp_path / "missing.json")


def test_rank_order_warning_names_the_real_order():
    inventory = parse(INVENTORY, "/nonexistent/inv.yml")
    assert rank_order_warning(inventory.hosts) == (
        "note: c10d numbers nodes by compute IP, so node ranks follow n2 (10.7.0.10), "
        "n1 (10.7.0.9); the rendezvous store stays on n1"
    )
    assert rank_order_warning(inventory.hosts[:1]) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--script", "missing.py"],
            "Error: script missing.py does not exist (try a path to a .py file)",
        ),
        (
            ["--nnodes", "2"],
            "Error: NNODES=2 needs an inventory (try INVENTORY=path.yml, or 'make "
            "sim-up' for a simulated cluster)",
        ),
        (
            ["--nproc-per-node", "0"],
            "Error: NPROC=0 (--nproc-per-node): 0 is below 1 (try .venv/bin/train --help)",
        ),
    ],
)
def test_bad_launch_arguments_are_one_line_errors(args, message):
    proc = run_cli("train", *args)
    assert (proc.returncode, proc.stderr) == (2, message + "\n")


# --- On the simulated cluster -------------------------------------------------------------


def _train(inventory_path, *args, timeout=240) -> subprocess.CompletedProcess:
    return run_cli("train", "-i", str(inventory_path), *args, timeout=timeout)


@pytest.mark.extended
@pytest.mark.sim
def test_tutorial_script_runs_unchanged_on_two_nodes(sim2):
    proc = _train(
        sim2.config.inventory_path, "--nnodes", "2", "--script", str(SCRIPTS / "tutorial_ddp.py")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    ranks = sorted(line for line in lines if "identical on all ranks" in line)
    assert len(ranks) == 2
    assert ranks[0].startswith("[node1] rank 0/2 local 0 on debian-1")
    assert ranks[1].startswith("[node2] rank 1/2 local 0 on debian-2")
    assert ranks[0].split("checksum ")[1] == ranks[1].split("checksum ")[1]
    assert "succeeded" in [line for line in lines if line.startswith("Job ")][0]
    assert leftovers(sim2.inventory, run_id_in(proc.stdout)) == {"node1": "", "node2": ""}


@pytest.mark.sim
def test_a_failing_rank_stops_every_node_and_is_named(sim2):
    proc = _train(
        sim2.config.inventory_path, "--script", str(SCRIPTS / "endless_allreduce.py"), "--", "5"
    )
    assert proc.returncode == 1
    summary = proc.stdout[proc.stdout.index("\nJob ") + 1 :].splitlines()
    assert summary[0].startswith(f"Job {run_id_in(proc.stdout)} FAILED on node2 after ")
    # A rank's own exception ("Cause:") and its peers' knock-on errors ("Consequence ...") may
    # come first; then a line per node.
    nodes = [
        line
        for line in summary[1:]
        if not line.startswith(("Cause:", "Consequence", "Known problem:"))
    ]
    assert nodes[0].split()[0] == "node1"  # stopped by us, or failed on its own first
    assert nodes[1].split()[:2] == ["node2", "exit"] and nodes[1].split()[2] != "0"
    assert nodes[2] == "Last lines from node2:"
    assert any("failing on purpose at step 5" in line for line in nodes[3:])
    assert leftovers(sim2.inventory, run_id_in(proc.stdout)) == {"node1": "", "node2": ""}


def _start_endless(inventory_path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(VENV_BIN / "train"),
            "-i",
            str(inventory_path),
            "--script",
            str(SCRIPTS / "endless_allreduce.py"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(process: subprocess.Popen, text: str, limit: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + limit
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    process.kill()
    raise AssertionError(f"never saw {text!r}; output:\n{''.join(seen)}")


@pytest.mark.sim
def test_node_killed_mid_run_stops_the_job_everywhere(sim2):
    process = _start_endless(sim2.config.inventory_path)
    seen = _wait_for(process, "rank 1 step 20")
    run_id = run_id_in("".join(seen))
    output = kill_node(process, sim2.config.container(2))
    try:
        output.end()  # within 60 s: a bound against a hang; the stop's time is make bench's
        rest = output.text
        assert process.returncode == 1
        assert f"Job {run_id} FAILED on node2" in rest
        survivor = sim2.inventory.hosts[:1]
        assert leftovers(sim2.inventory, run_id, survivor) == {"node1": ""}
    finally:
        sim.up(2, None, sim2.config)  # node2 back for the tests that follow


@pytest.mark.sim
@pytest.mark.parametrize(
    "sent, name, code, verdict",
    [
        (signal.SIGINT, "Ctrl-C", 130, "interrupted"),
        (signal.SIGTERM, "SIGTERM", 143, "terminated (SIGTERM)"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_or_sigterm_stops_every_node(sim2, sent, name, code, verdict):
    process = _start_endless(sim2.config.inventory_path)
    seen = _wait_for(process, "rank 1 step 10")
    run_id = run_id_in("".join(seen))
    process.send_signal(sent)
    rest, _ = process.communicate(timeout=30)
    assert process.returncode == code, rest
    assert f"[launcher] {name}: stopping the job on every node..." in rest
    assert f"Job {run_id} {verdict} after" in rest
    assert leftovers(sim2.inventory, run_id) == {"node1": "", "node2": ""}


@pytest.mark.sim
def test_a_second_job_on_the_same_port_is_refused_and_the_first_goes_on(sim2):
    first = _start_endless(sim2.config.inventory_path)
    seen = _wait_for(first, "rank 1 step 10")
    first_id = run_id_in("".join(seen))
    try:
        second = _train(sim2.config.inventory_path, "--script", str(SCRIPTS / "tutorial_ddp.py"))
        said = f"exit {second.returncode}\n{second.stdout[-2000:]}\n{second.stderr}"
        assert second.returncode == 1, said
        assert second.stderr == (
            f"Error: job {first_id} is already running on node1 (rendezvous port "
            f"{sim2.inventory.rendezvous_port}) (try waiting for it to end, or Ctrl-C where it "
            "was started)\n"
        ), said
        assert "identical on all ranks" not in second.stdout
        _wait_for(first, "rank 1 step 30")  # undisturbed
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=30)
    assert first.returncode == 130


@pytest.mark.sim
def test_a_lock_left_by_a_dead_launcher_is_taken_over(sim2):
    port = sim2.inventory.rendezvous_port
    lock = f"{REMOTE_LOCK_ROOT}/port-{port}"
    sim.docker(
        "exec",
        sim2.config.container(1),
        "sh",
        "-c",
        f"mkdir -p {lock} && echo tmn-gone > {lock}/run_id && touch -d '-1 min' {lock}",
    )
    proc = _train(sim2.config.inventory_path, "--script", str(SCRIPTS / "tutorial_ddp.py"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert (
        "[launcher] took over the lock of job tmn-gone on node1: none of its processes is left"
        in proc.stdout
    )
    left = sim.docker("exec", sim2.config.container(1), "ls", REMOTE_LOCK_ROOT).stdout
    assert left.strip() == ""  # released at the end


def test_a_restart_stops_what_the_failed_run_left_then_runs_again_under_a_new_id():
    """The one restart loop with the SSH backend, the real launcher on fake nodes (no traffic): the first run fails
    on n2, every node answers again, the failed run's leftovers are stopped on every node, and
    the second run, under a new run ID, succeeds. Host mode: in container mode the job checks
    the nodes' image against the controller's, which the simulated cluster's tests do."""
    inventory = parse(
        _inventory_text(launch_mode="host"),
        "/nonexistent/inv.yml",
    )
    runs: list[tuple[str, str]] = []

    def job_on(host, command, out) -> int:
        run_id = re.search(r"TMN_RUN_ID=([\w-]+)", command).group(1)
        runs.append((run_id, host.name))
        out.write(f"training {run_id} on {host.name}\n")
        return 1 if (run_id, host.name) == ("tmn-r", "n2") else 0

    nodes = FakeNodes(list(inventory.hosts), streamer=job_on)
    said: list[str] = []
    spec = JobSpec(run_id="tmn-r")
    project = Project(trees=(), workdir="/w", script=None)
    backend = SshBackend(inventory, spec, said.append, project, restart_wait=5, nodes=nodes)
    result = run_with_restarts(backend, spec, 1, said.append)
    assert sorted(runs) == [
        ("tmn-r", "n1"),
        ("tmn-r", "n2"),
        ("tmn-r-r1", "n1"),
        ("tmn-r-r1", "n2"),
    ]
    assert result.exit_code == 0 and (result.restart, result.restarts) == (1, 1)
    assert result.run_id == "tmn-r-r1"
    assert any(line.startswith("Job tmn-r FAILED on n2") for line in said), said
    assert "[n2] training tmn-r on n2" in said
    # The failed run is stopped on every node twice (when it fails, and before the restart);
    # the second run, which succeeded, never.
    stops = [(name, command) for name, command in nodes.commands if "TERM" in command]
    assert sorted(name for name, _ in stops) == ["n1", "n1", "n2", "n2"], stops
    assert all(re.search(r"TMN_RUN_ID=tmn-r\b(?!-)", command) for _, command in stops), stops
