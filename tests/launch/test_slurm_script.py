"""The Slurm job's pieces that need no cluster: the batch script, the follower of a node's
output, and reading Slurm's answers (scontrol's job line, the queue's order)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from tests.helpers import inventory, node
from torch_multinode.launch import slurm_script, slurm_state
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.spec import JobSpec

SPEC = JobSpec(run_id="tmn-0123456789", args=("--steps", "3"))


def _inventory():
    return inventory({"node1": node(1), "node2": node(2)}, scheduler="slurm")


def test_the_batch_script_asks_for_exactly_the_jobs_nodes_and_runs_each_ones_command(tmp_path):
    commands = {"node1": "echo 'one' && exec true", "node2": "echo two"}
    script = slurm_script.batch_script(_inventory(), SPEC, commands, requeue=False)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    assert directives == [
        "#SBATCH --job-name=tmn-0123456789",
        "#SBATCH --nodes=2",
        "#SBATCH --nodelist=node1,node2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --output=/tmp/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --no-requeue",
    ]
    # each node's command in a subshell of its own (an `exec` there must not end the task
    # before its exit status is written)
    assert "node1) ( echo 'one' && exec true ) ;;" in lines
    assert "node2) ( echo two ) ;;" in lines
    requeued = slurm_script.batch_script(_inventory(), SPEC, commands, requeue=True)
    assert "#SBATCH --requeue" in requeued
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0


def test_gpu_nodes_ask_slurm_for_the_gpus_the_job_uses_there():
    both = {"node1": "true", "node2": "true"}
    two = inventory({"node1": node(1, gpus=2), "node2": node(2, gpus=2)}, scheduler="slurm")
    assert "\n#SBATCH --gres=gpu:2\n" in slurm_script.batch_script(two, SPEC, both, False)
    selected = JobSpec(run_id="tmn-x", gpus=(1,))
    assert "\n#SBATCH --gres=gpu:1\n" in slurm_script.batch_script(two, selected, both, False)
    mixed = inventory({"node1": node(1, gpus=2), "node2": node(2, gpus=4)}, scheduler="slurm")
    script = slurm_script.batch_script(mixed, SPEC, both, False)
    assert (
        "# GPUs used per node: node1 2, node2 4; Slurm asks every node for the same count\n"
        "#SBATCH --gres=gpu:2\n" in script
    )
    assert "--gres" not in slurm_script.batch_script(_inventory(), SPEC, both, False)


def test_a_node_with_more_gpus_than_the_gres_request_sees_all_the_job_uses_there(tmp_path):
    """Unequal nodes (2 and 4 GPUs): Slurm asks gpu:2 of each and sets CUDA_VISIBLE_DEVICES=0,1 in
    the task, so in host mode torchrun's ranks 2 and 3 on node2 found no GPU. The task drops
    Slurm's pick: a node's command sees only what the launcher gives it (GPUS=, else all)."""
    mixed = inventory({"node1": node(1, gpus=2), "node2": node(2, gpus=4)}, scheduler="slurm")
    spec = JobSpec(run_id="tmn-gres")
    commands = {
        "node1": 'echo "seen ${CUDA_VISIBLE_DEVICES-all}"',
        "node2": 'echo "seen ${CUDA_VISIBLE_DEVICES-all}"; CUDA_VISIBLE_DEVICES=1,3 sh -c '
        "'echo \"selected $CUDA_VISIBLE_DEVICES\"'",
    }
    script = slurm_script.batch_script(mixed, spec, commands, requeue=False)
    assert "#SBATCH --gres=gpu:2\n" in script
    task = script.split("<<'END_OF_TASK'\n", 1)[1].split("\nEND_OF_TASK", 1)[0]
    task = task.replace(run_dir(spec), str(tmp_path))
    slurm_env = {"SLURM_RESTART_COUNT": "0", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    for name in ("node1", "node2"):
        done = subprocess.run(
            ["bash", "-c", task], env={**slurm_env, "SLURMD_NODENAME": name}, check=False
        )
        assert done.returncode == 0
    assert (tmp_path / "slurm-node1-0.log").read_text().startswith("seen all\n")
    assert (tmp_path / "slurm-node2-0.log").read_text().startswith("seen all\nselected 1,3\n")


def test_the_task_writes_its_nodes_output_and_exit_status_to_its_file(tmp_path):
    """The script's task, run here as srun would on node2 (commands pointing at tmp_path)."""
    spec = JobSpec(run_id="tmn-task")
    commands = {"node1": "exit 9", "node2": "echo 'hello from two'; exit 3"}
    script = slurm_script.batch_script(_inventory(), spec, commands, requeue=False)
    task = script.split("<<'END_OF_TASK'\n", 1)[1].split("\nEND_OF_TASK", 1)[0]
    task = task.replace(run_dir(spec), str(tmp_path))
    done = subprocess.run(
        ["bash", "-c", task],
        env={"SLURMD_NODENAME": "node2", "SLURM_RESTART_COUNT": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 3
    assert (tmp_path / "slurm-node2-1.log").read_text() == (
        f"hello from two\n{slurm_script.EXIT_MARKER} 3\n"
    )


def _follow(path) -> subprocess.Popen:
    command = [sys.executable, "-c", slurm_script.FOLLOWER, str(path), slurm_script.EXIT_MARKER]
    return subprocess.Popen(command, stdout=subprocess.PIPE)


def test_the_follower_prints_the_file_as_it_grows_and_exits_with_the_nodes_status(tmp_path):
    path = tmp_path / "out.log"
    follower = _follow(path)  # before the file exists: it waits for it
    time.sleep(0.3)
    with path.open("ab") as out:
        out.write(b"line one\nprogress 10%\r")
        out.flush()
        time.sleep(0.4)
        out.write(b"progress 90%\rdone\n" + slurm_script.EXIT_MARKER.encode())
        out.flush()
        time.sleep(0.4)
        out.write(b" 7\n")
    said, _ = follower.communicate(timeout=10)
    assert follower.returncode == 7
    assert said == b"line one\nprogress 10%\rprogress 90%\rdone\n"


def test_the_follower_shows_a_redrawn_line_before_it_ends(tmp_path):
    path = tmp_path / "out.log"
    path.write_bytes(b"epoch 1: 50%\r")
    follower = _follow(path)
    seen: list[bytes] = []
    reader = threading.Thread(target=lambda: seen.append(follower.stdout.read1(100)))
    reader.start()
    reader.join(5)
    assert seen == [b"epoch 1: 50%\r"]
    with path.open("ab") as out:
        out.write(f"\n{slurm_script.EXIT_MARKER} 0\n".encode())
    follower.communicate(timeout=10)
    assert follower.returncode == 0


def test_scontrols_job_line_is_read_for_state_reason_nodes_and_requeues():
    line = (
        "JobId=7 JobName=tmn-a UserId=root(0) JobState=PENDING Reason=BeginTime Dependency=(null) "
        "Requeue=1 Restarts=1 BatchFlag=1 NodeList=node[1-2] ExitCode=1:0"
    )
    expected = slurm_state.JobState("PENDING", "BeginTime", "node[1-2]", 1)
    assert slurm_state.parse_job(line) == expected
    assert not slurm_state.parse_job(line).ended
    assert slurm_state.parse_job("JobId=7 JobState=NODE_FAIL Reason=NodeDown").ended
    assert slurm_state.parse_job("slurm_load_jobs error: Invalid job id specified") is None


def test_the_queue_position_counts_running_jobs_first_then_slurms_order():
    listing = "12|tmn-b|ann|PENDING\n11|tmn-a|bob|RUNNING\n13|tmn-c|root|PENDING\n"
    assert slurm_state.queue_position(listing, "13") == (3, "job 12 (tmn-b, ann, pending)")
    assert slurm_state.queue_position(listing, "12") == (2, "job 11 (tmn-a, bob, running)")
    assert slurm_state.queue_position(listing, "11") == (1, "")
    assert slurm_state.queue_position(listing, "99") is None
