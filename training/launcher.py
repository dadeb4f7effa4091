"""Run a torchrun job on every node of the inventory, and never leave a mess behind.

One SSH session per node runs torchrun (c10d rendezvous on the master's compute IP). Every
process the job starts carries TMN_RUN_ID in its environment, so stopping a node means killing
exactly the processes with that marker, even ones torchrun started in new sessions. The job is
stopped everywhere as soon as one node fails, stops answering, or the user presses Ctrl-C.

A network partition leaves every node answering over SSH while the ranks wait on each other:
every other node pings the master's compute IP every few seconds, and a node that cannot reach
it for --network-timeout seconds is declared lost and the job stopped. When the job
fails for any reason while a node's compute link is down, that node is the one named.

With restarts allowed (`run_job`), a failed job is started again once every node answers over
SSH again; a workload that checkpoints resumes from the newest step every node holds.
"""

from __future__ import annotations

import collections
import re
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster import staging, sync
from cluster.containers import NCCL_CONF_GUARD, training_container_options
from cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, ClusterError, Terminated, printable
from cluster.inventory import Host, Inventory
from cluster.jobenv import BACKEND_VARIABLE, RUN_DIR_VARIABLE
from cluster.remote import Remote, on_all
from cluster.staging import REMOTE_RUN_ROOT, Project
from training.node_output import NodeOutput

DEFAULT_MODULE = "training.ddp"
RUN_LABEL = "torch-multinode.run"
CONTAINER_PYTHON = "python3"
REMOTE_LOCK_ROOT = "/tmp/torch-multinode/locks"
STALE_LOCK_SECONDS = 20  # a lock with no live process this old was left by a launcher that died
LOCK_BUSY_EXIT = 3
TAIL_LINES = 120
EXCERPT_LINES = 12
LIVENESS_INTERVAL = 2.0
LIVENESS_FAILURES = 2
DEFAULT_NETWORK_TIMEOUT = 300.0
LINK_PROBE_INTERVAL = 2.0
LINK_PROBE_WAIT = 3  # seconds a ping waits for its answer
DEFAULT_RESTART_WAIT = 300.0  # seconds a restart waits for every node to answer again
RESTART_POLL = 2.0
STOP_GRACE = 3.0
# How long one node's stop command may take before the stop there counts as unconfirmed.
STOP_TIMEOUT = STOP_GRACE + 8
# A node already lost must accept a TCP connection to its SSH port within this before the stop
# tries SSH on it: a dead node would otherwise hold the launcher for SSH's connect timeout.
LOST_NODE_PROBE = 1.0
RUNNER_GRACE = 5.0  # after the stop, how long the node runners may take to see their sessions end
# After Ctrl-C or SIGTERM, less: their last lines say nothing new, and a container's `docker run`
# holds its session until Docker has removed the container (15 s and more on a busy disk).
INTERRUPTED_RUNNER_GRACE = 1.0
# Workloads whose every process spans more than one GPU (the default is one GPU per process).
GPUS_PER_PROCESS = {"training.model_parallel": 2}
# A node's GPUs, as its driver lists them: no answer, no NCCL job there.
GPU_PROBE = "nvidia-smi --query-gpu=index --format=csv,noheader 2>&1"
BLAME_GRACE = 3.0  # after a first failure, how long the others may take to report their own
# What a rank says when a *peer* died: evidence against that peer, not against this node.
_COLLATERAL = re.compile(
    r"Connection closed by peer \[(?P<peer>[0-9.]+)\]|Connection reset by peer|Broken pipe"
    r"|Connection refused|got signal: 15|SignalException"
)

Emit = Callable[[str], None]


@dataclass(frozen=True)
class JobSpec:
    """What to run, and how. The command is the same on every node; only the host differs."""

    script: Path | None = None
    module: str = DEFAULT_MODULE
    args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    run_id: str = field(default_factory=lambda: f"tmn-{uuid.uuid4().hex[:10]}")
    rendezvous_timeout: int = 60
    max_restarts: int = 0
    extra_env: tuple[tuple[str, str], ...] = ()
    gpus: tuple[int, ...] | None = None
    """GPU indices each node uses (CUDA_VISIBLE_DEVICES); one process per selected GPU."""
    debug: str | None = None
    """None, 'info' or 'detail' (TORCH_DISTRIBUTED_DEBUG's level; see DEBUG_ENV)."""
    local_rank_flag: str | None = None
    """For scripts written for torch.distributed.launch: the flag they parse (--local_rank
    or --local-rank), passed to them by training.legacy. None: the script reads LOCAL_RANK."""
    log_dir: Path | None = None
    network_timeout: float = DEFAULT_NETWORK_TIMEOUT
    """Seconds a node may be unable to reach the master over the compute network."""
    workdir: Path | None = None
    """The project directory that travels (WORKDIR); None: see staging.project_root."""
    workdir_limit: int = sync.DEFAULT_WORKDIR_LIMIT
    secret_env: tuple[tuple[str, str], ...] = ()
    """--env variables: reach the job through a file read once, never a command line."""
    env_file: Path | None = None
    """netcheck's environment file (--env-file); None: where netcheck writes it by default."""


