"""Replicas of distributed checkpoints on node-local disks: each node's files of a step also on
the next node, so that the survivors of any one lost node hold every file of the newest step.

After each checkpoint (dcp.Checkpoints.save) every directory's lowest rank sends the files its
ranks wrote (`__<r>_<n>.distcp`, `rank-<r>.pt`; the index and the manifest every directory has
already) to the next directory in a ring ordered by their lowest ranks, and receives its
predecessor's: in a thread of its own, over a gloo group of all ranks made once (CPU tensors
only, beside NCCL on GPUs), at most --replication-mbps, each file written under a temporary name
in the step directory, fsynced and renamed into place. The next checkpoint waits for it first;
so does the end of the run.

Before a resume (dcp.Checkpoints.resume) the directories agree on the newest step whose files
are complete across all of them (the manifest lists every file), and every directory that lacks
some of its files gets them from one that holds them: then every directory holds the whole step
and the run resumes at any world size, on the survivors, a spare or a wiped disk.

Replicas cover one lost node once its step has been copied: not two nodes lost at once, nor a
node lost before its first copy finished.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.checkpointing import complete, dcp, durable
from torch_multinode.training.checkpointing.transfer import exchange, receiving, sending
from torch_multinode.training.distributed import parallel
from torch_multinode.training.settings import console

LONG_WAIT = 5.0  # seconds of waiting for a copy worth a line
PAUSE_SECONDS = 120.0  # --replication-pause-step: long enough to kill a node in


# -- what goes where (pure) --------------------------------------------------------------------


def directories(seen: Iterable[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct directories (the ranks that see each), ordered by their lowest ranks: the
    ring, each sending to the next."""
    return sorted(set(seen), key=lambda ranks: ranks[0])


writer = dcp.writer  # the rank that wrote a checkpoint file, None for the index and manifest


def written_by(files: Iterable[str], ranks: Iterable[int]) -> list[str]:
    """Of a manifest's files, those `ranks` wrote: what their directory sends to the next."""
    ranks = set(ranks)
    return sorted(name for name in files if writer(name) in ranks)


Files = Mapping[str, int | None] | Iterable[str]  # name -> size (None: unknown), or names


def _sized(files: Files) -> dict[str, int | None]:
    return dict(files) if isinstance(files, Mapping) else dict.fromkeys(files)


def _has(held: Files, name: str, size: int | None) -> bool:
    """Whether a directory holding `held` (name -> size found) has `name` complete: there, and
    of the size it was written with (complete.matches)."""
    held = _sized(held)
    return name in held and complete.matches(held[name] if held[name] is not None else -1, size)


def usable_step(held: dict[int, dict[int, Files]], needed: dict[int, Files]) -> int | None:
    """The newest step whose `needed` files (manifest's, manifest included; name -> size) the
    directories hold complete between them. held: directory -> step -> the files it holds of
    it (name -> size)."""
    for step in sorted(needed, reverse=True):
        wanted = _sized(needed[step])
        if all(
            any(_has(steps.get(step, {}), name, size) for steps in held.values())
            for name, size in wanted.items()
        ):
            return step
    return None


def transfers(
    held: dict[int, Files], needed: Files, ranks: dict[int, tuple[int, ...]] | None = None
) -> dict[tuple[int, int], list[str]]:
    """(source, destination) -> the files the destination lacks (or holds cut short), each from
    the lowest directory that holds it complete. held: directory -> the files it holds of the
    step (name -> size). With `ranks` (directory -> its ranks: a resume at the world size the
    step was saved at, no resharding) a directory wants only the files its ranks load: theirs,
    the index and the manifest."""
    plan: dict[tuple[int, int], list[str]] = {}
    wanted_all = _sized(needed)
    for destination in sorted(held):
        wanted = wanted_all
        if ranks is not None:
            wanted = {
                n: size
                for n, size in wanted_all.items()
                if writer(n) is None or writer(n) in ranks[destination]
            }
        for name, size in sorted(wanted.items()):
            if not _has(held[destination], name, size):
                source = min(d for d in held if _has(held[d], name, size))
                plan.setdefault((source, destination), []).append(name)
    return plan


# -- the job's side --------------------------------------------------------------------------


