"""A job with no inventory: on this machine alone (torchrun standalone, through
training.local_launch), one process per GPU or two on the CPU. It runs as a job on the nodes
does: in its project's root (the directory that would travel: staging.project_root) with the
project on the import path, the same variables a node's ranks get (environment.local_environment: TMN_RUN_DIR
is the job's own .runs/JOB-ID, TMN_BACKEND..., ENV='s over them), and it ends the same way: the
workers' output live, then one summary naming what failed with the failed rank's own last
lines (launch.ending's local_summary), never torchrun's ChildFailedError traceback. A job that stops making progress is a hang,
as on the nodes (launch.watch's watch and report, launch.hang's analysis): every rank's stacks
read here with py-spy, the rank holding the others up named, the report saved in the run
directory, then the job stopped (or, --on-hang wait, left running)."""

from __future__ import annotations

import collections
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, Terminated, UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import checks, flight, hang, idle, staging, stragglers, watch
from torch_multinode.launch.commands import stop_command
from torch_multinode.launch.ending import local_summary
from torch_multinode.launch.environment import local_environment
from torch_multinode.launch.node_output import JobLog
from torch_multinode.launch.nodes import job_backend, local_gpu_count, process_count
from torch_multinode.launch.progress import Progress, until_hang
from torch_multinode.launch.relay import Relaying
from torch_multinode.launch.spec import (
    LEGACY_SHIM,
    STOP_GRACE,
    STOP_TIMEOUT,
    TAIL_LINES,
    Emit,
    JobSpec,
    job_module,
)

# py-spy beside this Python (the venv's), else the one on PATH (hang.STACKS_SCRIPT looks there)
_PY_SPY = str(Path(sys.executable).parent / "py-spy")


def command(spec: JobSpec, nproc: int) -> list[str]:
    """The local torchrun: torch's own launcher, quiet about a failed worker (local_launch)."""
    # The script by its absolute path: the job runs in its project's root, not where `train` was
    # typed.
    if spec.script is None:
        entry = ["-m", job_module(spec)]
    elif spec.local_rank_flag:
        entry = [
            "-m",
            LEGACY_SHIM,
            f"--flag={spec.local_rank_flag}",
            str(spec.script.resolve()),
        ]
    else:
        entry = [str(spec.script.resolve())]
    return [
        sys.executable,
        "-m",
        f"{sync.TOOL_PACKAGE}.training.local_launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *entry,
        *spec.args,
    ]


def this_machine(gpus: int) -> Host:
    """This machine as the job's one node, for local_environment (its name and GPU count)."""
    loopback = ipaddress.IPv4Address("127.0.0.1")
    return Host(socket.gethostname(), str(loopback), 22, None, None, loopback, "lo", gpus)


def project_directory(spec: JobSpec) -> Path:
    """Where the job runs: its project's root, as a job on the nodes runs in the copy of it
    (WORKDIR, else the git work tree holding SCRIPT, else SCRIPT's directory), or, for a module
    without WORKDIR, this project's own root."""
    return staging.project_root(spec.script, spec.workdir) or sync.TOOL_ROOT


def environment_note(spec: JobSpec) -> str:
    """Which Python environment a local job runs in, for its first line: this one (the .venv
    `train` runs from), and the project's dependencies beside it, where it has them."""
    here = f"environment {sys.prefix}"
    return f"{here} + {spec.dependencies}" if spec.dependencies else here


def run_directory(spec: JobSpec) -> Path:
    """The job's run directory here: its log directory, .runs/JOB-ID unless --log-dir says."""
    return (spec.log_dir or Path(".runs") / spec.run_id).resolve()


