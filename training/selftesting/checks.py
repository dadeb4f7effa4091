"""The checks of training.selftest, each a function of this rank's Job: what it proves, or Skip
with the reason it does not apply here, or Failed with the remedy. Stopped: a peer failed first.
The checks over all of a node's GPUs in one process are node_gpus', the replicas' replicas'.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torch_multinode.cluster import durable, nccl_transport
from torch_multinode.training.checkpointing import checkpoint
from torch_multinode.training.distributed import flight, parallel, waits

if TYPE_CHECKING:
    from torch_multinode.training.selftesting.nccl_log import NcclLog

PASS, WARN, SKIPPED, FAIL, STOPPED = "PASS", "WARN", "SKIPPED", "FAIL", "STOPPED"
# A peer's failure stopped this rank's check: the peer's row says why.
DATA_TIMEOUT = 120  # seconds a collective of a check may wait for a peer that failed before it
DEBUG_REMEDY = "make selftest ... DEBUG=1 for NCCL's and torch's logs, and make netcheck"


class Skip(Exception):
    """The check does not apply here: the reason."""


class Failed(Exception):
    def __init__(self, what: str, remedy: str):
        super().__init__(what)
        self.remedy = remedy


class Stopped(Exception):
    """Another rank failed this check first; this one stopped where they would meet again."""


class Job:
    """This rank's place in the job and what the checks share."""

    def __init__(self, env: parallel.DistEnv, node: str, scratch: Path, fail: str | None):
        self.env, self.node, self.scratch, self.fail = env, node, scratch, fail
        self.control = None
        self.nodes: list[str] = [node]
        self.nccl_log: NcclLog | None = None  # this rank's NCCL log, on a GPU

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def cuda(self) -> bool:
        return self.env.device.type == "cuda"

    def gather(self, value: object) -> list:
        """Every rank's `value`, over the gloo group (the CPU), whatever the backend."""
        if not self.env.launched:
            return [value]
        gathered: list = [None] * self.env.world_size
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered

    def agree(self, error: BaseException | None = None) -> None:
        """A meeting point inside a check: if any rank failed before it, every other rank stops
        the check here instead of waiting in a collective the failed rank never joins."""
        found = self.gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [rank for rank, message in enumerate(found) if message is not None]
        if failed:
            raise Stopped(f"rank {failed[0]} on {self.nodes[failed[0]]} failed first")

    def local_gpus(self) -> int:
        return torch.cuda.device_count() if self.cuda else 0


# -- the checks ------------------------------------------------------------------------------


def check_device(job: Job) -> str:
    env, device = job.env, job.device
    placed = torch.ones(1, device=device).device
    if job.cuda:
        current = torch.cuda.current_device()
        if current != env.local_rank or placed != device:
            raise Failed(
                f"local rank {env.local_rank} computes on cuda:{current}, not {device}",
                "torch.cuda.set_device(LOCAL_RANK) before any CUDA work (training.distributed.parallel."
                "use_device)",
            )
        identity = str(torch.cuda.get_device_properties(device).uuid)
        described = f"{device} {torch.cuda.get_device_name(device)}"
    else:
        if placed.type != "cpu":
            raise Failed(f"a tensor meant for the CPU landed on {placed}", DEBUG_REMEDY)
        identity, described = None, "cpu"
    seen = job.gather((job.node, identity))
    twins = [
        rank
        for rank, (node, other) in enumerate(seen)
        if identity is not None and rank != env.rank and node == job.node and other == identity
    ]
    if twins:
        raise Failed(
            f"rank {env.rank} and rank {twins[0]} share one GPU ({identity})",
            "one process per GPU: GPUS= or the inventory's cuda_visible_devices naming each GPU "
            "once, and --nproc-per-node no more than the node's GPUs",
        )
    return described