@dataclass
class NodeOutcome:
    host: str
    exit_code: int | None = None
    error: str | None = None
    link_down: str | None = None
    """While this node cannot reach the master over the compute network: since when, and why."""
    unreachable: bool = False  # stopped answering over SSH
    session_lost: bool = False  # its SSH session ended with no exit status, or broke
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None

    @property
    def lost(self) -> bool:
        """The node itself (or its sshd) is gone, not just its job."""
        return self.unreachable or self.session_lost


@dataclass
class JobResult:
    run_id: str
    outcomes: dict[str, NodeOutcome]
    failed_node: str | None
    interrupted: bool
    seconds: float
    restart: int = 0  # which restart this run was (0: the first run)
    restarts: int = 0  # how many were allowed
    terminated: bool = False  # interrupted by SIGTERM rather than Ctrl-C
    brought_back: str | None = None  # what became of the master's run directory

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return TERMINATED_EXIT if self.terminated else INTERRUPTED_EXIT
        return 0 if all(o.ok for o in self.outcomes.values()) else 1


# What DEBUG=1 turns on, for that run only: NCCL's own log (interface choice and transports
# included), c10d's debug checks and the C++ logs that show gloo's, DDP's and the store's work.
# TORCH_DISTRIBUTED_DEBUG=DETAIL only on request (DEBUG=detail): with torch 2.14.1 it made DDP
# over gloo die with SIGSEGV right after the Reducer started, on every rank (measured here).
DEBUG_ENV = {
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
    "TORCH_DISTRIBUTED_DEBUG": "INFO",
    "TORCH_CPP_LOG_LEVEL": "INFO",
}
DEBUG_LEVELS = ("info", "detail")


def debug_environment(level: str | None) -> dict[str, str]:
    if level is None:
        return {}
    if level not in DEBUG_LEVELS:
        raise ClusterError(f"DEBUG={level!r} is not one of 1, detail", hint="DEBUG=1")
    return {**DEBUG_ENV, "TORCH_DISTRIBUTED_DEBUG": level.upper()}


_LOCAL_RANK_FLAG = re.compile(r"""["'](--local[-_]rank)["']""")


def visible_gpus(host: Host, spec: JobSpec) -> tuple[int, ...] | None:
    """The GPUs this node's job may use: the host's own selection from the inventory, else the
    job's GPUS. Checked against what the node has, before anything starts."""
    selected = host.visible_gpus if host.visible_gpus is not None else spec.gpus
    if selected is None:
        return None
    shown = ",".join(map(str, selected))
    if host.gpus == 0:
        raise ClusterError(
            f"GPUS={shown} but node '{host.name}' has no GPU (inventory gpus: 0)",
            hint="leaving GPUS unset on CPU nodes; --nproc-per-node sets the process count",
        )
    missing = [index for index in selected if index >= host.gpus]
    if missing:
        raise ClusterError(
            f"GPUS={shown} asks for GPU {missing[0]}, but node '{host.name}' has {host.gpus} "
            f"GPU(s) (0-{host.gpus - 1})",
        )
    return selected


def gpus_per_process(spec: JobSpec) -> int:
    return GPUS_PER_PROCESS.get(spec.module, 1) if spec.script is None else 1


def nproc_for(host: Host, spec: JobSpec) -> int:
    """Processes on this node (see process_count)."""
    selected = visible_gpus(host, spec)
    gpus = len(selected) if selected is not None else host.gpus
    given = f"GPUS={','.join(map(str, selected))}" if selected else f"inventory gpus: {host.gpus}"
    return process_count(spec, gpus, f"node '{host.name}' has {gpus} for the job ({given})")


def process_count(spec: JobSpec, gpus: int, has: str, cpu_default: int = 1) -> int:
    """--nproc-per-node where given (checked against the `gpus` the job has there), else one
    process per GPU, or per pair for a workload that spans two (model parallel), or
    `cpu_default` without GPUs. Too few GPUs for even one process is refused: `has` says where
    and what."""
    per = gpus_per_process(spec)
    what = spec.module if spec.script is None else spec.script.name
    if spec.nproc_per_node is not None:
        if gpus and spec.nproc_per_node * per > gpus:
            raise ClusterError(
                f"--nproc-per-node={spec.nproc_per_node} of {what} needs "
                f"{spec.nproc_per_node * per} GPU(s), but {has}",
                hint=f"--nproc-per-node={max(1, gpus // per)}",
            )
        return spec.nproc_per_node
    if gpus == 0:
        return cpu_default
    if gpus < per:
        raise ClusterError(
            f"{what} spans {per} GPUs per process, but {has}",
            hint=f"machines with {per} GPUs, or GPUS= naming {per} of them; without GPUs "
            f"(gpus: 0) its stages run on the CPU",
        )
    return gpus // per


