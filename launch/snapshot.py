"""The project's code as a run saw it, kept so that the run can be run again exactly (`make
rerun`): a commit of the work tree (tracked files, and the untracked ones that are code) in the
project's own git repository, made with a temporary index (the user's index, branch and files
are never touched), under refs/torch-multinode/runs/ID so that git keeps it. A project outside
git has no snapshot: its run cannot be run again exactly, and says so.

Code, not outputs: an untracked file is left out when it lies in a place a run writes (the
checkpoint and data roots, .runs/, the run's own output directories: `take`'s `outside`), has
a checkpoint's or a dataset's extension (NOT_CODE), or is over LARGE_FILE bytes; what git
ignores is never in it. Tracked files are always kept. What was left out, and why, is one line
at launch (`said`); so is a project whose untracked code is still too big to copy.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from torch_multinode.cluster.errors import UserError, shown

REF = "refs/torch-multinode/runs/{run_id}"
UNTRACKED_LIMIT = 100_000_000  # bytes of untracked files a snapshot copies into the repository
LARGE_FILE = 5_000_000  # bytes: an untracked file larger than this is data or an output
# Extensions of checkpoints, tensors, datasets and archives: never code, whatever their size.
NOT_CODE = frozenset(
    ".pt .pth .ckpt .safetensors .bin .distcp .onnx .npy .npz .h5 .hdf5 .pkl .pickle .parquet "
    ".arrow .tfrecord .lmdb .mdb .tar .gz .tgz .bz2 .xz .zst .zip .7z".split()
)
RUN_DIRECTORY = ".runs"  # the runs' own directories, wherever they are in the tree
_EXAMPLES = 3  # names a launch line shows of what was left out
# commit-tree needs a name and address; these are the snapshot's, not the user's
_IDENTITY = {
    "GIT_AUTHOR_NAME": "torch-multinode",
    "GIT_AUTHOR_EMAIL": "torch-multinode@localhost",
    "GIT_COMMITTER_NAME": "torch-multinode",
    "GIT_COMMITTER_EMAIL": "torch-multinode@localhost",
}


def _git(
    directory: Path,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    why: list[str] | None = None,
) -> str | None:
    """git's output, or None where it failed (its last line of error then added to `why`)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            input=stdin,
            env={**os.environ, **(env or {})},
        )
    except (OSError, subprocess.TimeoutExpired) as failed:
        if why is not None:
            why.append(str(failed))
        return None
    if done.returncode != 0:
        if why is not None:
            lines = done.stderr.strip().splitlines()
            why.append(lines[-1] if lines else f"git {args[0]}: exit {done.returncode}")
        return None
    return done.stdout.strip()


@dataclass
class Untracked:
    """The untracked files git does not ignore, split: code kept, and what is left out."""

    kept: list[str] = field(default_factory=list)
    kept_bytes: int = 0
    left_out: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes)
    left_out_bytes: int = 0

    def largest(self, count: int) -> list[str]:
        """The names of the `count` largest files left out, largest first."""
        return [name for name, _ in sorted(self.left_out, key=lambda f: -f[1])[:count]]


def not_code(name: str, size: int, outside: tuple[str, ...] = ()) -> bool:
    """Whether the untracked file `name` (relative to the repository's top) is left out of a
    snapshot: in a place a run writes (`outside`, or any .runs/), a checkpoint's or dataset's
    extension, or over LARGE_FILE bytes."""
    path = PurePosixPath(name)
    return (
        RUN_DIRECTORY in path.parts[:-1]
        or any(name == place or name.startswith(place.rstrip("/") + "/") for place in outside)
        or path.suffix.lower() in NOT_CODE
        or size > LARGE_FILE
    )


