"""The project's code as a run saw it, kept so that the run can be run again exactly (`make
rerun`): a commit of the whole work tree (tracked files, and the untracked ones git does not
ignore) in the project's own git repository, made with a temporary index (the user's index,
branch and files are never touched), under refs/torch-multinode/runs/ID so that git keeps it.
A project outside git has no snapshot: its run cannot be run again exactly, and says so.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from torch_multinode.cluster.errors import UserError, shown

REF = "refs/torch-multinode/runs/{run_id}"
UNTRACKED_LIMIT = 100_000_000  # bytes of untracked files a snapshot copies into the repository
# commit-tree needs a name and address; these are the snapshot's, not the user's
_IDENTITY = {
    "GIT_AUTHOR_NAME": "torch-multinode",
    "GIT_AUTHOR_EMAIL": "torch-multinode@localhost",
    "GIT_COMMITTER_NAME": "torch-multinode",
    "GIT_COMMITTER_EMAIL": "torch-multinode@localhost",
}


def _git(directory: Path, *args: str, env: dict[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, **(env or {})},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def work_tree(top: Path, head: str | None) -> str | None:
    """The git tree of the work tree at `top` as it is now (tracked and untracked files git
    does not ignore), written with a temporary index; None where git could not."""
    with tempfile.TemporaryDirectory(prefix="tmn-index-") as scratch:
        index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if head is not None and _git(top, "read-tree", head, env=index) is None:
            return None
        if _git(top, "add", "--all", "--", ".", env=index) is None:
            return None
        return _git(top, "write-tree", env=index)


def _untracked_bytes(top: Path) -> int:
    """The size of the files git would add that it does not track yet (ignored ones left out)."""
    listed = _git(top, "ls-files", "--others", "--exclude-standard", "-z") or ""
    total = 0
    for name in filter(None, listed.split("\0")):
        try:
            total += (top / name).stat().st_size
        except OSError:
            pass
    return total


def take(project: Path, run_id: str, limit: int = UNTRACKED_LIMIT) -> dict[str, Any] | None:
    """The snapshot of the git work tree holding `project`: the repository, the project's
    place in it, HEAD's commit (None before the first), the snapshot's commit, and whether
    the tree differed from HEAD. None outside git, or where git could not make it. Untracked
    files over `limit` bytes in all (a dataset git does not ignore) are not copied into the
    user's repository: no snapshot then, and the record says why."""
    top = _git(project, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    head = _git(project, "rev-parse", "--verify", "--quiet", "HEAD")
    prefix = _git(project, "rev-parse", "--show-prefix") or ""
    untracked = _untracked_bytes(Path(top))
    if untracked > limit:
        return {
            "repository": top,
            "prefix": prefix.rstrip("/"),
            "git": head,
            "snapshot": None,
            "dirty": True,
            "why": f"{untracked / 1e6:.0f} MB of untracked files (over {limit / 1e6:.0f} MB): "
            "add them to .gitignore, or commit them",
        }
    tree = work_tree(Path(top), head)
    if tree is None:
        return None
    parents = ["-p", head] if head else []
    commit = _git(
        Path(top),
        "commit-tree",
        tree,
        *parents,
        "-m",
        f"torch-multinode run {run_id}",
        env=_IDENTITY,
    )
    if commit is None or _git(Path(top), "update-ref", REF.format(run_id=run_id), commit) is None:
        return None
    head_tree = _git(Path(top), "rev-parse", f"{head}^{{tree}}") if head else None
    return {
        "repository": top,
        "prefix": prefix.rstrip("/"),
        "git": head,
        "snapshot": commit,
        "dirty": tree != head_tree,
    }


def unchanged(code: dict[str, Any]) -> bool:
    """Whether the work tree is now as the snapshot holds it."""
    repository = Path(code["repository"])
    now = work_tree(repository, _git(repository, "rev-parse", "--verify", "--quiet", "HEAD"))
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
    unpacked = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=False)
    archive.stdout.close()
    if archive.wait(timeout=600) != 0 or unpacked.returncode != 0:
        raise UserError(f"could not unpack the code snapshot {commit[:12]} into {into}")
    return into / code["prefix"] if code["prefix"] else into