def job_backend(hosts: tuple[Host, ...]) -> tuple[str, str | None]:
    """One process group backend for the whole job, decided before launch: NCCL only when every
    node has GPUs, else gloo everywhere (with a note naming the nodes without). Ranks mixing
    the two would wait on each other until the timeout."""
    without = [h.name for h in hosts if h.gpus == 0]
    if not without:
        return "nccl", None
    if len(without) == len(hosts):
        return "gloo", None
    return "gloo", (
        f"note: {', '.join(without)} {'has' if len(without) == 1 else 'have'} no GPU (inventory "
        f"gpus: 0), so the whole job runs on the CPU with gloo: NCCL needs GPUs on every node"
    )


def gpu_problem(host: Host, spec: JobSpec, answer: str, ok: bool) -> str | None:
    """Why this node's GPUs cannot take an NCCL job (from GPU_PROBE's answer), or None."""
    selected = visible_gpus(host, spec)
    needed = (max(selected) + 1) if selected else host.gpus
    indices = [line.strip() for line in answer.splitlines() if line.strip().isdigit()]
    if ok and len(indices) >= needed:
        return None
    said = answer.strip().splitlines()[-1:] if answer.strip() else []
    reason = (
        f"nvidia-smi lists {len(indices)} GPU(s), the job needs {needed}"
        if ok
        else f"nvidia-smi failed: {printable(said[0]) if said else 'no output'}"
    )
    return (
        f"on {host.name}: its GPUs do not answer ({reason}); an NCCL job cannot start there "
        f"(try nvidia-smi on {host.name}: load or reinstall the NVIDIA driver (a reboot after a "
        f"kernel update), or set gpus: 0 for it in the inventory)"
    )


def legacy_flag(script: Path) -> str | None:
    """The --local_rank / --local-rank flag a torch.distributed.launch-era script parses, if
    any (the dashed spelling wins when both are declared, as the old launcher passed it)."""
    try:
        found = set(_LOCAL_RANK_FLAG.findall(script.read_text(errors="replace")))
    except OSError:
        return None
    if not found:
        return None
    return "--local-rank" if "--local-rank" in found else "--local_rank"


def job_environment(host: Host, spec: JobSpec) -> dict[str, str]:
    """What the job's processes get on top of the interface settings."""
    variables = {"TMN_RUN_ID": spec.run_id, "PYTHONUNBUFFERED": "1", "TMN_NODE_NAME": host.name}
    if host.gpus > 0:
        # GPU indices as nvidia-smi numbers them (CUDA's default puts the fastest first), so
        # GPUS=0,2 names the cards the user saw in nvidia-smi.
        variables["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    selected = visible_gpus(host, spec)
    if selected is not None:
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, selected))
    variables.update(debug_environment(spec.debug))
    return variables


def entry_point(spec: JobSpec, where: Project | str) -> list[str]:
    """What torchrun runs: the module, or the script where it is on the node (in its project,
    or, without one, in directory `where`)."""
    if spec.script is None:
        return ["-m", spec.module]
    script = where.script if isinstance(where, Project) else f"{where}/{spec.script.name}"
    if spec.local_rank_flag:
        return ["-m", "training.legacy", f"--flag={spec.local_rank_flag}", script]
    return [script]


def interface_env(
    inventory: Inventory, hosts: tuple[Host, ...], env_file: Path | None = None
) -> dict[str, dict[str, str]]:
    """Per node, the socket interface settings: netcheck's findings if it wrote them (`env_file`,
    or where netcheck writes by default), else the inventory's compute_interface. Exact-match
    form for NCCL so 'eth1' never also means 'eth10'."""
    from netcheck import envfile

    found: dict[str, dict[str, str]] = {}
    path = env_file or envfile.default_path(inventory.path)
    if env_file is not None and not env_file.is_file():
        raise ClusterError(
            f"--env-file {env_file} does not exist",
            hint=f"make netcheck INVENTORY={inventory.path}, which writes it, or no --env-file",
        )
    if path.exists():
        found = envfile.load(path)
    settings = {}
    for host in hosts:
        settings[host.name] = found.get(host.name) or {
            "GLOO_SOCKET_IFNAME": host.compute_interface,
            "NCCL_SOCKET_IFNAME": f"={host.compute_interface}",
        }
    return settings


def rank_order_warning(hosts: tuple[Host, ...]) -> str | None:
    """c10d numbers nodes by the sorted string of their address: say so when that is not the
    inventory's order, rather than let the user think rank 0 runs on the first host."""
    by_address = sorted(hosts, key=lambda h: str(h.compute_ip))
    if [h.name for h in by_address] == [h.name for h in hosts]:
        return None
    order = ", ".join(f"{h.name} ({h.compute_ip})" for h in by_address)
    return (
        f"note: c10d numbers nodes by compute IP, so node ranks follow {order}; the rendezvous "
        f"store stays on {hosts[0].name}"
    )


