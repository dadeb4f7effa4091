"""The workloads' GPU-only lines, on a machine without a GPU: torch.cuda is faked (a list of GPUs
with their compute capabilities, the current device, per-device RNG states), and what would reach
a real collective is stopped or recorded."""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.training.conftest import run_main
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import BACKEND_VARIABLE, NODE_NAME_VARIABLE
from torch_multinode.training import ddp, fsdp, model_parallel, spawn
from torch_multinode.training.checkpointing import checkpoint
from torch_multinode.training.distributed import parallel
from torch_multinode.training.fixtures import init_methods
from torch_multinode.training.loop.numerics import resolve_numerics
from torch_multinode.training.settings.config import TrainConfig
from torch_multinode.training.settings.config import parse as parse_config

AMPERE, TURING = (8, 0), (7, 5)  # A100 (native bf16); T4 (bf16 only emulated), as V100 (7, 0)
TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
NO_GPU_HINT = (
    "(try nvidia-smi on that node; the NVIDIA driver and container toolkit (make provision), "
    "or gpus: 0 in the inventory for it)"
)


class FakeCuda:
    """torch.cuda on a node whose visible GPUs have `capabilities`, as torch 2.14 answers."""

    def __init__(self, monkeypatch, capabilities, available: bool = True):
        self.capabilities = list(capabilities)
        self.current = 0  # a fresh process's current device, before any set_device
        self.set_devices: list[int] = []
        self.asked: list[int] = []  # devices whose properties were read: each gets a context
        self.rng = {index: torch.full((16,), index, dtype=torch.uint8) for index in self.indices}
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: available)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.capabilities))
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "get_device_capability", self.get_device_capability)
        monkeypatch.setattr(cuda, "is_bf16_supported", self.is_bf16_supported)
        monkeypatch.setattr(cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(cuda, "get_rng_state_all", self.get_rng_state_all)
        monkeypatch.setattr(cuda, "set_rng_state_all", self.set_rng_state_all)

    @property
    def indices(self) -> range:
        return range(len(self.capabilities))

    def _index(self, device) -> int:
        if device is None or device == "cuda":
            return self.current
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if index >= len(self.capabilities):
            # What torch.cuda does with an index past the visible devices (default_generators).
            raise IndexError("tuple index out of range")
        return index

    def set_device(self, device) -> None:
        self.current = self._index(device)
        self.set_devices.append(self.current)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        index = self._index(device)
        self.asked.append(index)
        return self.capabilities[index]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # torch 2.14: asks the *current* device; Ampere or newer is native, older GPUs emulate.
        self.asked.append(self.current)
        return self.capabilities[self.current] >= AMPERE or including_emulation

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.rng[self._index(device)].clone()

    def set_rng_state(self, new_state, device="cuda") -> None:
        self.rng[self._index(device)] = new_state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(index) for index in self.indices]

    def set_rng_state_all(self, new_states) -> None:
        for index, state in enumerate(new_states):
            self.set_rng_state(state, index)


def torchrun_env(local_rank: int = 0, local_world_size: int = 1, **extra: str) -> dict[str, str]:
    return {
        **TORCHRUN,
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        **extra,
    }


@pytest.fixture
def no_collectives(monkeypatch):
    """A process group that never forms: reaching it fails the test with what was asked."""

    def init_process_group(backend=None, *args, **kwargs):
        raise AssertionError(f"init_process_group({backend!r}) reached")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)


# -- 5. one backend for the whole job ------------------------------------------------------------


def test_without_the_job_backend_each_process_picks_its_own_as_before(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE, AMPERE])
    env = parallel.read_env(torchrun_env(1, 2))
    assert (env.backend, env.device) == ("nccl", torch.device("cuda:1"))
    FakeCuda(monkeypatch, [], available=False)
    env = parallel.read_env(torchrun_env(1, 2))
    assert (env.backend, env.device) == ("gloo", torch.device("cpu"))


def test_a_gloo_job_stays_on_cpu_where_cuda_is_available(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE])
    env = parallel.read_env(torchrun_env(**{BACKEND_VARIABLE: "gloo"}))
    assert (env.backend, env.device) == ("gloo", torch.device("cpu"))
    assert parallel.read_env({BACKEND_VARIABLE: "gloo"}).device == torch.device("cpu")


