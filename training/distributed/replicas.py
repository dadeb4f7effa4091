"""Per-step fault tolerance across nodes (FT=1) with torchft: each node is one replica group.

Inside a node the ranks train as they always do (their own torchrun, their own process group,
DDP between them). Across nodes torchft's Manager replicates: every step it forms a quorum of the
groups that answer the lighthouse, averages the gradients over them, and commits the step only
where that worked. A group that dies mid-step costs the others that one step (not committed,
done again with the next batch) after `timeout` seconds; they go on with the next quorum, their
processes untouched. A group that starts late (restarted, or a spare) heals: it receives the
model, the optimizer and the position from a live peer at a step boundary (torchft's checkpoint
transport) and trains the next step with the others.

The environment names the group (cluster.jobenv: REPLICA_*, TORCHFT_LIGHTHOUSE); `read` takes
it. The launcher's FT=1 (launch.replicated) sets it on every node and runs the lighthouse
(launch.lighthouse); the loopback tests set it by hand.

Batch semantics: each group keeps its own share of the data (rank `index * ranks + rank` of
`count * ranks`), so while a group is out each step sees fewer samples, and torchft divides the
gradients' sum by the groups that took part: the step is the mean over the samples it saw, as
torchft's own examples do. Keeping the global batch would need the survivors to take the lost
group's share too, the next step's quorum being unknown when its data is drawn.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import (
    LIGHTHOUSE_VARIABLE,
    PLANNED_WORLD_VARIABLE,
    REPLICA_ADDRESS_VARIABLE,
    REPLICA_GROUP_VARIABLE,
    REPLICA_GROUPS_VARIABLE,
    REPLICA_MIN_GROUPS_VARIABLE,
    REPLICA_START_WAIT_VARIABLE,
    REPLICA_TIMEOUT_VARIABLE,
)

DEFAULT_TIMEOUT = 10.0  # seconds a cross-node collective waits for a group before dropping it
# How long a step waits for its quorum: the groups' first one (every group starting) and any
# after a loss; a quorum never formed (fewer than the minimum of groups alive) fails the job.
QUORUM_TIMEOUT = 120.0
VARIABLES = (
    LIGHTHOUSE_VARIABLE,
    REPLICA_GROUP_VARIABLE,
    REPLICA_GROUPS_VARIABLE,
    REPLICA_MIN_GROUPS_VARIABLE,
    REPLICA_TIMEOUT_VARIABLE,
    REPLICA_ADDRESS_VARIABLE,
    REPLICA_START_WAIT_VARIABLE,
)


@dataclass(frozen=True)
class ReplicaGroup:
    """This node's replica group in a job of `count` groups."""

    index: int
    count: int
    lighthouse: str
    min_groups: int = 1
    timeout: float = DEFAULT_TIMEOUT
    address: str = field(default_factory=socket.gethostname)
    start_wait: float = 0.0

    @property
    def replica_id(self) -> str:
        # torchft reads a global rank from the id's trailing digits.
        return f"group{self.index}"

    def data_position(self, rank: int, world_size: int) -> tuple[int, int]:
        """This rank's (rank, world size) in the data: its group's share, then its own."""
        return self.index * world_size + rank, self.count * world_size

    def own_rank(self, job_rank: int | None, world_size: int) -> int | None:
        """Rank `job_rank` of the whole job (counted across the groups, as the data shares are:
        group index x ranks a node + rank) as this group's ranks number it: its rank here, -1
        where it is another group's; None (every rank) stays None. What the test hooks that
        name a rank (--checkpoint-pause-rank) compare with their own rank."""
        if job_rank is None:
            return None
        first = self.index * world_size
        return job_rank - first if first <= job_rank < first + world_size else -1


