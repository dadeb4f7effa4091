"""A failed simulated-cluster test shows its own jobs' node logs, not another worker's."""

from __future__ import annotations

import json
import os
import time

from tests.run_logs import run_logs


def _run(runs, run_id, inventory, log, age=0.0):
    directory = runs / run_id
    directory.mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps({"inventory": {"path": inventory}}))
    (directory / "node2.log").write_text(log)
    stamp = time.time() - age
    os.utime(directory, (stamp, stamp))


def test_only_this_workers_runs_since_the_test_began_without_cpp_frames(tmp_path):
    mine = "/tmp/pytest-of-root/pytest-3/popen-gw2/sim0/inventory.yml"
    _run(tmp_path, "tmn-old", mine, "old\n", age=600)
    _run(tmp_path, "tmn-other", mine.replace("gw2", "gw1"), "other\n")
    _run(tmp_path, "tmn-mine", mine, "step 4/12\nframe #0: c10::Error\nRendezvousConnectionError\n")
    text = run_logs(tmp_path, time.time() - 60, "gw2")
    assert text.splitlines() == [
        "--- tmn-mine/node2.log (last 40 lines)",
        "step 4/12",
        "RendezvousConnectionError",
    ]
    assert run_logs(tmp_path / "absent", 0, None) == ""