class Replication:
    """dcp.Checkpoints' replicas (its `replication`): the copy after each save, the restore
    before a resume."""

    def __init__(
        self,
        checkpoints: dcp.Checkpoints,
        mbps: float,
        timeout: float,
        pause: tuple[int, int | None] | None = None,
    ):
        """`pause`: the test hook (step, rank or None for every directory): that step's copy
        pauses PAUSE_SECONDS after its first piece is sent, a copy in flight to kill a node in."""
        self.checkpoints, self.mbps, self.timeout = checkpoints, mbps, timeout
        self.pause = pause
        self.group = None
        self.ring: list[tuple[int, ...]] = []
        self.thread: threading.Thread | None = None
        self.copying: int | None = None  # the step being copied
        self.copied: int | None = None  # the newest step whose copy finished, this run
        self.broken = False  # a copy failed in the connection: no more this run

    @property
    def active(self) -> bool:
        """Node-local disks: more than one directory."""
        return len(self.ring) > 1

    @property
    def _layout(self) -> dcp.Layout:
        """The checkpoints' layout: Checkpoints.look ran before the ring opened."""
        layout = self.checkpoints.layout
        assert layout is not None
        return layout

    def _node(self, directory: tuple[int, ...]) -> str:
        return self._layout.nodes[directory[0]]

    def open(self) -> None:
        """The ring and its gloo group (collective, once, after Checkpoints.look).

        Every rank is a member, though only each directory's lowest rank sends or receives:
        under NCCL the job's group is bound to the rank's GPU (parallel.start), and torch 2.14.1
        then makes each rank left out of a new group, whatever its backend, take part in an
        ncclCommSplit of the job's communicator that the gloo group's members never join
        (distributed_c10d.py, _new_process_group_helper): with 2+ ranks on a node the left-out
        ones would wait in it for ever."""
        layout = self._layout
        self.ring = directories(layout.seen)
        if self.active and self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))

    def _neighbours(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        mine = self.ring.index(self._layout.visible)
        return self.ring[(mine + 1) % len(self.ring)], self.ring[mine - 1]

    # -- after each save -------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Copy this directory's files of `step` to the next one, and receive the previous
        one's, in the background (this directory's lowest rank)."""
        if not self.active or self.broken or not self._layout.owner:
            return
        self.copying = step
        self.thread = threading.Thread(
            target=self._copy, args=(step,), name=f"replicate-{step}", daemon=True
        )
        self.thread.start()

    def _copy(self, step: int) -> None:
        env, layout = self.checkpoints.env, self._layout
        to, source = self._neighbours()
        directory = self.checkpoints.path(step)
        failed: list[str] = []
        try:
            files = self.checkpoints._manifest(step)["files"]
            outgoing = sending(directory, written_by(files, layout.visible))
            if (
                self.pause is not None
                and self.pause[0] == step
                and self.pause[1]
                in (
                    None,
                    env.rank,
                )
            ):
                outgoing = self._paused(outgoing, step)
            exchange(
                self.group,
                outgoing,
                to[0],
                receiving(directory, written_by(files, source), failed),
                source[0],
                self.mbps,
            )
        except Exception as error:  # a peer gone, a timeout: the job's collectives decide
            self.broken = True
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            console.say_every_rank(
                env,
                f"replication of checkpoint step {step} with {self._node(to)} and "
                f"{self._node(source)} failed ({reason}): no more copies this run",
            )
            return
        if failed:
            console.say_every_rank(
                env,
                f"replica of {self._node(source)}'s checkpoint step {step} not written: "
                f"{', '.join(failed)}",
            )
        else:
            self.copied = step

    def _paused(self, outgoing: Iterator, step: int) -> Iterator:
        """The test hook: the sizes and the first piece go, then the copy stops for
        PAUSE_SECONDS, the next node holding part of this one's files of `step`."""
        yield next(outgoing)
        piece = next(outgoing, None)
        if piece is not None:
            yield piece
        console.say_every_rank(
            self.checkpoints.env,
            f"replication of checkpoint step {step}: first piece sent, pausing "
            f"{PAUSE_SECONDS:.0f} s (--replication-pause-step)",
        )
        time.sleep(PAUSE_SECONDS)
        yield from outgoing

    def wait(self) -> None:
        """The copy under way finished (before the next save, and at the end of the run)."""
        if self.thread is None:
            return
        began = time.monotonic()
        self.thread.join()
        waited = time.monotonic() - began
        if waited >= LONG_WAIT:
            console.say_every_rank(
                self.checkpoints.env,
                f"waited {waited:.1f} s for the copy of checkpoint step {self.copying} to the "
                f"next node (--replication-mbps {self.mbps:g})",
            )
        self.thread = None

    # -- before a resume -------------------------------------------------------------------

    def restore(self) -> None:
        """Every directory made to hold every file of the newest step the directories hold
        complete between them (collective)."""
        self.open()
        if not self.active:
            return
        store, env, layout = self.checkpoints, self.checkpoints.env, self._layout
        mine: dict[int, dict[str, int]] | None = None
        if layout.owner:
            mine = {s: self._sweep(store.path(s)) for s in store.steps()}
        held = {r: steps for r, steps in enumerate(parallel.all_gather(mine, env)) if steps}
        lowest = {}  # step -> the lowest directory holding it, which tells its manifest
        for owner in sorted(held, reverse=True):
            lowest.update(dict.fromkeys(held[owner], owner))
        listed = None
        if layout.owner:
            listed = {}
            for s, o in lowest.items():
                if o == env.rank:
                    manifest = store._manifest(s)
                    listed[s] = (dcp.expected(manifest), manifest["world_size"])
        needed, world = {}, {}
        for found in parallel.all_gather(listed, env):
            for s, (files, size) in (found or {}).items():
                needed[s], world[s] = files, size
        if not needed:
            return
        for owner in [ranks[0] for ranks in self.ring]:
            held.setdefault(owner, {})
        step = usable_step(held, needed)
        if step is None:
            raise self._incomplete(max(needed), held, needed[max(needed)])
        # At the saved world size each directory needs its own ranks' files only.
        ranks = {r[0]: r for r in self.ring} if world[step] == env.world_size else None
        plan = transfers({o: steps.get(step, {}) for o, steps in held.items()}, needed[step], ranks)
        if not plan:
            return
        self._fetch(step, plan, step in held.get(env.rank, {}))
        said = [
            f"{layout.nodes[to]}'s directory lacked {len(names)} file{'s' * (len(names) > 1)}, "
            f"copied from {layout.nodes[source]}"
            for (source, to), names in sorted(plan.items(), key=lambda item: item[0][::-1])
        ]
        newer = [s for s in needed if s > step]
        skipped = f" (step {max(newer)} is not complete on these nodes)" if newer else ""
        console.say(env, f"checkpoint step {step}{skipped}: " + "; ".join(said))

    @staticmethod
    def _sweep(directory: Path) -> dict[str, int]:
        """The files of a step directory with their sizes, once the temporary files of a copy
        cut short are gone."""
        found = {}
        for path in directory.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif (size := complete.size_of(path)) is not None:
                found[path.name] = size
        return found

    def _fetch(self, step: int, plan: dict[tuple[int, int], list[str]], have: bool) -> None:
        """The plan carried out, pair by pair in one order everywhere; a directory that held
        none of the step receives into a temporary directory renamed once complete."""
        rank, final = self.checkpoints.env.rank, self.checkpoints.path(step)
        into = final if have else final.parent / f".{final.name}.tmp"
        if not have and any(to == rank for _, to in plan):
            shutil.rmtree(into, ignore_errors=True)
            into.mkdir(parents=True)
        failed: list[str] = []
        for (source, to), names in sorted(plan.items()):
            if rank == source:
                exchange(self.group, sending(final, names), to, None, None, 0)
            elif rank == to:
                exchange(self.group, None, None, receiving(into, names, failed), source, 0)
        error = None
        if failed:
            error = UserError(
                f"cannot restore checkpoint step {step} in {self.checkpoints.directory}: "
                f"{', '.join(failed)}",
                hint="freeing space there, or --no-resume to start over",
                exit_code=1,
            )
        elif not have and any(to == rank for _, to in plan):
            durable.sync_directory(into)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(into, final)
            durable.sync_directory(final.parent)
        dcp.agree(self.checkpoints.env, error)

    def _incomplete(self, step: int, held: dict, needed: Files) -> UserError:
        needed = _sized(needed)
        lost = sorted(
            name
            for name, size in needed.items()
            if not any(_has(steps.get(step, {}), name, size) for steps in held.values())
        )
        nodes = ", ".join(self._node(ranks) for ranks in self.ring)
        return UserError(
            f"checkpoint step {step} in {self.checkpoints.directory}: the nodes of this run "
            f"({nodes}) hold {len(needed) - len(lost)} of its {len(needed)} files between them, "
            f"and no older step complete (lost: {', '.join(lost[:4])}"
            f"{', ...' if len(lost) > 4 else ''}); each node's files are copied to one other "
            "node after each checkpoint, which covers one lost node, not two at once nor one "
            "lost before its first copy",
            hint="the lost node's disk back, or --no-resume to start over",
        )