def test_an_nccl_job_on_a_node_whose_driver_is_broken_stops_at_once_naming_it(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE], available=False)
    environ = torchrun_env(**{BACKEND_VARIABLE: "nccl", NODE_NAME_VARIABLE: "node2"})
    with pytest.raises(UserError) as raised:
        parallel.read_env(environ)
    assert raised.value.line() == (
        "Error: on node2: this job uses NCCL (TMN_BACKEND=nccl) but CUDA is not available "
        f"here {NO_GPU_HINT}"
    )


def test_an_nccl_job_on_a_node_without_gpus_stops_naming_the_host(monkeypatch):
    FakeCuda(monkeypatch, [])  # CUDA answers, but shows no device
    with pytest.raises(UserError) as raised:
        parallel.read_env(torchrun_env(**{BACKEND_VARIABLE: "nccl"}))
    assert raised.value.line() == (
        f"Error: on {socket.gethostname()}: this job uses NCCL (TMN_BACKEND=nccl) but this "
        f"node shows no GPU (torch.cuda.device_count() is 0) {NO_GPU_HINT}"
    )


def test_an_nccl_job_where_the_gpus_answer_uses_them(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE, AMPERE])
    env = parallel.read_env(torchrun_env(1, 2, **{BACKEND_VARIABLE: "nccl"}))
    assert (env.backend, env.device) == ("nccl", torch.device("cuda:1"))


def test_an_unknown_job_backend_is_an_error(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE])
    with pytest.raises(UserError) as raised:
        parallel.read_env(torchrun_env(**{BACKEND_VARIABLE: "mpi"}))
    assert raised.value.line() == (
        "Error: TMN_BACKEND='mpi' is neither nccl nor gloo "
        "(try leaving it to the launcher, which sets nccl or gloo for the whole job)"
    )


def test_a_local_rank_past_the_visible_gpus_is_still_an_error(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE])
    with pytest.raises(UserError, match="LOCAL_RANK 1 needs GPU 1 but this node has 1"):
        parallel.read_env(torchrun_env(1, 2, **{BACKEND_VARIABLE: "nccl"}))


# -- 1. model parallel: two GPUs per process -----------------------------------------------------


def test_model_parallel_under_nccl_with_one_gpu_stops_before_any_collective(
    monkeypatch, capsys, no_collectives
):
    FakeCuda(monkeypatch, [AMPERE])
    for name, value in torchrun_env(**{NODE_NAME_VARIABLE: "node1"}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    code, out, err = run_main(model_parallel.main, [], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "Error: on node1: 1 process x 2 GPUs each need 2 GPUs, found 1 (try a node with 2 GPUs "
        "per process, or GPUS= naming two GPU indices per process, e.g. GPUS=0,1)"
    ]


def test_model_parallel_names_the_process_count_to_use_on_three_gpus(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE] * 3)
    monkeypatch.setenv(NODE_NAME_VARIABLE, "node1")
    env = parallel.read_env(torchrun_env(1, 2))
    with pytest.raises(UserError) as raised:
        model_parallel.stage_devices(env)
    assert raised.value.line() == (
        "Error: on node1: 2 processes x 2 GPUs each need 4 GPUs, found 3 (try a node with 2 "
        "GPUs per process, NPROC=1, or GPUS= naming two GPU indices per process, "
        "e.g. GPUS=0,1)"
    )


def test_model_parallel_takes_two_visible_gpus_per_local_rank(monkeypatch):
    # Indices are those torch sees, i.e. relative to CUDA_VISIBLE_DEVICES (GPUS=): 0..3 here.
    FakeCuda(monkeypatch, [AMPERE] * 4)
    env = parallel.read_env(torchrun_env(1, 2))
    assert model_parallel.stage_devices(env) == (torch.device("cuda:2"), torch.device("cuda:3"))
    single = parallel.read_env({})
    assert model_parallel.stage_devices(single) == (torch.device("cuda:0"), torch.device("cuda:1"))


def test_model_parallel_in_a_gloo_job_stays_on_cpu_even_with_one_gpu(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE])
    env = parallel.read_env(torchrun_env(**{BACKEND_VARIABLE: "gloo"}))
    cpu = torch.device("cpu")
    assert model_parallel.stage_devices(env) == (cpu, cpu)
    # One process without torchrun has no collective to break: it falls back to the CPU.
    assert model_parallel.stage_devices(parallel.read_env({})) == (cpu, cpu)


