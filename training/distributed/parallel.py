"""Process group, device and DDP wrapping: everything that depends on how many processes run where.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Without
them (plain `python -m ...`) a workload runs as one process with no process group at all.

The launcher decides the backend once per job (TMN_BACKEND, nccl or gloo) and every rank follows
it: a rank choosing for itself would join gloo to an NCCL job on a node whose driver is broken,
and the job would hang until the timeout. Under torchrun typed by hand (TMN_BACKEND unset) each
process still picks NCCL where it sees CUDA and gloo elsewhere.
"""

from __future__ import annotations

import gc
import hashlib
import io
import os
import random
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import BACKEND_VARIABLE, NODE_NAME_VARIABLE
from torch_multinode.training.distributed import flight, waits
from torch_multinode.training.settings.config import batch_fits
from torch_multinode.training.settings.console import emit

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("nccl", "gloo")
NO_GPU_HINT = (
    "nvidia-smi on that node; the NVIDIA driver and container toolkit (make provision), "
    "or gpus: 0 in the inventory for it"
)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False  # started by torchrun, so there is a process group to join
    backend: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def describe(self) -> str:
        if not self.launched:
            return f"1 process, no process group, {self.device.type}"
        return (
            f"{self.world_size} processes on {self.nodes} node(s), "
            f"{self.backend}, {self.device.type}"
        )


def _integer(name: str, environ: dict[str, str]) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name in the inventory where the launcher gave it, else the host name."""
    environ = os.environ if environ is None else environ
    return environ.get(NODE_NAME_VARIABLE) or socket.gethostname()


def _uses_cuda(environ: dict[str, str]) -> bool:
    """Whether this process computes on a GPU (backend NCCL) or on the CPU (gloo)."""
    backend = environ.get(BACKEND_VARIABLE)
    if not backend:
        return torch.cuda.is_available()
    if backend not in BACKENDS:
        raise UserError(
            f"{BACKEND_VARIABLE}={backend!r} is neither nccl nor gloo",
            hint="leaving it to the launcher, which sets nccl or gloo for the whole job",
        )
    if backend == "gloo":
        return False
    if not torch.cuda.is_available():
        found = "CUDA is not available here"
    elif torch.cuda.device_count() == 0:
        found = "this node shows no GPU (torch.cuda.device_count() is 0)"
    else:
        return True
    raise UserError(
        f"on {node_name(environ)}: this job uses NCCL ({BACKEND_VARIABLE}=nccl) but {found}",
        hint=NO_GPU_HINT,
    )


def read_env(environ: dict[str, str] | None = None) -> DistEnv:
    """The job layout torchrun describes in the environment, and the device and backend to use."""
    environ = dict(os.environ if environ is None else environ)
    cuda = _uses_cuda(environ)
    if "WORLD_SIZE" not in environ:
        return DistEnv(device=torch.device("cuda:0" if cuda else "cpu"))
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise UserError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not",
            hint="launching with python -m torch.distributed.run",
        )
    rank, local_rank, world_size = (
        _integer(n, environ) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    )
    local_world_size = _integer("LOCAL_WORLD_SIZE", environ) if "LOCAL_WORLD_SIZE" in environ else 1
    if not 0 <= rank < world_size:
        raise UserError(f"RANK {rank} is outside world size {world_size}")
    if cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise UserError(
                f"LOCAL_RANK {local_rank} needs GPU {local_rank} but this node has {visible}",
                hint=f"NPROC={visible} (torchrun's --nproc-per-node)",
            )
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        launched=True,
        backend="nccl" if cuda else "gloo",
        device=torch.device(f"cuda:{local_rank}" if cuda else "cpu"),
    )


def use_device(env: DistEnv) -> None:
    """Make this process's GPU the current one, before anything asks the current device (or
    creates a CUDA context on GPU 0, which every rank would then hold memory on)."""
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)


_PORT_CHOICE = random.Random()  # its own generator: the workloads' seeded one is never drawn from


def free_loopback_port() -> int:
    """A port free on loopback for a store of this machine's own ranks, chosen below the
    kernel's ephemeral range (net.ipv4.ip_local_port_range): a port from that range can be
    taken as the source port of any outgoing connection between this check and the store's
    bind, and the store then waits for a peer that never answers. CI saw exactly that."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(20000, low)) if low > 21000 else []
    _PORT_CHOICE.shuffle(candidates)
    for port in [*candidates[:200], 0]:  # 0: the kernel's choice, where no other is free
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def bound_device(device: torch.device) -> dict[str, torch.device]:
    """init_process_group's `device_id` for a rank on `device`: its GPU under NCCL, nothing on
    the CPU. torch 2.14 then forms the NCCL communicator at once (an unreachable peer or a
    broken GPU fails here, not at the first collective) and binds the group to that GPU, so
    barrier() knows its device instead of guessing one and warning on every call."""
    return {"device_id": device} if device.type == "cuda" else {}


def start(
    env: DistEnv, timeout_seconds: float = 600, bind: bool = True, measure_waits: bool = True
) -> None:
    """Join the process group (a no-op for a single unlaunched process), serve the Flight
    Recorder's trace to the launcher (training.distributed.flight) and measure this rank's waits
    in collectives (training.distributed.waits: the launcher names a job the network holds from
    them; our workloads name a slow rank from their own split of the step); `measure_waits=False`
    where the job's straggler detection is off (training.ddp's --slow-rank-factor 0).

    `bind=False` for a process whose model spans two GPUs (training.model_parallel): a group
    bound to one GPU refuses a collective on any other ("Attempt to perform collective on
    tensor not on device passed to init_process_group", torch 2.14.1's ProcessGroupNCCL), and
    DDP's first broadcast already carries the second stage's parameters."""
    use_device(env)
    if env.launched and not dist.is_initialized():
        dist.init_process_group(
            env.backend,
            timeout=timedelta(seconds=timeout_seconds),
            **(bound_device(env.device) if bind else {}),
        )
        flight.start()  # the trace, written when the launcher asks (a hang)
        if measure_waits:
            waits.start()  # written every few seconds to the run directory (none outside a job)


