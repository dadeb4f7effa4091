"""Every run remembered: the record a job leaves in its directory on this machine
(`.runs/ID/run.json`; a job given another --log-dir gets a copy there too), for local, SSH and
Slurm jobs alike; launch.runs reads them back (`make runs`).

The launcher writes it (launch.recorder's Recorder, around the job) when the job is about to
start (result "running"), again once the job has begun (its code and image added: `started`),
and when it ends, whatever the end (succeeded, failed, interrupted; "error" for a run that broke
off with an error after it had begun), each time whole or not at all. A job refused before
anything of it ran leaves no run behind.

What it holds: the command and the directory it was typed in, the backend and launch mode,
the image its containers ran (name and ID: the project's dependency layer where it has one,
else the training image), the project's dependencies (where they were read, what they resolved
to, pip freeze's form, and the layer's tag and ID or a local job's directory: what `make
rerun` takes again), the inventory (path and digest) and each node's ranks, the
project's code (its git commit and a snapshot of the work tree as it was, launch.snapshot;
the diff beside the record when the tree had changes), the names (never the values) of the
variables passed with ENV=, start, end, duration, exit code, the node blamed, the last step
line the job printed, where its TensorBoard events, checkpoints and other outputs are (absolute
paths: `outputs`), netcheck's findings file the job used (path and digest), each node's
versions as the job found them (kernel, driver, Docker, image or torch and NCCL:
cluster.version_lock) and, for a job run with ALLOW_DRIFT, what had changed since netcheck
locked them."""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from torch_multinode.cluster import files
from torch_multinode.cluster.errors import INTERRUPTED_EXIT, TERMINATED_EXIT
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.launch import snapshot, staging
from torch_multinode.launch.nodes import nproc_for
from torch_multinode.launch.spec import JobResult, JobSpec

RECORD = "run.json"
DIFF = "code.diff"
FORMAT = 1
RUNS_ROOT = Path(".runs")
_STEP = re.compile(r"\bstep +(\d+)(?:/\d+)?\b")  # "step  9/12": padded to the total
_TAIL_BYTES = 65536  # how much of each log's end is read for the last step line


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _digest(path: Path | None) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else None
    except OSError:
        return None


def places(spec: JobSpec) -> list[Path]:
    """Where the run's record is written: .runs/ID, where `make runs` finds it, and the job's
    own log directory too when --log-dir put that elsewhere (the logs described beside them)."""
    home = RUNS_ROOT / spec.run_id
    log_dir = spec.log_dir or home
    return [home] + ([log_dir] if log_dir.resolve() != home.resolve() else [])