def test_model_parallel_under_nccl_leaves_its_group_unbound_since_it_reduces_on_two_gpus(
    monkeypatch,
):
    """Bound to its first stage's GPU, the group would refuse DDP's broadcast of the second
    stage's parameters ("Attempt to perform collective on tensor not on device passed to
    init_process_group"): every launched run on GPUs crashed there."""
    cuda = FakeCuda(monkeypatch, [AMPERE] * 4)
    for name, value in torchrun_env(1, 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    groups = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(groups))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kwargs: groups.append((backend, kwargs))
    )

    class Built(Exception):
        pass

    def build(split_size, num_classes, devices, base=None):
        raise Built(devices)

    monkeypatch.setattr(model_parallel, "build", build)
    with pytest.raises(Built) as built:
        model_parallel.main([])
    assert built.value.args[0] == (torch.device("cuda:2"), torch.device("cuda:3"))
    assert cuda.set_devices == [2]  # its first stage's GPU, before the group forms
    assert [backend for backend, _ in groups] == ["nccl"]
    assert "device_id" not in groups[0][1]


# -- 2. init_methods: each rank on its own GPU ---------------------------------------------------


class TorchSeenBy:
    """torch as a module sees it, with the device of every tensor it makes recorded (a tensor
    cannot be made on a GPU that does not exist, so it is made on the CPU)."""

    def __init__(self):
        self.devices: list[torch.device] = []

    def tensor(self, data, *args, device=None, **kwargs):
        self.devices.append(torch.device(device if device is not None else "cpu"))
        return torch.tensor(data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_init_methods_puts_each_rank_on_its_gpu_before_the_group_forms(monkeypatch, capsys):
    cuda = FakeCuda(monkeypatch, [AMPERE, AMPERE])
    seen = TorchSeenBy()
    monkeypatch.setattr(init_methods, "torch", seen)
    events = []

    def init_process_group(backend, **kwargs):
        events.append(("init", backend, list(cuda.set_devices), kwargs.get("device_id")))

    def all_reduce(tensor):
        events.append(("all_reduce", seen.devices[-1]))
        tensor.add_(1.0)  # rank 0's value: the sum rank 1 of 2 would see

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    for name, value in torchrun_env(1, 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    init_methods.main(["--methods", "env"])
    assert events == [
        ("init", "nccl", [1], torch.device("cuda:1")),
        ("all_reduce", torch.device("cuda:1")),
    ]
    assert cuda.current == 1


def test_every_nccl_group_is_bound_to_the_ranks_gpu(monkeypatch):
    """Without device_id, torch 2.14 sets NCCL up lazily and every barrier warns that it guesses
    the device; with it the communicator forms at once on the rank's own GPU. Both ways a job
    forms its group, torchrun's (parallel.start) and mp.spawn's, pass it; a CPU rank does not,
    nor training.model_parallel (its test above)."""
    FakeCuda(monkeypatch, [AMPERE, AMPERE])
    groups = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(groups))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kwargs: groups.append((backend, kwargs))
    )
    parallel.start(parallel.read_env(torchrun_env(1, 2)))
    assert groups[-1][0] == "nccl" and groups[-1][1]["device_id"] == torch.device("cuda:1")

    monkeypatch.setattr(ddp, "main", lambda argv: 0)
    for name, value in torchrun_env(1, 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    groups.clear()
    assert spawn._join_and_train(29500, []) == 0
    assert groups[-1][0] == "nccl" and groups[-1][1]["device_id"] == torch.device("cuda:1")

    groups.clear()  # FSDP's group of one, for a plain process
    fsdp.start(parallel.read_env({}), timeout=60)
    assert groups[-1][0] == "nccl" and groups[-1][1]["device_id"] == torch.device("cuda:0")

    assert parallel.bound_device(torch.device("cpu")) == {}


# -- 3. --precision auto: native bf16 only, asked of the rank's own GPU --------------------------


@pytest.mark.parametrize("capability", [TURING, (7, 0)], ids=["turing", "volta"])
def test_precision_auto_is_fp32_on_a_gpu_that_only_emulates_bf16(monkeypatch, capability):
    """Not fp16, though these GPUs' tensor cores run it: auto is also training.fsdp's, which
    has no GradScaler, and a --comm-hook powersgd beside auto cannot be refused up front."""
    FakeCuda(monkeypatch, [capability])
    numerics = resolve_numerics("auto", torch.device("cuda:0"))
    assert (numerics.name, numerics.autocast_dtype, numerics.grad_scaler) == ("fp32", None, False)
    # Asked by name, fp16 is autocast with the GradScaler.
    fp16 = resolve_numerics("fp16", torch.device("cuda:0"))
    assert (fp16.name, fp16.autocast_dtype, fp16.grad_scaler) == ("fp16", torch.float16, True)


def test_precision_auto_is_bf16_on_ampere(monkeypatch):
    FakeCuda(monkeypatch, [AMPERE])
    numerics = resolve_numerics("auto", torch.device("cuda:0"))
    assert (numerics.name, numerics.autocast_dtype) == ("bf16", torch.bfloat16)


def test_prepare_asks_the_ranks_own_gpu_not_gpu_0(monkeypatch, tmp_path):
    # GPU 0 is an A100, this rank's GPU 1 a T4: the answer must be the T4's, and GPU 0 untouched.
    cuda = FakeCuda(monkeypatch, [AMPERE, TURING])
    config = parse_config(TrainConfig, ["--precision", "auto", "--run-dir", str(tmp_path)])
    env = parallel.read_env(torchrun_env(1, 2))
    _, numerics = ddp.prepare(config, env, "ddp")
    assert numerics.name == "fp32"
    assert cuda.asked == [1] and cuda.set_devices == [1]


# -- 4. checkpoints hold the rank's own GPU's RNG state ------------------------------------------


def test_resuming_with_fewer_visible_gpus_restores_the_ranks_own_rng_state(monkeypatch):
    saved_on = FakeCuda(monkeypatch, [AMPERE, AMPERE])  # saved on a node showing 2 GPUs
    states = checkpoint.rng_states(torch.device("cuda:0"))
    assert torch.equal(states["cuda"], saved_on.rng[0])
    resumed_on = FakeCuda(monkeypatch, [AMPERE])  # resumed with GPUS=... showing one
    resumed_on.rng[0].fill_(99)
    checkpoint.restore_rng_states(states, torch.device("cuda:0"))
    assert torch.equal(resumed_on.rng[0], saved_on.rng[0])


def test_a_checkpoint_written_on_a_gpu_resumes_there(monkeypatch, tmp_path):
    """Loaded onto the rank's GPU (map_location=device), numpy's generator keys came back as a
    GPU tensor and restore_rng_states' `keys.numpy()` raised a TypeError in every rank on every
    resume. Here a load onto a CUDA device gives tensors that, as on a GPU, cannot become numpy
    arrays; the store must load to the CPU, and every generator must continue where it was."""
    FakeCuda(monkeypatch, [AMPERE, AMPERE])
    device = torch.device("cuda:1")
    real_load, asked = torch.load, []

    def load(*args, map_location=None, **kwargs):
        asked.append(map_location)
        on_gpu = map_location is not None and torch.device(map_location).type == "cuda"
        state = real_load(*args, map_location="meta" if on_gpu else map_location, **kwargs)
        return state  # meta tensors, like CUDA ones, refuse .numpy()

    monkeypatch.setattr(torch, "load", load)
    store = checkpoint.CheckpointStore(tmp_path, rank=1, keep=2)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    store.save(4, {"rng": checkpoint.rng_states(device), "weight": torch.ones(2)})
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)

    state = store.load(4)
    checkpoint.restore_rng_states(state["rng"], device)
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected
    assert [torch.device(where).type for where in asked] == ["cpu"]
    assert state["weight"].device.type == "cpu"


