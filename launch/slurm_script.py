"""The Slurm job's batch script and the paths it writes to, on the master and the nodes, as pure
functions of the job: the script asks Slurm for exactly the job's nodes, waits for the
launcher's go file, and runs each node's command with its output into a file of its own that
ends with the EXIT_MARKER line; FOLLOWER, run on each node over SSH, prints that file as it
grows and exits with the node's status."""

from __future__ import annotations

import shlex

from torch_multinode.cluster.inventory import Inventory
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.nodes import visible_gpus
from torch_multinode.launch.spec import JobSpec

SCRIPT_NAME = "job.sbatch"
EXIT_MARKER = "tmn-slurm-task-exit"
"""The last line of a node's output file: its part's exit status (the follower exits with it)."""
GO_WAIT = 600  # seconds the batch script waits for the launcher's go before giving up
# Python on the node: print the file as it grows (waiting for it to exist), until the line
# EXIT_MARKER N, then exit N. Text after the last newline is printed at once (a progress bar
# redrawn with "\r" must show), unless it may be the start of the marker's line.
FOLLOWER = r"""
import os, sys, time
path, marker = sys.argv[1], sys.argv[2].encode() + b" "
while not os.path.exists(path):
    time.sleep(0.2)
out, pending, start = sys.stdout.buffer, b"", True
with open(path, "rb") as f:
    while True:
        chunk = f.read(65536)
        if not chunk:
            time.sleep(0.1)
            continue
        pending += chunk
        while pending:
            line, newline, rest = pending.partition(b"\n")
            if start and line.startswith(marker) and newline:
                out.flush()
                sys.exit(int(line[len(marker):].split()[0]))
            if not newline and start and marker.startswith(line[: len(marker)]):
                break  # perhaps the marker, still being written
            out.write(line + newline)
            start, pending = bool(newline), rest
        out.flush()
"""


def script_path(spec: JobSpec) -> str:
    """Where the batch script is on the master: in the job's run directory."""
    return f"{run_dir(spec)}/{SCRIPT_NAME}"


def go_path(spec: JobSpec) -> str:
    return f"{run_dir(spec)}/go"


def output_path(spec: JobSpec, node: str, attempt: int | str) -> str:
    """A node's output for one attempt (SLURM_RESTART_COUNT), on that node."""
    return f"{run_dir(spec)}/slurm-{node}-{attempt}.log"


def batch_script(
    inventory: Inventory, spec: JobSpec, commands: dict[str, str], requeue: bool
) -> str:
    """The batch script for the job: a plain sbatch script, which a user could submit by hand
    from the master (the project already on every node). `commands`: each node's command, as
    the SSH launcher would run it there."""
    names = [host.name for host in inventory.hosts]
    directory = run_dir(spec)
    cases = "\n".join(f"{name}) ( {commands[name]} ) ;;" for name in names)
    task = f"""\
attempt=${{SLURM_RESTART_COUNT:-0}}
out={shlex.quote(directory)}/slurm-$SLURMD_NODENAME-$attempt.log
mkdir -p {shlex.quote(directory)}
# Slurm sets CUDA_VISIBLE_DEVICES to the GPUs of the GRES request, the same count on every node;
# the job holds its nodes whole (--exclusive), and each node's command names its own GPUs (GPUS=,
# the host's selection) or uses all it has, as over SSH. That holds because the slurm role's
# slurm.conf confines no devices (TaskPlugin=task/none): with ConstrainDevices it would not.
unset CUDA_VISIBLE_DEVICES
case "$SLURMD_NODENAME" in
{cases}
*) echo "$SLURMD_NODENAME is not one of this job's nodes ({", ".join(names)})"; false ;;
esac >"$out" 2>&1
code=$?
echo "{EXIT_MARKER} $code" >>"$out"
exit $code"""
    what = f"script {spec.script}" if spec.script else f"module {spec.module}"
    gres = _gpu_request(inventory, spec)
    return f"""\
#!/bin/bash
# torch-multinode job {spec.run_id}: {what} on {", ".join(names)}
# (inventory {inventory.path}). Made by `make train`, which saves it in .runs/{spec.run_id}/.
# By hand, from {names[0]}, once the project is on every node: sbatch {SCRIPT_NAME}
# Each node's output: {directory}/slurm-NODE-ATTEMPT.log on that node.
#SBATCH --job-name={spec.run_id}
#SBATCH --nodes={len(names)}
#SBATCH --nodelist={",".join(names)}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=/tmp/%x-%j.out
#SBATCH --open-mode=append
#SBATCH {"--requeue" if requeue else "--no-requeue"}
{gres}set -u
if [ -n "${{TMN_GO_FILE:-}}" ]; then
    # make train sends the project once the nodes are this job's, then writes this file.
    for _ in $(seq {GO_WAIT * 5}); do [ -e "$TMN_GO_FILE" ] && break; sleep 0.2; done
    [ -e "$TMN_GO_FILE" ] || {{ echo "no go from make train within {GO_WAIT} s"; exit 1; }}
    rm -f "$TMN_GO_FILE"  # a requeued run waits for a go of its own
fi
# One task per node: that node's command, its output into its file, then its exit status.
read -r -d '' TASK <<'END_OF_TASK'
{task}
END_OF_TASK
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c "$TASK"
"""


def _gpu_request(inventory: Inventory, spec: JobSpec) -> str:
    """The GPUs the job holds on each node, as Slurm's GRES request ('' on CPU nodes): what the
    job uses there (GPUS=, the host's selection, else all of them). `--gres` asks the same count
    of every node (Slurm's sbatch: "per node"); where the job uses more on some, the smallest is
    asked, for Slurm's accounting only: the job holds its nodes whole (--exclusive), and the task
    drops the CUDA_VISIBLE_DEVICES Slurm derives from the request, so that a host-mode node with
    more GPUs than the smallest runs a rank on each of them, as the launcher counted."""
    counts = []
    for host in inventory.hosts:
        selected = visible_gpus(host, spec)
        counts.append(len(selected) if selected is not None else host.gpu_count)
    if not all(counts):
        return ""
    line = f"#SBATCH --gres=gpu:{min(counts)}\n"
    if len(set(counts)) > 1:
        used = ", ".join(f"{h.name} {n}" for h, n in zip(inventory.hosts, counts, strict=True))
        line = f"# GPUs used per node: {used}; Slurm asks every node for the same count\n" + line
    return line


def follow_command(path: str) -> str:
    return f"python3 -c {shlex.quote(FOLLOWER)} {shlex.quote(path)} {EXIT_MARKER}"