def environment(
    spec: JobSpec, gpus_here: int, environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, str], int]:
    """The job's environment and process count on this machine."""
    if spec.gpus is not None:
        shown = ",".join(map(str, spec.gpus))
        chosen = environ.get("CUDA_VISIBLE_DEVICES")
        if chosen is not None:
            # GPUS= counts as nvidia-smi does; under the shell's pick, torch counts only what
            # that leaves, so GPUS= would be checked in one numbering and applied in another.
            raise UserError(
                f"GPUS={shown} and this shell's CUDA_VISIBLE_DEVICES={chosen} both pick GPUs",
                hint="one of them: unset CUDA_VISIBLE_DEVICES, or leave out GPUS=",
            )
        if gpus_here == 0:
            raise UserError(
                f"GPUS={shown} but this machine has no GPU",
                hint="leaving GPUS unset; NPROC= sets the process count",
            )
        missing = [index for index in spec.gpus if index >= gpus_here]
        if missing:
            raise UserError(
                f"GPUS={shown} asks for GPU {missing[0]}, but this machine has {gpus_here} "
                f"GPU(s) (0-{gpus_here - 1})"
            )
        nproc = process_count(spec, len(spec.gpus), f"GPUS={shown} gives it {len(spec.gpus)}")
    else:
        nproc = process_count(spec, gpus_here, f"this machine has {gpus_here}", cpu_default=2)
    # The project alone: torch_multinode comes from this environment's install (see
    # torch_multinode/__init__.py), and this project's root would add generic names. Its
    # dependencies next, before this environment's own packages, as the layer's are in the
    # image's on the nodes; our sitecustomize's directory last for a script of the user's, as on
    # the nodes (staging.Project.import_path).
    sites = [staging.site_import_path(str(sync.TOOL_ROOT))] if stragglers.watched(spec) else []
    python_path = ":".join(
        [str(project_directory(spec)), *filter(None, [spec.dependencies]), *sites]
    )
    here = this_machine(gpus_here)
    backend = job_backend((here,))[0]
    env = local_environment(here, spec, str(run_directory(spec)), python_path, backend, environ)
    return env, nproc


def _stacks(
    spec: JobSpec, here: Host, progress: Progress, emit: Emit, ranks: list[int]
) -> hang.Verdict:
    """This machine's ranks' stacks and Flight Recorder traces, read as a node's are (the same
    command, run here), then judged, printed and saved in the run directory (launch.watch);
    the ranks' PIDs into `ranks`."""
    directory = run_directory(spec)
    command = watch.collection_command(
        spec.run_id, str(directory), _PY_SPY, native=here.gpu_count > 0
    )
    texts: dict[str, str] = {}
    silent: dict[str, str] = {}
    read = _here(command)
    if read is None:
        silent[here.name] = f"no answer within {hang.STACKS_TIMEOUT:g} s"
    else:
        texts[here.name] = read.stdout + read.stderr
        ranks += [rank.pid for rank in hang.parse(here.name, read.stdout)[0]]
    workdir = str(project_directory(spec))
    return watch.tell(spec, progress, texts, silent, workdir, emit, directory)


