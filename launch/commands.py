"""The shell commands sent to the nodes, as pure functions of the job and the node: the
torchrun, the container around it (its `docker run` written by cluster.containers), the port
lock, the link probe and the stop."""

from __future__ import annotations

import shlex
from dataclasses import replace

from torch_multinode.cluster.containers import job_container_command
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import staging
from torch_multinode.launch.environment import node_environment
from torch_multinode.launch.nodes import entry_point, nproc_for
from torch_multinode.launch.spec import (
    CONTAINER_PYTHON,
    LINK_PROBE_WAIT,
    LOCK_BUSY_EXIT,
    REMOTE_LOCK_ROOT,
    RUN_LABEL,
    STALE_LOCK_SECONDS,
    STOP_GRACE,
    JobSpec,
)
from torch_multinode.launch.staging import REMOTE_RUN_ROOT, Project


def torchrun_command(
    host: Host, master: Host, nnodes: int, spec: JobSpec, port: int, entry: list[str]
) -> list[str]:
    return [
        host.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_for(host, spec)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={master.compute_ip}:{port}",
        f"--rdzv-id={spec.run_id}",
        f"--rdzv-conf=join_timeout={spec.rendezvous_timeout},"
        f"is_host={'true' if host.name == master.name else 'false'}",
        # Bind the agent to the compute IP: a hostname may resolve to 127.0.1.1 on the node.
        f"--local-addr={host.compute_ip}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=1",
        *entry,
        *spec.args,
    ]


def run_dir(spec: JobSpec) -> str:
    """The job's run directory on every node: the workloads' outputs (TensorBoard events,
    traces, a relative --out); the master's comes back to the controller."""
    return f"{REMOTE_RUN_ROOT}/{spec.run_id}"


def remote_command(
    host: Host,
    master: Host,
    nnodes: int,
    spec: JobSpec,
    port: int,
    env: dict[str, str],
    mode: str = "host",
    image: str | None = None,
    memlock: str = "unlimited",
    project: Project | None = None,
    mounts: tuple[tuple[str, bool], ...] = (),
) -> str:
    """The one shell command that runs a node's part of the job, in launch mode `mode`: in the
    project's directory with the project on the import path (without a project: in the run
    directory, as torchrun by hand would), secrets read from their file (and the file deleted)
    before anything else starts. A container sees `mounts` (path, read-only) at the same paths
    (cluster.containers.job_container_command)."""
    directory = run_dir(spec)
    workdir = project.workdir if project is not None else directory
    entry = entry_point(spec, project if project is not None else directory)
    variables = (
        node_environment(host, spec, env, directory, project.import_path(spec))
        if project is not None
        else node_environment(host, spec, env)
    )

    # ENV= is sourced after the launcher's variables are set, in both modes, so ENV= wins for a
    # name both set (launch.environment); the secrets file is read and deleted first thing.
    def with_secrets(command: list[str]) -> list[str]:
        if not spec.secret_env:
            return command
        return [
            "sh",
            "-c",
            staging.load_secrets(spec.run_id) + ' && exec "$@"',
            "tmn-job",
            *command,
        ]

    if mode == "container":
        inside = replace(host, python=CONTAINER_PYTHON)
        torchrun = with_secrets(torchrun_command(inside, master, nnodes, spec, port, entry))
        mounted = [(directory, False), *mounts]
        if spec.secret_env:
            mounted.append((staging.secrets_dir(spec.run_id), False))
        container = job_container_command(
            host,
            spec.run_id,
            f"{RUN_LABEL}={spec.run_id}",
            image or "",
            variables,
            workdir,
            torchrun,
            memlock,
            mounted,
        )
        return f"mkdir -p {shlex.quote(directory)} && {container}"
    command = with_secrets(torchrun_command(host, master, nnodes, spec, port, entry))
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
    return (
        f"mkdir -p {shlex.quote(directory)} && cd {shlex.quote(workdir)} && "
        f"exec env {assignments} {shlex.join(command)}"
    )