def torchrun_command(
    host: Host, master: Host, nnodes: int, spec: JobSpec, port: int, entry: list[str]
) -> list[str]:
    return [
        host.python, "-m", "torch.distributed.run",
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
    ]  # fmt: skip


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
    before anything else starts. A container sees `mounts` (path, read-only) at the same paths."""
    directory = run_dir(spec)
    workdir = project.workdir if project is not None else directory
    entry = entry_point(spec, project if project is not None else directory)
    variables = {**job_environment(host, spec), **env, **dict(spec.extra_env)}
    if project is not None:
        variables.update(PYTHONPATH=project.python_path)
        variables[RUN_DIR_VARIABLE] = directory
    secrets = staging.load_secrets(spec.run_id) + " && " if spec.secret_env else ""
    if mode == "container":
        inside = replace(host, python=CONTAINER_PYTHON)
        torchrun = torchrun_command(inside, master, nnodes, spec, port, entry)
        if spec.secret_env:
            torchrun = ["sh", "-c", secrets + 'exec "$@"', "tmn-job", *torchrun]
        mounted = [(directory, False), *mounts]
        if spec.secret_env:
            mounted.append((staging.secrets_dir(spec.run_id), False))
        command = docker_run_command(
            host, spec, image or "", variables, workdir, torchrun, memlock, mounted
        )
        return (
            f"mkdir -p {shlex.quote(directory)} && {NCCL_CONF_GUARD} && exec {shlex.join(command)}"
        )
    command = torchrun_command(host, master, nnodes, spec, port, entry)
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
    return (
        f"mkdir -p {shlex.quote(directory)} && cd {shlex.quote(workdir)} && {secrets}"
        f"exec env {assignments} {shlex.join(command)}"
    )


def docker_run_command(
    host: Host,
    spec: JobSpec,
    image: str,
    env: dict[str, str],
    workdir: str,
    command: list[str],
    memlock: str = "unlimited",
    mounts: list[tuple[str, bool]] | None = None,
) -> list[str]:
    """The training container for one node: the job's whole lifetime, removed when it ends.
    Every node directory the job reads or writes is mounted at the same path."""
    options = training_container_options(host, memlock, f"{RUN_LABEL}={spec.run_id}")
    options += ["--name", f"{spec.run_id}-{host.name}"]
    seen: set[str] = set()
    for path, read_only in mounts or []:
        if path not in seen:
            seen.add(path)
            options += ["-v", f"{path}:{path}" + (":ro" if read_only else "")]
    options += ["-w", workdir]
    for key, value in env.items():
        options += ["-e", f"{key}={value}"]
    return [*options, image, *command]


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
        'if [ -n "$old" ] && grep -lsaF "TMN_RUN_ID=$old" /proc/[0-9]*/environ >/dev/null; '
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


def answers(host: Host, timeout: float) -> bool:
    """Whether `host` accepts a TCP connection to its SSH port within `timeout` seconds."""
    try:
        socket.create_connection((host.ssh_address, host.ssh_port), timeout=timeout).close()
    except OSError:
        return False
    return True


class Launcher:
    def __init__(
        self,
        inventory: Inventory,
        hosts: tuple[Host, ...],
        spec: JobSpec,
        emit: Emit = print,
        connect_timeout: float = 5.0,
        project: Project | None = None,
    ):
        self.inventory, self.hosts, self.spec, self.emit = inventory, hosts, spec, emit
        self.project = project
        self.connect_timeout = connect_timeout
        self.outcomes = {h.name: NodeOutcome(h.name) for h in hosts}
        self.done = threading.Event()
        self.stopping = threading.Event()  # stop_everywhere has begun
        self.first_failure: str | None = None
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._remotes: dict[str, Remote] = {}
        self.silent: set[str] = set()  # lost nodes that did not answer when the job was stopped
        self._writers: list[NodeOutput] = []  # each node's output, ticked for progress lines
        self.backend = job_backend(hosts)[0]  # one for the whole job

    def _remote(self, host: Host) -> Remote:
        return Remote.for_inventory(self.inventory, host, connect_timeout=self.connect_timeout)

    def _fail(self, name: str) -> None:
        with self._lock:
            if self.first_failure is None:
                self.first_failure = name
            self.failures.append(name)
        self.done.set()

    def _blame(self) -> str | None:
        """The node that caused the failure. A node that stopped answering comes first, then a
        node cut off from the master over the compute network. Peers of a crashed rank fail
        too, often first ("Connection closed by peer"): prefer a node whose own output shows no
        such sign, then a node that such messages name, then simply the first to fail."""
        if not self.failures:
            return None
        for name in self.failures:
            if self.outcomes[name].unreachable:
                return name
        cut_off = self._cut_off()
        if cut_off is not None:
            return cut_off
        for name in self.failures:
            outcome = self.outcomes[name]
            if outcome.error or not any(_COLLATERAL.search(line) for line in outcome.tail):
                return name
        by_ip = {str(h.compute_ip): h.name for h in self.hosts}
        for name in self.failures:
            for line in self.outcomes[name].tail:
                match = _COLLATERAL.search(line)
                if match and match.group("peer") in by_ip:
                    return by_ip[match.group("peer")]
        return self.failures[0]

    def _cut_off(self) -> str | None:
        """The node whose compute link is down: one that cannot reach the master, or the master
        itself when none of (at least two) others can reach it."""
        others = self.hosts[1:]
        down = [h.name for h in others if self.outcomes[h.name].link_down]
        if not down:
            return None
        return self.hosts[0].name if len(others) >= 2 and len(down) == len(others) else down[0]

    def _connect(self, host: Host) -> None:
        remote = self._remote(host)
        self._remotes[host.name] = remote
        remote.connect()

    def _prepare(self, host: Host, image_id: str | None) -> None:
        """After the project's trees were sent: check this node's copy and image, make the
        directories the job writes to, hand over its secrets."""
        remote, inventory = self._remotes[host.name], self.inventory
        if self.backend == "nccl":
            answer = remote.run(GPU_PROBE, timeout=30)
            problem = gpu_problem(host, self.spec, answer.stdout + answer.stderr, answer.ok)
            if problem is not None:
                message, _, hint = problem.rpartition(" (try ")
                raise ClusterError(message, hint=hint.removesuffix(")"), exit_code=1)
        for tree, destination in self.project.trees:
            sync.verify(remote, tree, destination)
        directories = [run_dir(self.spec), inventory.checkpoint_root, inventory.data_root]
        made = remote.run(f"mkdir -p {shlex.join(directories)}", timeout=15)
        if not made.ok:
            said = (made.stderr or made.stdout).strip().splitlines()[-1:] or ["no reason given"]
            raise ClusterError(
                f"on {host.name}: cannot make {', '.join(directories[1:])}: {said[0]}",
                hint=f"make provision INVENTORY={inventory.path} (it makes them for "
                f"{host.ssh_user or 'the SSH user'})",
                exit_code=1,
            )
        if image_id is not None:
            answer = remote.run(staging.image_check_command(inventory.training_image), timeout=60)
            problem = staging.image_mismatch(host, inventory, image_id, answer.stdout)
            if problem is not None:
                message, _, hint = problem.rpartition(" (try ")
                raise ClusterError(message, hint=hint.removesuffix(")"), exit_code=1)
        if self.spec.secret_env:
            remote.run(
                staging.write_secrets_command(self.spec.run_id), timeout=15, check=True,
                stdin=staging.secrets_text(self.spec.secret_env),
            )  # fmt: skip

    def _command(self, host: Host, master: Host, nnodes: int, env: dict[str, str]) -> str:
        inventory = self.inventory
        return remote_command(
            host, master, nnodes, self.spec, inventory.rendezvous_port, env,
            inventory.launch_mode, inventory.training_image, inventory.container_memlock,
            self.project, tuple(staging.mounts(inventory, self.project, run_dir(self.spec))),
        )  # fmt: skip

    def _parallel(self, work: Callable[[Host], None]) -> None:
        """`work` on every host at once; the first ClusterError raised, after all have ended."""
        errors: list[ClusterError] = []

        def guarded(host: Host) -> None:
            try:
                work(host)
            except ClusterError as exc:
                errors.append(exc)

        on_all(self.hosts, guarded)
        if errors:
            raise errors[0]

    def _stage(self, master: Host) -> None:
        """Everything before the first process starts: SSH to every node, the master's port,
        the project on every node, checked, and each node's image and directories."""
        self._parallel(self._connect)
        self._claim_port(master)  # before the sync: a running job's code is never changed
        try:
            if self.project is None:
                self.project = staging.plan(
                    self.inventory, self.spec.script, self.spec.workdir, self.spec.workdir_limit
                )
            for tree, destination in self.project.trees:
                sent = sync.push(self.inventory, self.hosts, tree, destination, self.emit)
                self.emit("[launcher] " + sync.summary_line(tree, destination, sent))
            image_id = None
            if self.inventory.launch_mode == "container":
                image_id = staging.local_image_id(self.inventory.training_image)
            self._parallel(lambda host: self._prepare(host, image_id))
        except BaseException:  # a refusal, or Ctrl-C while the project is sent: the port is free
            self._release_port(master)
            raise

    def _run_node(self, host: Host, command: str) -> None:
        outcome = self.outcomes[host.name]
        log = self.spec.log_dir / f"{host.name}.log" if self.spec.log_dir else None
        writer = NodeOutput(f"[{host.name}]", self.emit, outcome, log)
        self._writers.append(writer)
        try:
            result = self._remotes[host.name].connection.run(
                command, pty=True, warn=True, hide=True, out_stream=writer, err_stream=writer,
                in_stream=False,
            )  # fmt: skip
            outcome.exit_code = result.exited
            if result.exited == -1 and self.stopping.is_set():
                outcome.exit_code = None  # killed by our stop: the summary says "stopped"
            # An error already recorded (a watcher declared the node lost) says more.
            elif result.exited == -1:  # closed with no exit status
                outcome.session_lost = True
                if outcome.error is None:
                    outcome.error = "the SSH session ended without an exit status: node down?"
        except Exception as exc:  # a dropped connection surfaces as several invoke/paramiko types
            # Once the stop has begun, the launcher itself may close the session: "stopped".
            if not self.stopping.is_set():
                outcome.session_lost = True
                if outcome.error is None:
                    outcome.error = f"lost the SSH session: {type(exc).__name__}: {exc}".strip()
        finally:
            # Whatever happened above, the launcher must hear of it: a runner that dies without
            # a word leaves the main thread waiting forever.
            try:
                writer.close()
            finally:
                if not outcome.ok:
                    self._fail(host.name)
                elif all(o.exit_code is not None for o in self.outcomes.values()):
                    self.done.set()

    def _watch(self) -> None:
        """A node that stops answering is failed within a few seconds, not at TCP's leisure."""
        misses = collections.Counter()
        while not self.done.wait(LIVENESS_INTERVAL):
            for host in self.hosts:
                if self.outcomes[host.name].exit_code is not None:
                    continue
                if answers(host, 2):
                    misses[host.name] = 0
                else:
                    misses[host.name] += 1
                    if misses[host.name] >= LIVENESS_FAILURES:
                        outcome = self.outcomes[host.name]
                        outcome.error = f"stopped answering on {host.ssh_address}:{host.ssh_port}"
                        outcome.unreachable = True
                        self._fail(host.name)
                        return

    def _watch_link(self, host: Host, master: Host) -> None:
        """Ping the master's compute IP from `host`, over an SSH session of its own; a link
        down for --network-timeout seconds fails `host`. Only a link seen up during this job
        can go down: where ICMP is blocked from the start, the check stays silent."""
        target = f"{master.name} ({master.compute_ip})"
        command = link_probe_command(str(master.compute_ip))
        outcome, down_since, seen_up = self.outcomes[host.name], None, False
        remote = self._remote(host)
        try:
            while not self.done.wait(LINK_PROBE_INTERVAL):
                if outcome.exit_code is not None:
                    return
                probed_at = time.monotonic()
                try:
                    answer = remote.run(command, timeout=LINK_PROBE_WAIT + 10).stdout.strip()
                except ClusterError:
                    continue  # SSH itself failing is the liveness watcher's business
                if answer == "up":
                    seen_up = True
                    if down_since is not None:
                        self.emit(f"[launcher] {host.name} reaches {target} again")
                    down_since, outcome.link_down = None, None
                    continue
                if not (seen_up and answer.startswith("down")):
                    continue
                reason = answer.removeprefix("down").strip() or "no answer"
                if down_since is None:
                    down_since = probed_at
                    self.emit(
                        f"[launcher] {host.name} cannot reach {target} over the compute network "
                        f"({reason}); the job is stopped if this lasts "
                        f"{self.spec.network_timeout:g} s"
                    )
                down_for = time.monotonic() - down_since
                outcome.link_down = f"compute link to {target} down for {down_for:.0f} s ({reason})"
                if down_for >= self.spec.network_timeout:
                    lost = self._cut_off() or host.name
                    what = (
                        f"compute link to {target} down"
                        if lost == host.name
                        else "no other node reaches it over the compute network"
                    )
                    self.outcomes[lost].error = (
                        f"lost: {what} for {down_for:.0f} s ({reason}; "
                        f"--network-timeout {self.spec.network_timeout:g})"
                    )
                    self._fail(lost)
                    return
        finally:
            try:
                remote.close()
            except Exception:  # closing a session to a dead node may raise anything
                pass

    def stop_everywhere(self, master: Host | None = None) -> dict[str, float | str]:
        """Kill the run's processes on every node that still answers, in parallel, one SSH
        session each; on `master` the same session frees the rendezvous port. Per node: the
        seconds its stop took, or why it was not confirmed."""
        self.stopping.set()
        stopped: dict[str, float | str] = {
            h.name: f"not confirmed within {STOP_TIMEOUT:g} s" for h in self.hosts
        }
        unlock = unlock_command(self.spec.run_id, self.inventory.rendezvous_port)
        started = time.monotonic()

        def stop(host: Host) -> None:
            on_master = master is not None and host.name == master.name
            command = stop_command(self.spec.run_id, then=unlock if on_master else "")
            if self.outcomes[host.name].lost and not answers(host, LOST_NODE_PROBE):
                self.silent.add(host.name)
                stopped[host.name] = "unreachable"
                return
            with self._remote(host) as remote:
                try:
                    remote.connect()
                except ClusterError:
                    stopped[host.name] = "unreachable"
                    return
                try:
                    remote.run(command, timeout=STOP_TIMEOUT, check=True)
                    stopped[host.name] = time.monotonic() - started
                except ClusterError:
                    pass  # not confirmed: the command failed or outlasted its limit

        threads = [threading.Thread(target=stop, args=(h,), daemon=True) for h in self.hosts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, started + STOP_TIMEOUT + 2 - time.monotonic()))
        return dict(stopped)

    def run(self) -> JobResult:
        started = time.monotonic()
        master, nnodes = self.hosts[0], len(self.hosts)
        envs = interface_env(self.inventory, self.hosts, self.spec.env_file)
        for host in self.hosts:
            nproc_for(host, self.spec)  # a GPU the node lacks stops us before any SSH
        note = job_backend(self.hosts)[1]
        if note:
            self.emit(f"[launcher] {note}")
        envs = {name: {**found, BACKEND_VARIABLE: self.backend} for name, found in envs.items()}
        if self.spec.log_dir:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._stage(master)
        except BaseException:
            self._close()
            raise

        interrupted = terminated = False
        runners = [
            threading.Thread(
                target=self._run_node,
                args=(h, self._command(h, master, nnodes, envs[h.name])),
                daemon=True,
            )
            for h in self.hosts
        ]  # fmt: skip
        watchers = [threading.Thread(target=self._watch, daemon=True)]
        watchers += [
            threading.Thread(target=self._watch_link, args=(h, master), daemon=True)
            for h in self.hosts[1:]
        ]
        try:
            for runner in runners:
                runner.start()
            for watcher in watchers:
                watcher.start()
            while not self.done.wait(0.2):
                for writer in list(self._writers):
                    writer.tick()  # a progress bar's latest state, every few seconds
                if not any(runner.is_alive() for runner in runners):
                    break  # every runner has ended: nothing is left to wait for
        except KeyboardInterrupt as signalled:
            interrupted = True
            terminated = isinstance(signalled, Terminated)
            why = "SIGTERM" if terminated else "Ctrl-C"
            self.emit(f"[launcher] {why}: stopping the job on every node...")
        finally:
            if self.first_failure is not None and not interrupted:
                # The others may take a moment to report their own failure, which can say more
                # than the first; not worth waiting for once a node is known to be gone.
                deadline = time.monotonic() + BLAME_GRACE
                while (
                    time.monotonic() < deadline
                    and any(runner.is_alive() for runner in runners)
                    and not any(self.outcomes[name].lost for name in self.failures)
                ):
                    time.sleep(0.1)
                self.first_failure = self._blame()
                self.emit(
                    f"[launcher] {self.first_failure} failed: stopping the job on every node..."
                )
            if interrupted or self.first_failure is not None:
                stopped = self.stop_everywhere(master)
                self.emit("[launcher] stopped: " + ", ".join(
                    f"{name} in {done:.1f} s" if isinstance(done, float) else f"{name} {done}"
                    for name, done in stopped.items()
                ))  # fmt: skip
                if not isinstance(stopped[master.name], float) and master.name not in self.silent:
                    self._release_port(master)  # a silent master: the next launch finds it stale
            else:
                self._release_port(master)
            self.done.set()
            deadline = time.monotonic() + (
                INTERRUPTED_RUNNER_GRACE if interrupted else RUNNER_GRACE
            )
            for runner in runners:
                runner.join(max(0.0, deadline - time.monotonic()))
            self._close()
        return JobResult(
            self.spec.run_id, self.outcomes, self.first_failure, interrupted,
            time.monotonic() - started, terminated=terminated,
        )  # fmt: skip

    def _claim_port(self, master: Host) -> None:
        port = self.inventory.rendezvous_port
        result = self._remotes[master.name].run(lock_command(self.spec.run_id, port), timeout=15)
        words = result.stdout.split()
        if result.exit_code == LOCK_BUSY_EXIT:
            other = words[1] if len(words) > 1 else "another job"
            raise ClusterError(
                f"job {other} is already running on {master.name} (rendezvous port {port})",
                hint="waiting for it to end, or Ctrl-C where it was started",
                exit_code=1,
            )
        if not result.ok:
            raise ClusterError(
                f"host '{master.name}': could not claim rendezvous port {port}: "
                f"{(result.stderr or result.stdout).strip()}",
                exit_code=1,
            )
        if words[:1] == ["stale"]:
            self.emit(f"[launcher] took over the lock of job {words[1] if len(words) > 1 else '?'}"
                      f" on {master.name}: none of its processes is left")  # fmt: skip

    def _release_port(self, master: Host) -> None:
        try:
            with self._remote(master) as remote:
                remote.run(
                    unlock_command(self.spec.run_id, self.inventory.rendezvous_port), timeout=10
                )
        except ClusterError:
            pass  # the master is gone; the next launch finds the lock stale

    def _close(self) -> None:
        for remote in self._remotes.values():
            try:
                remote.close()
            except Exception:  # closing a session to a dead node may raise anything
                pass


