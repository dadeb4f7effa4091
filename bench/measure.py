"""What the measurements behind `make bench` share, each taken on a simulated cluster this run
started.

Every figure is a ratio of two things measured side by side in the same run, each repeated
(median with the spread), never an absolute time alone. The sections' functions only measure
and parse; bench.report turns what they return into the report.

This module owns what the sections share: Series and the ratios, BENCH rows, commands run
from this checkout, the bench cluster's cores and link, `make train` to the first step,
side-by-side repetitions, nodes provisioned for jobs in containers and their network
counters. The sections are in bench.network (6, 5, 1), bench.jobs (2, 3, 4, 7, 8, 9),
bench.shipping (10), bench.rebuild (11), bench.hang (12) and bench.flight (13, on this machine,
no cluster); bench.cli runs them in order.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from torch_multinode.cluster.errors import UserError
from torch_multinode.sim import nodes as sim

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = REPO_ROOT / ".venv" / "bin"
BENCH_PREFIX = "BENCH "
FIRST_STEP = re.compile(r"\bstep 1/\d+\b")

Progress = Callable[[str], None]
Measured = TypeVar("Measured")  # what side_by_side's two measurements return (a float, a row)


@dataclass
class Series:
    """Repeated measurements of one quantity."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def as_dict(self) -> dict:
        return {
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "n": len(self.values),
            "values": self.values,
        }


def ratio_series(numerators: list[float], denominators: list[float]) -> Series:
    """Ratios of paired measurements (rep i over rep i), so drift hits both sides alike."""
    return Series([a / b for a, b in zip(numerators, denominators, strict=True)])


def bench_rows(output: str) -> list[dict]:
    """The BENCH lines a workload printed (the launcher prefixes each with [node])."""
    rows = []
    for line in output.splitlines():
        _, found, payload = line.partition(BENCH_PREFIX)
        if found:
            rows.append(json.loads(payload))
    return rows


def run(command: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise UserError(f"{what} failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))
    return proc


# -- the cluster ------------------------------------------------------------------------------


def pin_cores(config: sim.SimConfig, nnodes: int, cores: list[int] | None = None) -> None:
    """Node i on core cores[i-1]; by default one core per node, as two one-core machines:
    node i on core (i-1) mod 2."""
    for index in range(1, nnodes + 1):
        core = cores[index - 1] if cores else (index - 1) % 2
        sim.docker("update", "--cpuset-cpus", str(core), config.container(index))


def shape(config: sim.SimConfig, nnodes: int, link: str | None) -> None:
    for index in range(1, nnodes + 1):
        sim.shape_link(config.container(index), link)


# -- jobs and their first step ---------------------------------------------------------------------


def until_first_step(
    processes: list[subprocess.Popen], watch: int, timeout: float, outputs: list | None = None
) -> float:
    """Seconds until process `watch` prints the first training step; the rest must succeed.
    Each process's lines go into `outputs` (one list per process) when it is given."""
    started = time.monotonic()
    seen = threading.Event()
    if outputs is None:
        outputs = []
    outputs[:] = [[] for _ in processes]

    def read(index: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            outputs[index].append(line)
            if index == watch and FIRST_STEP.search(line) and not seen.is_set():
                seen.set()

    readers = [
        threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(processes)
    ]
    for reader in readers:
        reader.start()
    deadline = started + timeout
    while not seen.wait(0.5):
        ended = processes[watch].poll() is not None and not readers[watch].is_alive()
        if ended or time.monotonic() > deadline:
            for proc in processes:
                proc.kill()
            why = "it ended" if ended else f"within {timeout:.0f} s"
            raise UserError(
                f"no first training step ({why}): {''.join(outputs[watch][-15:])}", exit_code=1
            )
    elapsed = time.monotonic() - started
    for proc, reader, output in zip(processes, readers, outputs, strict=True):
        if proc.wait(timeout=timeout) != 0:
            raise UserError(f"a run failed: {''.join(output[-10:])}")
        reader.join()
    return elapsed


def train_command(inventory: Path, args: list[str], *variables: str) -> list[str]:
    """`make train` of a job with `args` on the first 2 nodes of `inventory`."""
    return [
        "make",
        "--no-print-directory",
        "train",
        f"INVENTORY={inventory}",
        "NNODES=2",
        *variables,
        f"ARGS={shlex.join(args)}",
    ]


def make_train_to_first_step(inventory: Path, args: list[str]) -> float:
    proc = subprocess.Popen(
        train_command(inventory, args),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return until_first_step([proc], 0, 600)


def side_by_side(
    reps: int,
    ours: Callable[[], Measured],
    theirs: Callable[[], Measured],
    said: Callable[[int, Measured, Measured], None],
) -> tuple[list[Measured], list[Measured]]:
    """`reps` pairs of measurements, alternating which goes first so that warm caches on the
    nodes favour neither; `said(rep, ours, theirs)` after each pair."""
    first: list[Measured] = []
    second: list[Measured] = []
    for rep in range(reps):
        ours_first = rep % 2 == 1
        if ours_first:
            first.append(ours())
        second.append(theirs())
        if not ours_first:
            first.append(ours())
        said(rep, first[-1], second[-1])
    return first, second


# -- nodes for jobs in containers ------------------------------------------------------------------

# Each node's bytes received on every interface but loopback, one "name bytes" line each.
RX_COMMAND = 'for i in /sys/class/net/*; do echo "${i##*/} $(cat "$i/statistics/rx_bytes")"; done'


def containers_inventory(inventory_path: Path, image: str | None = None, nodes: int = 2) -> Path:
    """A copy of the bench's inventory for jobs in containers on its first `nodes` nodes,
    running `image` (default: the inventory's training image)."""
    import yaml

    document = yaml.safe_load(inventory_path.read_text())
    document["all"]["vars"]["launch_mode"] = "container"
    if image:
        document["all"]["vars"]["training_image"] = image
    hosts = document["all"]["children"]["nodes"]["hosts"]
    document["all"]["children"]["nodes"]["hosts"] = dict(list(hosts.items())[:nodes])
    suffix = "" if nodes == 2 else f"-{nodes}"
    inventory = inventory_path.with_name(f"inventory-containers{suffix}.yml")
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    return inventory


def provision_containers(
    inventory_path: Path, image: str | None, progress: Progress, nodes: int = 2
) -> Path:
    """`nodes` nodes provisioned by `make provision` for jobs in containers (it builds the
    training image if needed and ships it); the inventory for them. The edit loop and the image
    figures share the 2 nodes' when both run; the hang section provisions 4."""
    inventory = containers_inventory(inventory_path, image, nodes)
    progress(
        f"provisioning {nodes} nodes for jobs in containers (builds and ships the training "
        "image)..."
    )
    run(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        timeout=3600,
        what="make provision (containers)",
    )
    return inventory


def rx_bytes(listing: str) -> int:
    """The sum of RX_COMMAND's counters, loopback left out."""
    total = 0
    for line in listing.splitlines():
        name, _, value = line.strip().partition(" ")
        if name and name != "lo" and value.strip().isdigit():
            total += int(value)
    return total


def node_containers(inventory: Path) -> dict[str, str]:
    """Each node's simulated-node container (the inventory's sim_container)."""
    import yaml

    hosts = yaml.safe_load(inventory.read_text())["all"]["children"]["nodes"]["hosts"]
    return {name: host["sim_container"] for name, host in hosts.items()}


def node_rx(containers: dict[str, str]) -> dict[str, int]:
    return {
        node: rx_bytes(sim.docker("exec", container, "sh", "-c", RX_COMMAND).stdout)
        for node, container in containers.items()
    }
