"""DataParallel vs DDP: refused plainly without two GPUs; the code path checked on CPU."""

from __future__ import annotations

import pytest

from torch_multinode.training.dp_vs_ddp import EXIT_NEEDS_GPUS

NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # the same outcome on a machine that has GPUs


def test_without_two_gpus_it_says_so_and_exits_69(python_module):
    run = python_module("training.dp_vs_ddp", env=NO_GPUS)
    assert EXIT_NEEDS_GPUS == 69
    assert (run.returncode, run.stdout) == (69, "")
    assert run.stderr == (
        "Error: dp_vs_ddp needs two or more GPUs on this machine, found 0 "
        "(try a multi-GPU node, or --cpu 2 to check the code path in about 30 s)\n"
    )


@pytest.mark.extended
def test_the_comparison_runs_on_cpu_processes(python_module):
    run = python_module(
        "training.dp_vs_ddp",
        "--cpu",
        "2",
        "--model",
        "tiny",
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--num-classes",
        "10",
        "--steps",
        "2",
        "--warmup",
        "1",
        env=NO_GPUS,
    )
    assert run.returncode == 0, run.explain()
    lines = run.stdout.splitlines()
    assert (
        lines[0]
        == "tiny, batch 4 per process x 2 = 8, 16px, 2 timed steps after 1, on 2 CPU processes"
    )
    # Progress: each phase as it starts (more lines, timed, on a slow machine), then the table.
    said = [line for line in lines if line.startswith(("DataParallel: ", "DDP: "))]
    for line in (
        "DataParallel: 3 steps in this process",
        "DDP: starting 2 processes on 127.0.0.1",
        "DDP: 2 processes joined, 3 steps each",
    ):
        assert line in said, run.stdout
    lines = [lines[0], *(line for line in lines[1:] if line not in said)]
    assert lines[1].split() == ["DataParallel", "DDP"]
    assert lines[2].startswith("time per step") and lines[2].count(" ms") == 2
    assert lines[4].split() == ["peak", "memory", "n/a", "(CPU)", "n/a", "(CPU)"]
