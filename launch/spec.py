"""What a job is, the constants every part of the launcher shares, and what became of a job."""

from __future__ import annotations

import collections
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT

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
STALL_POLL = 1.0  # seconds between two looks at the job's progress
ON_HANG = ("stop", "wait")
BLAME_GRACE = 3.0  # after a first failure, how long the others may take to report their own
# What a rank says when a *peer* died: evidence against that peer, not against this node.
_COLLATERAL = re.compile(
    r"Connection closed by peer \[(?P<peer>[0-9.]+)\]|Connection reset by peer|Broken pipe"
    r"|Connection refused|got signal: 15|SignalException"
)

Emit = Callable[[str], None]


def runnable_module(module: str, project_root: Path | None = None) -> str:
    """The name `python -m` runs for MODULE=: our workloads are `training.<name>` to the user
    and `torch_multinode.training.<name>` to Python (nothing of ours has a generic name in a
    job); a project's own module of that name (its file under `project_root`) stays its own."""
    if not module.startswith("training."):
        return module
    if project_root is not None:
        path = project_root.resolve().joinpath(*module.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return module
    return f"{sync.TOOL_PACKAGE}.{module}"


def job_module(spec: JobSpec) -> str:
    """The module the job's processes run (see runnable_module)."""
    return runnable_module(spec.module, spec.workdir)


# What a job started as a torch.distributed.launch-era script runs: our shim that hands the
# script its --local_rank flag.
LEGACY_SHIM = f"{sync.TOOL_PACKAGE}.training.legacy"


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
    stall: float | None = None
    """Seconds without progress that make the job a hang (--stall; 0: never); None: from the
    step times seen (launch.progress)."""
    on_hang: str = "stop"
    """What a hang does once its report is out: 'stop' the job, or 'wait' for a person."""
    allow_drift: bool = False
    """Run on nodes that changed since netcheck locked their versions (cluster.version_lock)."""
    planned_world: int | None = None
    """The job's first world size, when a restart runs it on fewer nodes (MIN_NODES): the
    workloads keep its global batch (jobenv.PLANNED_WORLD_VARIABLE)."""
    fault_tolerant: bool = False
    """FT=1: each node one replica group, the others going on when one is lost
    (launch.replicated)."""
    min_groups: int = 1
    """FT=1: the fewest replica groups the job goes on with (MIN_NODES)."""
    group_restarts: int = 0
    """FT=1: how many times a lost group is started again once its node answers (RESTARTS)."""
    restart_wait: float = DEFAULT_RESTART_WAIT
    """FT=1: how long a lost group's node is waited for to answer again (--restart-wait)."""
    dependencies: str | None = None
    """A local job's project dependencies: the directory they were installed into (pip
    --target, provision.dependencies), on the job's import path right after the project."""


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
    flights: tuple[str, ...] = ()  # a failed job's last collectives (launch.flight), as lines
    # each node's versions (cluster.version_lock), and what changed in them since the lock for
    # a job run with allow_drift
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    drift: dict[str, list[str]] = field(default_factory=dict)
    # what became of the nodes lost on the way (a spare in one's place, or dropped), as lines
    # (launch.survivors.survivors)
    nodes_changed: tuple[str, ...] = ()
    # the straggler each time one was named, with its cause (launch.causes.Stragglers), as lines
    stragglers: tuple[str, ...] = ()
    # an FT=1 job's replica groups lost on the way, the others having gone on (launch.groups)
    groups_lost: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return TERMINATED_EXIT if self.terminated else INTERRUPTED_EXIT
        ended = [o for o in self.outcomes.values() if o.host not in self.groups_lost]
        return 0 if ended and all(o.ok for o in ended) else 1


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
