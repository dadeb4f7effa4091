"""The measurements behind `make bench`, each taken on a simulated cluster this run started.

Every figure is a ratio of two things measured side by side in the same run, each repeated
(median with the spread), never an absolute time alone. The functions here only measure and
parse; bench.report turns what they return into the report.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch_multinode.cluster import images, sync
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Inventory, load
from torch_multinode.launch.commands import remote_command
from torch_multinode.launch.nodes import interface_env
from torch_multinode.launch.spec import JobSpec
from torch_multinode.sim import nodes as sim

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
    common = [*workload, "--reps", str(reps), "--bench"]
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
        "runpy.run_module('torch_multinode.training.ddp', run_name='__main__')\n"
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


def measure_edit_loop(inventory: Path, reps: int, progress: Progress) -> dict:
    """On nodes provisioned for jobs in containers (`inventory`, provision_containers): make
    train's time to the first step after a one-line edit in a project of 1,000 files, over the
    same with nothing changed; and what the edit cost on the wire, per node."""
    import tempfile

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
    args = [*FSDP_MODEL, "--steps", str(steps), "--strategy", strategy, "--bench"]
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


# -- 10. shipping the training image ---------------------------------------------------------

# What a user's rebuild changes when only the Dockerfile's last step changed: one new file in
# the top layer (random bytes, so that no compression makes it smaller on the wire).
TOP_LAYER_BYTES = 1 << 20
TOP_LAYER_TAG = "bench-top-layer"
# Each node's bytes received on every interface but loopback, one "name bytes" line each.
RX_COMMAND = 'for i in /sys/class/net/*; do echo "${i##*/} $(cat "$i/statistics/rx_bytes")"; done'
REGISTRY_QUIET_SECONDS = 30  # no connection to another cluster's registry for this long
REGISTRY_QUIET_LIMIT = 600  # then go on anyway, saying so


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


def clear_nodes(containers: dict[str, str], image: str, image_id: str) -> None:
    """Remove `image` from every node, and the layers no other image holds, so the next
    shipment starts from nothing."""
    for node, container in containers.items():
        sim.docker("exec", container, "docker", "rmi", "-f", image, check=False)
        sim.docker("exec", container, "docker", "image", "prune", "-f")
        if (
            sim.docker(
                "exec", container, "docker", "image", "inspect", image_id, check=False
            ).returncode
            == 0
        ):
            raise UserError(
                f"on {node}: {image} ({image_id[7:19]}) is still there after rmi and prune"
            )


def repository_of(image: str) -> str:
    """The image's repository: its name without the tag."""
    name, _, last = image.rpartition("/")
    return f"{name}/{last.split(':')[0]}" if name else last.split(":")[0]


def _linked(directory: Path) -> set[str]:
    """The digests a repository links (layers, configs, manifests): the names of its link dirs."""
    found = set()
    for kind in ("_layers", "_manifests/revisions"):
        folder = directory / kind / "sha256"
        if folder.is_dir():
            found |= {entry.name for entry in folder.iterdir()}
    return found


def registry_files(storage: Path, repository: str) -> list[Path]:
    """What to delete from the registry's storage (its docker/registry/v2 directory) for it to
    forget `repository`: the repository's directory, then the blobs it links that no other
    repository links."""
    root = storage / "repositories"
    directory = root / repository
    if not directory.is_dir():
        return []
    mine = _linked(directory)
    others = set()
    for layers in root.rglob("_layers"):
        if layers.parent != directory:
            others |= _linked(layers.parent)
    blobs = storage / "blobs" / "sha256"
    return [
        directory,
        *(blobs / d[:2] / d for d in sorted(mine - others) if (blobs / d[:2] / d).exists()),
    ]


def registry_storage(registry) -> Path:
    """The storage of the registry instance `registry` (ship.Registry), from its config."""
    import yaml
    from torch_multinode.cluster import ship

    config = yaml.safe_load((ship.REGISTRY_DIR / f"{registry.instance}.yml").read_text())
    return Path(config["storage"]["filesystem"]["rootdirectory"]) / "docker" / "registry" / "v2"


