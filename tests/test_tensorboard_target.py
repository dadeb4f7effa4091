"""`make tensorboard RUN=JOB-ID`: TensorBoard on the run directory a job brought back to
.runs/JOB-ID/ (its events in tensorboard/ there, as the trainer writes them), served on loopback
only; without RUN, or with a RUN that has no directory, one error line and exit 2."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid

from tests.conftest import REPO_ROOT

TAG = "probe/loss"
# TensorBoard's own line once it serves; the Makefile passes no --port (TensorBoard takes 6006,
# or the next free one of 10) and no --host/--bind_all (it binds localhost only).
SERVING = re.compile(r"^TensorBoard \S+ at http://([^/:\s]+):(\d+)/")
# No proxy, even where the environment names one: every request goes to loopback directly.
LOOPBACK_ONLY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _make(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`make tensorboard ARGS` as a user types it, with no RUN taken from the environment."""
    return subprocess.run(
        ["make", "--no-print-directory", "tensorboard", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={name: value for name, value in os.environ.items() if name != "RUN"},
    )


def test_without_run_it_says_how_to_name_one():
    done = _make()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == (
        "Error: RUN is not set (try make tensorboard RUN=<job id from the summary>; ls .runs)\n"
    )


def test_a_run_without_a_directory_is_named():
    missing = f"tmn-missing-{uuid.uuid4().hex[:10]}"
    done = _make(f"RUN={missing}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == f"Error: .runs/{missing} does not exist (try ls .runs)\n"


def _get(port: int, path: str) -> bytes:
    with LOOPBACK_ONLY.open(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        assert answer.status == 200, (path, answer.status)
        return answer.read()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* shows them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def _is_loopback(address: str) -> bool:
    if len(address) == 8:  # IPv4, in the host's (little-endian) byte order: 127.x.x.x
        return address.endswith("7F")
    return address == "00000000000000000000000001000000"  # ::1


def test_it_serves_the_runs_scalars_on_loopback():
    from torch.utils.tensorboard import SummaryWriter

    run_id = f"tmn-tbtest-{uuid.uuid4().hex[:10]}"
    run_dir = REPO_ROOT / ".runs" / run_id
    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for step in range(5):
        writer.add_scalar(TAG, 1.0 / (step + 1), step)
    writer.close()
    process = None
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []
    try:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "tensorboard", f"RUN={run_id}"],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def read(stream=process.stdout) -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 60
        serving = None
        while serving is None:
            left = deadline - time.monotonic()
            assert left > 0, "TensorBoard never said where it serves:\n" + "".join(seen)
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "make tensorboard ended:\n" + "".join(seen)
            seen.append(line)
            serving = SERVING.match(line)
        host, port = serving.group(1), int(serving.group(2))
        assert host in ("localhost", "127.0.0.1"), line

        while True:  # answering, within the same minute
            try:
                _get(port, "/")
                break
            except OSError:
                assert time.monotonic() < deadline, f"no answer on 127.0.0.1:{port}"
                time.sleep(0.5)
        listening = _listening_addresses(port)
        assert listening and all(_is_loopback(a) for a in listening), listening

        # The events are read in the background: the run and its tag show up within a minute.
        deadline = time.monotonic() + 60
        while TAG not in (tags := json.loads(_get(port, "/data/plugin/scalars/tags"))).get(
            "tensorboard", {}
        ):
            assert time.monotonic() < deadline, (tags, "".join(seen))
            time.sleep(1)
        # One run, the directory the trainer writes its events to.
        assert json.loads(_get(port, "/data/runs")) == ["tensorboard"]
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop(process: subprocess.Popen) -> None:
    """make, TensorBoard and its data server: the whole process group, SIGTERM then SIGKILL."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            process.poll()  # make, reaped once it ends: a zombie would still count below
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