def read(environ: Mapping[str, str] | None = None) -> ReplicaGroup | None:
    """The replica group the launcher gave this process, or None where it gave none (no FT)."""
    environ = os.environ if environ is None else environ
    if not any(environ.get(name) for name in (LIGHTHOUSE_VARIABLE, REPLICA_GROUP_VARIABLE)):
        return None
    missing = [name for name in VARIABLES[:3] if not environ.get(name)]
    if missing:
        raise UserError(
            f"a replica group needs {', '.join(missing)} in the environment as well",
            hint=f"set {', '.join(VARIABLES[:3])} together (training/README.md, replica groups)",
        )

    def number(name: str, default: float, kind: type = int) -> Any:
        value = environ.get(name, "").strip()
        try:
            return kind(value) if value else default
        except ValueError:
            raise UserError(f"{name}={value!r} is not a number") from None

    group = ReplicaGroup(
        index=number(REPLICA_GROUP_VARIABLE, 0),
        count=number(REPLICA_GROUPS_VARIABLE, 0),
        lighthouse=environ[LIGHTHOUSE_VARIABLE],
        min_groups=number(REPLICA_MIN_GROUPS_VARIABLE, 1),
        timeout=number(REPLICA_TIMEOUT_VARIABLE, DEFAULT_TIMEOUT, float),
        address=environ.get(REPLICA_ADDRESS_VARIABLE) or socket.gethostname(),
        start_wait=number(REPLICA_START_WAIT_VARIABLE, 0.0, float),
    )
    if not 0 <= group.index < group.count:
        raise UserError(
            f"{REPLICA_GROUP_VARIABLE}={group.index} is not a group of "
            f"{REPLICA_GROUPS_VARIABLE}={group.count} (0 to {group.count - 1})"
        )
    if not 1 <= group.min_groups <= group.count:
        raise UserError(
            f"{REPLICA_MIN_GROUPS_VARIABLE}={group.min_groups} must be 1 to the "
            f"{group.count} groups"
        )
    if not 0 <= group.start_wait <= 86400:
        raise UserError(
            f"{REPLICA_START_WAIT_VARIABLE}={group.start_wait} must be 0 to 86400 seconds"
        )
    if not 0 < group.timeout <= 3600:
        raise UserError(f"{REPLICA_TIMEOUT_VARIABLE}={group.timeout} must be above 0, at most 3600")
    return group


