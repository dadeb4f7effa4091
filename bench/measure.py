"""The measurements behind `make bench`, each taken on a simulated cluster this run started.

Every figure is a ratio of two things measured side by side in the same run, each repeated
(median with the spread), never an absolute time alone. The functions here only measure and
parse; bench.report turns what they return into the report.
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

from cluster import sim, sync
from cluster.errors import UserError
from cluster.inventory import Inventory, load
from launch.commands import remote_command
from launch.nodes import interface_env
from launch.spec import JobSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = REPO_ROOT / ".venv" / "bin"
BENCH_PREFIX = "BENCH "
FIRST_STEP = re.compile(r"\bstep 1/\d+\b")
VAL_ACCURACY = re.compile(r"val accuracy\s+([0-9.]+)%")

Progress = Callable[[str], None]


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


# -- 6. provisioning -------------------------------------------------------------------------


def provision_seconds(inventory: Path) -> float:
    started = time.monotonic()
    run(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        timeout=1800,
        what="make provision",
    )
    return time.monotonic() - started


def measure_provision(inventory: Path, reps: int, progress: Progress) -> dict:
    progress("provision: first run on fresh nodes...")
    first = provision_seconds(inventory)
    progress(f"provision: first run {first:.0f} s; second (idempotent) runs...")
    second = Series([provision_seconds(inventory) for _ in range(reps)])
    return {
        "first_seconds": first,
        "second_seconds": second.as_dict(),
        "ratio": Series([s / first for s in second.values]).as_dict(),
    }


# -- 5. netcheck -----------------------------------------------------------------------------


def netcheck_report(inventory: Path, nnodes: int, *extra: str, timeout: float = 600) -> dict:
    proc = subprocess.run(
        [
            str(BIN / "netcheck"),
            "-i",
            str(inventory),
            "-n",
            str(nnodes),
            "--json",
            *extra,
            "--env-file",
            str(inventory.parent / "netcheck-env.json"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise UserError(f"netcheck printed no report: {proc.stderr.strip()[-300:]}") from None
    if not report.get("ok"):
        failed = [f["detail"] for f in report.get("findings", []) if f["status"] == "FAIL"]
        raise UserError(f"netcheck on {nnodes} nodes failed: {'; '.join(failed[:3])}")
    return report


def measure_netcheck(inventory: Path, config: sim.SimConfig, reps: int, progress: Progress) -> dict:
    """netcheck on 4 nodes against 2, each node with the same share of a core in both: this
    machine's 2 cores give 4 nodes half a core each, so the 2 nodes share one core. Real nodes
    do not lose CPU when others join; with 2 nodes on a core each, the 4-node run would mostly
    measure the torch import of twice the nodes on the same 2 cores (also reported)."""
    times: dict[str, list[float]] = {"two": [], "four": [], "two_own_cores": []}
    runs = (("two", 2, [0, 0]), ("four", 4, [0, 1, 0, 1]), ("two_own_cores", 2, [0, 1]))
    try:
        for rep in range(reps):
            for name, nnodes, cores in runs:  # interleaved: drift hits all alike
                pin_cores(config, nnodes, cores)
                started = time.monotonic()
                netcheck_report(inventory, nnodes)
                times[name].append(time.monotonic() - started)
            progress(
                f"netcheck: rep {rep + 1}/{reps}: half a core per node: 2 nodes "
                f"{times['two'][-1]:.1f} s, 4 nodes {times['four'][-1]:.1f} s; 2 nodes on "
                f"a core each {times['two_own_cores'][-1]:.1f} s"
            )
    finally:
        pin_cores(config, 4, [0, 1, 0, 1])
    return {
        "two_nodes_seconds": Series(times["two"]).as_dict(),
        "four_nodes_seconds": Series(times["four"]).as_dict(),
        "ratio": ratio_series(times["four"], times["two"]).as_dict(),
        "two_nodes_own_cores_seconds": Series(times["two_own_cores"]).as_dict(),
        "ratio_own_cores": ratio_series(times["four"], times["two_own_cores"]).as_dict(),
    }


# -- 1. bus bandwidth against raw TCP --------------------------------------------------------


def sweep(inventory: Path) -> dict:
    """One netcheck --sweep: all_reduce busbw per size, raw TCP of the same link."""
    report = netcheck_report(inventory, 2, "--sweep")
    busbw = {
        m["bytes"]: m["busbw"]
        for m in report["collective"]["measurements"]
        if m["op"] == "all_reduce"
    }
    ring = [link["gbps"] for link in report["tcp"]["ring"] if link.get("gbps")]
    return {"busbw": busbw, "tcp": statistics.mean(ring)}


def measure_bandwidth(
    inventory: Path, config: sim.SimConfig, link: str, reps: int, progress: Progress
) -> dict:
    result = {}
    for name, rate in (("shaped", link), ("unshaped", None)):
        shape(config, 2, rate)
        runs = [sweep(inventory) for _ in range(reps)]
        sizes = sorted(runs[0]["busbw"])
        largest = sizes[-1]
        result[name] = {
            "link": rate or "unshaped veth",
            "busbw_by_size": {
                str(size): Series([r["busbw"][size] for r in runs]).as_dict() for size in sizes
            },
            "tcp_gbytes_per_s": Series([r["tcp"] for r in runs]).as_dict(),
            "largest_bytes": largest,
            "busbw_over_tcp": ratio_series(
                [r["busbw"][largest] for r in runs], [r["tcp"] for r in runs]
            ).as_dict(),
        }
        progress(
            f"bandwidth ({name}): busbw at {largest >> 20} MiB "
            f"{result[name]['busbw_by_size'][str(largest)]['median']:.3f} GB/s, raw TCP "
            f"{result[name]['tcp_gbytes_per_s']['median']:.3f} GB/s"
        )
    shape(config, 2, link)
    return result


# -- 2 and 3. scaling efficiency per lever, auto -------------------------------------------


def train(inventory: Path, nnodes: int, module: str, args: list[str], timeout: float) -> str:
    proc = run(
        [
            str(BIN / "train"),
            "-i",
            str(inventory),
            "--nnodes",
            str(nnodes),
            "--module",
            module,
            "--",
            *args,
        ],
        timeout=timeout,
        what=f"{module} on {nnodes} node(s)",
    )
    return proc.stdout


def measure_scaling(inventory: Path, workload: list[str], reps: int, progress: Progress) -> dict:
    """samples/s of 2 nodes over twice that of 1 node, per lever, same per-rank batch."""
    common = [*workload, "--reps", str(reps)]
    progress("scaling: 1 node (the baseline)...")
    single = bench_rows(
        train(inventory, 1, "training.bench_scaling", [*common, "--levers", "none"], 1800)
    )
    progress("scaling: 2 nodes, every lever...")
    double = bench_rows(train(inventory, 2, "training.bench_scaling", common, 3600))
    base = [r["samples_per_second"] for r in single if "samples_per_second" in r]
    if len(base) != reps:
        raise UserError(f"the 1-node run reported {len(base)} measurements, not {reps}")
    levers: dict[str, dict] = {}
    for row in double:
        if "samples_per_second" not in row:
            continue
        levers.setdefault(row["lever"], {"rows": []})["rows"].append(row)
    selection = next((r for r in double if r.get("lever") == "auto-selection"), None)
    result: dict = {"baseline_samples_per_second": Series(base).as_dict(), "levers": {}}
    for lever, item in levers.items():
        rate = [r["samples_per_second"] for r in item["rows"]]
        result["levers"][lever] = {
            "samples_per_second": Series(rate).as_dict(),
            # rep i of 2 nodes against rep i of 1 node: both ran in this bench run
            "efficiency": ratio_series(rate, [2 * b for b in base[: len(rate)]]).as_dict(),
            "seconds_per_step": Series([r["seconds_per_step"] for r in item["rows"]]).as_dict(),
        }
    result["auto_selection"] = selection
    first = next((r for r in double if "batch" in r), {})  # the auto-selection row has none
    result["workload"] = {k: first[k] for k in ("batch", "accumulate") if k in first}
    for lever, item in result["levers"].items():
        progress(f"scaling: {lever:9s} efficiency {item['efficiency']['median']:.2f}")
    return result


def measure_powersgd_accuracy(inventory: Path, args: list[str], progress: Progress) -> dict:
    """Final validation accuracy with PowerSGD against no hook, same steps and seed."""
    accuracy = {}
    for hook in ("none", "powersgd"):
        out = train(inventory, 2, "training.ddp", [*args, "--comm-hook", hook], 1800)
        found = VAL_ACCURACY.findall(out)
        if not found:
            raise UserError(f"the {hook} run printed no validation accuracy")
        accuracy[hook] = float(found[-1])
        progress(f"powersgd accuracy: {hook} {accuracy[hook]:.2f} %")
    return {
        "args": args,
        "val_accuracy_none": accuracy["none"],
        "val_accuracy_powersgd": accuracy["powersgd"],
        "cost_points": accuracy["none"] - accuracy["powersgd"],
    }


# -- 4. launcher overhead --------------------------------------------------------------------


def _until_first_step(
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
    return _until_first_step([proc], 0, 600)


def by_hand_to_first_step(inventory: Inventory, args: list[str]) -> float:
    """What a user does without us: on each node, over SSH, the same torchrun command."""

    inventory = inventory.first(2)
    hosts = inventory.hosts
    spec = JobSpec(args=tuple(args))
    env = interface_env(inventory)
    processes = []
    for host in hosts:
        command = remote_command(
            host, inventory.master, len(hosts), spec, inventory.rendezvous_port, env[host.name]
        )
        ssh = [*sync.ssh_command(inventory, host), f"{host.ssh_user}@{host.ssh_address}", command]
        processes.append(
            subprocess.Popen(ssh, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return _until_first_step(processes, 0, 600)


def side_by_side(
    reps: int,
    ours: Callable[[], float],
    theirs: Callable[[], float],
    said: Callable[[int, float, float], None],
) -> tuple[list[float], list[float]]:
    """`reps` pairs of measurements, alternating which goes first so that warm caches on the
    nodes favour neither; `said(rep, ours, theirs)` after each pair."""
    first, second = [], []
    for rep in range(reps):
        ours_first = rep % 2 == 1
        if ours_first:
            first.append(ours())
        second.append(theirs())
        if not ours_first:
            first.append(ours())
        said(rep, first[-1], second[-1])
    return first, second


def measure_launcher(inventory_path: Path, args: list[str], reps: int, progress: Progress) -> dict:
    inventory = load(inventory_path)
    ours, by_hand = side_by_side(
        reps,
        lambda: make_train_to_first_step(inventory_path, args),
        lambda: by_hand_to_first_step(inventory, args),
        lambda rep, train, hand: progress(
            f"launcher: rep {rep + 1}/{reps}: make train {train:.1f} s, "
            f"torchrun by hand {hand:.1f} s to the first step"
        ),
    )
    return {
        "make_train_seconds": Series(ours).as_dict(),
        "by_hand_seconds": Series(by_hand).as_dict(),
        "ratio": ratio_series(ours, by_hand).as_dict(),
    }


# -- 7. the edit loop ------------------------------------------------------------------------

EDIT_LOOP_FILES = 1000
EDIT_LOOP_ARGS = ["--model", "tiny", "--steps", "2", "--log-every", "1", "--no-tensorboard"]
SENT = re.compile(r"(node\d+) (\d+) changed file\(s\), ([\d,]+) bytes sent")


def edit_loop_project(root: Path) -> Path:
    """A project of EDIT_LOOP_FILES small files: a package of modules and the script, which
    imports one and runs the project's DDP workload."""
    package = root / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for index in range(EDIT_LOOP_FILES - 2):
        (package / f"mod_{index:04d}.py").write_text(
            f'"""Module {index} of a project of many small files."""\n\nVALUE = {index}\n'
        )
    script = root / "train.py"
    script.write_text(
        "import runpy\n\nimport pkg.mod_0000  # noqa: F401\n\n"
        "runpy.run_module('training.ddp', run_name='__main__')\n"
    )
    return script


