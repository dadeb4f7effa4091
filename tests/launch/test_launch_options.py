"""Meeting users where they are: GPU selection, the debug switch, scripts written for
torch.distributed.launch, and the three init methods."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from tests.conftest import make, run_cli
from tests.helpers import SCRIPTS, inventory, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch.commands import remote_command
from torch_multinode.launch.nodes import (
    entry_point,
    gpu_problem,
    job_backend,
    legacy_flag,
    nproc_for,
)
from torch_multinode.launch.spec import JobSpec


def _gpu_inventory(big_gpus: int = 4):
    """A node with 4 GPUs, one with 2 of which its own selection is GPU 1, and a CPU node."""
    hosts = {
        "big": node(1, gpus=big_gpus),
        "small": node(2, gpus=2, cuda_visible_devices="1"),
        "cpu": node(3),
    }
    return inventory(hosts, "inv.yml", launch_mode="container")


def _command(host, spec, inventory) -> list[str]:
    master = inventory.hosts[0]
    return shlex.split(remote_command(host, master, 2, spec, 29500, {}, "container", "img:1"))


def test_gpu_selection_sets_visible_devices_and_process_count():
    inventory = _gpu_inventory()
    big, small, _ = inventory.hosts
    spec = JobSpec(run_id="tmn-g", gpus=(0, 2))
    words = _command(big, spec, inventory)
    assert "CUDA_VISIBLE_DEVICES=0,2" in words and "--nproc-per-node=2" in words
    assert words[words.index("--gpus") + 1] == "all"
    # The inventory's per-host selection wins for that host.
    words = _command(small, spec, inventory)
    assert "CUDA_VISIBLE_DEVICES=1" in words and "--nproc-per-node=1" in words
    # Without a selection: every GPU the node has, one process each, no CUDA_VISIBLE_DEVICES.
    words = _command(big, JobSpec(run_id="tmn-g"), inventory)
    assert "--nproc-per-node=4" in words
    assert not any(w.startswith("CUDA_VISIBLE_DEVICES=") for w in words)


@pytest.mark.parametrize(
    "host_index, gpus, message",
    [
        (0, (0, 4), "GPUS=0,4 asks for GPU 4, but node 'big' has 4 GPU(s) (0-3)"),
        (2, (0,), "GPUS=0 but node 'cpu' has no GPU (inventory gpus: 0)"),
    ],
)
def test_gpu_selection_is_checked_against_each_node(host_index, gpus, message):
    inventory = _gpu_inventory()
    with pytest.raises(UserError) as caught:
        nproc_for(inventory.hosts[host_index], JobSpec(gpus=gpus))
    assert str(caught.value) == message


def test_gpus_on_a_cpu_machine_is_one_clear_line():
    proc = run_cli("train", "--gpus", "0")
    assert proc.returncode == 2
    assert proc.stderr == (
        "Error: GPUS=0 but this machine has no GPU (try leaving GPUS unset; NPROC= sets the "
        "process count)\n"
    )
    proc = run_cli("train", "--gpus", "0,zero")
    assert proc.returncode == 2
    assert (
        proc.stderr == "Error: GPUS: '0,zero' is not a list of GPU indices (try a form like 0,2)\n"
    )


def test_debug_turns_on_the_backends_logs_for_that_run():
    inventory = _gpu_inventory()
    words = _command(inventory.hosts[0], JobSpec(run_id="tmn-d", debug="info"), inventory)
    for variable in (
        "NCCL_DEBUG=INFO",
        "NCCL_DEBUG_SUBSYS=INIT,NET",
        "TORCH_DISTRIBUTED_DEBUG=INFO",
        "TORCH_CPP_LOG_LEVEL=INFO",
    ):
        assert variable in words
    detail = _command(inventory.hosts[0], JobSpec(run_id="tmn-d", debug="detail"), inventory)
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in detail
    quiet = _command(inventory.hosts[0], JobSpec(run_id="tmn-d"), inventory)
    assert not any(w.startswith("NCCL_DEBUG=") for w in quiet)


def test_legacy_scripts_are_detected_by_the_flag_they_declare(tmp_path):
    assert legacy_flag(SCRIPTS / "legacy_local_rank.py") == "--local_rank"
    assert legacy_flag(SCRIPTS / "tutorial_ddp.py") is None
    both = tmp_path / "both.py"
    both.write_text('p.add_argument("--local-rank", "--local_rank", type=int)\n')
    assert legacy_flag(both) == "--local-rank"
    spec = JobSpec(script=both, local_rank_flag="--local-rank", run_id="tmn-l")
    assert entry_point(spec, "/run") == [
        "-m",
        "torch_multinode.training.legacy",
        "--flag=--local-rank",
        "/run/both.py",
    ]


# --- On the simulated cluster -------------------------------------------------------------


@pytest.mark.extended
@pytest.mark.sim
def test_debug_output_shows_backend_lines_from_every_node(sim2, tmp_path):
    proc = run_cli(
        "train",
        "-i",
        str(sim2.config.inventory_path),
        "--debug",
        "--log-dir",
        str(tmp_path),
        "--script",
        str(SCRIPTS / "tutorial_ddp.py"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert f"each node's log: {tmp_path}/NODE.log" in proc.stdout
    for name, rank in (("node1", 0), ("node2", 1)):
        # The C++ side's own log lines (DDP's logger, the reducer), from that node's rank.
        backend = [
            line
            for line in proc.stdout.splitlines()
            if line.startswith(f"[{name}] [rank{rank}]:[I") and "DDP Initialized with" in line
        ]
        assert backend, f"no backend debug line from {name}"
        assert "DDP Initialized with" in (tmp_path / f"{name}.log").read_text()


@pytest.mark.sim
def test_legacy_local_rank_script_trains_on_two_nodes_unchanged(sim2):
    proc = run_cli(
        "train",
        "-i",
        str(sim2.config.inventory_path),
        "--script",
        str(SCRIPTS / "legacy_local_rank.py"),
        "--",
        "--steps",
        "3",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "[launcher] legacy_local_rank.py parses --local_rank: passing it the local rank" in (
        proc.stdout
    )
    lines = sorted(line for line in proc.stdout.splitlines() if " legacy rank " in line)
    assert [line.split(" legacy ")[0] for line in lines] == ["[node1]", "[node2]"]
    assert "legacy rank 0 local_rank 0 steps 3" in lines[0]
    assert "legacy rank 1 local_rank 0 steps 3" in lines[1]
    assert lines[0].split("weight ")[1] == lines[1].split("weight ")[1]


@pytest.mark.extended
@pytest.mark.sim
def test_three_init_methods_each_form_a_two_node_group(sim2):
    proc = run_cli(
        "train",
        "-i",
        str(sim2.config.inventory_path),
        "--module",
        "training.fixtures.init_methods",
        "--",
        "--shared-dir",
        "/shared",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for method in ("env", "tcp", "file"):
        found = [
            line for line in proc.stdout.splitlines() if f"] {method}:// group of 2 ranks" in line
        ]
        assert len(found) == 2, method
        assert all(line.endswith("all_reduce 3 == 3 OK") for line in found)
        assert {line.split()[0] for line in found} == {"[node1]", "[node2]"}


# -- GPU day one: process counts, one backend per job, GPUs that do not answer -------------------


def _nproc(words: list[str]) -> int:
    return int(next(w for w in words if w.startswith("--nproc-per-node=")).split("=")[1])


def test_nproc_per_node_is_honoured_with_a_gpu_selection():
    inventory = _gpu_inventory()
    big = inventory.hosts[0]
    spec = JobSpec(run_id="tmn-n", gpus=(0, 1, 2, 3), nproc_per_node=2)
    words = _command(big, spec, inventory)
    assert _nproc(words) == 2 and "CUDA_VISIBLE_DEVICES=0,1,2,3" in words
    with pytest.raises(UserError) as caught:
        nproc_for(big, JobSpec(gpus=(0, 1), nproc_per_node=3))
    assert str(caught.value) == (
        "NPROC=3 (--nproc-per-node) of training.ddp needs 3 GPU(s), but node 'big' has 2 for "
        "the job (GPUS=0,1)"
    )


def test_the_process_count_hint_names_a_knob_that_reaches_the_launcher():
    """The hint said --nproc-per-node, which only ARGS could carry, and ARGS go to the workload,
    which rejects it. NPROC= is the make knob; what the hint suggests is what make hands over."""
    with pytest.raises(UserError) as caught:
        nproc_for(_gpu_inventory().hosts[0], JobSpec(gpus=(0, 1), nproc_per_node=3))
    assert caught.value.hint == "NPROC=2"
    planned = make("-n", "train", "INVENTORY=cluster.yml", caught.value.hint, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert "--nproc-per-node 2" in planned.stdout, planned.stdout
    planned = make("-n", "train", timeout=60).stdout
    assert "--nproc-per-node" not in planned, planned


def test_model_parallel_gets_one_process_per_pair_of_gpus():
    inventory = _gpu_inventory()
    big, small, cpu = inventory.hosts
    model_parallel = JobSpec(run_id="tmn-m", module="training.model_parallel")
    # The default on a 4-GPU node: two processes of two GPUs each.
    assert _nproc(_command(big, model_parallel, inventory)) == 2
    # GPUS=0,1: one process spanning both.
    words = _command(big, replace(model_parallel, gpus=(0, 1)), inventory)
    assert _nproc(words) == 1 and "CUDA_VISIBLE_DEVICES=0,1" in words
    # On a CPU node the stages share the CPU: one process.
    assert _nproc(_command(cpu, model_parallel, inventory)) == 1
    # A node with one GPU for the job (its inventory selection is "1") is refused.
    with pytest.raises(UserError) as caught:
        nproc_for(small, model_parallel)
    assert str(caught.value) == (
        "training.model_parallel spans 2 GPUs per process, but node 'small' has 1 for the job "
        "(GPUS=1)"
    )
    two_gpus = _gpu_inventory(2).hosts[0]
    assert nproc_for(two_gpus, model_parallel) == 1
    one_gpu = _gpu_inventory(1).hosts[0]
    with pytest.raises(UserError, match="has 1 for the job \\(inventory gpus: 1\\)"):
        nproc_for(one_gpu, model_parallel)
    # Other workloads keep one process per GPU.
    assert nproc_for(one_gpu, JobSpec()) == 1


def test_one_backend_for_the_whole_job():
    inventory = _gpu_inventory()
    big, small, cpu = inventory.hosts
    assert job_backend((big, small)) == ("nccl", None)
    assert job_backend((cpu,)) == ("gloo", None)
    backend, note = job_backend((big, small, cpu))
    assert backend == "gloo"
    assert note == (
        "note: cpu has no GPU (inventory gpus: 0), so the whole job runs on the CPU with gloo: "
        "NCCL needs GPUs on every node"
    )


def test_gpu_nodes_number_gpus_as_nvidia_smi_does():
    inventory = _gpu_inventory()
    big, _, cpu = inventory.hosts
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in _command(big, JobSpec(run_id="t"), inventory)
    assert not any(w.startswith("CUDA_DEVICE_ORDER") for w in _command(cpu, JobSpec(), inventory))


@pytest.mark.parametrize(
    "answer, ok, problem",
    [
        ("0\n1\n2\n3\n", True, None),
        ("0\n1\n", True, "nvidia-smi lists 2 GPU(s), the job needs 4"),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
            "that the latest NVIDIA driver is installed and running.\n",
            False,
            "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the "
            "NVIDIA driver.",
        ),
        (
            "sh: 1: nvidia-smi: not found\n",
            False,
            "nvidia-smi failed: sh: 1: nvidia-smi: not found",
        ),
    ],
)
def test_gpus_that_do_not_answer_stop_an_nccl_job_naming_the_node(answer, ok, problem):
    big = _gpu_inventory().hosts[0]
    found = gpu_problem(big, JobSpec(), answer, ok)
    if problem is None:
        assert found is None
    else:
        assert found.startswith(f"on big: its GPUs do not answer ({problem}"), found
        assert found.endswith("or set gpus: 0 for it in the inventory)")
    # A selection needs only the GPUs it names.
    assert gpu_problem(big, JobSpec(gpus=(0, 1)), "0\n1\n", True) is None


@pytest.mark.parametrize("module", ["training.nope", "nope", "training.ddp.deeper"])
def test_a_local_module_that_does_not_exist_is_refused_before_anything_starts(module, tmp_path):
    done = run_cli("train", "--module", module, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""  # no "[launcher] local job" line: nothing was started
    assert done.stderr.splitlines() == [
        f"Error: --module {module}: no module of that name here (try MODULE=training.ddp, one "
        "of the workloads listed in training/__init__.py, or SCRIPT=path/to/train.py)"
    ]


def test_a_local_module_of_the_users_own_directory_is_found_and_not_run(tmp_path, monkeypatch):
    from torch_multinode.launch import checks

    (tmp_path / "mine.py").write_text("raise SystemExit('imported: find_spec must not run it')\n")
    monkeypatch.chdir(tmp_path)
    checks.importable_here("mine")  # no error, and no SystemExit from running it


# Every workload training.settings.arguments checks: arguments it takes, and bad ones with their error.
WORKLOAD_ARGUMENTS = {
    "training.ddp": (["--steps", "3"], ["--steps", "-1"], "--steps must be positive, got -1"),
    "training.manual_dp": (["--lr", "0.1"], ["--lr", "-0.5"], "--lr must be 0 or more, got -0.5"),
    "training.fsdp": (
        ["--layers", "2", "--checkpoint-dir", "/shared/gpt"],
        ["--width", "30"],
        "--width 30 does not split into 4 heads (30 % 4 = 2) (try --width 28)",
    ),
    "training.model_parallel": (
        ["--split-size", "2"],
        ["--split-size", "-3"],
        "--split-size must be 0 (off) or positive",
    ),
    "training.pipeline": (
        ["--schedule", "1f1b"],
        ["--batch-size", "10", "--microbatches", "4"],
        "batch 10 does not split into 4 micro-batches (10 % 4 = 2)",
    ),
    "training.comm_demo": (
        ["--corrupt", "gather"],
        ["--bogus"],
        "unknown option --bogus (try .venv/bin/train --module training.comm_demo -- --help)",
    ),
    "training.selftest": (
        ["--checkpoint-dir", "/shared"],
        ["--checkpoint-dir"],
        "argument --checkpoint-dir: expected one argument (try .venv/bin/train --module "
        "training.selftest -- --help)",
    ),
}
CONTROLLER_CHECK = """\
import contextlib, io, json, sys
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import checks

