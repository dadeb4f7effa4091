"""`make runs`: the runs this machine launched, newest first, from their records
(launch.record); one run whole with RUN=ID; JSON=1 for scripts. `make rerun RUN=ID`: the same
command again, in the directory it was typed in, on the code as that run saw it, its outputs
in places of its own (`apart`) unless SAME_OUTPUTS=1 asks for the original's.

python -m torch_multinode.launch.runs                 # the table
python -m torch_multinode.launch.runs --run ID        # one run, every field
python -m torch_multinode.launch.runs --json [--run ID]
python -m torch_multinode.launch.runs --rerun ID [--same-outputs]    # run it again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import posixpath
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge, shown
from torch_multinode.launch import record, snapshot, staging
from torch_multinode.launch.spec import JobSpec

RERUN_TAG = "-rerun-{run_id}"  # what a rerun's outputs' names carry (`apart`)


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
        "--same-outputs",
        action="store_true",
        help="with --rerun: write the original run's outputs (--checkpoint-dir, --out, "
        "--run-dir, --out-dir, --log-dir), resuming from its checkpoints, instead of places of "
        "the rerun's own (NAME-rerun-ID)",
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


def apart(path: str, run_id: str, file: bool = False) -> str:
    """`path` renamed for the rerun `run_id`: RERUN_TAG at the end of a directory's name, before
    the extension of a file's (ckpt1 -> ckpt1-rerun-ID, out/model.pt -> out/model-rerun-ID.pt)."""
    tag = RERUN_TAG.format(run_id=run_id)
    head, name = posixpath.split(posixpath.normpath(path))
    if name in ("", ".", ".."):  # the directory itself: a directory of the rerun's inside
        return posixpath.join(posixpath.normpath(path), tag.lstrip("-"))
    dot = name.find(".", 1) if file else -1
    return posixpath.join(head, name + tag if dot < 0 else name[:dot] + tag + name[dot:])


def outputs_apart(
    argv: list[str], found: dict[str, Any], run_id: str, same: bool
) -> tuple[list[str], list[str]]:
    """The recorded command with each of its outputs (the job's staging.OUTPUT_FLAGS, the
    launcher's --log-dir) in a place of the rerun's own (`apart`), or the original's with
    `same`; and where each goes, as words to show. A relative --checkpoint-dir stays relative
    (its root takes it, here or on the nodes: launch.staging), a relative --out of our
    workloads too (it lands in the rerun's own run directory); any other relative output of a
    job on this machine is made absolute against the directory the original job ran in (its
    project), never the temporary copy of the code a rerun runs in."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    job = argv[len(options) + 1 :] if "--" in argv else []
    local = found.get("backend") == "local"
    project = Path((found.get("code") or {}).get("project") or found["cwd"])
    roots = staging.local_roots(Path(found["cwd"]))
    options, job, shown = list(options), list(job), []
    for index, flag, value, equals in staging.flag_values(job, staging.OUTPUT_FLAGS):
        relative = not posixpath.isabs(value)
        if flag == "--out" and not _given(options, "--script") and relative:
            shown.append(f"--out {value} in its run directory")
            continue
        path = value
        if local and relative and flag not in staging.ROOTED_FLAGS:
            path = str(project / value)
        if not same:
            path = apart(path, run_id, file=flag == "--out")
        job[index] = f"{flag}={path}" if equals else path
        if flag in staging.ROOTED_FLAGS and relative:
            field = staging.ROOTED_FLAGS[flag]
            where = roots[field] / path if local else f"{path} under each node's {field}"
            shown.append(f"{flag} {where}")
        else:
            shown.append(f"{flag} {path}")
    for index, flag, value, equals in staging.flag_values(options, ("--log-dir",)):
        path = value if same else apart(value, run_id)
        options[index] = f"{flag}={path}" if equals else path
        shown.append(f"--log-dir {path}")
    return options + (["--", *job] if "--" in argv else []), shown


def _given(options: list[str], flag: str) -> bool:
    return any(word == flag or word.startswith(f"{flag}=") for word in options)


def rerun(run_id: str, root: Path, same_outputs: bool = False) -> int:
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
    again = JobSpec().run_id  # the rerun's own, which its outputs' names carry
    argv, outputs = outputs_apart(argv, found, again, same_outputs)
    if same_outputs:
        said = f"; outputs: run {run_id}'s own (SAME_OUTPUTS=1), " + ", ".join(
            outputs or ["none named"]
        )
    else:
        own = [] if _given(argv, "--log-dir") else [f"run directory .runs/{again}"]
        said = f"; outputs: its own, apart from run {run_id}'s: " + ", ".join(own + outputs)
    if "--script" not in argv and "--workdir" not in argv:
        # one of our workloads, from this checkout: the checkout must be as it was
        if not snapshot.unchanged(code):
            raise UserError(
                f"run {run_id} ran {found['workload']} of this checkout, which has changed since "
                f"(the run's snapshot: {code['snapshot'][:12]})",
                hint=f"git stash, or git checkout {code['git'][:12]}, then make rerun again",
            )
        print(f"[rerun] {run_id}: {' '.join(argv)}{said}", flush=True)
        with contextlib.chdir(found["cwd"]):
            return cli.main(argv, (found, root / run_id), again)
    scratch = Path(tempfile.mkdtemp(prefix=f"tmn-rerun-{run_id}-"))
    try:
        project = snapshot.restore(code, scratch / "code")
        argv = _remapped(argv, found, project)
        print(
            f"[rerun] {run_id}: its code snapshot {code['snapshot'][:12]} in {project}: "
            + " ".join(argv)
            + said,
            flush=True,
        )
        with contextlib.chdir(found["cwd"]):
            return cli.main(argv, (found, root / run_id), again)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def show(args: argparse.Namespace) -> int:
    if args.same_outputs and args.rerun is None:
        raise UserError("SAME_OUTPUTS=1 is for make rerun", hint="make rerun RUN=ID SAME_OUTPUTS=1")
    if args.rerun is not None:
        return rerun(args.rerun, args.root.resolve(), args.same_outputs)
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
    try:
        code = at_the_edge(show, _parser().parse_args(argv))
        sys.stdout.flush()  # a reader that stopped early (make runs | head -2) is found here
    except BrokenPipeError:
        # Python's recommended way: what is left goes nowhere, the exit's own flush too. The
        # reader took what it wanted: nothing failed.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
