"""Virtual ranks: a data-parallel job continued on fewer ranks than it was planned for (the
launcher sets TMN_PLANNED_WORLD_SIZE) computes the same steps as the planned world would have.

Of `planned` ranks only `world_size` run. Rank r plays the planned ranks r, r + world_size,
r + 2 * world_size, ... (below `planned`): each has its own sampler and the planned per-rank
batch, so it sees exactly the data that planned rank would have seen. One optimizer step is a
forward and backward per played rank, gradients summed locally and synchronised once, on the
last micro-batch. Each micro-batch's loss is multiplied by `loss_scale`: DDP averages over the
`world_size` ranks that run, and (world_size / planned) times that sum is the mean over the
`planned` micro-batches, which is what the planned world's step averages.

Pure functions of the three numbers: no torch, no process group."""

from __future__ import annotations

from dataclasses import dataclass


def played_ranks(rank: int, world_size: int, planned: int) -> tuple[int, ...]:
    """The planned ranks that `rank` of `world_size` plays, its own first."""
    if not 0 <= rank < world_size <= planned:
        raise ValueError(f"rank {rank} of {world_size} cannot play ranks of a world of {planned}")
    return tuple(range(rank, planned, world_size))


def loss_scale(world_size: int, planned: int) -> float:
    """What each micro-batch's loss is multiplied by, so that averaging the gradients over the
    `world_size` ranks that run gives their mean over the `planned` ranks' micro-batches."""
    return world_size / planned


def _and(numbers: tuple[int, ...]) -> str:
    words = [str(number) for number in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


@dataclass(frozen=True)
class VirtualRanks:
    rank: int
    world_size: int
    planned: int

    def __post_init__(self):
        played_ranks(self.rank, self.world_size, self.planned)  # refuses an impossible layout

    @property
    def active(self) -> bool:
        """Whether ranks are missing: otherwise every rank plays itself and nothing changes."""
        return self.planned != self.world_size

    @property
    def ranks(self) -> tuple[int, ...]:
        return played_ranks(self.rank, self.world_size, self.planned)

    @property
    def loss_scale(self) -> float:
        return loss_scale(self.world_size, self.planned)

    def describe(self, batch_per_rank: int) -> str:
        """One line for the log: what this layout keeps and who plays what."""
        fewest = len(played_ranks(self.world_size - 1, self.world_size, self.planned))
        most = len(played_ranks(0, self.world_size, self.planned))
        counts = str(most) if fewest == most else f"{fewest} or {most}"
        return (
            f"continuing on {self.world_size} of {self.planned} planned ranks: global batch "
            f"{batch_per_rank * self.planned} kept, rank 0 plays ranks "
            f"{_and(played_ranks(0, self.world_size, self.planned))} (rank r plays r, "
            f"r + {self.world_size}, ...: {counts} micro-batches of {batch_per_rank} per step)"
        )