def code(
    project: Path, log_dir: Path, run_id: str, outside: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """The project's code: its git commit and a snapshot of the work tree's code
    (launch.snapshot, what `make rerun` runs; `outside`: the places the run writes, left out);
    where the tree differs from the commit, the difference as code.diff beside the record, to
    read."""
    found = snapshot.take(project, run_id, outside=outside)
    if found is None:
        return {"project": str(project), "git": None, "snapshot": None}
    if found["dirty"] and found["git"] and found["snapshot"]:
        diff = subprocess.run(
            ["git", "-C", found["repository"], "diff", found["git"], found["snapshot"]],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        files.write_atomically(log_dir / DIFF, diff.stdout)
        found["diff"] = DIFF
    return {"project": str(project), **found}


def _nodes(inventory: Inventory | None, spec: JobSpec) -> list[dict[str, Any]]:
    """Each node with its ranks (the master's first, in the inventory's order)."""
    if inventory is None:
        return [{"name": socket.gethostname(), "ranks": None}]  # this machine
    nodes, first = [], 0
    for host in inventory.hosts:
        count = nproc_for(host, spec)
        nodes.append({"name": host.name, "ranks": [first, first + count - 1]})
        first += count
    return nodes


def _netcheck_file(spec: JobSpec, inventory: Inventory | None) -> Path | None:
    """netcheck's findings file the job's interface settings come from, if there is one."""
    if inventory is None:
        return None
    from torch_multinode.netcheck import envfile

    path = spec.env_file or envfile.default_path(inventory.path)
    return path if path.is_file() else None


def begin(
    spec: JobSpec,
    argv: list[str],
    inventory: Inventory | None,
    project: Path,
    origin: dict[str, Any] | None = None,
    dependencies: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of a job about to start, written at once (result "running"): what the
    command line and the inventory say, and the project's dependencies as made ready for it
    (provision.dependencies' record). Nothing is run for it: the code and the image are added
    once the job has begun (`started`)."""
    env_file = _netcheck_file(spec, inventory)
    for place in places(spec):
        place.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "format": FORMAT,
        "id": spec.run_id,
        "command": [Path(sys.argv[0]).name, *redacted(argv)],
        "workload": str(spec.script) if spec.script else spec.module,
        "args": list(spec.args),
        "backend": "local"
        if inventory is None
        else "slurm"
        if inventory.scheduler == "slurm"
        else "ssh",
        "launch_mode": None if inventory is None else inventory.launch_mode,
        "image": None,  # `started`
        "dependencies": dependencies,  # None: the project has no requirements
        "inventory": None
        if inventory is None
        else {"path": str(inventory.path), "sha256": _digest(inventory.path)},
        "nodes": _nodes(inventory, spec),
        "cwd": str(Path.cwd()),
        "code": None,  # `started`
        "env_names": sorted(name for name, _ in spec.secret_env),
        "netcheck": None
        if env_file is None
        else {"path": str(env_file), "sha256": _digest(env_file)},
        "started": _now(),
        "ended": None,
        "seconds": None,
        "result": "running",
        "exit_code": None,
        "failed_node": None,
        "restarts": 0,
        "last_step": None,
        "tensorboard": None,
        "checkpoints": _argument(spec.args, "--checkpoint-dir"),  # absolute: cli resolves it
        "outputs": outputs(spec, project, here=inventory is None),
        "versions": None,  # each node's, as the job found them (cluster.version_lock); at its end
        "drift": None,  # what changed since netcheck locked them, for a job run with ALLOW_DRIFT
        "allow_drift": spec.allow_drift,
        "rerun_of": None,  # the run a `make rerun` ran again
    }
    if origin is not None:  # a rerun: its origin's command and workload, not the copy's paths
        record.update(command=origin["command"], workload=origin["workload"], rerun_of=origin["id"])
    write(spec, record)
    return record


def redacted(argv: list[str]) -> list[str]:
    """The launcher's arguments with every --env value left out (NAME=VALUE becomes NAME: a
    rerun passes that machine's value); what follows `--` is the job's own and kept."""
    kept, options = [], True
    for index, word in enumerate(argv):
        if word == "--":
            options = False
        elif options and index > 0 and argv[index - 1] == "--env":
            word = " ".join(item.partition("=")[0] for item in word.split())
        elif options and word.startswith("--env="):
            word = "--env=" + " ".join(item.partition("=")[0] for item in word[6:].split())
        kept.append(word)
    return kept


def outputs(spec: JobSpec, project: Path, here: bool = True) -> dict[str, str]:
    """Where the job's outputs go, for each of staging.OUTPUT_FLAGS it was given: a relative
    --checkpoint-dir is already absolute (under its root: launch.cli), a relative --out of our
    workloads lands in the run directory (.runs/ID here, where the nodes' comes back), any other
    relative path in the job's directory: the project, for a job `here`; on the nodes, their
    copy of it (the path then as given, relative to it)."""
    found = {}
    for _, flag, value, _ in staging.flag_values(spec.args, staging.OUTPUT_FLAGS):
        if Path(value).is_absolute():
            found[flag] = value
        elif flag == "--out" and spec.script is None:
            found[flag] = str((spec.log_dir or RUNS_ROOT / spec.run_id).resolve() / value)
        else:
            found[flag] = str(project / value) if here else value
    return found


def _argument(args: tuple[str, ...], flag: str) -> str | None:
    for index, word in enumerate(args):
        if word == flag and index + 1 < len(args):
            return args[index + 1]
        if word.startswith(f"{flag}="):
            return word.split("=", 1)[1]
    return None


def last_step(directories: list[Path]) -> str | None:
    """The newest step line of the job's logs (NODE.log) in these directories."""
    found: list[tuple[float, str]] = []
    for directory in directories:
        for log in directory.glob("*.log"):
            try:
                with log.open("rb") as stream:
                    stream.seek(max(0, log.stat().st_size - _TAIL_BYTES))
                    lines = stream.read().decode(errors="replace").splitlines()
            except OSError:
                continue
            steps = [line.strip() for line in lines if _STEP.search(line)]
            if steps:
                found.append((log.stat().st_mtime, steps[-1][:300]))
    return max(found)[1] if found else None


def last_step_number(log_dir: Path | None) -> int | None:
    """The step of the newest step line in the job's logs (NODE.log in `log_dir`), if any."""
    line = last_step([log_dir]) if log_dir is not None else None
    found = _STEP.search(line) if line else None
    return int(found.group(1)) if found else None


def finish(
    record: dict[str, Any],
    spec: JobSpec,
    result: JobResult | None,
    exit_code: int,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """The record of a job that ended (`result` None: refused or broken before it ran), written
    whole over the first."""
    log_dir = spec.log_dir or RUNS_ROOT / spec.run_id
    started = datetime.datetime.fromisoformat(record["started"])
    ended = datetime.datetime.now(datetime.UTC)
    directories = [log_dir] + ([run_dir] if run_dir is not None and run_dir != log_dir else [])
    board = next((d / "tensorboard" for d in directories if (d / "tensorboard").is_dir()), None)
    record.update(
        ended=ended.isoformat(timespec="seconds"),
        seconds=round((ended - started).total_seconds(), 1),
        exit_code=exit_code,
        result=_result(result, exit_code),
        failed_node=None if result is None or result.interrupted else result.failed_node,
        restarts=0 if result is None else result.restart,
        nodes_changed=list(result.nodes_changed) if result is not None else [],
        stragglers=list(result.stragglers) if result is not None else [],
        versions=None if result is None or not result.versions else result.versions,
        drift=None if result is None or not result.drift else result.drift,
        last_step=last_step(directories),
        tensorboard=None if board is None else str(board.resolve()),  # whatever the reader's cwd
        run_dir=str((run_dir if run_dir is not None else log_dir).resolve()),
    )
    write(spec, record)
    return record


def _result(result: JobResult | None, exit_code: int) -> str:
    if result is None:  # broke off with an error or an interruption after it had begun
        return "interrupted" if exit_code in (INTERRUPTED_EXIT, TERMINATED_EXIT) else "error"
    if result.interrupted:
        return "interrupted"
    return "succeeded" if result.exit_code == 0 else "failed"


def write(spec: JobSpec, record: dict[str, Any]) -> None:
    for place in places(spec):
        files.write_atomically(place / RECORD, json.dumps(record, indent=2) + "\n")
