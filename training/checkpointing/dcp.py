"""Distributed checkpoints of a sharded model: torch.distributed.checkpoint (DCP), one directory
per step that exists only once complete, resumable at another world size where storage is
shared.

Layout of `--checkpoint-dir`:

    step-00000020/          complete: renamed from .step-00000020.tmp/ once every rank wrote
        .metadata           DCP's index of every shard (rank 0 writes it; copied to every node)
        __<rank>_<n>.distcp each rank's shards of the parameters and the optimizer state
        rank-<rank>.pt      each rank's own: position, RNG, the optimizer's unsharded entries
        manifest.pt         step, world size, the node of every writer, every file with its
                            size, the run's shape
    .step-00000030.tmp/     being written (removed at the next start)

Only DTensors (the shards) go through DCP; everything else (the optimizer's step counts and
hyperparameters, and every tensor of a strategy that does not shard) goes into each rank's own
file. DCP writes a replicated value once, from one rank, so on node-local disks a rank on
another node could not read it back: this way a rank needs at the same world size only its
own files and the index, which every node gets a copy of.

A step is resumed only where it is complete for every rank (training.checkpointing.complete):
each file a rank needs there with the size the manifest lists; a newer step some rank holds in
part is said and skipped, never loaded.

Storage every rank sees (one directory holds every rank's files) is told apart from node-local
disks by looking: each rank writes a probe file and looks for the others'. Each directory's
lowest rank renames, prunes and cleans it. Resuming at another world size (resharding) reads
other ranks' shards: where a rank cannot see all the files the manifest lists, the run stops
with one line saying that resharding needs shared storage.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.checkpointing import checkpoint, complete, durable
from torch_multinode.training.distributed import parallel
from torch_multinode.training.settings import console
from torch_multinode.training.settings.console import say

if TYPE_CHECKING:
    from torch_multinode.training.checkpointing.replicate import Replication

FORMAT = 1
MANIFEST = "manifest.pt"
METADATA = ".metadata"  # DCP's index file (torch.distributed.checkpoint.filesystem)
SHARDED = "<in the DCP shards>"  # what stands in a rank's file where a DTensor was
_STEP = re.compile(r"^step-(\d{8})$")
_DCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # FileSystemWriter: __<rank>_<n>.distcp
PAUSE_SECONDS = 120.0  # --checkpoint-pause-step: long enough to kill a node in
SHARED_HINT = (
    "a --checkpoint-dir on storage every node sees, such as /shared on the simulated cluster"
)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def writer(name: str) -> int | None:
    """The rank that wrote a checkpoint file, None for the index and the manifest."""
    match = _DCP_FILE.match(name)
    if match:
        return int(match[1])
    if name.startswith("rank-") and name.endswith(".pt"):
        return int(name[5:-3])
    return None


def own_files(directory: Path, rank: int) -> list[str]:
    """The files in `directory` that rank `rank` wrote."""
    return sorted(p.name for p in directory.iterdir() if writer(p.name) == rank)


def expected(manifest: dict) -> dict[str, int | None]:
    """Every file of a step with the size it was written with (None where the manifest, from
    before sizes were kept, or for itself, does not say)."""
    sizes = manifest.get("sizes") or {}
    return {**{name: sizes.get(name) for name in manifest["files"]}, MANIFEST: None}


# -- splitting a state dict into its shards and the rest ---------------------------------------


def split(state: Any, path: tuple = ()) -> tuple[Any, dict[str, DTensor]]:
    """(state with every DTensor replaced by SHARDED, {path: DTensor})."""
    if isinstance(state, DTensor):
        return SHARDED, {"/".join(map(str, path)): state}
    if isinstance(state, dict | list | tuple):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        rest, sharded = {}, {}
        for key, value in items:
            rest[key], found = split(value, (*path, key))
            sharded.update(found)
        if not isinstance(state, dict):
            return type(state)(rest[index] for index in range(len(state))), sharded
        return rest, sharded
    return state, {}


def merge(rest: Any, sharded: dict[str, DTensor], path: tuple = ()) -> Any:
    """The inverse of split."""
    if isinstance(rest, str) and rest == SHARDED:
        return sharded["/".join(map(str, path))]
    if isinstance(rest, dict):
        return {key: merge(value, sharded, (*path, key)) for key, value in rest.items()}
    if isinstance(rest, list | tuple):
        return type(rest)(merge(value, sharded, (*path, i)) for i, value in enumerate(rest))
    return rest


def sharded_paths(rest: Any, path: tuple = ()) -> set[str]:
    """The paths split() took DTensors from."""
    if isinstance(rest, str) and rest == SHARDED:
        return {"/".join(map(str, path))}
    if not isinstance(rest, dict | list | tuple):
        return set()
    items = rest.items() if isinstance(rest, dict) else enumerate(rest)
    return set().union(*(sharded_paths(value, (*path, key)) for key, value in items))


def agree(env: parallel.DistEnv, error: UserError | None, own: bool = True) -> None:
    """Raise on every rank the lowest rank's error, if any rank had one: a rank that raised
    alone would leave the others waiting in their next collective. An error that is not the
    rank's `own` (it only heard of another rank's failure) is said only when no rank has one."""
    found = parallel.all_gather(
        None if error is None else (not own, str(error), error.hint, error.exit_code), env
    )
    entries = sorted((entry for entry in found if entry is not None), key=lambda e: e[0])
    if entries:
        _, message, hint, code = entries[0]  # sorted() keeps the ranks' order among equals
        raise UserError(message, hint=hint, exit_code=code)


# What a failed read or write raises: DCP gathers every rank's exception into one
# CheckpointException (a BaseException), raised on every rank; torch.save and torch.load report
# a failed write or a bad file as a RuntimeError.
FAILURES = (OSError, RuntimeError, ValueError, CheckpointException)


def _reason(error: BaseException) -> str:
    """What went wrong, in a few words: the OSError behind it, else its first line."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = next(iter(error.failures.items()))
        return f"rank {rank}: {_reason(error)}"
    cause = checkpoint._os_error(error)
    if cause is not None:
        return cause.strerror or str(cause)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