def untracked(
    top: Path, outside: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Untracked:
    """The files git would add that are not committed (ignored ones left out; with `env`'s
    index, those not in it), split into code and what is not (`not_code`)."""
    listed = _git(top, "ls-files", "--others", "--exclude-standard", "-z", env=env) or ""
    found = Untracked()
    for name in filter(None, listed.split("\0")):
        try:
            size = 0 if name.endswith("/") else (top / name).lstat().st_size  # "/": a repository
        except OSError:
            continue
        if not_code(name, size, outside):
            found.left_out.append((name, size))
            found.left_out_bytes += size
        else:
            found.kept.append(name)
            found.kept_bytes += size
    return found


def work_tree(
    top: Path,
    head: str | None,
    outside: tuple[str, ...] = (),
    limit: int | None = None,
    why: list[str] | None = None,
) -> tuple[str | None, Untracked, int]:
    """The git tree of the work tree at `top` as it is now: HEAD's files as they are now, and
    the files not committed that are code (`untracked`), written with a temporary index; the
    split of the files not committed, and how many files the tree holds. None for the tree
    where git could not write it, or where the code not committed is over `limit` bytes (then
    nothing is written into the repository); where git failed, its words are added to `why`."""
    with tempfile.TemporaryDirectory(prefix="tmn-index-") as scratch:
        index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if head is not None and _git(top, "read-tree", head, env=index, why=why) is None:
            return None, Untracked(), 0
        split = untracked(top, outside, index)
        if limit is not None and split.kept_bytes > limit:
            return None, split, 0
        if _git(top, "add", "--update", "--", ".", env=index, why=why) is None:  # as they are
            return None, split, 0
        if split.kept and (
            _git(
                top,
                "add",
                "--pathspec-from-file=-",
                "--pathspec-file-nul",
                env={**index, "GIT_LITERAL_PATHSPECS": "1"},
                stdin="\0".join(split.kept),
                why=why,
            )
            is None
        ):
            return None, split, 0
        listed = _git(top, "ls-files", "-z", env=index)
        tree = _git(top, "write-tree", env=index, why=why)
    return tree, split, len(list(filter(None, (listed or "").split("\0"))))


def places_in(top: Path, places: list[Path]) -> tuple[str, ...]:
    """The places a run writes that lie inside the repository at `top` (its top itself left
    out), relative to it."""
    found = []
    for place in places:
        # as named (a link to elsewhere is left out as the link), and resolved as git's top is
        for where in (Path(os.path.abspath(place)), Path(place).resolve()):
            if where.is_relative_to(top) and where != top:
                found.append(where.relative_to(top).as_posix())
                break
    return tuple(sorted(set(found)))


def take(
    project: Path, run_id: str, limit: int | None = None, outside: tuple[Path, ...] = ()
) -> dict[str, Any] | None:
    """The snapshot of the git work tree holding `project`: the repository, the project's
    place in it, HEAD's commit (None before the first), the snapshot's commit, whether the
    tree differed from HEAD, how many files it holds, and what was left out (`outside`: the
    places the run writes). None outside git. No snapshot, and why, where git could not make
    it (its own words) or where untracked code is over `limit` bytes in all (UNTRACKED_LIMIT,
    then nothing is copied into the user's repository)."""
    top = _git(project, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    limit = UNTRACKED_LIMIT if limit is None else limit
    head = _git(project, "rev-parse", "--verify", "--quiet", "HEAD")
    prefix = _git(project, "rev-parse", "--show-prefix") or ""
    inside = places_in(Path(top), list(outside))
    why: list[str] = []  # git's words where it failed (a full disk, a repository it cannot write)
    tree, split, count = work_tree(Path(top), head, inside, limit, why)
    found: dict[str, Any] = {
        "repository": top,
        "prefix": prefix.rstrip("/"),
        "git": head,
        "outside": list(inside),
        "left_out": {
            "files": len(split.left_out),
            "bytes": split.left_out_bytes,
            "examples": split.largest(_EXAMPLES),
        },
    }
    if split.kept_bytes > limit:
        return {
            **found,
            "snapshot": None,
            "dirty": True,
            "why": f"{split.kept_bytes / 1e6:.0f} MB of untracked files that look like code "
            f"(over {limit / 1e6:.0f} MB with outputs and large binaries left out): add them to "
            ".gitignore, or commit them",
        }
    parents = ["-p", head] if head else []
    commit = tree and _git(
        Path(top),
        "commit-tree",
        tree,
        *parents,
        "-m",
        f"torch-multinode run {run_id}",
        env=_IDENTITY,
        why=why,
    )
    ref = REF.format(run_id=run_id)
    if not commit or _git(Path(top), "update-ref", ref, commit, why=why) is None:
        # Never silence: the launch says it, the record keeps why, a rerun refuses with it.
        reason = why[-1] if why else "git failed"
        return {
            **found,
            "snapshot": None,
            "dirty": None,
            "why": f"git could not write it ({reason})",
        }
    head_tree = _git(Path(top), "rev-parse", f"{head}^{{tree}}") if head else None
    return {**found, "snapshot": commit, "files": count, "dirty": tree != head_tree}


def said(found: dict[str, Any] | None) -> str | None:
    """The launch's one line about a snapshot that left files out, or that could not be made
    (too big), with the remedy; None when it holds the whole work tree's code."""
    if found is None:
        return None
    left = found.get("left_out") or {}
    what = ""
    if left.get("files"):
        names = ", ".join(left["examples"]) + (", ..." if left["files"] > _EXAMPLES else "")
        what = (
            f"left out {left['files']} untracked file(s) ({_size(left['bytes'])}: {names}: "
            "outputs, checkpoints, data and files over "
            f"{LARGE_FILE // 1_000_000} MB are not code)"
        )
    if found.get("snapshot") is None and found.get("why"):
        return f"no code snapshot for make rerun: {found['why']}" + (f"; {what}" if what else "")
    if not what:
        return None
    return f"code snapshot for make rerun: {found.get('files', '?')} files; {what}"


def _size(count: int) -> str:
    if count >= 1e6:
        return f"{count / 1e6:.0f} MB"
    return f"{count / 1e3:.0f} kB" if count >= 1e3 else f"{count} bytes"


def unchanged(code: dict[str, Any]) -> bool:
    """Whether the work tree's code is now as the snapshot holds it (what a snapshot leaves
    out, left out of the comparison too)."""
    repository = Path(code["repository"])
    head = _git(repository, "rev-parse", "--verify", "--quiet", "HEAD")
    now, _, _ = work_tree(repository, head, tuple(code.get("outside") or ()))
    return now is not None and now == _git(repository, "rev-parse", f"{code['snapshot']}^{{tree}}")


def restore(code: dict[str, Any], into: Path) -> Path:
    """The snapshot's files written under `into` (a new directory): the project's directory
    there. A UserError naming why when the snapshot is gone."""
    repository, commit = Path(code["repository"]), code["snapshot"]
    if _git(repository, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        raise UserError(
            f"the code snapshot {commit[:12]} is no longer in {shown(str(repository))}",
            hint="a run whose repository still holds refs/torch-multinode/runs/ID",
        )
    into.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(repository), "archive", "--format=tar", commit], stdout=subprocess.PIPE
    )
    assert archive.stdout is not None  # stdout=PIPE
    unpacked = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=False)
    archive.stdout.close()
    if archive.wait(timeout=600) != 0 or unpacked.returncode != 0:
        raise UserError(f"could not unpack the code snapshot {commit[:12]} into {into}")
    return into / code["prefix"] if code["prefix"] else into