def registry_endpoints(configs: list[str]) -> set[str]:
    """address:port of each registry instance, from its config's file name
    (torch-multinode-registry-172-30-150-1-5000.yml)."""
    found = set()
    for name in configs:
        parts = name.removesuffix(".yml").removeprefix("torch-multinode-registry-").split("-")
        if len(parts) == 5 and all(p.isdigit() for p in parts):
            found.add(f"{'.'.join(parts[:4])}:{parts[4]}")
    return found


def connections_to(ss_output: str, endpoints: set[str]) -> int:
    """Established TCP connections (`ss -Htn state established`) with an end in `endpoints`."""
    return sum(
        1 for line in ss_output.splitlines() if any(f in endpoints for f in line.split()[2:4])
    )


def wait_for_quiet_registries(mine: set[str], progress: Progress) -> float:
    """Wait until no registry instance but `mine` has had a connection for
    REGISTRY_QUIET_SECONDS (Docker's registry client keeps none open between requests), so
    that forgetting the image does not pull it from under another cluster's shipment; the
    seconds waited."""
    from torch_multinode.cluster import ship

    others = registry_endpoints([p.name for p in ship.REGISTRY_DIR.glob("*.yml")]) - mine
    started = quiet_since = time.monotonic()
    said = False
    while others and time.monotonic() - quiet_since < REGISTRY_QUIET_SECONDS:
        out = subprocess.run(
            ["ss", "-Htn", "state", "established"], capture_output=True, text=True, check=False
        ).stdout
        if connections_to(out, others):
            quiet_since = time.monotonic()
            if not said:
                progress(
                    f"image: another cluster's registry ({', '.join(sorted(others))}) is busy; "
                    "waiting for it to be quiet before the storage they share forgets the image..."
                )
                said = True
        if time.monotonic() - started > REGISTRY_QUIET_LIMIT:
            progress(f"image: still busy after {REGISTRY_QUIET_LIMIT} s; going on")
            break
        time.sleep(1)
    return time.monotonic() - started


def forget_in_registry(inventory: Inventory, image: str, progress: Progress) -> int:
    """Make the controller's registry forget `image`'s repository, so the next push uploads
    every layer and every node pulls it whole; the bytes of blobs deleted.

    Bench-only: this deletes files under the registry's storage while it runs, which works
    only because its config has no cache (it reads the files on every request) and because
    the bench runs as root on the controller. Nothing in the project does this to a registry:
    the storage is shared by every instance (every cluster provisioned from this controller),
    so the other clusters' registries forget the repository too until the next push restores
    it (the same layers give the same blobs). A separate repository name would not do: the
    controller's engine remembers which repository of this registry holds each layer and
    mounts it from there instead of uploading it. Blobs another repository links stay (deleting
    them would break it): the push uploads them all the same, since the registry answers
    'unknown' for every blob this repository no longer links (its log: HEAD 404, then an
    upload, no mount)."""
    from torch_multinode.cluster import ship

    registries, reason = ship.find_registries(inventory)
    if not registries:
        raise UserError(f"no registry to measure: {reason}", hint="make provision")
    wait_for_quiet_registries({r.endpoint for r in registries.values()}, progress)
    deleted = 0
    for storage in {registry_storage(r) for r in registries.values()}:
        for path in registry_files(storage, repository_of(image)):
            if path.is_dir():
                deleted += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                subprocess.run(["rm", "-rf", "--", str(path)], check=True)
    return deleted


def ship_from_nothing(inventory_path: Path, image: str, via: str, progress: Progress) -> dict:
    """`image` removed from both nodes (and, through the registry, from the registry), then
    shipped `via` 'registry' or 'stream': wall seconds, and what each node received."""
    from torch_multinode.cluster import ship

    inventory = load(inventory_path)
    containers = node_containers(inventory_path)
    wanted = ship.image_id(image)
    clear_nodes(containers, image, wanted)
    forgotten = forget_in_registry(inventory, image, progress) if via == "registry" else 0
    before = node_rx(containers)
    started = time.monotonic()
    shipment = ship.ship(inventory, image, via=via, emit=lambda line: progress(f"image: {line}"))
    seconds = time.monotonic() - started
    after = node_rx(containers)
    if shipment.via != via:
        raise UserError(f"asked to ship {image} {via}, it went {shipment.via or 'nowhere'}")
    return {
        "seconds": seconds,
        "received": shipment.received,
        "rx_bytes": {node: after[node] - before[node] for node in containers},
        "registry_bytes_forgotten": forgotten,
    }


