"""`make runs`: the runs this machine launched, newest first, from their records
(launch.record); one run whole with RUN=ID; JSON=1 for scripts.

python -m torch_multinode.launch.runs                 # the table
python -m torch_multinode.launch.runs --run ID        # one run, every field
python -m torch_multinode.launch.runs --json [--run ID]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch_multinode.cluster.errors import ArgumentParser, UserError, at_the_edge, shown
from torch_multinode.launch import record


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="runs",
        description="The runs launched from this directory (each one's record: .runs/ID/"
        f"{record.RECORD}), newest first: ID, start, workload, nodes, time, result, last step.",
    )
    parser.add_argument("--run", metavar="ID", help="one run, every field of its record")
    parser.add_argument("--json", action="store_true", help="as JSON, for scripts")
    parser.add_argument(
        "--root", type=Path, default=record.RUNS_ROOT, help="where the runs are (default: .runs)"
    )
    return parser


def _one(run_id: str, root: Path) -> dict:
    found = record.load(run_id, root)
    if found is None:
        raise UserError(
            f"no run {shown(run_id)} is recorded in {root}/",
            hint="make runs, which lists the recorded runs",
        )
    return found


def show(args: argparse.Namespace) -> int:
    if args.run is not None:
        found = _one(args.run, args.root)
        if args.json:
            print(json.dumps(found, indent=2))
        else:
            for key, value in found.items():
                print(f"{key:<12} {json.dumps(value) if isinstance(value, dict | list) else value}")
        return 0
    records = record.every(args.root)
    if args.json:
        print(json.dumps(records, indent=2))
    elif not records:
        print(f"No run recorded in {args.root}/ yet: make train records each one.")
    else:
        print("\n".join(record.table(records)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return at_the_edge(show, _parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
