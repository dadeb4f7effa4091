"""What `train` refuses or adjusts on the controller before anything starts (issue 28, findings
7 and 8): a SCRIPT= that is not Python, an NNODES= that is not a number, and a global batch
against the job's world size (a default one rounded to it, one the user chose refused)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.helpers import inventory_text, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.training.settings import arguments

NOT_DIVISIBLE = (
    "Error: global batch 64 is not divisible by world size 3 (try --global-batch-size 63)"
)


def _error_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.strip()]


def test_a_script_that_does_not_compile_is_refused_naming_the_file_and_line(tmp_path):
    done = run_cli("train", "--script", "/etc/passwd", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""  # no "[launcher] local job" line: nothing was started
    assert _error_lines(done) == [
        "Error: script /etc/passwd: SyntaxError at line 1: invalid syntax "
        "(try SCRIPT=path/to/train.py, a Python file)"
    ]
    broken = tmp_path / "train.py"
    broken.write_text("import os\n\ndef main(:\n    pass\n")
    done = run_cli("train", "--script", str(broken), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    [line] = _error_lines(done)
    assert line.startswith(f"Error: script {broken}: SyntaxError at line 3: "), line
    assert "(try" not in line  # a .py file: what is wrong is the line Python names


def test_nnodes_that_is_not_a_number_says_so_without_an_inventory():
    done = run_cli("train", "--nnodes", "abc", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert _error_lines(done) == ["Error: NNODES='abc' is not a whole number"]
    done = run_cli("train", "--nnodes", "2", timeout=60)  # a number: it needs an inventory
    assert done.returncode == 2
    assert _error_lines(done)[0].startswith("Error: NNODES=2 needs an inventory")


@pytest.mark.parametrize(
    ("module", "default", "fitted"),
    [("training.ddp", 64, 63), ("training.manual_dp", 64, 63), ("training.fsdp", 16, 15)],
)
def test_a_default_global_batch_is_rounded_to_a_world_of_three(module, default, fitted):
    from torch_multinode.training.distributed import parallel

    parse = arguments.CHECKS[module]
    assert parse([]).optim.global_batch_size == default  # world unknown: as written
    config = parse([], 3)
    assert config.optim.global_batch_size == fitted
    # what the workload then does on each of the 3 ranks: no error
    env = parallel.DistEnv(rank=2, world_size=3, launched=True)
    assert parallel.per_rank_batch(config.optim.global_batch_size, env) == fitted // 3
    assert arguments.check(module, [], 3) == (
        f"global batch {fitted} (the default {default} rounded to a multiple of the world size 3)"
    )
    assert arguments.check(module, [], 4) is None  # it fits: nothing to say
    # More ranks than the default batch: one sequence per rank.
    assert parse([], 100).optim.global_batch_size == 100


@pytest.mark.parametrize("module", ["training.ddp", "training.manual_dp", "training.fsdp"])
def test_a_global_batch_the_user_chose_is_refused_as_the_workload_would(module, tmp_path):
    from torch_multinode.training.distributed import parallel

    with pytest.raises(UserError) as on_rank:
        parallel.per_rank_batch(64, parallel.DistEnv(world_size=3, launched=True))
    assert on_rank.value.line() == NOT_DIVISIBLE
    for argv in (
        ["--global-batch-size", "64"],
        ["--config", str(_config_file(tmp_path))],  # in the file: chosen too
    ):
        with pytest.raises(UserError) as refused:
            arguments.check(module, argv, 3)
        assert refused.value.line() == NOT_DIVISIBLE
    assert arguments.check(module, ["--global-batch-size", "63"], 3) is None


def _config_file(tmp_path):
    path = tmp_path / "batch.yml"
    path.write_text("optim: {global_batch_size: 64}\n")
    return path


def test_the_controller_refuses_an_explicit_batch_for_three_nodes_before_any_node(tmp_path):
    """Three nodes of one process each: the launcher knows the world size is 3 before it
    touches a node (SSH goes to loopback addresses here, and is never reached)."""
    hosts = {f"node{i}": node(i, ansible_host=f"127.0.1.{i}") for i in (1, 2, 3)}
    path = tmp_path / "inventory.yml"
    path.write_text(inventory_text(hosts))
    for module in ("training.ddp", "training.fsdp"):
        done = run_cli(
            "train", "-i", str(path), "--module", module, "--", "--global-batch-size", "64"
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == ""  # no "[launcher] job" line
        assert _error_lines(done) == [NOT_DIVISIBLE]


def test_a_local_job_of_three_processes_refuses_an_explicit_batch_before_starting():
    done = run_cli("train", "--nproc-per-node", "3", "--", "--global-batch-size", "64")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert _error_lines(done) == [NOT_DIVISIBLE]


@pytest.mark.timeout(600)
def test_the_default_fsdp_job_runs_on_three_local_processes_saying_the_rounded_batch():
    done = run_cli(
        "train",
        "--nproc-per-node",
        "3",
        "--module",
        "training.fsdp",
        "--",
        "--steps",
        "2",
        timeout=500,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(line for line in done.stdout.splitlines() if "[launcher] local job" in line)
    assert header.endswith(
        "; global batch 15 (the default 16 rounded to a multiple of the world size 3)"
    ), header
    assert "batch    5 sequences of 64 tokens per rank x 3 ranks" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
