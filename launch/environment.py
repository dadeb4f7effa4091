"""The job's environment variables: every one the launcher sets for a job's processes, on every
backend (SSH, Slurm, local; on the host or in the training container), and which source wins
when two set the same name. The names shared with the workloads are cluster/jobenv.py's; the
format of netcheck's findings file is netcheck/envfile.py's; how the secrets file travels is
launch/staging.py's; how the variables reach the command line (`env NAME=...`, `docker run -e`)
is launch/commands.py's.

On a node (SSH and Slurm alike: the sbatch script runs each node's SSH command), lowest first:

=========================  ====================================  ============================
variable                   set by                                notes
=========================  ====================================  ============================
(the node's own)           the SSH login / the image             below everything
TMN_RUN_ID                 job_environment                       reserved
PYTHONUNBUFFERED=1         job_environment                       reserved
TORCH_FR_BUFFER_SIZE=256   job_environment (Flight Recorder)     ENV= may change it; 0: off
TMN_NODE_NAME              job_environment                       reserved
TMN_RUN_DIR                job_environment (with a project)      reserved
TMN_PLANNED_WORLD_SIZE     job_environment (a restart on fewer   reserved; the workloads
                           nodes: MIN_NODES)                     keep its global batch
TORCH_NCCL_DUMP_ON_TIMEOUT job_environment (with a project):     NCCL's trace of a timed-out
TORCH_FR_DUMP_TEMP_FILE    1, and the run directory's            collective, for the failed
                           jobenv.FLIGHT_TIMEOUT_DUMP            job's summary
PYTHONPATH                 job_environment (with a project)      reserved; last on it, our
                                                                 sitecustomize (staging.SITE_PATH)
CUDA_DEVICE_ORDER          job_environment (node with GPUs)      PCI_BUS_ID
TORCH_NCCL_ENABLE_TIMING   job_environment (node with GPUs)      1: the straggler watch's
                                                                 timing of each collective
CUDA_VISIBLE_DEVICES       job_environment (the host's           Slurm's own is unset by the
                           selection, else GPUS=)                batch script
NCCL_DEBUG, ...            debug_environment (DEBUG=)            over the job variables
GLOO_SOCKET_IFNAME,        interface_env: netcheck's file,       over the job and debug
NCCL_SOCKET_IFNAME,        else the inventory's                  variables (node_environment)
NCCL_IB_DISABLE, ...       compute_interface; NCCL_IB_HCA: the
                           inventory's nccl_ib_hca
TMN_BACKEND                node_settings (the job's backend)     over the interface settings
TORCHFT_LIGHTHOUSE,        FT=1 (launch.replicated): the         TMN_REPLICA_* reserved;
TMN_REPLICA_GROUP, ...     node's replica group                  TORCHFT_LIGHTHOUSE is not
spec.extra_env             JobSpec                               over all of the above
ENV= (secret_env)          the secrets file (staging)            over all; never reserved
=========================  ====================================  ============================

ENV= against the rest: ENV= wins, in both launch modes and under Slurm. The launcher's
variables are set first (`exec env NAME=...` on the host, `docker run -e` for the container)
and the secrets file is sourced after them, just before torchrun starts, so a non-reserved name
the user gives explicitly (CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME, ...) overrides what the
launcher derived. Reserved names (RESERVED_PREFIXES, RESERVED_NAMES) are refused in ENV=
before anything starts (parse_env).

On this machine (a job without an inventory: local_environment), lowest first: this
process's own environment; OMP_NUM_THREADS=1 only where that does not set it; then
job_environment (TMN_RUN_DIR, PYTHONPATH, TMN_BACKEND always, debug variables last); then ENV=
over all, as on a node (the same names refused: parse_env). No interface settings. Its values
reach torchrun's environment alone, never its command line; the record keeps only the names.
PYTHONPATH there is the project, then the project's dependencies where it has requirements
(JobSpec.dependencies: the directory provision.dependencies installed them into, never .venv
itself), both before this environment's own packages: on a node the project comes first too,
and the dependency layer's packages sit in the image's own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.jobenv import (
    BACKEND_VARIABLE,
    FLIGHT_BUFFER_DEFAULT,
    FLIGHT_BUFFER_VARIABLE,
    FLIGHT_TIMEOUT_DUMP,
    NODE_NAME_VARIABLE,
    PLANNED_WORLD_VARIABLE,
    RUN_DIR_VARIABLE,
)
from torch_multinode.launch.nodes import visible_gpus
from torch_multinode.launch.spec import DEBUG_ENV, DEBUG_LEVELS, JobSpec

# The launcher's own variables: a job's --env may not change them.
RESERVED_PREFIXES = ("TMN_",)
RESERVED_NAMES = ("PYTHONPATH", "PYTHONUNBUFFERED")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def debug_environment(level: str | None) -> dict[str, str]:
    if level is None:
        return {}
    if level not in DEBUG_LEVELS:
        raise UserError(f"DEBUG={level!r} is not one of 1, detail", hint="DEBUG=1")
    return {**DEBUG_ENV, "TORCH_DISTRIBUTED_DEBUG": level.upper()}


def job_environment(
    host: Host,
    spec: JobSpec,
    run_dir: str | None = None,
    python_path: str | None = None,
    backend: str | None = None,
) -> dict[str, str]:
    """What the job's processes get on top of the interface settings, on a node and on this
    machine alike: its run directory (TMN_RUN_DIR), the project on the import path, the job's
    process group backend (TMN_BACKEND) where the caller decided them."""
    variables = {"TMN_RUN_ID": spec.run_id, "PYTHONUNBUFFERED": "1", NODE_NAME_VARIABLE: host.name}
    variables[FLIGHT_BUFFER_VARIABLE] = FLIGHT_BUFFER_DEFAULT  # the hang report's trace
    if run_dir is not None:
        variables[RUN_DIR_VARIABLE] = run_dir
        # NCCL's watchdog writes the trace itself when a collective times out (launch.flight
        # reads it for the summary); gloo's ranks write theirs (training.distributed.flight).
        variables["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        variables["TORCH_FR_DUMP_TEMP_FILE"] = f"{run_dir}/{FLIGHT_TIMEOUT_DUMP}"
    if python_path is not None:
        variables["PYTHONPATH"] = python_path
    if backend is not None:
        variables[BACKEND_VARIABLE] = backend
    if host.gpu_count > 0:
        # GPU indices as nvidia-smi numbers them (CUDA's default puts the fastest first), so
        # GPUS=0,2 names the cards the user saw in nvidia-smi.
        variables["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # Each NCCL collective timed on the GPU, for the straggler watch (training.distributed.
        # waits reads the durations from the Flight Recorder).
        variables["TORCH_NCCL_ENABLE_TIMING"] = "1"
    selected = visible_gpus(host, spec)
    if selected is not None:
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, selected))
    if spec.planned_world is not None:
        variables[PLANNED_WORLD_VARIABLE] = str(spec.planned_world)
    variables.update(debug_environment(spec.debug))
    return variables


def interface_env(inventory: Inventory, env_file: Path | None = None) -> dict[str, dict[str, str]]:
    """Per node of the (narrowed) inventory, the socket interface settings: netcheck's findings
    if it wrote them (`env_file`, or where netcheck writes by default), else the inventory's
    compute_interface. Exact-match form for NCCL so 'eth1' never also means 'eth10'. The HCAs
    the inventory names for training (nccl_ib_hca) as NCCL_IB_HCA, where NCCL may use RDMA."""
    from torch_multinode.netcheck import envfile

    found: dict[str, dict[str, str]] = {}
    path = env_file or envfile.default_path(inventory.path)
    if env_file is not None and not env_file.is_file():
        raise UserError(
            f"--env-file {env_file} does not exist",
            hint=f"make netcheck INVENTORY={inventory.path}, which writes it, or no --env-file",
        )
    if path.exists():
        found = envfile.load(path)
    settings = {}
    for host in inventory.hosts:
        own = found.get(host.name)
        if not own:
            assert host.compute_interface is not None  # found on the node before a job (autodetect)
            own = {
                "GLOO_SOCKET_IFNAME": host.compute_interface,
                "NCCL_SOCKET_IFNAME": f"={host.compute_interface}",
            }
        settings[host.name] = own
        if host.nccl_ib_hca and settings[host.name].get("NCCL_IB_DISABLE") != "1":
            # The inventory's HCAs for training, as it says now (netcheck's file may be older).
            settings[host.name] = {**settings[host.name], "NCCL_IB_HCA": host.nccl_ib_hca}
    return settings


def node_settings(
    inventory: Inventory, env_file: Path | None, backend: str
) -> tuple[dict[str, dict[str, str]], str | None]:
    """Per node, what the controller decided for the whole job: the interface settings, with
    one NCCL network for all the job's nodes (netcheck.envfile.one_network), then the job's
    backend (TMN_BACKEND) over them; and a note to print when the network had to be made one."""
    from torch_multinode.netcheck import envfile

    found, without = envfile.one_network(interface_env(inventory, env_file))
    note = envfile.one_network_note(found, without) if without and backend == "nccl" else None
    return {name: {**env, BACKEND_VARIABLE: backend} for name, env in found.items()}, note


def node_environment(
    host: Host,
    spec: JobSpec,
    settings: dict[str, str],
    run_dir: str | None = None,
    python_path: str | None = None,
) -> dict[str, str]:
    """Every variable the launcher puts on a node's torchrun (the secrets aside): the job's own
    (job_environment, debug variables included), then the node's `settings` (node_settings)
    over them, then spec.extra_env over all."""
    return {
        **job_environment(host, spec, run_dir, python_path),
        **settings,
        **dict(spec.extra_env),
    }


def local_environment(
    here: Host,
    spec: JobSpec,
    run_dir: str,
    python_path: str,
    backend: str,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The whole environment of a job on this machine: this process's own, OMP_NUM_THREADS=1
    where that does not set it, then the job's variables over both, then ENV= (spec.secret_env,
    checked by parse_env) over all, as on a node."""
    env = {**environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's choice too, without its 4-line warning
    job = job_environment(here, spec, run_dir, python_path, backend)
    if spec.gpus is None and "CUDA_VISIBLE_DEVICES" in environ:
        # The shell's own pick of GPUs stands, counted in the order it was made in.
        job.pop("CUDA_DEVICE_ORDER", None)
    env.update(job)
    env.update(spec.secret_env)
    return env


def reserved(name: str) -> bool:
    """Whether `name` is the launcher's own, which a job's ENV= may not set."""
    return name.startswith(RESERVED_PREFIXES) or name in RESERVED_NAMES


def parse_env(items: list[str], environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """--env NAME=VALUE or NAME (this machine's value), each item possibly several separated by
    spaces (make's ENV="A B=c"). Checked here, so a node never sees a half-made file."""
    found: dict[str, str] = {}
    for item in items:
        for word in item.split():
            name, equals, value = word.partition("=")
            if not _NAME.fullmatch(name):
                raise UserError(
                    f"ENV: {shown(name)} is not a variable name", hint="ENV='NAME=value OTHER'"
                )
            if reserved(name):
                raise UserError(f"ENV: {name} is set by the launcher itself")
            if not equals:
                if name not in environ:
                    raise UserError(
                        f"ENV: {name} is not set on this machine, so there is no value to pass",
                        hint=f"exporting {name} first, or ENV='{name}=value'",
                    )
                value = environ[name]
            if "\n" in value or "\0" in value:
                raise UserError(f"ENV: the value of {name} holds a newline or NUL")
            found[name] = value
    return tuple(found.items())
