"""`make runs`: the runs this machine launched, newest first, from their records
(launch.record); one run whole with RUN=ID; JSON=1 for scripts. `make rerun RUN=ID`: the same
command again, in the directory it was typed in, on the code as that run saw it.

python -m torch_multinode.launch.runs                 # the table
python -m torch_multinode.launch.runs --run ID        # one run, every field
python -m torch_multinode.launch.runs --json [--run ID]
python -m torch_multinode.launch.runs --rerun ID      # run it again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge, shown
from torch_multinode.launch import record, snapshot


def load(run_id: str, root: Path = record.RUNS_ROOT) -> dict[str, Any] | None:
    path = root / run_id / record.RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def every(root: Path = record.RUNS_ROOT) -> list[dict[str, Any]]:
    """Every run's record under `root`, newest first."""
    found = [
        r for d in root.glob(f"*/{record.RECORD}") if (r := load(d.parent.name, root)) is not None
    ]
    return sorted(found, key=lambda r: r.get("started") or "", reverse=True)


def table(records: list[dict[str, Any]]) -> list[str]:
    """One line per run: ID, when, workload, nodes, duration, result, last step line."""
    rows = [("ID", "STARTED", "WORKLOAD", "NODES", "TIME", "RESULT", "LAST STEP")]
    for r in records:
        seconds = r.get("seconds")
        rows.append(
            (
                r.get("id", "?"),
                (r.get("started") or "")[:19].replace("T", " "),
                Path(str(r.get("workload"))).name
                if str(r.get("workload", "")).endswith(".py")
                else str(r.get("workload")),
                ",".join(n["name"] for n in r.get("nodes", [])),
                "-" if seconds is None else f"{seconds:.0f}s",
                str(r.get("result")),
                (r.get("last_step") or "-")[:60],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]])
        for row in rows
    ]


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="runs",
        description="The runs launched from this directory (each one's record: .runs/ID/"
        f"{record.RECORD}), newest first: ID, start, workload, nodes, time, result, last step.",
    )
    parser.add_argument("--run", metavar="ID", help="one run, every field of its record")
    parser.add_argument("--json", action="store_true", help="as JSON, for scripts")
    parser.add_argument(
        "--rerun",
        metavar="ID",
        help="run ID again: its command, in the directory it was typed in, on its code snapshot "
        "(a project in git); ENV= variables take this machine's values",
    )
    parser.add_argument(
        "--root", type=Path, default=record.RUNS_ROOT, help="where the runs are (default: .runs)"
    )
    return parser


def _one(run_id: str, root: Path) -> dict:
    found = load(run_id, root)
    if found is None:
        raise UserError(
            f"no run {shown(run_id)} is recorded in {root}/",
            hint="make runs, which lists the recorded runs",
        )
    return found


def _remapped(argv: list[str], found: dict[str, Any], project: Path) -> list[str]:
    """The recorded command with its project's paths (--script, --workdir) moved into the
    restored copy at `project`; the job then takes that copy, not the project as it is now."""
    cwd, recorded = Path(found["cwd"]), Path(found["code"]["project"])
    options = argv[: argv.index("--")] if "--" in argv else argv
    rest = argv[len(options) :]
    moved: list[str] = []
    for index, word in enumerate(options):
        if index > 0 and options[index - 1] == "--script":
            path = (cwd / word).resolve()
            word = (
                str(project / path.relative_to(recorded)) if path.is_relative_to(recorded) else word
            )
        elif index > 0 and options[index - 1] == "--workdir":
            word = str(project)
        moved.append(word)
    if "--workdir" not in moved:
        moved += ["--workdir", str(project)]
    return moved + rest


def rerun(run_id: str, root: Path) -> int:
    """Run `run_id` again; the launcher's exit code."""
    from torch_multinode.launch import cli  # the launcher, only when a run is run again

    found = _one(run_id, root)
    code = found.get("code") or {}
    argv = list(found["command"][1:])
    if code.get("why"):
        raise UserError(
            f"run {run_id}'s code was not kept: {code['why']}",
            hint="make train again once they are; each run from then on can be run again",
        )
    if not code.get("snapshot"):
        raise UserError(
            f"run {run_id}'s project {code.get('project')} is not in a git repository, so its "
            "code was not kept: it cannot be run again exactly",
            hint="git init in the project: each run from then on can be run again",
        )
    if "--script" not in argv and "--workdir" not in argv:
        # one of our workloads, from this checkout: the checkout must be as it was
        if not snapshot.unchanged(code):
            raise UserError(
                f"run {run_id} ran {found['workload']} of this checkout, which has changed since "
                f"(the run's snapshot: {code['snapshot'][:12]})",
                hint=f"git stash, or git checkout {code['git'][:12]}, then make rerun again",
            )
        print(f"[rerun] {run_id}: {' '.join(argv)}", flush=True)
        with contextlib.chdir(found["cwd"]):
            return cli.main(argv, (found, root / run_id))
    scratch = Path(tempfile.mkdtemp(prefix=f"tmn-rerun-{run_id}-"))
    try:
        project = snapshot.restore(code, scratch / "code")
        argv = _remapped(argv, found, project)
        print(
            f"[rerun] {run_id}: its code snapshot {code['snapshot'][:12]} in {project}: "
            + " ".join(argv),
            flush=True,
        )
        with contextlib.chdir(found["cwd"]):
            return cli.main(argv, (found, root / run_id))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def show(args: argparse.Namespace) -> int:
    if args.rerun is not None:
        return rerun(args.rerun, args.root.resolve())
    if args.run is not None:
        found = _one(args.run, args.root)
        if args.json:
            print(json.dumps(found, indent=2))
        else:
            for key, value in found.items():
                print(f"{key:<12} {json.dumps(value) if isinstance(value, dict | list) else value}")
        return 0
    records = every(args.root)
    if args.json:
        print(json.dumps(records, indent=2))
    elif not records:
        print(f"No run recorded in {args.root}/ yet: make train records each one.")
    else:
        print("\n".join(table(records)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return at_the_edge(show, _parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
