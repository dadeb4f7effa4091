"""`train`: run a job on the first NNODES nodes of the inventory, or locally without one.

train                                   # the default job on this machine
train -i cluster.yml --nnodes 2         # the default job (DDP ResNet) on two nodes
train -i cluster.yml --script proj/train.py -- --epochs 3    # proj/ (or its git tree) travels
train -i cluster.yml --script train.py --env WANDB_API_KEY --env HF_TOKEN=abc
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch_multinode.cluster import autodetect, inventory_read
from torch_multinode.cluster import inventory as inventory_module
from torch_multinode.cluster.errors import UserError, at_the_edge, shown, stop_on_sigterm
from torch_multinode.cluster.execution import SshNodes
from torch_multinode.cluster.inventory_checks import parse_gpu_list
from torch_multinode.launch import checks, ft, options, requirements, restarts, staging
from torch_multinode.launch.backends import backend_for
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.ending import record_exit_code
from torch_multinode.launch.environment import parse_env
from torch_multinode.launch.local import project_directory
from torch_multinode.launch.nodes import legacy_flag, nproc_for, rank_order_warning
from torch_multinode.launch.recorder import Recorder
from torch_multinode.launch.spec import JobSpec, job_module

if TYPE_CHECKING:
    from torch_multinode.provision.dependencies import Dependencies


_print_lock = threading.Lock()  # the node runners' lines, one at a time


def _emit(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def _spec(args: argparse.Namespace) -> JobSpec:
    """The job, checked as far as this machine can (the script compiles, our workload accepts
    its arguments)."""
    extra = list(args.args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.script is not None:
        checks.script_file(args.script)  # a directory is said to be one
        checks.script_compiles(args.script)
    if args.script is None and not all(part.isidentifier() for part in args.module.split(".")):
        raise UserError(
            f"--module {shown(args.module)} is not a Python module name",
            hint="a dotted name like training.ddp",
        )
    flag = None
    if args.script is not None and args.local_rank_arg != "none":
        flag = legacy_flag(args.script) if args.local_rank_arg == "auto" else args.local_rank_arg
    if args.script is None:
        checks.workload_arguments(args.module, extra, workdir=args.workdir)
    run_id = getattr(args, "run_id", None) or JobSpec().run_id  # new; a rerun's from launch.runs
    return JobSpec(
        run_id=run_id,
        gpus=parse_gpu_list(args.gpus),
        debug=args.debug,
        local_rank_flag=flag,
        log_dir=args.log_dir or Path(".runs") / run_id,
        script=args.script,
        module=args.module,
        args=tuple(extra),
        nproc_per_node=args.nproc_per_node,
        network_timeout=args.network_timeout,
        stall=args.stall,
        on_hang=args.on_hang,
        allow_drift=args.allow_drift,
        rendezvous_timeout=args.rendezvous_timeout,
        max_restarts=args.max_restarts,
        workdir=args.workdir,
        workdir_limit=int(args.workdir_limit * 1e6),
        secret_env=parse_env(args.env, os.environ),
        env_file=Path(args.env_file) if args.env_file else None,
    )


def _here(args: argparse.Namespace, spec: JobSpec) -> None:
    """A job without an inventory: refused if it asks for what only nodes have (ENV= is not:
    its variables reach every local rank, launch.environment.local_environment)."""
    ft.check(args.ft, spec, None, args.restarts, args.min_nodes)
    restarts.check_local(args.restarts, args.min_nodes)
    if args.nnodes not in (None, ""):
        # a number first (as with an inventory), then whether it needs one
        inventory_module.check_nnodes(args.nnodes, sys.maxsize, "")
    if args.nnodes not in (None, "", "1"):
        raise UserError(
            f"NNODES={args.nnodes} needs an inventory",
            hint="INVENTORY=path.yml, or 'make sim-up' for a simulated cluster",
        )
    if spec.script is None:
        checks.importable_here(job_module(spec), project_directory(spec), spec.module)


def _on_nodes(
    args: argparse.Namespace, spec: JobSpec
) -> tuple[inventory_module.Inventory, JobSpec, staging.Project, tuple[inventory_module.Host, ...]]:
    """The job's nodes (narrowed once), project and paths on the nodes, and the spares (with
    --restarts), decided and said before any node is touched."""
    whole = inventory_read.load(args.inventory, args.group)
    inventory = whole.first(args.nnodes)
    restarts.check_min_nodes(args.min_nodes, args.restarts, inventory, args.ft)
    spec = ft.check(
        args.ft, spec, inventory.scheduler, args.restarts, args.min_nodes, args.restart_wait
    )
    # The inventory's hosts the job does not use: a lost node's place, on a restart
    spares = whole.hosts[len(inventory.hosts) :] if args.restarts else ()
    inventory, spares = _found_on_nodes(inventory, spares)
    master = inventory.master
    fitted = None  # the workload's batch against the world size: every node's processes
    if args.script is None:
        world = sum(nproc_for(host, spec) for host in inventory.hosts)
        fitted = checks.workload_arguments(spec.module, list(spec.args), world, spec.workdir)
    project = staging.plan(
        inventory, spec.script, spec.workdir, spec.workdir_limit, args.requirements
    )
    resolved, notes = staging.resolve_paths(spec.args, inventory, project, run_dir(spec))
    spec = replace(spec, args=resolved)
    _emit(
        f"[launcher] job {spec.run_id}: {len(inventory.hosts)} node(s), master {master.name} "
        f"{master.compute_ip}:{inventory.rendezvous_port}, "
        + ("script " + str(spec.script) if spec.script else f"module {spec.module}")
        + (f", {fitted}" if fitted else "")
    )
    said: list[str | None] = [rank_order_warning(inventory.hosts)]  # None: the order is fine
    if spec.fault_tolerant:
        said.append(ft.describe(len(inventory.hosts), spec.min_groups))
    if flag := spec.local_rank_flag:
        assert spec.script is not None  # the flag is read from the script (nodes.legacy_flag)
        said.append(f"{spec.script.name} parses {flag}: passing it the local rank")
    for note in filter(None, [*said, *notes]):
        _emit(f"[launcher] {note}")
    if spec.secret_env:
        _emit(
            f"[launcher] environment for every rank: {staging.environment_names(spec.secret_env)}"
            " (values not shown)"
        )
    if spec.debug:
        _emit(f"[launcher] debug logging on every node; each node's log: {spec.log_dir}/NODE.log")
    return inventory, spec, project, spares


def _found_on_nodes(
    inventory: inventory_module.Inventory, spares: tuple[inventory_module.Host, ...]
) -> tuple[inventory_module.Inventory, tuple[inventory_module.Host, ...]]:
    """The job's nodes and spares with their auto values (compute_interface, gpus) found on
    them (cluster.autodetect), once, before the job's processes are counted or its
    environment written; said. Nothing asked where the inventory has none."""
    if not any(autodetect.wanted(host) for host in (*inventory.hosts, *spares)):
        return inventory, spares
    nodes = SshNodes(inventory)
    try:
        resolved = autodetect.resolve(inventory, nodes, spares)
    finally:
        nodes.close()
    for line in resolved.lines():
        _emit(f"[launcher] {line}")
    return resolved.inventory, resolved.spares


def _dependencies(
    args: argparse.Namespace,
    inventory: inventory_module.Inventory | None,
    wanted: requirements.Requirements | None,
    spares: tuple[inventory_module.Host, ...] = (),
) -> tuple[Dependencies | None, Callable[[], None] | None]:
    """The project's dependencies made ready for the job (provision.dependencies: the layer
    built for jobs in containers, the directory for a local job), or None: none, or host mode,
    where each node's training_python must hold them (said, and checked on every node as it is
    prepared). A rerun takes the recorded run's requirements, and its layer. With it, what
    makes the layer ready on the nodes, which the job calls before it checks their images."""
    recorded = (args.rerun_of[0] if args.rerun_of else {}).get("dependencies")
    if recorded:
        wanted = requirements.Requirements(recorded["source"], tuple(recorded["requirements"]))
    if wanted is None:
        return None, None
    if inventory is not None and inventory.launch_mode != "container":
        _emit(f"[launcher] {requirements.host_mode_note(wanted)}")
        return None, None
    from torch_multinode.provision import dependencies  # only for a project with requirements

    def say(line: str) -> None:
        _emit(f"[launcher] {line}")

    if inventory is None:
        return dependencies.for_this_machine(wanted.lines, wanted.source, say, recorded), None
    return dependencies.begin_for_inventory(
        inventory, wanted.lines, wanted.source, say, recorded, spares
    )


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    inventory = project = None
    spares: tuple[inventory_module.Host, ...] = ()
    if not args.inventory:
        _here(args, spec)
        resolved, notes = staging.resolve_local_paths(spec.args)  # the nodes' rule, here
        spec = replace(spec, args=resolved)
        for note in notes:
            _emit(f"[launcher] {note}")
        root = staging.project_root(spec.script, spec.workdir)
        made, _ = _dependencies(args, None, requirements.requirements(root, args.requirements))
        if made is not None and made.directory is not None:
            spec = replace(spec, dependencies=str(made.directory))
    else:
        inventory, spec, project, spares = _on_nodes(args, spec)
        made, ready = _dependencies(args, inventory, project.requirements, spares)
        if made is not None and made.image is not None:
            project = replace(project, image=made.image, image_ready=ready)
    recorder = Recorder(
        spec,
        args.argv,
        inventory,
        args.rerun_of,
        emit=_emit,
        image=project.image if project is not None else None,
        dependencies=made.record() if made is not None else None,
    )
    backend = backend_for(
        inventory,
        spec,
        _emit,
        project,
        args.restart_wait,
        recorder.started,
        spares=spares,
        min_nodes=args.min_nodes,
    )
    # FT=1: a lost group starts again within the job (launch.replicated), the job never does
    whole_job_restarts = 0 if spec.fault_tolerant else args.restarts
    if spec.group_restarts:
        _emit(f"[launcher] {ft.restart_note(spec, spares)}")
    elif whole_job_restarts:
        _emit(
            f"[launcher] up to {args.restarts} restart(s) after a failure: {backend.restart_note}"
        )
    result = recorder.kept(
        lambda: restarts.run_with_restarts(backend, spec, whole_job_restarts, _emit)
    )
    for line in backend.summary(result) + backend.closing(result):
        _emit(line)
    return result.exit_code


def main(
    argv: list[str] | None = None,
    rerun_of: tuple[dict, Path] | None = None,
    run_id: str | None = None,
) -> int:
    code = 1  # an uncaught exception (a bug): Python's own exit code
    try:
        args = options.parser().parse_args(argv)
        args.argv = sys.argv[1:] if argv is None else list(argv)  # as typed, for its record
        args.rerun_of = rerun_of  # launch.runs: the record and directory of the run run again
        args.run_id = run_id  # launch.runs: the rerun's ID, which its outputs' names carry
        stop_on_sigterm()  # a killed launcher stops the job on every node, as Ctrl-C does
        code = at_the_edge(run, args)
    except SystemExit as exiting:  # argparse: --help (0) or bad usage (2)
        code = exiting.code if isinstance(exiting.code, int) else int(exiting.code is not None)
        raise
    finally:
        record_exit_code(code)  # for a script around make, which exits 2 on any failure
    return code


if __name__ == "__main__":
    sys.exit(main())