def _train_in_containers(inventory: Path, script: Path) -> tuple[float, dict[str, int]]:
    """make train of `script`: seconds to the first step, and the bytes the project's sync sent
    each node."""
    proc = subprocess.Popen(
        train_command(inventory, EDIT_LOOP_ARGS, f"SCRIPT={script}"),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    outputs: list = []
    seconds = _until_first_step([proc], 0, 900, outputs)
    project_line = next(line for line in outputs[0] if f"{script.parent} (" in line)
    sent = {node: int(size.replace(",", "")) for node, _, size in SENT.findall(project_line)}
    return seconds, sent


def measure_edit_loop(inventory_path: Path, reps: int, progress: Progress) -> dict:
    """On nodes provisioned for jobs in containers: make train's time to the first step after a
    one-line edit in a project of 1,000 files, over the same with nothing changed; and what the
    edit cost on the wire, per node."""
    import tempfile

    import yaml

    document = yaml.safe_load(inventory_path.read_text())
    document["all"]["vars"]["launch_mode"] = "container"
    hosts = document["all"]["children"]["nodes"]["hosts"]
    document["all"]["children"]["nodes"]["hosts"] = dict(list(hosts.items())[:2])
    inventory = inventory_path.with_name("inventory-containers.yml")
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    progress(
        "edit loop: provisioning 2 nodes for jobs in containers (builds and ships the "
        "training image)..."
    )
    run(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        timeout=3600,
        what="make provision (containers)",
    )
    unchanged, edited, sent = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-project-") as scratch:
        script = edit_loop_project(Path(scratch) / "project")
        size = sum(path.stat().st_size for path in script.parent.rglob("*") if path.is_file())
        first, _ = _train_in_containers(inventory, script)  # the whole project travels once
        progress(f"edit loop: first run {first:.1f} s to the first step (the whole project sent)")
        module = script.parent / "pkg" / "mod_0500.py"
        for rep in range(reps):
            # Alternate which goes first, so warm caches on the nodes favour neither.
            if rep % 2:
                unchanged.append(_train_in_containers(inventory, script)[0])
            module.write_text(module.read_text() + f"EDITED = {rep}\n")
            seconds, bytes_sent = _train_in_containers(inventory, script)
            edited.append(seconds)
            sent.append(float(max(bytes_sent.values())))
            if not rep % 2:
                unchanged.append(_train_in_containers(inventory, script)[0])
            progress(
                f"edit loop: rep {rep + 1}/{reps}: after an edit {edited[-1]:.1f} s, "
                f"nothing changed {unchanged[-1]:.1f} s; {sent[-1]:.0f} bytes per node"
            )
    return {
        "workdir_files": EDIT_LOOP_FILES,
        "workdir_bytes": size,
        "edited_seconds": Series(edited).as_dict(),
        "unchanged_seconds": Series(unchanged).as_dict(),
        "ratio": ratio_series(edited, unchanged).as_dict(),
        "edit_bytes_per_node": Series(sent).as_dict(),
    }


# -- 8. Slurm --------------------------------------------------------------------------------


def measure_slurm(inventory_path: Path, args: list[str], reps: int, progress: Progress) -> dict:
    """make train through Slurm (scheduler: slurm) over make train through the SSH launcher,
    the same job on the same 2 nodes, time from the command to the first training step: what
    the queue costs (submission, scheduling, the script's go, polling) before training starts."""
    import yaml

    document = yaml.safe_load(inventory_path.read_text())
    document["all"]["vars"]["scheduler"] = "slurm"
    inventory = inventory_path.with_name("inventory-slurm.yml")
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    name = "tmnbench"
    progress("slurm: setting Slurm up on the nodes (the hostname and slurm roles)...")
    key = REPO_ROOT / ".slurm" / f"{name}.munge.key"
    try:
        run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(inventory),
                str(REPO_ROOT / "ansible" / "site.yml"),
                "--tags",
                "hostname,slurm",
                "-e",
                f"slurm_cluster_name={name}",
            ],
            timeout=1800,
            what="the slurm role",
        )
        through_slurm, through_ssh = side_by_side(
            reps,
            lambda: make_train_to_first_step(inventory, args),
            lambda: make_train_to_first_step(inventory_path, args),
            lambda rep, queued, direct: progress(
                f"slurm: rep {rep + 1}/{reps}: through Slurm {queued:.1f} s, "
                f"through the SSH launcher {direct:.1f} s to the first step"
            ),
        )
    finally:
        key.unlink(missing_ok=True)
    return {
        "slurm_seconds": Series(through_slurm).as_dict(),
        "ssh_seconds": Series(through_ssh).as_dict(),
        "ratio": ratio_series(through_slurm, through_ssh).as_dict(),
    }