def summary(result: JobResult, hosts: tuple[Host, ...]) -> list[str]:
    """What happened, node by node; for a failed node, its last lines."""
    verdict = (
        ("terminated (SIGTERM)" if result.terminated else "interrupted")
        if result.interrupted
        else "succeeded"
        if result.exit_code == 0
        else f"FAILED on {result.failed_node}"
    )
    lines = [f"Job {result.run_id} {verdict} after {result.seconds:.1f} s on {len(hosts)} node(s)"
             + (f", restart {result.restart} of {result.restarts}." if result.restart else ".")]  # fmt: skip
    for host in hosts:
        outcome = result.outcomes[host.name]
        state = (
            outcome.error
            if outcome.error
            else "stopped"
            if outcome.exit_code is None
            else f"exit {outcome.exit_code}"
        )
        if outcome.link_down and not (outcome.error or "").startswith("lost:"):
            state += f"; {outcome.link_down}"
        lines.append(f"  {host.name:<12} {state}")
    if result.failed_node and not result.interrupted:
        excerpt = failure_excerpt(list(result.outcomes[result.failed_node].tail))
        if excerpt:
            lines.append(f"Last lines from {result.failed_node}:")
            lines += [f"  | {line}" for line in excerpt]
    return lines


def wait_for_nodes(
    inventory: Inventory, hosts: tuple[Host, ...], wait: float, emit: Emit = print
) -> float:
    """Until every host answers over SSH (a command run, not only a port open): the seconds that
    took. A host that never answers within `wait` seconds is a ClusterError naming it and why."""
    started = time.monotonic()
    missing = {host.name: host for host in hosts}
    silent: dict[str, str] = {}  # host name -> why its last probe failed
    # A node that booted again answers over SSH a moment before its Docker engine does.
    command = (
        "docker info >/dev/null 2>&1 || { echo 'its Docker engine does not answer yet'; exit 1; }"
        if inventory.launch_mode == "container"
        else "true"
    )

    def probe(host: Host) -> str | None:
        try:
            with Remote.for_inventory(inventory, host) as remote:
                remote.run(command, timeout=10, check=True)
            return None
        except ClusterError as exc:
            return str(exc)

    while True:
        for name, error in on_all(list(missing.values()), probe).items():
            if error is None:
                del missing[name]
                if name in silent:
                    emit(
                        f"[launcher] {name} answers again after {time.monotonic() - started:.0f} s"
                    )
                    del silent[name]
            else:
                silent[name] = error
        if not missing:
            return time.monotonic() - started
        if time.monotonic() - started >= wait:
            name = next(iter(missing))
            raise ClusterError(
                f"{', '.join(missing)} did not answer within --restart-wait {wait:g} s: "
                f"{silent[name]}",
                hint="bringing the node back, then running the job again (it resumes from its "
                "checkpoints)",
                exit_code=1,
            )
        time.sleep(RESTART_POLL)