def lock_command(run_id: str, port: int) -> str:
    """Claim the master's rendezvous port for this job: one job per port, so a second launch
    is refused instead of joining or disturbing the first. A lock whose job has no process
    left (its launcher was killed) is taken over once it is STALE_LOCK_SECONDS old."""
    lock = shlex.quote(f"{REMOTE_LOCK_ROOT}/port-{port}")
    run = shlex.quote(run_id)
    return (
        f"mkdir -p {REMOTE_LOCK_ROOT}; "
        f"if mkdir {lock} 2>/dev/null; then echo {run} > {lock}/run_id; echo taken; exit 0; fi; "
        f"old=$(cat {lock}/run_id 2>/dev/null); "
        # -q: a match is exit 0 even where a process ended during the scan; with -l grep exits 2
        # then (CI run 44: a running job's lock taken over as stale).
        'if [ -n "$old" ] && grep -qsaF "TMN_RUN_ID=$old" /proc/[0-9]*/environ; '
        f'then echo "busy $old"; exit {LOCK_BUSY_EXIT}; fi; '
        f"age=$(( $(date +%s) - $(stat -c %Y {lock}) )); "
        f'if [ "$age" -lt {STALE_LOCK_SECONDS} ]; then echo "busy $old"; exit {LOCK_BUSY_EXIT}; fi; '
        f"rm -rf {lock} && mkdir {lock} && echo {run} > {lock}/run_id "
        f'&& echo "stale $old" && exit 0; echo "busy $old"; exit {LOCK_BUSY_EXIT}'
    )


def link_probe_command(address: str, wait: int = LINK_PROBE_WAIT) -> str:
    """One ping of `address`: prints `up`, `down` and why, or `unknown` (no ping on the node).
    A ping, not a connection to the rendezvous port: connecting to the c10d store every 2 s
    made a rank abort at exit in 3 of 10 runs of the tutorial script (none without)."""
    return (
        f"out=$(ping -c 1 -n -W {int(wait)} {shlex.quote(address)} 2>&1); rc=$?; "
        'case "$rc" in 0) echo up;; 1) echo "down no answer";; 126|127) echo unknown;; '
        '*) echo "down $(printf %s "$out" | tail -n 1 | sed "s/.*: //")";; esac'
    )


def unlock_command(run_id: str, port: int) -> str:
    lock = shlex.quote(f"{REMOTE_LOCK_ROOT}/port-{port}")
    return f'[ "$(cat {lock}/run_id 2>/dev/null)" = {shlex.quote(run_id)} ] && rm -rf {lock}; true'


def stop_command(run_id: str, then: str = "") -> str:
    """Stop the run on this node: its container, if it runs in one, and every process carrying
    the run's marker (TERM, a grace period, then KILL); `then` runs afterwards in the same session
    (the master frees the rendezvous port there).

    `docker rm -f` kills a container at once but returns only once Docker has cleaned up after
    it, and unmounting syncs the disk: 15 s and more on a busy one. So it runs in the background,
    and the stop waits (for at most the grace period) only for the container's processes to be
    gone; Docker then removes the container when its cleanup is done."""
    marker = shlex.quote(f"TMN_RUN_ID={run_id}")
    label = shlex.quote(f"label={RUN_LABEL}={run_id}")
    return (
        "inits=; if command -v docker >/dev/null 2>&1; then "
        f"ids=$(docker ps -q --filter {label}); "
        'if [ -n "$ids" ]; then '
        "inits=$(docker inspect -f '{{.State.Pid}}' $ids 2>/dev/null); "
        "nohup docker rm -f $ids >/dev/null 2>&1 & "
        "fi; fi; "
        "found() { grep -lsaF " + marker + " /proc/[0-9]*/environ 2>/dev/null "
        "| cut -d/ -f3 | grep -vx $$; }; "
        # a container's init is watched by its PID: a user in the docker group cannot read the
        # environment of processes that run as root in a container
        'alive() { for p in $inits; do [ -d "/proc/$p" ] && return 0; done; [ -n "$(found)" ]; }; '
        'pids=$(found); [ -n "$pids" ] && kill -TERM $pids 2>/dev/null; '
        f"for _ in $(seq {int(STOP_GRACE * 10)}); do alive || break; sleep 0.1; done; "
        'pids=$(found); [ -n "$pids" ] && { kill -KILL $pids 2>/dev/null; sleep 0.2; }; '
        # secrets a job that never started left unread
        f"rm -rf {shlex.quote(staging.secrets_dir(run_id))}; "
        f"{then + '; ' if then else ''}exit 0"
    )
