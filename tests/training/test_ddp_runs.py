"""Whole DDP runs: the default one learns, and the DDP options, metrics and profiler all work."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import make
from tests.helpers import REPO_ROOT
from tests.training.conftest import REFERENCE_STEPS, TINY, Finished, run_environment
from torch_multinode.training.distributed.parallel import DistEnv

HANG_GUARD_SECONDS = 900  # against a hang only; the run's speed is a benchmark's business


def test_the_default_run_learns_the_synthetic_task(tmp_path):
    """README's `make train`: the default job on this machine (two processes on a machine
    without a GPU), which tests/test_readme_commands.py counts on this test to run. Its exit
    code goes to a file of this test's own (EXIT_CODE=), not the .runs/exit-code the README's
    own check reads, beside it in another worker."""
    done = make("train", f"EXIT_CODE={tmp_path / 'exit-code'}", timeout=HANG_GUARD_SECONDS)
    run = Finished(done.args, done.returncode, done.stdout, done.stderr)
    assert run.returncode == 0, run.explain()
    job = re.search(r"^Job (\S+) succeeded after [\d.]+ s on this machine\.$", run.stdout, re.M)
    assert job, run.explain()
    shutil.rmtree(REPO_ROOT / ".runs" / job.group(1), ignore_errors=True)
    assert (tmp_path / "exit-code").read_text().strip() == "0"
    assert run.lines("world    ") == ["world    2 processes on 1 node(s), gloo, cpu"]
    assert run.lines("batch    ") == ["batch    32 per rank x 2 ranks = 64 global"]
    assert run.lines("model    ")[0].startswith("model    resnet18, 11.18M parameters, fp32")
    accuracy = re.search(r"val accuracy +([\d.]+)% of 1024 samples", run.stdout)
    assert accuracy and float(accuracy.group(1)) >= 90.0, run.explain()
    digests = run.digests()
    assert sorted(digests) == [0, 1] and digests[0] == digests[1]


def test_ddp_options_profiler_and_metrics(torchrun, tmp_path, reference_ddp):
    run_dir = tmp_path / "run"
    arguments = [a for a in TINY if a != "--no-tensorboard"]
    run = torchrun(
        "training.ddp",
        *arguments,
        "--steps",
        str(REFERENCE_STEPS),
        "--comm-hook",
        "powersgd",
        "--powersgd-start-step",
        "2",
        "--static-graph",
        "--gradient-as-bucket-view",
        "--bucket-cap-mb",
        "1",
        "--profile",
        "--run-dir",
        str(run_dir),
    )
    assert run.returncode == 0, run.explain()
    digests = run.digests()
    assert sorted(digests) == [0, 1] and digests[0] == digests[1]
    # Compression changed the updates: the hook really ran.
    assert digests[0] != reference_ddp.finished.digests()[0]
    progress = run.lines("samples/s/rank")
    assert len(progress) == 3 and progress[-1].startswith("step 12/12  loss ")
    assert re.fullmatch(
        r"step 12/12  loss \d+\.\d{4}  acc +\d+\.\d%  lr 0\.2  "
        r"[\d,]+ samples/s/rank  [\d,]+ samples/s total",
        progress[-1],
    )
    traces = sorted(p.name.split(".")[0] for p in (run_dir / "profile").glob("*.pt.trace.json"))
    assert traces == ["rank0", "rank1"]
    if importlib.util.find_spec("tensorboard") is None:
        assert run.lines("TensorBoard") == [
            "TensorBoard is not installed: skipping scalars (pip install tensorboard)"
        ]
    else:
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("hook", ["none", "fp16", "bf16", "powersgd"])
def test_each_comm_hook_is_registered_and_compresses(hook):
    # One rank on a real gloo group, in a process of its own (tests/training/comm_hook_probe.py).
    probe = subprocess.run(
        [sys.executable, "-m", "tests.training.comm_hook_probe", hook],
        cwd=REPO_ROOT,
        env=run_environment(None),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    found = re.search(r"^relative error (\S+)$", probe.stdout, re.MULTILINE)
    assert found, probe.stdout + probe.stderr
    error = float(found.group(1))
    # Compression is lossy, which shows the gradients went through the hook; rank-1 PowerSGD
    # is a coarse approximation, the float casts are not.
    if hook == "none":
        assert error == 0.0
    else:
        assert 0.0 < error < {"fp16": 1e-3, "bf16": 1e-2, "powersgd": 1.0}[hook]


def test_the_profiler_pauses_once_before_it_stops_and_writes_its_trace(tmp_path, monkeypatch):
    from torch_multinode.training.loop import metrics

    pauses: list[int] = []
    steps_done: list[int] = []
    real_sleep = metrics.time.sleep
    monkeypatch.setattr(
        metrics.time, "sleep", lambda s: (pauses.append(len(steps_done)), real_sleep(0))[1]
    )
    total = metrics.PROFILE_WAIT + metrics.PROFILE_WARMUP + metrics.PROFILE_ACTIVE + 2
    with metrics.profiler(DistEnv(), tmp_path, True) as profiler:
        for step in range(total):
            torch.ones(8).sum()
            profiler.step()
            steps_done.append(step)
    # Only the step that ends the recording waits, and the trace was written after it.
    assert pauses == [metrics.PROFILE_WAIT + metrics.PROFILE_WARMUP + metrics.PROFILE_ACTIVE - 1]
    assert [p.name.split(".")[0] for p in (tmp_path / "profile").glob("*.pt.trace.json")] == [
        "rank0"
    ]