def run_job(
    inventory: Inventory,
    hosts: tuple[Host, ...],
    spec: JobSpec,
    emit: Emit = print,
    restarts: int = 0,
    restart_wait: float = DEFAULT_RESTART_WAIT,
    project: Project | None = None,
) -> JobResult:
    """The job, started again after a failure up to `restarts` times, each time once every node
    answers again (for at most `restart_wait` seconds). Each run has its own run ID (the first
    one's with -r1, -r2...) and rendezvous; the node logs go on in the same files. Before a
    restart, whatever the failed run left (on a node that was cut off rather than down) is
    stopped and its rendezvous port freed. Ctrl-C and refusals are never restarted."""
    if project is None:
        project = staging.plan(inventory, spec.script, spec.workdir, spec.workdir_limit)
    attempt = spec
    for restart in range(restarts + 1):
        result = Launcher(inventory, hosts, attempt, emit, project=project).run()
        result.restart, result.restarts = restart, restarts
        bring_back(inventory, hosts[0], attempt, result, emit)
        if result.exit_code != 1 or restart == restarts:
            return result
        for line in summary(result, hosts):
            emit(line)
        emit(f"[launcher] restart {restart + 1} of {restarts}: waiting up to {restart_wait:g} s "
             "for every node to answer...")  # fmt: skip
        waited = wait_for_nodes(inventory, hosts, restart_wait, emit)
        Launcher(inventory, hosts, attempt, emit).stop_everywhere(hosts[0])
        attempt = replace(spec, run_id=f"{spec.run_id}-r{restart + 1}")
        emit(f"[launcher] job {attempt.run_id}: every node answers (waited {waited:.0f} s); "
             f"restart {restart + 1} of {restarts}")  # fmt: skip
    raise AssertionError("unreachable")  # the loop returns on its last turn