def _exact(ranks: list[int], group, job: Job) -> list[str]:
    """all_reduce, all_gather, broadcast and a send/recv ring among `ranks` on `group`, with
    small integers whose results are exact in fp32: the operations whose results differ."""
    rank = job.env.rank

    def tensor(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=job.device)

    total = float(sum(r + 1 for r in ranks))
    summed = tensor(rank + 1, 2 * (rank + 1))
    dist.all_reduce(summed, group=group)
    gathered = [tensor(-1) for _ in ranks]
    dist.all_gather(gathered, tensor(rank), group=group)
    root = ranks[0]
    sent = tensor(7 * root + 3) if rank == root else tensor(0)
    dist.broadcast(sent, src=root, group=group)
    position = ranks.index(rank)
    right, left = ranks[(position + 1) % len(ranks)], ranks[position - 1]
    received = tensor(-1)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor(10 * rank + 1), right, group),
            dist.P2POp(dist.irecv, received, left, group),
        ]
    )
    for request in requests:
        request.wait()
    wrong = []
    for operation, held, wanted in (
        ("all_reduce", summed.tolist(), [total, 2 * total]),
        ("all_gather", torch.cat(gathered).tolist(), [float(r) for r in ranks]),
        ("broadcast", sent.tolist(), [7.0 * root + 3]),
        ("send/recv", received.tolist(), [10.0 * left + 1]),
    ):
        if held != wanted:
            wrong.append(f"{operation} gave {held}, expected {wanted}")
    return wrong


def _groups(job: Job, key: Callable[[int], object]) -> tuple[list[int], object] | None:
    """Every rank creates every group of 2+ ranks with the same `key` (in the same order, as
    new_group needs); this rank's group's ranks and the group, or None when it has no partner."""
    members: dict[object, list[int]] = {}
    for rank in range(job.env.world_size):
        members.setdefault(key(rank), []).append(rank)
    mine = None
    for ranks in members.values():
        if len(ranks) > 1:
            group = dist.new_group(ranks)
            if job.env.rank in ranks:
                mine = (ranks, group)
    return mine


def _communicate(job: Job, key: Callable[[int], object], where: str, alone: str) -> str:
    if not job.env.launched:
        raise Skip("one process, no process group")
    mine = _groups(job, key)
    if mine is None:
        raise Skip(alone)
    ranks, group = mine
    wrong = _exact(ranks, group, job)
    if wrong:
        raise Failed(
            f"{job.env.backend} {wrong[0]} {where} (ranks {ranks})",
            DEBUG_REMEDY + " to see which link or GPU gives wrong data",
        )
    return f"{job.env.backend}, ranks {', '.join(map(str, ranks))}"


def check_comm_in_node(job: Job) -> str:
    return _communicate(job, lambda rank: job.nodes[rank], "within the node", "1 rank on this node")


def check_comm_across_nodes(job: Job) -> str:
    # The ranks of every node with the same local rank: one per node.
    local = [rank - job.nodes.index(job.nodes[rank]) for rank in range(job.env.world_size)]
    return _communicate(
        job, lambda rank: local[rank], "across nodes", "one node in this job: nothing across"
    )


def check_nccl_transport(job: Job) -> tuple[str, str]:
    """The network NCCL used between nodes, its HCAs and GPUDirect RDMA, from this rank's NCCL
    log (training.selftesting.nccl_log), against the node's RDMA devices."""
    if not job.cuda:
        raise Skip("no NCCL on a CPU node (gloo over TCP)")
    log = job.nccl_log.read() if job.nccl_log is not None else ""
    used = nccl_transport.transport_used(log)
    if len(set(job.nodes)) == 1:
        raise Skip(f"one node: no traffic between nodes (NCCL's network: {used or 'not said'})")
    status, detail = nccl_transport.transport_finding(
        used,
        nccl_transport.rdma_devices(),
        hcas=nccl_transport.hcas_used(log),
        gdr=nccl_transport.gpudirect(log, used),
        peermem=nccl_transport.peermem_loaded(),
    )
    if status == "SKIP":  # netcheck's word; the table's is SKIPPED, with the reason
        raise Skip(detail)
    return status, detail


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.layers(x)


def batch(device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=generator)
    return x.to(device), (x[:, :4] * 2).to(device)


