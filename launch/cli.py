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

from torch_multinode.cluster import autodetect, inventory_read, sync
from torch_multinode.cluster import inventory as inventory_module
from torch_multinode.cluster.errors import (
    ArgumentParser,
    UserError,
    at_the_edge,
    positive_number,
    shown,
    stop_on_sigterm,
    whole_number,
)
from torch_multinode.cluster.execution import SshNodes
from torch_multinode.cluster.inventory import NODES_GROUP
from torch_multinode.cluster.inventory_checks import GROUP_HELP, parse_gpu_list
from torch_multinode.launch import checks, requirements, restarts, staging
from torch_multinode.launch.backends import backend_for
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.ending import record_exit_code
from torch_multinode.launch.environment import parse_env
from torch_multinode.launch.local import project_directory
from torch_multinode.launch.nodes import legacy_flag, nproc_for, rank_order_warning
from torch_multinode.launch.recorder import Recorder
from torch_multinode.launch.spec import (
    DEBUG_LEVELS,
    DEFAULT_MODULE,
    DEFAULT_NETWORK_TIMEOUT,
    ON_HANG,
    JobSpec,
    job_module,
)

if TYPE_CHECKING:
    from torch_multinode.provision.dependencies import Dependencies


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="train",
        description="Launch a torchrun job on every node of the inventory over SSH, streaming "
        "each node's output; if any node fails or Ctrl-C is pressed, the job is stopped on every "
        "node. Without an inventory the job runs on this machine (torchrun --standalone).",
        epilog="Arguments after '--' go to the script or module. Exit: 0 success, 1 the job "
        "failed (the summary names the node), 2 bad input, 130 interrupted (Ctrl-C), 143 "
        "terminated (SIGTERM: stopped on every node, as for Ctrl-C).",
    )
    parser.add_argument(
        "-i",
        "--inventory",
        help="the Ansible inventory, YAML or INI, or a directory (default: run locally)",
    )
    parser.add_argument("-n", "--nnodes", default=None, help="use the first N hosts (default: all)")
    parser.add_argument("--group", default=NODES_GROUP, help=GROUP_HELP)
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--script",
        type=Path,
        help="your torchrun-compatible script; its project (the git work tree it is in, else its "
        "directory, or --workdir) is mirrored to every node and the job runs in it",
    )
    what.add_argument(
        "--module",
        default=DEFAULT_MODULE,
        help="a module importable on the nodes (default: %(default)s)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="the project directory that travels to every node (default: see --script; for a "
        "--module, this project's own packages); what git ignores, .git, virtual environments "
        "and caches stay behind",
    )
    parser.add_argument(
        "--requirements",
        default=None,
        metavar="PATH",
        help="the project's Python dependencies: a requirements file, or a pyproject.toml's "
        "[project] dependencies (default: requirements.txt at the project's root, else its "
        "pyproject.toml); 'none': none. In containers they become a layer on the training "
        "image, built once and shipped by layers; for a local job, a directory beside this "
        "environment; torch, torchvision and the CUDA libraries stay the environment's",
    )
    parser.add_argument(
        "--env-file",
        default=None,
        metavar="PATH",
        help="netcheck's interface settings for each node, as netcheck --env-file wrote them "
        "(default: netcheck-env.json next to the inventory, where netcheck writes it; without "
        "one, each node's compute_interface)",
    )
    parser.add_argument(
        "--workdir-limit",
        type=positive_number("number of MB"),
        default=sync.DEFAULT_WORKDIR_LIMIT / 1e6,
        help="MB a workdir may hold; datasets go through 'make data' (default: %(default)g)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="an environment variable for every rank (repeatable; several per flag, space "
        "separated); a bare NAME passes this machine's value. Values never appear in output, "
        "logs, docker inspect or any command line",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=whole_number(1),
        default=None,
        help="processes per node (default: the node's GPU count, or 1 on a CPU node; 2 locally)",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=whole_number(1),
        default=60,
        help="seconds to wait for every node to join (default: %(default)s)",
    )
    parser.add_argument(
        "--network-timeout",
        type=positive_number("number of seconds"),
        default=DEFAULT_NETWORK_TIMEOUT,
        help="seconds a node may be unable to reach the master over the compute network before "
        "it is declared lost and the job stopped (default: %(default)g)",
    )
    parser.add_argument(
        "--stall",
        type=positive_number("number of seconds", zero=True),
        default=None,
        help="seconds without progress (step lines, '[tmn] heartbeat' lines, or any output for a "
        "script that prints neither), counted from its first, after which the job is a hang: "
        "every rank's stacks are read and the rank that holds the others up is named; 0: never "
        "(default: the larger of 120 s and 5 times the median time between step lines or "
        "heartbeats, once one was seen; none for a job that prints neither)",
    )
    parser.add_argument(
        "--on-hang",
        choices=ON_HANG,
        default="stop",
        help="after a hang's report: stop the job, or wait, leaving it running for a person to "
        "look (Ctrl-C stops it) (default: %(default)s)",
    )
    parser.add_argument(
        "--allow-drift",
        action="store_true",
        help="run even on nodes whose kernel, NVIDIA driver, Docker, training image or torch "
        "changed since netcheck locked them (versions.lock.json next to the inventory); the "
        "changes are said and kept in the run's record",
    )
    restarts.add_options(parser)
    parser.add_argument(
        "--max-restarts",
        type=whole_number(0),
        default=0,
        help="torchrun's own restarts of the worker processes while every node stays up "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        help="GPU indices every node uses, e.g. 0,2: one process per GPU, CUDA_VISIBLE_DEVICES "
        "set for the job (a host's cuda_visible_devices in the inventory wins for that host)",
    )
    parser.add_argument(
        "--debug",
        nargs="?",
        const="info",
        default=None,
        choices=DEBUG_LEVELS,
        help="NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=INFO and the C++ backend logs, on every "
        "node, for this run only; '--debug detail' for TORCH_DISTRIBUTED_DEBUG=DETAIL (it "
        "crashed DDP over gloo with torch 2.14.1)",
    )
    parser.add_argument(
        "--local-rank-arg",
        choices=("auto", "none", "--local_rank", "--local-rank"),
        default="auto",
        help="scripts written for torch.distributed.launch get their local rank as this flag; "
        "auto: if the script declares one (default)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where each node's output is saved as NODE.log (default: .runs/JOB-ID)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


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
    restarts.check_min_nodes(args.min_nodes, args.restarts, inventory)
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
    if args.restarts:
        _emit(
            f"[launcher] up to {args.restarts} restart(s) after a failure: {backend.restart_note}"
        )
    result = recorder.kept(lambda: restarts.run_with_restarts(backend, spec, args.restarts, _emit))
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
        args = _parser().parse_args(argv)
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
