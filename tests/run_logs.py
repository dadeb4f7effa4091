"""What a failed simulated-cluster test leaves for the reader of CI's output: the node logs of
the jobs it ran (.runs/<id>/node*.log), C++ frames left out, since a test's own assertion shows
only the end of the launcher's output and the cause is often earlier, or on another node."""

from __future__ import annotations

import json
from pathlib import Path

from torch_multinode.launch.ending import CPP_FRAME

LINES_PER_LOG = 40
RUNS_SHOWN = 3


def run_logs(runs: Path, since: float, worker: str | None) -> str:
    """The newest runs under `runs` written since `since` (epoch seconds) by this pytest worker
    (`worker`: xdist's gwN, whose inventories lie under its popen-gwN folder), their node logs'
    last lines."""
    if not runs.is_dir():
        return ""
    mine = []
    for directory in runs.iterdir():
        record = directory / "run.json"
        try:
            if directory.stat().st_mtime < since:
                continue
            inventory = json.loads(record.read_text()).get("inventory") or {}
        except (OSError, ValueError):
            continue
        if worker and f"/popen-{worker}/" not in str(inventory.get("path", "")):
            continue
        mine.append(directory)
    mine.sort(key=lambda d: d.stat().st_mtime)
    parts = []
    for directory in mine[-RUNS_SHOWN:]:
        for log in sorted(directory.glob("node*.log")):
            lines = [
                line
                for line in log.read_text(errors="replace").splitlines()
                if not CPP_FRAME.match(line)
            ]
            parts.append(f"--- {directory.name}/{log.name} (last {LINES_PER_LOG} lines)")
            parts += lines[-LINES_PER_LOG:]
    return "\n".join(parts)