@dataclass(frozen=True)
class Layout:
    """Who shares this rank's directory, learnt by looking."""

    rank: int
    visible: tuple[int, ...]  # the ranks whose files this rank sees in its directory
    nodes: tuple[str, ...]  # every rank's node, by rank
    seen: tuple[tuple[int, ...], ...] = ()  # every rank's `visible`, by rank

    @property
    def owner(self) -> bool:
        """Whether this rank is its directory's lowest rank: the one that renames and prunes."""
        return self.rank == self.visible[0]


class Checkpoints:
    """One job's distributed checkpoints in `directory` (the same path on every node)."""

    def __init__(
        self,
        directory: Path,
        env: parallel.DistEnv,
        keep: int,
        node: str,
        pause: tuple[int, int | None] | None = None,
        hold: tuple[int, int | None] | None = None,
    ):
        """`pause`: the test hook (step, rank or None for every rank): that rank's write of that
        step pauses PAUSE_SECONDS once its files are in the temporary directory, before the
        ranks agree and the directory takes its name (a write to kill a node in). `hold`: the
        same, but that rank sleeps PAUSE_SECONDS after the step, between checkpoints."""
        self.directory, self.env, self.keep, self.node = Path(directory), env, keep, node
        self.pause, self.hold = pause, hold
        self.layout: Layout | None = None
        self.replication: Replication | None = None  # on node-local disks

    def path(self, step: int) -> Path:
        return self.directory / step_name(step)

    def steps(self) -> list[int]:
        """The complete checkpoints this rank sees, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _STEP.match(entry.name)
            if match and (entry / MANIFEST).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    # -- the directory's layout ------------------------------------------------------------------

    def look(self) -> Layout:
        """Every rank writes a probe file and looks for the others' (collective); also the check
        that the directory takes files at all."""
        env = self.env
        token = parallel.all_gather(uuid.uuid4().hex[:12], env)[0]
        probe = self.directory / f".probe-{token}-{env.rank:05d}"
        store = checkpoint.CheckpointStore(self.directory, env.rank, self.keep)
        error = None
        try:
            store.check_writable()
            probe.touch()
        except UserError as raised:
            error = raised
        except OSError as raised:
            reason = raised.strerror or str(raised)
            error = UserError(
                f"cannot write checkpoints to {self.directory}: {reason}", exit_code=1
            )
        agree(env, error)
        visible = tuple(
            r
            for r in range(env.world_size)
            if (self.directory / f".probe-{token}-{r:05d}").exists()
        )
        gathered = parallel.all_gather((self.node, visible), env)
        probe.unlink(missing_ok=True)  # every rank has looked: the gather waited for them
        nodes, seen = tuple(n for n, _ in gathered), tuple(v for _, v in gathered)
        self.layout = Layout(env.rank, visible, nodes, seen)
        return self.layout

    def _clean(self) -> None:
        """The owner's sweep: half-written steps and probes a killed run left behind."""
        for entry in self.directory.iterdir():
            if entry.name.startswith(".step-") and entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(".probe-"):
                entry.unlink(missing_ok=True)

    # -- saving ------------------------------------------------------------------------------

    def _write_error(self, step: int, raised: BaseException) -> tuple[UserError, bool]:
        """A failed write's line, and whether the failure is this rank's own. DCP raises every
        rank's failures on every rank; the line the ranks agree on is the failing rank's, naming
        its directory, and its node where nodes do not share the directory (node-local disks)."""
        failures = raised.failures if isinstance(raised, CheckpointException) else {}
        mine = not failures or self.env.rank in failures
        if failures and mine:
            raised = failures[self.env.rank][0]
        where = str(self.directory)
        layout = self.layout
        if layout is not None and len(layout.visible) < self.env.world_size:
            where += f" on {self.node}"
        error = UserError(
            f"cannot write checkpoint step {step} to {where}: {_reason(raised)}",
            hint="freeing space there, or another --checkpoint-dir",
            exit_code=1,
        )
        return error, mine

    def _pausing(self, step: int) -> bool:
        """Whether this rank pauses in the write of `step` (--checkpoint-pause-step)."""
        return self._once("paused", self.pause, step)

    def holding(self, step: int) -> bool:
        """Whether this rank sleeps after `step` (--hold-after-step): a node to kill between
        checkpoints. The caller says so and sleeps PAUSE_SECONDS."""
        return self._once("held", self.hold, step)

    def _once(self, kind: str, hook: tuple[int, int | None] | None, step: int) -> bool:
        """Whether a test hook (step, rank or None) holds this rank at `step`: once per
        checkpoint directory, so that a restart of a job killed there goes on. The marker it
        leaves is a dot file beside the steps, which nothing else reads."""
        if hook is None or hook[0] != step or hook[1] not in (None, self.env.rank):
            return False
        marker = self.directory / f".{kind}-{step_name(step)}-rank-{self.env.rank}"
        if marker.exists():
            return False
        self.directory.mkdir(parents=True, exist_ok=True)  # a hold before the first checkpoint
        marker.touch()
        return True

    def save(self, step: int, model: nn.Module, optimizer, own: dict[str, Any], info: dict) -> str:
        """Write step `step` (collective): the shards through DCP, each rank's own file, then
        the manifest, and the rename that makes it complete. The line to print."""
        env, layout = self.env, self.layout
        assert layout is not None  # resume looked, as the job began
        if self.replication is not None:
            self.replication.wait()  # the previous step's copy, before anything is pruned
        final = self.path(step)
        temporary = self.directory / f".{final.name}.tmp"
        model_state, optimizer_state = get_state_dict(model, optimizer)
        rest, sharded = split({"model": model_state, "optimizer": optimizer_state})
        error, mine = None, True
        try:
            temporary.mkdir(parents=True, exist_ok=True)
            if sharded:
                dcp.save(sharded, storage_writer=dcp.FileSystemWriter(temporary))
            durable.write_synced(temporary / rank_file(env.rank), {"rest": rest, "own": own})
        except FAILURES as raised:
            error, mine = self._write_error(step, raised)
        if self._pausing(step):
            console.say_every_rank(
                env,
                f"checkpoint step {step}: its files written to {temporary.name}, pausing "
                f"{PAUSE_SECONDS:.0f} s before the rename (--checkpoint-pause-step)",
            )
            time.sleep(PAUSE_SECONDS)
        agree(env, error, own=mine)  # also: every rank's files are written
        index = (temporary / METADATA).read_bytes() if env.is_main and sharded else None
        index = parallel.all_gather(index, env)[0]
        # Every file with the size it was written with: what `complete` checks at a resume.
        written: dict[str, int] = {}
        for found in parallel.all_gather(
            complete.sizes(temporary, own_files(temporary, env.rank)), env
        ):
            written.update(found)
        if index is not None:
            written[METADATA] = len(index)
        if layout.owner:
            if index is not None and not (temporary / METADATA).exists():
                durable.write_synced(
                    temporary / METADATA, index
                )  # a node-local disk: a copy of the index
            files = [METADATA] if index is not None else []
            if index is not None:
                stored = pickle.loads(index).storage_data.values()
                files += sorted({entry.relative_path for entry in stored})
            files += [rank_file(r) for r in range(env.world_size)]
            manifest = {
                "format": FORMAT,
                "step": step,
                "world_size": env.world_size,
                "nodes": list(layout.nodes),
                "files": files,
                "sizes": {name: written.get(name) for name in files},
                "info": info,
            }
            durable.write_synced(temporary / MANIFEST, manifest)
            durable.sync_directory(temporary)
            if final.exists():  # this step written before, by a run that went on from it
                shutil.rmtree(final)
            os.replace(temporary, final)
            durable.sync_directory(self.directory)
        parallel.barrier(env)  # complete everywhere before anything older goes
        if layout.owner:
            protected = self._protected()
            for old in self.steps()[: -self.keep]:
                if old not in protected:
                    shutil.rmtree(self.path(old), ignore_errors=True)
        where = (
            "storage every rank sees"
            if len(layout.visible) == env.world_size
            else ("node-local disks: each node holds its own ranks' shards")
        )
        if self.replication is not None and self.replication.active:
            self.replication.start(step)
            where += ", copied to the next node in the background"
        return f"checkpoint step {step} written to {final} ({where})"

    def _protected(self) -> set[int]:
        """The steps --keep must not prune yet: with replicas, the newest step whose copies
        finished and every newer one (before any finished this run, every step), so that the
        survivors of a node lost while the newest step is being copied still hold a complete
        one. Without replicas (or once they broke), none."""
        replication = self.replication
        if replication is None or not replication.active or replication.broken:
            return set()
        copied = replication.copied
        return {step for step in self.steps() if copied is None or step >= copied}

    # -- resuming ----------------------------------------------------------------------------

    def resume(
        self, model: nn.Module, optimizer, resume: bool | None, info: dict
    ) -> tuple[int | None, dict[str, Any] | None]:
        """Load the newest step every rank sees (collective): (its step, this rank's own state
        as saved, None when resharded) or (None, None) to start from step 0."""
        env = self.env
        layout = self.look()
        if layout.owner:
            self._clean()
            if resume is False:
                for step in self.steps():
                    shutil.rmtree(self.path(step), ignore_errors=True)
        if self.replication is not None:  # every file of the newest step survivors hold, here
            self.replication.restore()
        # after the owners' sweep: each rank's steps (a manifest), those complete for it, and
        # what it lacks of the others
        found = parallel.all_gather(self._completeness(), env)
        held = [steps for steps, _, _ in found]
        usable = [steps for _, steps, _ in found]
        self._refuse_what_only_other_nodes_hold(held)
        if resume is not False and complete.newest_everywhere(usable) is not None:
            plan = checkpoint.plan_resume(usable, resume, str(self.directory))
            said: dict[int, dict[str, None]] = {}  # step -> what each node lacks, once each
            for _, _, lacks in found:
                for lacking_step, line in lacks.items():
                    said.setdefault(lacking_step, {})[line] = None
            why = {step: "; ".join(lines) for step, lines in said.items()}
            skipped = complete.skipped([list(why)], plan.step, why)
            say(env, *filter(None, [skipped, plan.message]))
        else:  # nothing complete everywhere: the newest step every rank sees says why below
            plan = checkpoint.plan_resume(held, resume, str(self.directory))
            say(env, plan.message)
        if plan.step is None:
            return None, None
        step = plan.step
        manifest = self._manifest(step)
        agree(env, self._mismatch(step, manifest, info))
        resharding = manifest["world_size"] != env.world_size
        self._refuse_missing_files(step, manifest, resharding)
        saved = self._load(step, model, optimizer, rank_file(0 if resharding else env.rank))
        if resharding:
            say(
                env,
                f"resharded step {step} from world size {manifest['world_size']} to "
                f"{env.world_size}: each rank read the parts of the saved shards it now holds",
            )
        return step, None if resharding else saved["own"]

    def _load(self, step: int, model: nn.Module, optimizer, name: str) -> dict[str, Any]:
        """The model and optimizer loaded from step `step`, with the unsharded entries of the
        rank file `name` (resharded, every rank's file holds the same ones: rank 0's are
        read); that file's contents."""
        directory, env = self.path(step), self.env
        model_state, optimizer_state = get_state_dict(model, optimizer)
        _, sharded = split({"model": model_state, "optimizer": optimizer_state})
        saved, error = None, None
        try:
            saved = torch.load(directory / name, map_location="cpu", weights_only=True)
            error = self._other_model(step, sharded_paths(saved["rest"]), set(sharded))
        except (*FAILURES, EOFError, pickle.UnpicklingError) as raised:
            error = self._unreadable(step, raised)
        agree(env, error)
        assert saved is not None  # read, or agree raised on every rank
        try:
            if sharded:  # DCP raises a rank's failure on every rank
                dcp.load(sharded, storage_reader=dcp.FileSystemReader(directory))
            state = merge(saved["rest"], sharded)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        except FAILURES as raised:
            error = self._unreadable(step, raised)
        agree(env, error)
        return saved

    def _unreadable(self, step: int, error: BaseException) -> UserError:
        return UserError(
            f"cannot load checkpoint step {step} from {self.directory}: {_reason(error)}",
            hint="--no-resume to start over",
            exit_code=1,
        )

    def _other_model(self, step: int, saved: set[str], expected: set[str]) -> UserError | None:
        """Shards saved from a model with other parameters (the code changed since)."""
        if saved == expected:
            return None
        extra, missing = sorted(saved - expected), sorted(expected - saved)
        example = (extra or missing)[0].split("/", 1)[1]
        return UserError(
            f"checkpoint step {step} in {self.directory} was saved from another model: "
            f"{len(extra)} of its shards are not this model's and {len(missing)} of this "
            f"model's are not in it (such as {example})",
            hint="--no-resume, or the code and settings it was saved with",
        )

    def _manifest(self, step: int) -> dict:
        return torch.load(self.path(step) / MANIFEST, map_location="cpu", weights_only=True)

    def _mismatch(self, step: int, manifest: dict, info: dict) -> UserError | None:
        if manifest.get("format") != FORMAT:
            return UserError(
                f"checkpoint step {step} in {self.directory} is not in this workload's format "
                f"{FORMAT}",
                hint="--no-resume, or another --checkpoint-dir",
            )
        for key, value in info.items():
            saved = manifest["info"].get(key)
            if saved != value:
                return UserError(
                    f"checkpoint step {step} in {self.directory} has {key} {saved}, this run "
                    f"{value}: it cannot continue that run",
                    hint=f"--no-resume, or the {key} it was saved with",
                )
        return None

    def _writers(self, manifest: dict) -> str:
        nodes = list(dict.fromkeys(manifest["nodes"]))
        ranks = manifest["world_size"]
        return f"{ranks} rank{'s' if ranks > 1 else ''} on {', '.join(nodes)}"

    def _resharding_error(self, step: int, manifest: dict, seen: str) -> UserError:
        return UserError(
            f"checkpoint step {step} in {self.directory} was written by "
            f"{self._writers(manifest)} to node-local disks ({seen}); resuming it at world size "
            f"{self.env.world_size} reshards it, and resharding needs storage every node sees",
            hint=f"the world size it was written at ({manifest['world_size']}), or {SHARED_HINT}",
        )

    def _refuse_what_only_other_nodes_hold(self, held: list[list[int]]) -> None:
        """No step every rank sees, but some rank holds one written at another world size: the
        checkpoint is on node-local disks and the job's shape changed."""
        if checkpoint.newest_common_step(held) is not None or not any(held):
            return
        newest = max(step for steps in held for step in steps)
        error = None
        if newest in self.steps():
            manifest = self._manifest(newest)
            if manifest["world_size"] != self.env.world_size:
                blind = [r for r, steps in enumerate(held) if newest not in steps]
                assert self.layout is not None  # resume looked before this
                nodes = sorted({self.layout.nodes[r] for r in blind})
                error = self._resharding_error(
                    newest, manifest, f"{', '.join(nodes)} holds none of it"
                )
        agree(self.env, error)

    def needed(self, manifest: dict) -> dict[str, int | None]:
        """The files this rank reads to load a step (name -> size written): every file to
        reshard it (another world size), else its own, the index and the manifest."""
        files = expected(manifest)
        if manifest["world_size"] != self.env.world_size:
            return files
        rank = self.env.rank
        return {name: size for name, size in files.items() if writer(name) in (None, rank)}

    def _completeness(self) -> tuple[list[int], list[int], dict[int, str]]:
        """This rank's steps (those it has a manifest of), the ones complete for it (every file
        it needs, whole: complete.lacking), and for each other one what it lacks."""
        steps, usable, lacks = self.steps(), [], {}
        for step in steps:
            try:
                manifest = self._manifest(step)
                needed = self.needed(manifest)
            except (*FAILURES, EOFError, KeyError, pickle.UnpicklingError):
                lacks[step] = f"{self.node}: its manifest does not read"
                continue
            missing = complete.lacking(self.path(step), needed)
            if missing:
                lacks[step] = (
                    f"{self.node} lacks {len(missing)} of the {len(needed)} files it needs"
                )
            else:
                usable.append(step)
        return steps, usable, lacks

    def _refuse_missing_files(self, step: int, manifest: dict, resharding: bool) -> None:
        """Each rank needs every file to reshard; at the same world size, its own and the
        index: each there with the size it was written with."""
        directory = self.path(step)
        rank, needed = self.env.rank, self.needed(manifest)
        missing = complete.lacking(directory, needed)
        error = None
        if missing and resharding:
            files = len(manifest["files"])  # the manifest itself is there: steps() found it
            seen = f"{self.node} sees {files - len(missing)} of its {files} files"
            error = self._resharding_error(step, manifest, seen)
        elif missing:
            wrote_on = manifest["nodes"][rank]
            error = UserError(
                f"checkpoint step {step} in {self.directory} on {self.node} lacks rank {rank}'s "
                f"{', '.join(missing)} (rank {rank} wrote it on {wrote_on}): node-local "
                "checkpoints resume only with every rank on the node it was on",
                hint=f"the same nodes in the same order, or {SHARED_HINT}",
                exit_code=1,
            )
        agree(self.env, error)