def seeded_net(device: torch.device, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(device)


def sharded_net(job: Job, seed: int, policy=None) -> Net:
    """The seeded net under FSDP2 over every rank (its two linear layers and the whole), with
    `policy` (a MixedPrecisionPolicy; fully_shard's default: none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(job.device.type, (job.env.world_size,))
    policy = policy or MixedPrecisionPolicy()
    model = seeded_net(job.device, seed)
    for layer in (model.layers[0], model.layers[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def check_amp_bf16(job: Job) -> str:
    device = job.device
    model = seeded_net(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(device)
    losses = []
    for _ in range(5):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weight = model.layers[0].weight
    if out.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise Failed(
            f"autocast computed in {out.dtype} with {weight.dtype} weights, not bf16 with fp32",
            "a torch build with bf16 autocast for this device",
        )
    if not all(map(math.isfinite, losses)) or losses[-1] >= losses[0]:
        raise Failed(f"bf16 losses did not fall: {losses}", DEBUG_REMEDY)
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def check_amp_fp16(job: Job) -> str:
    if not job.cuda:
        raise Skip("fp16 with GradScaler is the GPU path; no GPU on this node")
    device = job.device
    model = seeded_net(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)  # no overflow at first
    x, y = batch(device)
    losses = []
    for _ in range(4):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    if out.dtype != torch.float16 or not losses[-1] < losses[0]:
        raise Failed(f"fp16 autocast gave {out.dtype}, losses {losses}", DEBUG_REMEDY)
    # An overflowing gradient: the step is skipped and the scale halves.
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if not unchanged or scaler.get_scale() != scale * 0.5:
        raise Failed(
            f"GradScaler did not skip an overflowing step (scale {scale} -> {scaler.get_scale()})",
            DEBUG_REMEDY,
        )
    return (
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, overflow skipped, scale {scaler.get_scale():g}"
    )


def _ddp_step(model, optimizer, device: torch.device, step: int) -> None:
    x, y = batch(device, seed=100 + step)
    noise = torch.randn(x.shape).to(device) * 0.01  # draws from the CPU generator: RNG matters
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x + noise), y).backward()
    optimizer.step()


def _checkpoint_failed(raised: Exception) -> Failed:
    return Failed(
        f"saving or resuming a checkpoint failed: {type(raised).__name__}: {raised}",
        "a training/checkpointing/checkpoint.py whose CheckpointStore.load loads to the CPU, and a "
        "writable temporary directory (or --checkpoint-dir)",
    )


def check_ddp_checkpoint(job: Job) -> str:
    from torch.nn.parallel import DistributedDataParallel

    env, device = job.env, job.device
    if not env.launched:
        raise Skip("one process, no process group")
    ids = [device.index] if job.cuda else None
    store = checkpoint.CheckpointStore(job.scratch / "ddp", env.rank, keep=1)
    error, straight = None, []
    try:
        model = DistributedDataParallel(seeded_net(device), device_ids=ids)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(2):
            _ddp_step(model, optimizer, device, step)
        state = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": checkpoint.rng_states(device),
        }
        store.save(2, state)
    except Exception as raised:
        error = _checkpoint_failed(raised)
    # A rank whose save failed (its node's disk full or read-only) stops every rank here: the
    # others would wait for it in DDP's next collective, which under NCCL ends the process
    # at the collective timeout, the table with it.
    job.agree(error)
    try:
        _ddp_step(model, optimizer, device, 2)
        straight = [p.detach().cpu() for p in model.parameters()]
        # A model from another seed resumes from step 2 and must take the same step 3.
        resumed = DistributedDataParallel(seeded_net(device, seed=1), device_ids=ids)
        optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
        state = store.load(2)
        resumed.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        checkpoint.restore_rng_states(state["rng"], device)
    except Exception as raised:  # the defect this check exists for: a crash while resuming
        error = _checkpoint_failed(raised)
    job.agree(error)
    _ddp_step(resumed, optimizer, device, 2)
    again = [p.detach().cpu() for p in resumed.parameters()]
    worst = max((a - b).abs().max().item() for a, b in zip(straight, again, strict=True))
    if worst > 1e-6:
        raise Failed(
            f"the resumed step differs from the uninterrupted one by {worst:.3g}",
            "checking that model, optimizer and RNG states all go into the checkpoint",
        )
    return f"written on {device}, resumed: step 3 within {worst:.1g}"


def _dcp_index(job: Job, directory: Path) -> None:
    """DCP's index (.metadata) is written by rank 0 alone: on node-local disks the other nodes
    get a copy, as training.checkpointing.dcp does."""
    index = directory / ".metadata"
    data = index.read_bytes() if job.env.is_main else None
    data = job.gather(data)[0]
    if not index.exists():  # several ranks of a node may copy it: each renames a whole file
        durable.write_atomically(index, data)


def check_fsdp2_dcp(job: Job) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy

    env, device = job.env, job.device
    if not env.launched:
        raise Skip("one process, no process group")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def sharded(seed: int) -> nn.Module:
        return sharded_net(job, seed, policy)

    model = sharded(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(device, seed=env.rank)
    out = model(x)
    nn.functional.mse_loss(out.float(), y).backward()
    optimizer.step()
    weight = model.layers[0].weight
    if out.dtype != torch.bfloat16 or weight.to_local().dtype != torch.float32:
        raise Failed(
            f"FSDP2 computed in {out.dtype} on {weight.to_local().dtype} shards, not bf16 on fp32",
            DEBUG_REMEDY,
        )
    directory = job.scratch / "dcp"
    saved = get_model_state_dict(model)
    full = {name: tensor.full_tensor().cpu() for name, tensor in saved.items()}
    dcp.save(saved, checkpoint_id=directory)
    _dcp_index(job, directory)
    loaded = sharded(1)
    state = get_model_state_dict(loaded)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(loaded, state)
    back = {k: v.full_tensor().cpu() for k, v in get_model_state_dict(loaded).items()}
    if any(not torch.equal(full[name], back[name]) for name in full):
        raise Failed("FSDP2 parameters loaded from DCP differ from those saved", DEBUG_REMEDY)
    # Resharding: every rank reads the whole model into one plain process's layout, which
    # needs every rank's shards where it can read them.
    stored = dcp.FileSystemReader(directory).read_metadata().storage_data.values()
    files = {entry.relative_path for entry in stored}
    if not all(job.gather(all((directory / name).is_file() for name in files))):
        return (
            f"{env.world_size} shards saved and loaded; not resharded: node-local disks "
            "(--checkpoint-dir on storage every node sees)"
        )
    plain = seeded_net(torch.device("cpu"), seed=2).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(plain, checkpoint_id=directory, no_dist=True)
    if any(not torch.equal(full[name], plain[name]) for name in full):
        raise Failed("the checkpoint resharded to one process differs from the model", DEBUG_REMEDY)
    return f"{env.world_size} shards saved, loaded, resharded to 1"


def check_compile(job: Job) -> str:
    from torch._inductor import config as inductor_config

    from torch_multinode.training.settings.compile_check import compile_problem

    problem = compile_problem(job.device)
    if problem is not None:  # its hint's way out, "leave out --compile", is training.fsdp's
        remedy = (problem.hint or "").replace(", or leave out --compile", "")
        raise Failed(
            str(problem).replace("--compile ", "torch.compile "),
            f"{remedy} on the node, or the training image (make image), which has them",
        )
    device = job.device
    model = seeded_net(device)
    compiled = torch.compile(model)
    x, _ = batch(device)
    eager_out = model(x)
    eager_out.sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    try:
        # One kernel or two: a pool of compile workers would cost more than it saves.
        with inductor_config.patch(compile_threads=1):
            out = compiled(x)
            out.sum().backward()
    except Exception as error:  # inductor's own failure, e.g. a broken compiler install
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise Failed(
            f"torch.compile failed: {type(error).__name__}: {first}",
            "TORCH_LOGS=output_code for what it built; gcc/g++ and python3-dev (make image)",
        ) from None
    grads = [p.grad for p in model.parameters()]
    worst = max(
        (out - eager_out).abs().max().item(),
        *((a - b).abs().max().item() for a, b in zip(eager, grads, strict=True)),
    )
    if worst > 1e-4:
        raise Failed(f"torch.compile's result differs from eager by {worst:.3g}", DEBUG_REMEDY)
    return f"inductor on {device.type}, within {worst:.1g} of eager"


FLIGHT_MARK_SIZE = 7  # the check's all_reduce: a size no other check uses, to find it in the ring


def check_flight_recorder(job: Job) -> str:
    """The trace a hang report and a failed job's summary read (training.distributed.flight):
    this rank's own, from NCCL's recorder on GPUs, holding the all_reduce just done."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip("0"):
        raise Skip("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE unset or 0)")
    if not job.env.launched:
        raise Skip("one process without a process group: no collective to record")
    tensor = torch.ones(FLIGHT_MARK_SIZE, device=job.device)
    dist.all_reduce(tensor)  # the job's own group: NCCL on GPUs
    if job.cuda:
        torch.cuda.synchronize(job.device)  # its entry completed, not only enqueued
    backend = str(dist.get_backend())
    ours: list[dict] = []
    problem: BaseException | None = None
    try:  # every rank meets below, whatever this one found
        # as the watcher reads it for the launcher: the backend the group has
        entries = json.loads(flight.trace_json()).get("entries", [])
        ours = [
            entry
            for entry in entries
            if str(entry.get("profiling_name", "")).endswith("all_reduce")
            and entry.get("input_sizes") == [[FLIGHT_MARK_SIZE]]
        ]
        if not ours:
            problem = Failed(
                f"the {backend} Flight Recorder's trace holds no entry for the check's "
                f"all_reduce ({len(entries)} entries)",
                "TORCH_FR_BUFFER_SIZE=256 (the launcher's default) in the job's environment; "
                + DEBUG_REMEDY,
            )
    except Exception as error:  # torch's private dump API changed, or the dump failed
        problem = error
    job.agree(problem)
    newest = max(ours, key=lambda entry: entry.get("collective_seq_id", 0))
    return f"{newest.get('profiling_name')} #{newest.get('collective_seq_id')}"


WAITS_MARK_SIZE = 11  # the waits check's all_reduces: a size no other check uses
WAITS_READ_FOR = 10.0  # seconds the watchdog gets to mark the collectives completed


def check_waits(job: Job) -> str:
    """The straggler watch's measure of a rank's waits in collectives under NCCL
    (training.distributed.waits, as its writer reads it every few seconds): NCCL's Flight Recorder
    holds the default group's collectives just done, completed and timed on the GPU
    (TORCH_NCCL_ENABLE_TIMING=1, which the launcher sets on nodes with GPUs). Under gloo the
    measure is its hooks', which the tests run."""
    if not job.env.launched:
        raise Skip("one process without a process group: no collective to time")
    if str(dist.get_backend()) != "nccl":
        raise Skip("gloo's waits are timed by its hooks (the CPU path, run by the tests)")
    if os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") in ("", "0"):
        raise Skip("TORCH_NCCL_ENABLE_TIMING is off in this job: the watch reads no NCCL times")
    if not os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip("0"):
        raise Skip("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE unset or 0)")
    tensor = torch.ones(WAITS_MARK_SIZE, device=job.device)
    for _ in range(3):
        dist.all_reduce(tensor)
    torch.cuda.synchronize(job.device)
    seconds, count = 0.0, 0
    problem: BaseException | None = None
    try:  # every rank meets below, whatever this one found
        deadline = time.monotonic() + WAITS_READ_FOR
        while True:  # the watchdog marks an entry completed, with its duration, a moment later
            entries = json.loads(flight.trace_json("nccl")).get("entries", [])
            marked = [e for e in entries if e.get("input_sizes") == [[WAITS_MARK_SIZE]]]
            seconds, count, _ = waits.nccl_durations({"entries": marked}, -1)
            if count >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if count < 3:
            problem = Failed(
                f"NCCL's Flight Recorder holds {count} timed, completed collective(s) of the "
                f"default group after 3 all_reduces and {WAITS_READ_FOR:g} s",
                "TORCH_NCCL_ENABLE_TIMING=1 and TORCH_FR_BUFFER_SIZE=256 in the job's environment "
                "(the launcher's defaults); " + DEBUG_REMEDY,
            )
    except Exception as error:  # torch's private dump API changed, or the dump failed
        problem = error
    job.agree(problem)
    return f"{count} collectives timed, {seconds * 1000:.2f} ms"


RUNS: dict[str, Callable[[Job], object]] = {
    "device": check_device,
    "comm-in-node": check_comm_in_node,
    "comm-across-nodes": check_comm_across_nodes,
    "nccl-transport": check_nccl_transport,
    "amp-bf16": check_amp_bf16,
    "amp-fp16": check_amp_fp16,
    "ddp-checkpoint": check_ddp_checkpoint,
    "fsdp2-dcp": check_fsdp2_dcp,
    "compile": check_compile,
    "flight-recorder": check_flight_recorder,
    "nccl-waits": check_waits,
}