def bring_back(
    inventory: Inventory, master: Host, spec: JobSpec, result: JobResult, emit: Emit
) -> None:
    """The master's run directory into the job's log directory, after a job that ended by
    itself (successful or not); after Ctrl-C or SIGTERM the user wants it stopped now, so only
    how to fetch it is said."""
    if spec.log_dir is None:
        return
    where = f"{master.name}:{run_dir(spec)}"
    if result.interrupted:
        result.brought_back = f"not copied (interrupted): it stays in {where}"
        return
    if result.outcomes[master.name].lost:
        result.brought_back = f"not copied: {master.name} was lost"
        return
    files, problem = staging.fetch_run_dir(inventory, master, run_dir(spec), spec.log_dir)
    if problem is None:
        result.brought_back = f"{files} file(s) from {where}"
    else:
        result.brought_back = f"not copied from {where}: {problem}"
        emit(f"[launcher] the run directory {where} was {result.brought_back}")


def failure_excerpt(lines: list[str], limit: int = EXCERPT_LINES) -> list[str]:
    """The worker's last words, not torchrun's: a failed torchrun ends with its own traceback
    (ChildFailedError) and a report; what the worker said comes just before them."""
    cut = len(lines)
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].lstrip().startswith("Traceback (most recent call last):") and any(
            "ChildFailedError" in line for line in lines[index:]
        ):
            cut = index
            break
    report = [
        line.strip() for line in lines[cut:] if re.match(r"\s*(host|rank|exitcode)\s*:", line)
    ]
    return lines[max(0, cut - limit) : cut] + report
