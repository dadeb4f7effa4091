"""ENV= for a local job (issue 49), as on the nodes: every local rank gets the variables (a bare
NAME with this machine's value, a NAME=value over the launcher's own value of a name it also
sets), the launcher says their names only, and the value is in no output, log, record or
command line; the launcher's own TMN_* names are refused before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess

from tests.conftest import REPO_ROOT, VENV_BIN, run_cli

SECRET = "tok-4f8a1c-local-env"  # what must be nowhere but in the ranks' environments
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()[:12]

# Each rank says whether each variable arrived (a digest of the secret, never the secret), and
# whether the secret is on any process's command line on this machine while the job runs.
SCRIPT = """\
import hashlib
import os
from pathlib import Path

token = os.environ.get("PROJECT_TOKEN")
digest = hashlib.sha256(token.encode()).hexdigest()[:12] if token else "unset"
listed = False
for entry in Path("/proc").iterdir():
    try:
        listed = listed or token.encode() in (entry / "cmdline").read_bytes()
    except (OSError, AttributeError):
        pass
print(
    f"rank {os.environ['RANK']}: token {digest}, mode {os.environ.get('PROJECT_MODE', 'unset')}, "
    f"buffer {os.environ.get('TORCH_FR_BUFFER_SIZE')}, on a command line {listed}",
    flush=True,
)
"""


def test_env_reaches_every_local_rank_and_its_value_nowhere_else(tmp_path):
    script = tmp_path / "proj" / "job.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    done = subprocess.run(
        [str(VENV_BIN / "train"), "--script", str(script)]
        + ["--env", "PROJECT_TOKEN PROJECT_MODE=fast", "--env", "TORCH_FR_BUFFER_SIZE=0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PROJECT_TOKEN": SECRET},
        check=False,
    )
    output = done.stdout + done.stderr
    run_id = re.search(r"\[launcher\] local job (tmn-\w+) in ", output).group(1)
    run_dir = REPO_ROOT / ".runs" / run_id
    try:
        assert done.returncode == 0, output[-3000:]
        assert (
            "[launcher] environment for every rank: PROJECT_TOKEN, PROJECT_MODE, "
            "TORCH_FR_BUFFER_SIZE (values not shown)"
        ) in output, output
        for rank in (0, 1):
            # ENV='s value over the launcher's Flight Recorder buffer (256)
            said = f"rank {rank}: token {DIGEST}, mode fast, buffer 0, on a command line False"
            assert said in output, output
        assert SECRET not in output
        for saved in run_dir.rglob("*"):
            if saved.is_file():
                assert SECRET not in saved.read_text(errors="replace"), saved
        record = json.loads((run_dir / "run.json").read_text())
        assert record["env_names"] == ["PROJECT_MODE", "PROJECT_TOKEN", "TORCH_FR_BUFFER_SIZE"]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_env_may_not_set_the_launchers_own_names_for_a_local_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    done = run_cli("train", "--script", str(script), "--env", "TMN_RUN_DIR=/elsewhere")
    assert (done.returncode, done.stdout) == (2, "")  # nothing started
    assert done.stderr == "Error: ENV: TMN_RUN_DIR is set by the launcher itself\n"