outcomes = []
for module, argv in json.loads(sys.argv[1]):
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            checks.workload_arguments(module, argv)
        outcomes.append("accepted")
    except UserError as error:
        outcomes.append(error.line())
    except SystemExit as exited:
        outcomes.append(f"exit {exited.code}: {printed.getvalue()}")
print(json.dumps({"outcomes": outcomes, "modules": sorted(sys.modules)}))
"""


def test_the_controller_checks_a_workloads_arguments_without_importing_torch():
    """`train` checks every workload's arguments on the controller before anything starts;
    importing the workload (and with it torch) cost 2 s of CPU on every `make train`. In a
    fresh interpreter: the verdicts and the --help text are the workload's own, and neither
    torch nor the workload module was imported."""
    import importlib
    import json
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT
    from torch_multinode.training.settings.arguments import CHECKS

    assert set(WORKLOAD_ARGUMENTS) == set(CHECKS)  # a workload added there gets its cases here
    calls, expected = [], []
    for module, (good, bad, error) in WORKLOAD_ARGUMENTS.items():
        calls += [(module, good), (module, bad), (module, ["--help"])]
        expected += ["accepted", f"Error: {error}", "help"]
    done = subprocess.run(
        [sys.executable, "-c", CONTROLLER_CHECK, json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    helps = {
        module: outcome
        for (module, argv), outcome in zip(calls, found["outcomes"], strict=True)
        if argv == ["--help"] and outcome.startswith("exit 0: usage: ")
    }
    assert [o if o not in helps.values() else "help" for o in found["outcomes"]] == expected
    assert [name for name in found["modules"] if name.split(".")[0] == "torch"] == []
    assert set(found["modules"]) & set(CHECKS) == set()
    for module, text in helps.items():  # described by the module's own docstring
        assert importlib.import_module(module).__doc__.strip() in text