def _completed(value: torch.Tensor) -> torch.futures.Future:
    """A future already done with `value`: a bucket of a step already lost."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class Replication:
    """This group's torchft Manager and what the training loop asks of it: the optimizer that
    steps only on a committed step, the gradients averaged across groups, and the state a
    healing group receives (`state`) and takes (`load`)."""

    def __init__(
        self,
        group: ReplicaGroup,
        device: torch.device,
        state: Callable[[], dict],
        load: Callable[[dict], None],
        store: tuple[str, int] | None = None,
    ):
        """`store`: the (address, port) of a TCPStore of this group's alone, its only rank being
        this process (make selftest's ft-replicas check, where every rank is a group); by
        default the group is this torchrun's ranks, and its store torchrun's."""
        # torchft's Rust side logs every quorum and commit at INFO: its warnings only, unless
        # the user asks for more.
        os.environ.setdefault("RUST_LOG", "warn")
        # A healing group reads the state from torchft's stream into read-only buffers, which
        # torch warns about once; nothing writes to them.
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport

        class Transport(HTTPTransport):
            """torchft's checkpoint server, giving the group's address instead of the host
            name (torchft 0.2.0's HTTPTransport.address), and no access log line per transfer
            in the job's output."""

            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self._server.RequestHandlerClass.log_message = lambda *_: None

            def address(self) -> str:
                port = self._server.socket.getsockname()[1]
                return f"http://{group.address}:{port}/checkpoint/"

        self.group = group
        timeout = timedelta(seconds=group.timeout)
        # The only device branch: torchft's reconfigurable NCCL group where the gradients are on
        # a GPU, its gloo one elsewhere (torchft 0.2.0: both take the timeout).
        pg = ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)
        self._pg = pg  # its size is the quorum's members, once torchft has configured it
        # torchft points the Flight Recorder at a new folder per quorum when its dump path
        # is set (an empty folder in the run directory per membership change): the launcher's
        # path stays as it set it, read by torchft only here.
        saved = os.environ.pop("TORCH_FR_DUMP_TEMP_FILE", None)
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=load,
                state_dict=state,
                min_replica_size=group.min_groups,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT),
                lighthouse_addr=group.lighthouse,
                replica_id=group.replica_id,
                hostname=group.address,
                checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
                **(
                    {}
                    if store is None
                    else {
                        "store_addr": store[0],
                        "store_port": store[1],
                        "rank": 0,
                        "world_size": 1,
                    }
                ),
                # Every group builds the same initial weights (one seed): step 0 needs no transfer.
                # A group that joins later is behind the others' step and heals all the same.
                init_sync=False,
            )
        finally:
            if saved is not None:
                os.environ["TORCH_FR_DUMP_TEMP_FILE"] = saved
        self._participants: int | None = None

    def gather(self) -> int:
        """Before the first step of groups started together: quorums without healing until all
        of them are in one, or `start_wait` seconds have passed (a group whose node is slow to
        start, or lost, joins later and heals). Otherwise the first group up trains alone and
        every other one heals from it. Every member of a quorum sees the same members, so they
        leave together. The groups in the last quorum.

        Members, not participants: without healing torchft counts as participants only the
        groups at the newest step, so groups resumed from checkpoints of different steps would
        wait out `start_wait` in full; the ones behind heal at the first step's quorum."""
        deadline = time.monotonic() + self.group.start_wait
        while True:
            self.manager.start_quorum(allow_heal=False)
            members = max(self.manager.num_participants(), self._members())
            if members >= self.group.count or time.monotonic() >= deadline:
                return members
            time.sleep(0.5)

    def _members(self) -> int:
        """The groups in the quorum just formed: torchft configures its process group with all
        of them (0 where that failed; torchft then reports the error at the step's commit)."""
        try:
            return self._pg.size()
        except (AssertionError, AttributeError):  # not configured: no parent process group
            return 0

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` behind torchft's wrapper: zero_grad starts the step's quorum, step()
        steps only if every rank of the group may commit."""
        from torchft.optim import OptimizerWrapper

        return OptimizerWrapper(self.manager, optimizer)

    def replicate(self, ddp: nn.Module) -> None:
        """DDP's gradient buckets averaged over the groups in this step's quorum as each comes
        ready in the backward pass: a comm hook in place of DDP's own all-reduce, averaging over
        the node's ranks (DDP's process group) and then, through torchft, over the groups (a
        healing group's counts as zero), as torchft's own DDP does for one rank a group. The
        collectives across the groups overlap the rest of the backward pass, as DDP's own do: on
        a GPU the stream waits for them, not the host; on the CPU gloo's thread completes them
        (`_across`).

        Every group must lay its buckets out alike, or a bucket would meet another group's
        parameters: `ddp` is built with find_unused_parameters=True (wrap_ddp's fixed_buckets),
        which keeps DDP from rebuilding them in the order of its first step (a group that joins
        later would still have the first layout while the others had rebuilt theirs)."""
        import torch.distributed as dist

        node = ddp.process_group
        ranks = dist.get_world_size(node)
        manager = self.manager

        # Unannotated: DDP checks a hook's annotations against the types themselves, which the
        # strings of `from __future__ import annotations` are not.
        def hook(_, bucket):
            buffer = bucket.buffer()
            if ranks > 1:
                dist.all_reduce(buffer, group=node)
                buffer.div_(ranks)
            if buffer.device.type == "cpu":
                return self._across(buffer)
            # torchft 0.2.0 builds the chain of the work's callbacks (the division by the
            # groups, an error or a timeout reported and the step not committed) in its wait,
            # which on a GPU makes the stream wait, not the host; its own DDP's hook returns
            # the future that chain completes, as here. A step already lost gives a plain,
            # completed future.
            work = manager.allreduce(buffer)
            work.wait()
            future = work.get_future()
            return getattr(future, "_fut", None) or future

        ddp.register_comm_hook(None, hook)

    def _across(self, tensor: torch.Tensor) -> torch.futures.Future:
        """`tensor` averaged over the groups in this step's quorum, on the CPU, as torchft's
        Manager.allreduce does it (a group not participating sends zeros, the sum is divided by
        the participants, an error or a timeout is reported so that the step is not committed,
        and a step already lost skips the rest), but returned as a future that gloo's thread
        completes while the backward pass goes on, as DDP's own all-reduce does. torchft 0.2.0
        chains its callbacks only in its work's `wait` (the chain's closures read the loop's
        last node, right only on a completed work): waiting there would hold the backward pass
        at every bucket until the bucket had crossed the network."""
        from torch.distributed import AllreduceOptions, ReduceOp

        manager = self.manager
        if manager.errored():
            return _completed(tensor)
        manager.wait_quorum()
        participants = manager.num_participants()
        if not manager.is_participating():
            tensor.zero_()
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        try:
            work = self._pg.allreduce([tensor], options)
        except Exception as error:  # as torchft's: this step is lost, the job goes on
            manager.report_error(error)
            return _completed(tensor)

        def average(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # a failed all-reduce raises here, for wrap_future to report
            return tensor.div_(participants)

        return manager.wrap_future(work.get_future().then(average), tensor)

    def gradient_sync(self, model: nn.Module) -> None:
        """Every gradient averaged over the groups in this step's quorum (a healing group's
        counts as zero), in one flat tensor after the backward pass: one cross-node collective
        per step, for a loop without DDP (training.fsdp's). Sharded gradients (FSDP2's) are this
        rank's shards, averaged with the same rank's of the other groups."""
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def resumed(self, step: int) -> None:
        """This group resumed from its own checkpoint of `step`: torchft's step count is that
        step, so that at the first quorum a group behind the newest heals from it (and this one
        from a group ahead)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def committed(self) -> int:
        """The steps committed: torchft's step count, which a healed group takes from its peer."""
        return self.manager.current_step()

    def participants(self) -> int:
        """The groups that trained the step just done."""
        return self.manager.num_participants()

    def membership(self, step: int) -> str | None:
        """A line when the groups training changed with the step just done, else None."""
        participants = self.participants()
        if participants == self._participants:
            return None
        self._participants, count = participants, self.group.count
        if participants == count:
            return f"step {step}: all {count} replica groups train"
        return (
            f"step {step}: {participants} of {count} replica groups train: each step sees "
            f"{participants}/{count} of the planned samples, its gradients averaged over them"
        )

    def describe(self) -> str:
        group = self.group
        return (
            f"replicas {group.count} groups, one per node (this node's: {group.index}), torchft: "
            f"a group silent for {group.timeout:g} s is dropped and the others go on; "
            f"at least {group.min_groups} train every step"
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def check_ddp(settings: Any) -> None:
    """What DDP does not run with under replica groups (its DDPConfig), said in one line: the
    groups' hook carries the gradients, with a fixed layout of buckets."""
    if settings.comm_hook != "none":
        raise UserError(
            f"--comm-hook {settings.comm_hook} with replica groups: torchft's all-reduce carries "
            "the gradients across the nodes, uncompressed",
            hint="--comm-hook none",
        )
    if settings.static_graph:
        raise UserError(
            "--static-graph with replica groups: DDP would rebuild its buckets after the first "
            "step, and every group must keep the same layout (a group that joins later starts "
            "with the first)",
            hint="leave out --static-graph",
        )


def check_job(planned_world_size: int | None, world_size: int, grad_scaler: bool = False) -> None:
    """What replica groups do not run with, said in one line: the workloads' common refusals."""
    if planned_world_size not in (None, world_size):
        raise UserError(
            f"replica groups do not continue on fewer ranks than planned "
            f"({PLANNED_WORLD_VARIABLE}): they go on without the lost group",
            hint=f"unset {PLANNED_WORLD_VARIABLE}",
        )
    if grad_scaler:
        raise UserError(
            "--precision fp16 with replica groups: the loss scaler skips an optimizer "
            "step torchft must commit on every group alike",
            hint="--precision bf16 (or fp32)",
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's part on this rank (a view of it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_like(parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """An optimizer state's shard received from a peer, as this rank's optimizer keeps it for
    `parameter`: sharded alike on its device (a DTensor for FSDP2's), or a scalar on the CPU
    (AdamW's step count)."""
    from torch.distributed.tensor import DTensor

    if value.dim() == 0:
        return value.detach().cpu().clone()
    value = value.to(_local(parameter).device).clone()
    if isinstance(parameter, DTensor):
        return DTensor.from_local(
            value, parameter.device_mesh, parameter.placements, run_check=False
        )
    return value


class Shards:
    """FT=1 for a training loop of its own over sharded parameters (training.fsdp's FSDP2):
    the state a healing group receives is each rank's own shards of the parameters and of the
    optimizer's state, plain tensors. torchft heals every rank from the same rank of a live
    group, and every node's ranks shard alike, so the shards fit.

    The loop starts each step with `optimizer.zero_grad()` (the step's quorum), averages its
    gradients with `gradient_sync` after backward, steps, and asks `after_step` whether the
    step counts and from which step it goes on (a group that healed takes its peer's)."""

    def __init__(
        self,
        group: ReplicaGroup,
        device: torch.device,
        optimizer: torch.optim.Optimizer,
        learning_rate: Callable[[int], float],
    ):
        self.inner, self.learning_rate = optimizer, learning_rate
        # The optimizer's own parameters: FSDP2's sharded ones. A peer may ask for the state
        # mid-forward, while the module's attributes are the gathered, unsharded tensors.
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.step = 0  # the step being trained: what a healing peer takes
        self.healed = False
        self.replication = Replication(group, device, self._state, self._load)
        self.optimizer = self.replication.optimizer(optimizer)

    def _state(self) -> dict:
        parameters = self.parameters
        return {
            "parameters": [_local(p).detach() for p in parameters],
            "optimizer": [
                {name: _local(value) for name, value in self.inner.state.get(p, {}).items()}
                for p in parameters
            ],
            "step": self.step,
        }

    def _load(self, state: dict) -> None:
        parameters = self.parameters
        shapes = [tuple(_local(p).shape) for p in parameters]
        if [tuple(t.shape) for t in state["parameters"]] != shapes:
            raise UserError(
                "a live group's shards do not fit this group's: the nodes run different "
                "numbers of ranks",
                hint="the same number of ranks on every node (NPROC_PER_NODE)",
            )
        with torch.no_grad():
            for parameter, shard in zip(parameters, state["parameters"], strict=True):
                _local(parameter).copy_(shard)
        for parameter, values in zip(parameters, state["optimizer"], strict=True):
            self.inner.state[parameter] = {
                name: _shard_like(parameter, value) for name, value in values.items()
            }
        self.step = state["step"]
        # The peer's optimizer holds the rate of its step before: this step's, as it steps it.
        for param_group in self.inner.param_groups:
            param_group["lr"] = self.learning_rate(self.step)
        self.healed = True

    def after_step(self, step: int) -> tuple[int, bool, bool]:
        """After `optimizer.step()` of step `step` (0-based): the step trained (the peer's
        where this group healed in it), whether it was committed, whether this group healed."""
        healed, self.healed = self.healed, False
        step = self.step if healed else step
        return step, self.replication.committed() != step, healed
