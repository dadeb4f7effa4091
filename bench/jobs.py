"""The bench sections that time training jobs on the bench cluster's nodes: 2 and 3. scaling
efficiency per lever and PowerSGD's accuracy, 4. launcher overhead (make train against
torchrun by hand), 7. the edit loop (jobs in containers), 8. Slurm against the SSH launcher,
9. FSDP2 against DDP, 16. a project with dependencies against the same without (in
containers)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from torch_multinode.bench import wheels
from torch_multinode.bench.measure import (
    BIN,
    REPO_ROOT,
    Progress,
    Series,
    bench_rows,
    make_train_to_first_step,
    node_containers,
    ratio_series,
    run,
    side_by_side,
    train_command,
    until_first_step,
)
from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.inventory_read import load
from torch_multinode.launch.commands import remote_command
from torch_multinode.launch.environment import interface_env
from torch_multinode.launch.spec import JobSpec
from torch_multinode.provision import dependencies
from torch_multinode.sim import nodes as sim

# -- 2 and 3. scaling efficiency per lever, auto -------------------------------------------

VAL_ACCURACY = re.compile(r"val accuracy\s+([0-9.]+)%")


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
        train(inventory, 1, "training.fixtures.bench_scaling", [*common, "--levers", "none"], 1800)
    )
    progress("scaling: 2 nodes, every lever...")
    double = bench_rows(train(inventory, 2, "training.fixtures.bench_scaling", common, 3600))
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
        ssh = [
            *trust.openssh_command(inventory, host),
            f"{host.ssh_user}@{host.ssh_address}",
            command,
        ]
        processes.append(
            subprocess.Popen(ssh, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return until_first_step(processes, 0, 600)


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
    seconds = until_first_step([proc], 0, 900, outputs)
    project_line = next(line for line in outputs[0] if f"{script.parent} (" in line)
    sent = {node: int(size.replace(",", "")) for node, _, size in SENT.findall(project_line)}
    return seconds, sent


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


# -- 16. a project's dependencies -----------------------------------------------------------

# A pure-Python package the training image lacks, a wheel made here (bench/wheels.py: pip asks
# no package index): the project's layer brings it.
DEPENDENCIES = ("bench-dependency",)
DEPENDENT_SCRIPT = """\
import pathlib
import runpy

if (pathlib.Path(__file__).parent / "requirements.txt").exists():
    import bench_dependency  # noqa: F401  (from the project's dependency layer)

runpy.run_module("torch_multinode.training.ddp", run_name="__main__")
"""


def dependency_projects(root: Path) -> tuple[Path, Path]:
    """Two projects alike but for a requirements.txt (DEPENDENCIES), whose script imports them
    where the project has it: the scripts, with first."""
    scripts = []
    for name, requirements in (("with", DEPENDENCIES), ("without", ())):
        project = root / name
        project.mkdir(parents=True)
        (project / "train.py").write_text(DEPENDENT_SCRIPT)
        if requirements:
            (project / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))
        scripts.append(project / "train.py")
    return scripts[0], scripts[1]


def _to_first_step(inventory: Path, script: Path, pip: dict[str, str]) -> tuple[float, list[str]]:
    """make train of `script` in containers, pip's environment `pip`: seconds to the first
    step, and its lines."""
    proc = subprocess.Popen(
        train_command(inventory, EDIT_LOOP_ARGS, f"SCRIPT={script}"),
        cwd=REPO_ROOT,
        env={**os.environ, **pip},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    outputs: list = []
    seconds = until_first_step([proc], 0, 900, outputs)
    return seconds, outputs[0]


NOTHING_BUILT = "nothing to build"
NOTHING_SHIPPED = "nothing to ship"


LAYER_TAG = re.compile(rf"\b({re.escape(dependencies.REPOSITORY)}:[0-9a-f]+)\b")


def remove_layer(inventory: Path, lines: list[str]) -> None:
    """The layer a run made or found (its tag, from its lines), off every node and this
    machine: the image section then removes the training image from the nodes, which a layer
    on it would keep there."""
    for tag in sorted(set(LAYER_TAG.findall("".join(lines)))):
        for container in node_containers(inventory).values():
            sim.docker("exec", container, "docker", "rmi", tag, check=False)
        sim.docker("rmi", tag, check=False)


def reused(lines: list[str]) -> bool:
    """Whether a run of the project with dependencies built and shipped nothing, as it says."""
    text = "".join(lines)
    return NOTHING_BUILT in text and NOTHING_SHIPPED in text


def measure_dependencies(inventory: Path, reps: int, progress: Progress) -> dict:
    """On nodes provisioned for jobs in containers: make train's time to the first step of a
    project with a requirements.txt on its second and later runs (its layer built and shipped by
    the first, found then: nothing built, nothing shipped), against the same project without
    one, side by side."""
    import tempfile

    def again(script: Path) -> float:
        seconds, lines = _to_first_step(inventory, script, pip)
        if not reused(lines):
            raise UserError(
                "a run of the project with dependencies after the first built or shipped its "
                f"layer again: {''.join(lines[-15:])}",
                exit_code=1,
            )
        return seconds

    with tempfile.TemporaryDirectory(prefix="bench-dependencies-") as scratch:
        with_them, without = dependency_projects(Path(scratch))
        for name in DEPENDENCIES:
            wheels.wheel(Path(scratch) / "wheels", name, "1.0")
        pip = wheels.offline_pip(Path(scratch) / "wheels")
        first, lines = _to_first_step(inventory, with_them, pip)  # builds and ships the layer
        progress(
            f"dependencies: first run {first:.1f} s to the first step (the layer "
            + ("built and shipped" if not reused(lines) else "found")
            + ")"
        )
        try:
            seconds_with, seconds_without = side_by_side(
                reps,
                lambda: again(with_them),
                lambda: _to_first_step(inventory, without, pip)[0],
                lambda rep, ours, theirs: progress(
                    f"dependencies: rep {rep + 1}/{reps}: with {ours:.1f} s, without "
                    f"{theirs:.1f} s to the first step"
                ),
            )
        finally:
            remove_layer(inventory, lines)
    return {
        "requirements": list(DEPENDENCIES),
        "first_seconds": first,
        "with_seconds": Series(seconds_with).as_dict(),
        "without_seconds": Series(seconds_without).as_dict(),
        "ratio": ratio_series(seconds_with, seconds_without).as_dict(),
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