def top_layer_size(image: str) -> int:
    """The size of the image's last layer (`docker history`, newest first)."""
    out = sim.docker("history", "--no-trunc", "--human=false", "--format", "{{.Size}}", image)
    return int(out.stdout.split()[0])


def derived_tag(image: str) -> str:
    """The image's repository with the bench's tag: what a rebuild under a new tag pushes."""
    return f"{repository_of(image)}:{TOP_LAYER_TAG}"


def build_top_layer_change(image: str, tag: str) -> None:
    """`tag`: `image` with one changed file added on top, as a rebuild after an edit to the
    Dockerfile's last step makes."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-image-") as scratch:
        context = Path(scratch)
        (context / "changed.bin").write_bytes(os.urandom(TOP_LAYER_BYTES))
        (context / "Dockerfile").write_text(
            f"FROM {image}\nCOPY changed.bin /opt/torch-multinode-bench/changed.bin\n"
        )
        sim.docker("build", "-q", "-t", tag, str(context), timeout=600)


def ship_top_layer_change(inventory_path: Path, image: str, progress: Progress) -> dict:
    """After `image` reached the nodes through the registry: the same image with a changed top
    layer, shipped as `cluster ship` chooses (via auto); bytes each node received, on its own
    network counters and as the shipment counted them, against the image's and the layer's
    size. The derived image is removed afterwards (nodes, this machine, its registry tag)."""
    from torch_multinode.cluster import ship

    inventory = load(inventory_path)
    containers = node_containers(inventory_path)
    tag = derived_tag(image)
    build_top_layer_change(image, tag)
    try:
        whole, layer = images.image_size(tag), top_layer_size(tag)
        before = node_rx(containers)
        started = time.monotonic()
        shipment = ship.ship(
            inventory, tag, via="auto", emit=lambda line: progress(f"image: {line}")
        )
        seconds = time.monotonic() - started
        after = node_rx(containers)
    finally:
        for container in containers.values():
            sim.docker("exec", container, "docker", "rmi", tag, check=False)
        sim.docker("rmi", tag, check=False)
        registries, _ = ship.find_registries(inventory)
        for storage in {registry_storage(r) for r in registries.values()}:
            # The tag only: the layer's blob stays until a garbage collection, like any tag's.
            tags = storage / "repositories" / repository_of(image) / "_manifests" / "tags"
            subprocess.run(["rm", "-rf", "--", str(tags / TOP_LAYER_TAG)], check=False)
    rx = {node: after[node] - before[node] for node in containers}
    return {
        "via": shipment.via,
        "reason": shipment.reason,
        "seconds": seconds,
        "image_bytes": whole,
        "layer_bytes": layer,
        "received": shipment.received,
        "rx_bytes": rx,
        "rx_over_image": {node: value / whole for node, value in rx.items()},
    }


def measure_image(inventory: Path, image: str, reps: int, progress: Progress) -> dict:
    """On 2 nodes provisioned for jobs in containers (`inventory`, holding `image`): the first
    shipment of the whole image through the registry (push, then both nodes pull at once)
    against the stream (docker save | ssh | docker load on both), side by side, each from
    nothing; then the bytes each node receives after a change to the image's top layer."""
    registry: list[dict] = []
    stream: list[dict] = []

    order: list[str] = []

    def one(via: str, into: list) -> Callable[[], float]:
        def measure() -> float:
            how = "through the registry" if via == "registry" else "streamed whole"
            progress(f"image: shipping {image} {how}, from nothing on both nodes...")
            order.append(via)
            into.append(ship_from_nothing(inventory, image, via, progress))
            return into[-1]["seconds"]

        return measure

    first, second = side_by_side(
        reps,
        one("registry", registry),
        one("stream", stream),
        lambda rep, through, whole: progress(
            f"image: rep {rep + 1}/{reps}: first shipment through the registry {through:.0f} s, "
            f"streamed whole {whole:.0f} s"
        ),
    )
    if order[-1] == "stream":
        # A node that loaded the image from a stream knows no registry digest for its layers
        # and would fetch them all again: the top-layer change starts from a registry pull.
        progress("image: shipping it through the registry again, so the nodes know its layers...")
        ship_from_nothing(inventory, image, "registry", progress)
    progress("image: a changed top layer, through the registry...")
    changed = ship_top_layer_change(inventory, image, progress)
    progress(
        "image: top-layer change: "
        + ", ".join(
            f"{node} {value:,} bytes received ({changed['rx_over_image'][node]:.5f} of the image)"
            for node, value in changed["rx_bytes"].items()
        )
    )
    return {
        "image": image,
        "image_bytes": images.image_size(image),
        "order": order,
        "registry_seconds": Series(first).as_dict(),
        "stream_seconds": Series(second).as_dict(),
        "ratio": ratio_series(first, second).as_dict(),
        "registry_runs": registry,
        "stream_runs": stream,
        "top_layer": changed,
    }


