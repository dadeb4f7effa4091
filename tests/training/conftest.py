"""Launching workloads the way a user does: `python -m training.X`, under torchrun or not.

Every launch stays on loopback: the rendezvous endpoint and the worker-facing address are
127.0.0.1 on a port picked free for that launch, and gloo is pinned to the `lo` interface.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torch_multinode.bench.timed import TimedOutput
from torch_multinode.launch.spec import runnable_module
from torch_multinode.sim import nodes as sim
from torch_multinode.training.distributed import parallel

LOOPBACK = "127.0.0.1"
# Small enough for two cores, and the same everywhere so runs can be compared.
TINY = (
    "--model",
    "tiny",
    "--image-size",
    "16",
    "--train-samples",
    "256",
    "--val-samples",
    "128",
    "--global-batch-size",
    "32",
    "--workers",
    "0",
    "--lr",
    "0.2",
    "--warmup-steps",
    "1",
    "--schedule",
    "constant",
    "--log-every",
    "4",
    "--no-tensorboard",
)


def with_values(args: tuple[str, ...], **values: str) -> list[str]:
    """Arguments such as TINY's with some values replaced: with_values(TINY,
    global_batch_size="48") gives --global-batch-size 48."""
    out = list(args)
    for flag, value in values.items():
        out[out.index("--" + flag.replace("_", "-")) + 1] = value
    return out


# The default job, small, as a user runs it on the cluster: TensorBoard on, its model brought
# back (tests/conftest.py's `small_job_over_ssh`; the same job through Slurm must equal it).
SMALL_JOB = (
    *(arg for arg in TINY if arg != "--no-tensorboard"),
    "--steps",
    "4",
    "--out",
    "model.pt",
)
_TORCHRUN_VARIABLES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
}


@dataclass(frozen=True)
class Finished:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, text: str) -> list[str]:
        """Every output line containing `text`, from both streams."""
        return [line for line in self.output.splitlines() if text in line]

    def digests(self) -> dict[int, str]:
        """rank -> parameter sha256, from the `[rank N] parameters sha256 ...` lines."""
        found = re.findall(r"\[rank (\d+)\] parameters sha256 ([0-9a-f]{64})", self.stdout)
        return {int(rank): digest for rank, digest in found}

    def explain(self) -> str:
        return f"$ {' '.join(self.command)}\nexit {self.returncode}\n{self.stdout}\n{self.stderr}"


@contextlib.contextmanager
def launches(cluster, inventory: Path | None = None):
    """launch(*args) -> the launcher (`train -i` the cluster's inventory, or `inventory`)
    running a job, its output piped; one a test leaves running (it failed early) gets Ctrl-C at
    the end, so its job stops on the nodes too."""
    started: list[subprocess.Popen] = []
    path = inventory or cluster.config.inventory_path

    def launch(*args: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "train"), "-i", str(path)] + list(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        return process

    try:
        yield launch
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()


def kill_node(process: subprocess.Popen, container: str) -> TimedOutput:
    """`docker kill` a node container while `process` (the launcher) runs; its output from here
    on, timed from the start of the kill. The kill returns once Docker has cleaned up after the
    container, which under heavy disk load takes 15 s and more: the launcher is timed apart."""
    output = TimedOutput(process, time.monotonic())
    sim.docker("kill", container)
    output.mark("docker kill returned")
    return output


def free_port() -> int:
    return parallel.free_loopback_port()


def run_environment(extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of a process a test starts: gloo on loopback, one thread, unbuffered."""
    # A clean slate: a test run under torchrun must not leak its own rank into the launches.
    environ = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
    environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    environ.update(extra or {})
    return environ


def run_command(
    command: list[str], cwd: Path, env: dict[str, str] | None, timeout: float
) -> Finished:
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=run_environment(env),
        check=False,
    )
    return Finished(command, done.returncode, done.stdout, done.stderr)