# -- 9. FSDP2 against DDP --------------------------------------------------------------------

FSDP_MODEL = [
    "--layers",
    "4",
    "--width",
    "256",
    "--heads",
    "4",
    "--seq-len",
    "128",
    "--global-batch-size",
    "8",
    "--log-every",
    "10",
]


def fsdp_row(inventory: Path, strategy: str, steps: int) -> dict:
    """training.fsdp on 2 nodes with --strategy `strategy`: rank 0's BENCH row."""
    args = [*FSDP_MODEL, "--steps", str(steps), "--strategy", strategy]
    done = run(
        train_command(inventory, args, "MODULE=training.fsdp"),
        timeout=1200,
        what=f"make train MODULE=training.fsdp (--strategy {strategy})",
    )
    (row,) = [row for row in bench_rows(done.stdout) if row.get("workload") == "fsdp"]
    return row


def measure_fsdp(inventory: Path, steps: int, reps: int, progress: Progress) -> dict:
    """The same GPT on the same 2 nodes, sharded (FSDP2) and replicated (DDP), alternating:
    tokens/s of each, and what one rank holds (parameters, gradients, optimizer state) against
    one unsharded replica."""
    sharded, replicated = side_by_side(
        reps,
        lambda: fsdp_row(inventory, "fsdp", steps),
        lambda: fsdp_row(inventory, "ddp", steps),
        lambda rep, fsdp, ddp: progress(
            f"fsdp: rep {rep + 1}/{reps}: FSDP2 {fsdp['tokens_per_second']:,.0f} tokens/s "
            f"(holds {fsdp['bytes_ratio']:.3f} of a replica), DDP "
            f"{ddp['tokens_per_second']:,.0f} tokens/s ({ddp['bytes_ratio']:.3f})"
        ),
    )
    fsdp_rate = [row["tokens_per_second"] for row in sharded]
    ddp_rate = [row["tokens_per_second"] for row in replicated]
    return {
        "model": FSDP_MODEL + ["--steps", str(steps)],
        "fsdp_tokens_per_second": Series(fsdp_rate).as_dict(),
        "ddp_tokens_per_second": Series(ddp_rate).as_dict(),
        "tokens_ratio": ratio_series(fsdp_rate, ddp_rate).as_dict(),
        "fsdp_bytes_ratio": Series([row["bytes_ratio"] for row in sharded]).as_dict(),
        "ddp_bytes_ratio": Series([row["bytes_ratio"] for row in replicated]).as_dict(),
    }