def stop(synchronize: bool = False) -> None:
    """Leave the process group; `synchronize` (only when every rank gets here) first waits for
    the others, since tearing gloo down under a peer still using it can abort the process.

    destroy_process_group only drops c10d's own references: a DDP model (its reducer) that sits
    in a reference cycle keeps the gloo group, with its worker threads, alive until the
    interpreter's final collection, where destroying it aborts the process (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#179291). Collecting here
    ends the group while the interpreter is whole."""
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # also after a workload that destroyed the group itself


def call(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Call `main` and leave the process group either way (a rank that exits with gloo still up
    can abort at exit, "terminate called without an active exception"); a UserError becomes
    one `Error: ...` line and its exit code."""
    try:
        code = main(argv)
        stop(synchronize=True)
    except UserError as error:
        emit(error.line(), sys.stderr)
        code = error.exit_code
        stop()
    return code or 0


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """`call`, then exit with its code: the edge of every workload's `python -m`."""
    sys.exit(call(main, argv))


def barrier(env: DistEnv) -> None:
    if env.launched:
        dist.barrier()


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over all ranks (identity for one process)."""
    if not env.launched:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def share(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's `values` (the same count on each), in rank order, in one all_reduce_sum:
    each rank fills its own slots (all_gather_object pickles, and is two collectives)."""
    count = len(values)
    slots = [0.0] * (count * env.world_size)
    slots[env.rank * count : (env.rank + 1) * count] = values
    summed = all_reduce_sum(slots, env)
    return [summed[rank * count : (rank + 1) * count] for rank in range(env.world_size)]


def all_gather(value: object, env: DistEnv) -> list:
    """Every rank's `value`, in rank order."""
    if not env.launched:
        return [value]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_state(state: dict | None, source: int, env: DistEnv) -> dict:
    """Rank `source`'s checkpoint state (tensors on the CPU) on every rank: written with
    torch.save and read back weights-only, as from a file (broadcast_object_list's own pickling
    could not read the tensors back: "UntypedStorage has no attribute 'dtype'", torch 2.14.1).
    NCCL carries the bytes through the rank's current device, which start() set."""
    if not env.launched:
        assert state is not None  # one process: it is the source, and holds the state
        return state
    carried: list = [None]  # every rank's filled by broadcast_object_list
    if env.rank == source:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        carried = [buffer.getvalue()]
    dist.broadcast_object_list(carried, src=source)
    return torch.load(io.BytesIO(carried[0]), map_location="cpu", weights_only=True)


def per_rank_batch(global_batch: int, env: DistEnv, planned_world_size: int | None = None) -> int:
    """The batch of each rank; of each planned rank where the job runs on fewer ranks than it
    was planned for (training.loop.virtual_ranks)."""
    ranks = planned_world_size or env.world_size
    batch_fits(global_batch, ranks)  # a default one was fitted when it was parsed
    return global_batch // ranks


COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")  # what register_comm_hook registers


def _check_hook(name: str) -> None:
    if name not in COMM_HOOKS:
        # "auto" is a choice made before wrapping (training.distributed.levers.choose), not a hook.
        raise ValueError(f"comm hook {name!r} is not one of {', '.join(COMM_HOOKS)}")


def wrap_ddp(model: nn.Module, env: DistEnv, config, fixed_buckets: bool = False) -> nn.Module:
    """DDP with the options of a DDPConfig and its gradient-compression hook registered.
    `fixed_buckets`: the buckets keep the layout they start with (replica groups: every group
    alike, training.distributed.replicas), through find_unused_parameters, which DDP rebuilds
    its buckets without."""
    from torch.nn.parallel import DistributedDataParallel

    if not env.launched:
        return model
    _check_hook(config.comm_hook)
    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        static_graph=config.static_graph,
        find_unused_parameters=fixed_buckets,
    )
    register_comm_hook(ddp, config)
    return ddp


def register_comm_hook(ddp: nn.Module, config) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    _check_hook(config.comm_hook)
    if config.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif config.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start_step,
        )
        hook = powerSGD_hook.powerSGD_hook
        if dist.get_backend(ddp.process_group) == "gloo":
            hook = in_bucket_order(hook)
        ddp.register_comm_hook(state, hook)


def in_bucket_order(hook):
    """`hook` with each bucket started only once the previous bucket's result is in.

    PowerSGD all-reduces a bucket twice, the second time from the first one's completion
    callback. gloo runs those callbacks on its own threads, so one rank can enqueue bucket 1's
    second all-reduce before bucket 2's first and another rank after it: a collective mismatch
    that aborts the job ("Received data size doesn't match expected size") as soon as a model
    has more than one bucket (ResNet-18 has three). Waiting keeps every rank's collectives in
    one order, at the price of overlapping less of the communication with the backward pass.
    NCCL completes those futures inline, in order, and needs none of this."""
    previous = None

    def ordered(state, bucket):
        nonlocal previous
        if previous is not None:
            previous.wait()
        future = hook(state, bucket)
        previous = None if bucket.is_last() else future
        return future

    ordered.__name__ = ordered.__qualname__ = f"{hook.__name__}_in_bucket_order"
    return ordered


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def parameter_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes: equal digests mean bit-identical parameters."""
    digest = hashlib.sha256()
    for name, parameter in unwrap(model).named_parameters():
        digest.update(name.encode())
        digest.update(
            parameter.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()
