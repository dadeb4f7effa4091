"""A job's preparations on the nodes, as plain functions of a node's SSH session: the master's
rendezvous port claimed before anything is sent (and released once the job is over), and each
node readied once the project is there (its GPUs, its copy of the project, the directories the
job writes to, its image, its secrets). The commands themselves are launch.commands'."""

from __future__ import annotations

import shlex
from collections.abc import Callable

from torch_multinode.cluster import sync
from torch_multinode.cluster import version_lock as lock
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Session
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch import image_check, requirements, staging
from torch_multinode.launch.commands import lock_command, run_dir, unlock_command
from torch_multinode.launch.nodes import gpu_problem
from torch_multinode.launch.spec import GPU_PROBE, LOCK_BUSY_EXIT, Emit, JobSpec
from torch_multinode.launch.staging import Project


def prepare_node(
    remote: Session,
    host: Host,
    inventory: Inventory,
    spec: JobSpec,
    project: Project,
    backend: str,
    image_id: str | None,
    locked: dict[str, str] | None = None,
    emit: Emit = print,
) -> tuple[dict[str, str], list[str]]:
    """After the project's trees were sent: check this node's versions against those netcheck
    locked (`locked`, None: no lock), its copy and image (the project's dependency layer where
    it has one; in host mode, that its training_python holds the project's requirements), make
    the directories the job writes to, hand over its secrets. The node's versions and what
    changed in them since the lock (allowed by `spec.allow_drift`, or refused), for the run's
    record."""
    versions = lock.parse(remote.run(lock.probe_command(host, inventory), timeout=60).stdout)
    changes = lock.drift(locked, versions) if locked else []
    if changes and not spec.allow_drift:
        raise lock.refusal(host, inventory, changes)
    if changes:
        emit(
            f"[launcher] {host.name} changed since netcheck passed: {'; '.join(changes)} "
            "(ALLOW_DRIFT=1: running anyway)"
        )
    if backend == "nccl":
        answer = remote.run(GPU_PROBE, timeout=30)
        problem = gpu_problem(host, spec, answer.stdout + answer.stderr, answer.ok)
        if problem is not None:
            message, _, hint = problem.rpartition(" (try ")
            raise UserError(message, hint=hint.removesuffix(")"), exit_code=1)
    for tree, destination in project.trees:
        sync.verify(remote, tree, destination)
    directories = [run_dir(spec), inventory.checkpoint_root, inventory.data_root]
    made = remote.run(f"mkdir -p {shlex.join(directories)}", timeout=15)
    if not made.ok:
        said = (made.stderr or made.stdout).strip().splitlines()[-1:] or ["no reason given"]
        raise UserError(
            f"on {host.name}: cannot make {', '.join(directories[1:])}: {said[0]}",
            hint=f"make provision INVENTORY={inventory.path} (it makes them for "
            f"{host.ssh_user or 'the SSH user'})",
            exit_code=1,
        )
    if image_id is not None:
        image = staging.job_image(inventory, project)
        answer = remote.run(image_check.image_check_command(image), timeout=60)
        problem = image_check.image_mismatch(host, inventory, image_id, answer.stdout, image)
        if problem is not None:
            message, _, hint = problem.rpartition(" (try ")
            raise UserError(message, hint=hint.removesuffix(")"), exit_code=1)
    wanted = project.requirements
    if inventory.launch_mode == "host" and wanted is not None:
        answer = remote.run(
            requirements.requirements_check_command(host.python, wanted), timeout=60
        )
        problem = requirements.requirements_missing(host, wanted, answer.stdout + answer.stderr)
        if problem is not None:
            message, _, hint = problem.rpartition(" (try ")
            raise UserError(message, hint=hint.removesuffix(")"), exit_code=1)
    if spec.secret_env:
        remote.run(
            staging.write_secrets_command(spec.run_id),
            timeout=15,
            check=True,
            stdin=staging.secrets_text(spec.secret_env),
        )
    return versions, changes


def prepare_nodes(
    remotes: dict[str, Session],
    inventory: Inventory,
    spec: JobSpec,
    project: Project,
    backend: str,
    emit: Emit,
    parallel: Callable[[Callable[[Host], None]], None],
) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    """Every node of the job readied at once (`parallel`: the launcher's, which raises the
    first refusal once all have ended), the controller's image ID and the version lock read
    once for all: each node's versions, and what changed on those that drifted (allowed)."""
    image_id = None
    if project.image_ready is not None:  # the dependency layer, looked for on the nodes meanwhile
        project.image_ready()
    if inventory.launch_mode == "container":
        image_id = image_check.local_image_id(staging.job_image(inventory, project))
    locked = lock.load(lock.default_path(inventory.path)) or {}
    versions: dict[str, dict[str, str]] = {}
    drift: dict[str, list[str]] = {}

    def one(host: Host) -> None:
        versions[host.name], changes = prepare_node(
            remotes[host.name],
            host,
            inventory,
            spec,
            project,
            backend,
            image_id,
            locked.get(host.name),
            emit,
        )
        if changes:
            drift[host.name] = changes

    parallel(one)
    return versions, drift


def claim_port(remote: Session, master: Host, run_id: str, port: int, emit: Emit) -> None:
    """The master's rendezvous port for job `run_id`, over the master's session `remote`:
    refused while another job of ours holds it; a stale lock (none of its processes left) is
    taken over, and said."""
    result = remote.run(lock_command(run_id, port), timeout=15)
    words = result.stdout.split()
    if result.exit_code == LOCK_BUSY_EXIT:
        other = words[1] if len(words) > 1 else "another job"
        raise UserError(
            f"job {other} is already running on {master.name} (rendezvous port {port})",
            hint="waiting for it to end, or Ctrl-C where it was started",
            exit_code=1,
        )
    if not result.ok:
        raise UserError(
            f"host '{master.name}': could not claim rendezvous port {port}: "
            f"{(result.stderr or result.stdout).strip()}",
            exit_code=1,
        )
    if words[:1] == ["stale"]:
        emit(
            f"[launcher] took over the lock of job {words[1] if len(words) > 1 else '?'}"
            f" on {master.name}: none of its processes is left"
        )


def release_port(
    remote_for: Callable[[Host], Session], master: Host, run_id: str, port: int
) -> None:
    """The port freed, over a session of its own (`remote_for(master)`); a master that no
    longer answers is left alone: the next launch finds its lock stale."""
    try:
        with remote_for(master) as remote:
            remote.run(unlock_command(run_id, port), timeout=10)
    except UserError:
        pass  # the master is gone; the next launch finds the lock stale