# -- 11. rebuilding the image after a one-line change ----------------------------------------

# The image this section builds and ships under its own name (never a tag tests or users hold),
# removed at the end; its layers below the change stay in the engine's cache, shared.
REBUILD_TAG = "torch-multinode/train:bench-rebuild"
REBUILD_FILE = "docker/entrypoint.sh"  # copied after the torch install, as a user edits it
REBUILD_TIMEOUT = 3600


def scratch_checkout(destination: Path) -> Path:
    """A checkout of this repository for the bench to edit as a user edits theirs: its files
    (tracked, and untracked ones git does not ignore) copied as they are now, so that edits
    made here meanwhile never reach it; docker/wheels hard-linked (3 GB that never change, cost
    nothing to "copy"); the venv linked. Editing a file there (edit_line) never touches this
    checkout, which tests may read."""
    destination.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file() and not source.is_symlink():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    if images.WHEELS_DIR.is_dir():
        wheels = destination / images.WHEELS_DIR.relative_to(REPO_ROOT)
        wheels.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(images.WHEELS_DIR), str(wheels)], check=True)
    (destination / ".venv").symlink_to(REPO_ROOT / ".venv")
    return destination


def edit_line(path: Path, line: str) -> None:
    """One line appended to `path`, a new file in its place (never through a hard link), its
    mode kept (the entrypoint stays executable)."""
    text, mode = path.read_text(), path.stat().st_mode
    path.unlink()
    path.write_text(f"{text}\n{line}\n")
    path.chmod(mode)


# The Makefile's provision recipe, step by step: make echoes each command as it starts it.
PROVISION_PHASES = (
    ("image", re.compile(r"/cluster image ")),
    ("playbook", re.compile(r"ansible-playbook ")),
    ("ship", re.compile(r"/cluster ship ")),
)


