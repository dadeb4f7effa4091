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
    ):
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
            # Every group builds the same initial weights (one seed): step 0 needs no transfer.
            # A group that joins later is behind the others' step and heals all the same.
            init_sync=False,
        )
        self._participants: int | None = None

    def gather(self) -> int:
        """Before the first step of groups started together: quorums without healing until all
        of them are in one, or `start_wait` seconds have passed (a group whose node is slow to
        start, or lost, joins later and heals). Otherwise the first group up trains alone and
        every other one heals from it. Every member of a quorum sees the same participants, so
        they leave together. The groups that will train the first step."""
        deadline = time.monotonic() + self.group.start_wait
        while True:
            self.manager.start_quorum(allow_heal=False)
            participants = self.manager.num_participants()
            if participants >= self.group.count or time.monotonic() >= deadline:
                return participants
            time.sleep(0.5)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` behind torchft's wrapper: zero_grad starts the step's quorum, step()
        steps only if every rank of the group may commit."""
        from torchft.optim import OptimizerWrapper

        return OptimizerWrapper(self.manager, optimizer)

    def gradient_sync(self, model: nn.Module) -> None:
        """Every gradient averaged over the groups in this step's quorum (a healing group's
        counts as zero), in one flat tensor: one cross-node collective per step."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

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