def test_a_rank_saves_the_rng_state_of_its_own_gpu(monkeypatch):
    cuda = FakeCuda(monkeypatch, [AMPERE, AMPERE])
    states = checkpoint.rng_states(torch.device("cuda:1"))
    assert torch.equal(states["cuda"], cuda.rng[1])
    assert checkpoint.rng_states(torch.device("cpu"))["cuda"] is None


def test_an_old_checkpoint_with_every_gpus_rng_state_resumes_on_fewer_gpus(monkeypatch):
    old = {**checkpoint.rng_states(torch.device("cpu"))}
    old["cuda"] = [
        torch.full((16,), 40, dtype=torch.uint8),
        torch.full((16,), 41, dtype=torch.uint8),
    ]
    cuda = FakeCuda(monkeypatch, [AMPERE])
    checkpoint.restore_rng_states(old, torch.device("cuda:0"))
    assert torch.equal(cuda.rng[0], old["cuda"][0])
    # A state list without this rank's device (saved on fewer GPUs, or on CPU) leaves it as is.
    cuda = FakeCuda(monkeypatch, [AMPERE, AMPERE])
    checkpoint.restore_rng_states({**old, "cuda": old["cuda"][:1]}, torch.device("cuda:1"))
    assert torch.equal(cuda.rng[1], torch.full((16,), 1, dtype=torch.uint8))
    checkpoint.restore_rng_states({**old, "cuda": []}, torch.device("cuda:1"))