def provision_phases(lines: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Seconds per step of `make provision` from its output, each line with the second it was
    read (from the start): 'checks' (cluster check and cluster ready) until make echoes
    `cluster image`, 'image' until `ansible-playbook`, 'playbook' until `cluster ship`, 'ship'
    until `end`. A step whose line never came is left out."""
    starts = {"checks": 0.0}
    for name, pattern in PROVISION_PHASES:
        found = next((at for at, text in lines if pattern.search(text)), None)
        if found is not None:
            starts[name] = found
    ordered = sorted(starts.items(), key=lambda item: item[1])
    ends = [at for _, at in ordered[1:]] + [end]
    return {name: stop - at for (name, at), stop in zip(ordered, ends, strict=True)}


def make_provision_in(checkout: Path, inventory: Path) -> tuple[float, str, dict[str, float]]:
    """`make provision INVENTORY=...` typed in `checkout` (its code runs: PYTHONPATH puts it
    before this checkout's editable install, as a user's own clone would be): wall seconds,
    its output, and the seconds of each of its steps (provision_phases)."""
    import os

    started = time.monotonic()
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        cwd=checkout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONPATH": str(checkout)},
    )
    timer = threading.Timer(REBUILD_TIMEOUT, proc.kill)
    timer.start()
    try:
        lines = [(time.monotonic() - started, line) for line in proc.stdout]
        returncode = proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - started
    output = "".join(text for _, text in lines)
    if returncode != 0:
        tail = output.strip().splitlines()[-15:]
        raise UserError(f"make provision failed (exit {returncode}):\n  " + "\n  ".join(tail))
    return seconds, output, provision_phases(lines, seconds)


def install_layer(image: str) -> str:
    """The id of the step that installed torch (`docker history`), the image's 3.8 GB layer."""
    out = sim.docker("history", "--no-trunc", "--format", "{{.ID}}\t{{.CreatedBy}}", image).stdout
    found = [line.split("\t")[0] for line in out.splitlines() if "pip install" in line]
    if len(found) != 1:
        raise UserError(f"{image}: {len(found)} steps install with pip, not 1")
    return found[0]


def measure_rebuild(config: sim.SimConfig, link: str, reps: int, progress: Progress) -> dict:
    """On 2 fresh simulated nodes for jobs in containers (a cluster of its own, `config`,
    removed at the end): `make provision` typed in a scratch checkout, the first time (it builds
    the training image, from the engine's cache where it holds the layers, and ships the whole
    of it), then `reps` times again, each after one more line appended to docker/entrypoint.sh
    there (make image rebuilds the layers above that COPY, cluster ship sends them). Each
    second run over the first; the torch install layer's id before and after; the bytes each
    node received in each second run."""
    import tempfile

    sim.down(config)
    try:
        cluster = sim.up(2, link, config)
        inventory = containers_inventory(cluster.config.inventory_path, REBUILD_TAG)
        containers = node_containers(inventory)
        with tempfile.TemporaryDirectory(prefix="bench-checkout-") as scratch:
            checkout = scratch_checkout(Path(scratch) / "checkout")
            progress("rebuild: make provision on 2 fresh nodes, jobs in containers...")
            first, _, first_phases = make_provision_in(checkout, inventory)
            installed = install_layer(REBUILD_TAG)
            progress(f"rebuild: first make provision {first:.0f} s ({shown(first_phases)})")
            seconds, received, kept, phases = [], [], [], []
            for rep in range(reps):
                edit_line(checkout / REBUILD_FILE, f"# bench rebuild {rep + 1}")
                before = node_rx(containers)
                again, _, again_phases = make_provision_in(checkout, inventory)
                after = node_rx(containers)
                seconds.append(again)
                phases.append(again_phases)
                received.append({node: after[node] - before[node] for node in containers})
                kept.append(install_layer(REBUILD_TAG) == installed)
                progress(
                    f"rebuild: rep {rep + 1}/{reps}: make provision after a one-line change to "
                    f"{REBUILD_FILE} {again:.0f} s ({again / first:.2f} of the first: "
                    f"{shown(again_phases)}); "
                    + ", ".join(f"{n} {v:,} bytes received" for n, v in received[-1].items())
                )
            whole = images.image_size(REBUILD_TAG)
    finally:
        sim.down(config)  # the nodes, and the image they held
        sim.docker("rmi", REBUILD_TAG, check=False)
    return {
        "changed_file": REBUILD_FILE,
        "image_bytes": whole,
        "first_seconds": first,
        "second_seconds": Series(seconds).as_dict(),
        "ratio": Series([value / first for value in seconds]).as_dict(),
        "install_layer_kept": kept,
        "rx_bytes": received,
        "first_phases": first_phases,
        "second_phases": phases,
    }


def shown(phases: dict[str, float]) -> str:
    """'checks 4 s, image 60 s, ...'"""
    return ", ".join(f"{name} {value:.0f} s" for name, value in phases.items())