def local_nodes(
    cwd: Path,
    module: str,
    count: int,
    args: Callable[[int], list[str]],
    env: Callable[[int], dict[str, str]],
    during: Callable[[list[subprocess.Popen]], None] | None = None,
) -> list[Finished]:
    """A job of `count` "nodes" on this machine, one rank each, node i running `module` with
    args(i) and env(i), named node-i; node ranks fixed (torchrun's static rendezvous).
    `during`, if given, is called with the nodes' processes as they run (each its torchrun;
    kill_local_node kills a "node")."""
    port = free_port()

    def command(index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={count}",
            "--nproc-per-node=1",
            f"--node-rank={index}",
            f"--master-addr={LOOPBACK}",
            f"--master-port={port}",
            f"--local-addr={LOOPBACK}",
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m",
            module,
            *args(index),
        ]

    commands = [command(index) for index in range(count)]
    processes = [
        subprocess.Popen(
            commands[index],
            cwd=cwd,
            env=run_environment({"TMN_NODE_NAME": f"node-{index}", **env(index)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for index in range(count)
    ]
    pool = ThreadPoolExecutor(count)
    try:
        ended = [pool.submit(process.communicate, timeout=180) for process in processes]
        if during is not None:
            during(processes)
        outputs = [future.result() for future in ended]
    finally:
        for process in processes:
            if process.poll() is None:
                kill_local_node(process)
        pool.shutdown()
    return [
        Finished(commands[index], process.returncode, *outputs[index])
        for index, process in enumerate(processes)
    ]


def local_ranks(node: subprocess.Popen) -> list[int]:
    """The rank processes a "node" of local_nodes (its torchrun) still runs."""
    found = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def kill_local_node(node: subprocess.Popen) -> None:
    """A "node" of local_nodes killed: its torchrun's ranks (torchrun starts each in a session
    of its own) and the torchrun (in a process group of its own)."""
    for rank in local_ranks(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)


def kill_node_then_the_others(nodes: list[subprocess.Popen], index: int) -> None:
    """Node `index` of local_nodes killed, as a node dies; the others' ranks then end by
    themselves (their peer's connection is gone, or a collective times out), and their
    torchruns, which would wait for the dead one's at the exit (a static rendezvous: 5 minutes),
    are killed then, as the launcher stops the other nodes of a job that lost one."""
    kill_local_node(nodes[index])
    others = [node for i, node in enumerate(nodes) if i != index]
    wait_until(
        lambda: not any(local_ranks(node) for node in others),
        120,
        "the other nodes' ranks did not end",
    )
    for node in others:  # in a store wait, where it handles no SIGTERM
        kill_local_node(node)


def wait_until(
    condition: Callable[[], bool], seconds: float, what: str, every: float = 0.05
) -> None:
    """`condition()` true within `seconds` (asked `every` seconds), else AssertionError `what`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def torchrun_command(
    module: str,
    *args: str,
    nproc: int = 2,
    nnodes: int = 1,
    port: int | None = None,
    run_id: str = "test",
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={LOOPBACK}:{port or free_port()}",
        f"--rdzv-id={run_id}",
        f"--local-addr={LOOPBACK}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        runnable_module(module),  # training.ddp is torch_multinode.training.ddp to Python
        *args,
    ]


@pytest.fixture
def torchrun(tmp_path):
    """torchrun(module, *args, nproc=2) -> Finished: one torchrun on this machine, loopback only."""

    def launch(module: str, *args: str, nproc: int = 2, env=None, timeout: float = 180):
        return run_command(torchrun_command(module, *args, nproc=nproc), tmp_path, env, timeout)

    return launch


@pytest.fixture
def python_module(tmp_path):
    """python_module(module, *args) -> Finished: `python -m module` without torchrun."""

    def launch(module: str, *args: str, env=None, timeout: float = 120):
        return run_command(
            [sys.executable, "-m", runnable_module(module), *args], tmp_path, env, timeout
        )

    return launch


def two_node_launch(
    module: str, *args: str, cwd: Path, nproc: int = 2, timeout: float = 180
) -> list[Finished]:
    """Two torchrun agents on this machine forming one job of 2 "nodes" x `nproc`."""
    port = free_port()
    processes = []
    for _ in range(2):
        command = torchrun_command(
            module, *args, nproc=nproc, nnodes=2, port=port, run_id="two-nodes"
        )
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=run_environment(None),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        processes.append((command, process))
    finished = []
    for command, process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        finished.append(Finished(command, process.returncode, stdout, stderr))
    return finished


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max((left[name] - right[name]).abs().max().item() for name in left)


REFERENCE_STEPS = 12  # 8 steps per epoch at TINY's sizes, so runs cross an epoch boundary


@dataclass(frozen=True)
class ReferenceRun:
    finished: Finished
    state: dict[str, torch.Tensor]


@pytest.fixture(scope="session")
def reference_ddp(tmp_path_factory) -> ReferenceRun:
    """One uninterrupted 2-process DDP run of the tiny model, which other runs must equal."""
    return reference_run(tmp_path_factory.mktemp("reference"))


def reference_run(directory: Path) -> ReferenceRun:
    """The run behind `reference_ddp`, in `directory`."""
    out = directory / "model.pt"
    command = torchrun_command(
        "training.ddp", *TINY, "--steps", str(REFERENCE_STEPS), "--out", str(out)
    )
    finished = run_command(command, directory, None, 180)
    assert finished.returncode == 0, finished.explain()
    return ReferenceRun(finished, load_state(out))


def run_main(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """A workload's CLI entry, in this process: (exit code, stdout, stderr)."""
    from torch_multinode.training.distributed import parallel

    with pytest.raises(SystemExit) as exited:
        parallel.run(main, argv)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err
