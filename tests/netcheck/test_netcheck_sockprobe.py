"""The node-side socket probe, run exactly as shipped (`python3 -c SOURCE ...`), on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from torch_multinode.netcheck import attempts


def probe(*args: str) -> dict:
    proc = subprocess.run(
        ["sh", "-c", attempts.sockprobe(*args)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return bool(handle.read())
    except OSError:
        return False


@pytest.fixture
def token(tmp_path):
    return f"netcheck-test-{uuid.uuid4().hex[:8]}", str(tmp_path / "serve.pid")


def test_serve_connect_send_stop(token):
    tag, pidfile = token
    served = probe(
        "serve", "--ports", "0,0", "--lifetime", "20", "--pidfile", pidfile, "--token", tag
    )
    pid = served["pid"]
    try:
        ports = [p["port"] for p in served["ports"]]
        assert all(p["ok"] for p in served["ports"]) and len(set(ports)) == 2
        for _ in range(50):  # the detached copy writes its pidfile once it is ready
            if os.path.exists(pidfile):
                break
            time.sleep(0.05)
        targets = ",".join(f"me=127.0.0.1:{p}" for p in ports)
        connected = probe("connect", "--targets", targets + ",me=127.0.0.1:1", "--timeout", "2")
        assert [r["ok"] for r in connected["results"]] == [True, True, False]
        assert connected["results"][2]["error"] == "connection refused"
        sent = probe(
            "send",
            "--targets",
            f"me=127.0.0.1:{ports[0]}",
            "--bytes",
            str(8 << 20),
            "--source",
            "127.0.0.1",
            "--timeout",
            "10",
        )
        (result,) = sent["results"]
        assert result["ok"] and result["bytes"] == 8 << 20 and result["seconds"] > 0
    finally:
        stopped = probe("stop", "--pidfile", pidfile, "--token", tag)
    assert stopped == {"stopped": True, "pid": pid}
    assert not alive(pid) and not os.path.exists(pidfile)
    # Stopping twice, or with another token, ends nothing.
    assert probe("stop", "--pidfile", pidfile, "--token", tag)["stopped"] is False


def test_port_in_use_names_the_holder(token):
    tag, pidfile = token
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        served = probe("serve", "--ports", str(port), "--pidfile", pidfile, "--token", tag)
    finally:
        holder.close()
    assert served["pid"] is None
    (result,) = served["ports"]
    assert result["ok"] is False and result["in_use"] is True
    assert result["error"] == "Address already in use"
    assert [h["pid"] for h in result["holders"]] == [os.getpid()]


def test_a_listener_that_is_not_ours_is_recognised():
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]

    def accept_and_close():
        conn, _ = other.accept()
        conn.close()

    thread = threading.Thread(target=accept_and_close)
    thread.start()
    try:
        (result,) = probe("connect", "--targets", f"x=127.0.0.1:{port}", "--timeout", "2")[
            "results"
        ]
    finally:
        thread.join(5)
        other.close()
    assert result["ok"] is False
    assert result["error"] == "connected, but the listener is not netcheck's (no reply)"


def test_stop_refuses_a_pid_without_the_token(tmp_path):
    pidfile = tmp_path / "other.pid"
    pidfile.write_text(str(os.getpid()))
    assert probe("stop", "--pidfile", str(pidfile), "--token", "netcheck-nothere") == {
        "stopped": False,
        "reason": f"pid {os.getpid()} is not ours",
    }


def test_freeport_binds_the_given_address():
    port = probe("freeport", "--bind", "127.0.0.1")["port"]
    assert 1024 < port < 65536