def _here(command: str) -> subprocess.CompletedProcess | None:
    """`command` run on this machine as a node runs it, within hang.STACKS_TIMEOUT; None when it
    did not end by then."""
    try:
        return subprocess.run(
            ["sh", "-c", command],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=hang.STACKS_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


def _idle_look(spec: JobSpec, here: Host, done: threading.Event) -> str | None:
    """This machine's ranks' counters and places, read as a node's are (launch.idle.look); a
    reading that does not end in time reads as nothing (no hang is called on it)."""

    def run(command: str) -> str:
        finished = _here(command)
        return finished.stdout if finished is not None else ""

    def places() -> dict[int, str]:
        command = hang.stacks_command(spec.run_id, _PY_SPY, None, native=here.gpu_count > 0)
        ranks, _ = hang.parse(here.name, run(command))
        return {rank.rank: hang.shown_place(rank) for rank in ranks}

    return idle.look(lambda: idle.parse(run(idle.command(spec.run_id, None))), places, done.wait)


def _stop(run_id: str, ranks: list[int], done: threading.Event) -> None:
    """The job stopped after its hang's report: its ranks first (torchrun then ends as for any
    failed rank, saying which, not with a traceback of its own), then whatever of the run is
    left on this machine, stopped as a node's is (commands.stop_command: each process found by
    the run's marker in its environment, TERM, a grace period, then KILL)."""
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass  # gone already
    if ranks:
        done.wait(STOP_GRACE + 5)  # torchrun sees its ranks end, and ends
    try:
        subprocess.run(
            ["sh", "-c", stop_command(run_id)],
            capture_output=True,
            timeout=STOP_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pass  # what is left holds the output open: the Ctrl-C that follows stops it


def _watch(
    spec: JobSpec,
    here: Host,
    progress: Progress,
    done: threading.Event,
    emit: Emit,
    tail: collections.deque,
    hung: list[tuple[str, list[str]]],
) -> None:
    """The hang watch of a job on this machine (launch.progress.until_hang, as on the nodes): a
    hang's report, then the job stopped, its cause and the lines before the stop in `hung`."""
    look = f"{_PY_SPY} dump --pid PID, each rank's PID in hang-stacks-{here.name}.txt"
    ranks: list[int] = []
    verdict = until_hang(
        done,
        lambda: progress,
        spec,
        emit,
        lambda: _stacks(spec, here, progress, emit, ranks),
        look,
        lambda: _idle_look(spec, here, done),
    )
    if verdict is None:
        return
    hung.append((verdict.cause, list(tail.copy())))
    emit("[launcher] the job hangs: stopping it...")
    _stop(spec.run_id, ranks, done)


def run_local(
    spec: JobSpec, emit: Emit = print, out=None, started: Callable[[], None] | None = None
) -> int:
    """Run the job here; its exit code is the launcher's: 0, 1 when it failed or hung, or the
    code of an interruption. `started` is called once torchrun has started."""
    gpus = local_gpu_count()
    env, nproc = environment(spec, gpus)
    argv = command(spec, nproc)
    root, run_dir = project_directory(spec), run_directory(spec)
    # the workload's batch against this machine's processes, before any starts
    fitted = (
        None
        if spec.script
        else checks.workload_arguments(spec.module, list(spec.args), nproc, spec.workdir)
    )
    emit(
        f"[launcher] local job {spec.run_id} in {root} ({environment_note(spec)}): "
        f"{shlex.join(argv)}" + (f"; {fitted}" if fitted else "")
    )
    if spec.secret_env:
        emit(
            f"[launcher] environment for every rank: {staging.environment_names(spec.secret_env)}"
            " (values not shown)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: a job refused before start leaves none
    began = time.monotonic()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    progress, done = Progress(spec.stall), threading.Event()
    hung: list[tuple[str, list[str]]] = []  # a hang's cause and the lines before its stop
    watcher = threading.Thread(
        target=_watch,
        args=(spec, this_machine(gpus), progress, done, emit, tail, hung),
        daemon=True,
    )
    process = subprocess.Popen(
        argv,
        cwd=root,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    log = JobLog(run_dir / f"{socket.gethostname()}.log", emit)  # NODE.log, as on the nodes
    relaying = Relaying(process.stdout, out or sys.stdout.buffer, tail, log, progress.note)
    try:
        if started is not None:
            started()
        if spec.stall != 0:  # --stall 0: never a hang
            watcher.start()
        relaying.follow()
        code = process.wait()
    except KeyboardInterrupt as signalled:
        terminated = isinstance(signalled, Terminated)
        emit(f"[launcher] {'SIGTERM' if terminated else 'Ctrl-C'}: stopping the local job...")
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE + 5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        relaying.finish(STOP_GRACE)  # the lines the job said as it stopped
        return TERMINATED_EXIT if terminated else INTERRUPTED_EXIT
    finally:
        done.set()
        if relaying.close():
            log.close()
    if watcher.is_alive():  # a report or a stop under way: its lines come before the summary
        watcher.join(hang.STACKS_TIMEOUT + STOP_TIMEOUT)
    cause, before = hung[0] if hung else (None, list(tail))
    traced = flight.from_directory(run_dir) if code != 0 and cause is None else {}
    flights = flight.failure_lines(traced, dict.fromkeys(traced, "this machine"))
    seconds = time.monotonic() - began
    for line in local_summary(spec.run_id, code, seconds, before, flights, cause):
        emit(line)
    emit(f"Run directory: {run_dir} (its log: {socket.gethostname()}.log)")
    if (run_dir / "tensorboard").is_dir():
        emit(f"TensorBoard: make tensorboard RUN={run_dir.name}")
    return 0 if code == 0 and cause is None else 1
