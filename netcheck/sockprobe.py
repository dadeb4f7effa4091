"""Node side of the port and raw-TCP checks. Standard library only, one JSON line per command.

The controller ships this file's source and runs it with the node's python3
(`python3 -c SOURCE COMMAND ...`), so the port check works even where the training stack is
broken. Subcommands:

  serve    --ports 29500,0 --lifetime S --pidfile F --token T
           bind every port (0 = a random free high port), then detach; the background copy
           accepts connections, reads each to EOF and answers with the byte count (8 bytes),
           and exits after S seconds or on SIGTERM. Prints the ports bound and, for a port
           already in use, the processes holding it.
  connect  --targets name=ip:port,... [--source IP] --timeout S
           connect to every target at once, half-close, and expect the listener's count.
  send     --targets name=ip:port,... [--source IP] --bytes N --timeout S
           stream N bytes to each target at once; report the seconds until the count came back.
  stop     --pidfile F --token T
           end a detached copy, only if its command line carries the token.
  freeport --bind IP
           a port free right now on IP (for the collective's rendezvous).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import struct
import sys
import threading
import time

ACK = struct.Struct("!Q")
CHUNK = 1 << 20


def _emit(data) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def holders(port: int) -> list:
    """Processes holding a listening TCP socket on `port` (those this user may inspect)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    found: list[dict] = []
    if not inodes:
        return found
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in inodes:
                process = _process(int(pid))
                process["command"] = process["command"][:160]
                found.append(process)
                break
    return found


def _process(pid: int) -> dict:
    def read(name):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                return handle.read()
        except OSError:
            return b""

    command = read("cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    name = read("comm").decode(errors="replace").strip()
    return {"pid": pid, "name": name, "command": command}


def _bind(port: int):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As torch's TCPStore does: a TIME_WAIT left by an earlier run is not "in use".
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("0.0.0.0", port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        result = {"requested": port, "ok": False, "error": os.strerror(exc.errno or 0)}
        if exc.errno == errno.EADDRINUSE:
            result["in_use"] = True
            result["holders"] = holders(port)
        return None, result
    return sock, {"requested": port, "ok": True, "port": sock.getsockname()[1]}


def _sink(conn: socket.socket, deadline: float) -> None:
    count = 0
    try:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        while True:
            data = conn.recv(CHUNK)
            if not data:
                break
            count += len(data)
        conn.sendall(ACK.pack(count))
        # The peer closes first, so TIME_WAIT lands on its ephemeral port, not on ours.
        conn.settimeout(2.0)
        conn.recv(1)
    except OSError:
        pass
    finally:
        conn.close()


class Listener:
    """`serve`'s listener in this process, on a thread of its own (the controller's side of a
    check whose nodes connect to this machine), until `close`."""

    def __init__(self, sock: socket.socket, lifetime: float = 600.0):
        self._sock, self._stopping = sock, threading.Event()
        self._deadline = time.monotonic() + lifetime
        sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the accept's timeout included
                continue
            threading.Thread(target=_sink, args=(conn, self._deadline), daemon=True).start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._sock.close()


def listen(port: int):
    """(a Listener on `port` of every address of this machine, None) or (None, `_bind`'s
    result: why not, and who holds the port)."""
    sock, result = _bind(port)
    return (Listener(sock), None) if sock is not None else (None, result)


def serve(args) -> int:
    ports = [int(p) for p in args.ports.split(",") if p != ""]
    sockets, results = [], []
    for port in ports:
        sock, result = _bind(port)
        results.append(result)
        if sock is not None:
            sockets.append(sock)
    sys.stdout.flush()
    child = os.fork() if sockets else 0
    if sockets and child:
        for sock in sockets:
            sock.close()
        _emit({"pid": child, "ports": results})
        return 0
    if not sockets:
        _emit({"pid": None, "ports": results})
        return 0
    # The detached copy: its own session, no handle on the SSH channel, a bounded life.
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    with open(args.pidfile, "w") as handle:
        handle.write(str(os.getpid()))
    deadline = time.monotonic() + args.lifetime
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    for sock in sockets:
        sock.settimeout(0.2)
    try:
        while not stopping.is_set() and time.monotonic() < deadline:
            for sock in sockets:
                try:
                    conn, _ = sock.accept()
                except (socket.timeout, BlockingIOError, InterruptedError):  # noqa: UP041 - py3.8 nodes
                    continue
                except OSError:
                    continue
                threading.Thread(target=_sink, args=(conn, deadline), daemon=True).start()
    finally:
        for sock in sockets:
            sock.close()
        try:
            os.unlink(args.pidfile)
        except OSError:
            pass
    os._exit(0)


def _targets(text: str) -> list:
    targets = []
    for item in text.split(","):
        if not item:
            continue
        name, address = item.split("=", 1)
        ip, port = address.rsplit(":", 1)
        targets.append((name, ip, int(port)))
    return targets


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


def _exchange(target, source, timeout, payload_bytes):
    """Connect, send `payload_bytes`, half-close, read the listener's count."""
    name, ip, port = target
    result = {"name": name, "ip": ip, "port": port, "ok": False, "bytes": payload_bytes}
    started = time.monotonic()
    try:
        conn = socket.create_connection(
            (ip, port), timeout=timeout, source_address=(source, 0) if source else None
        )
    except OSError as exc:
        result["error"] = _describe(exc)
        result["seconds"] = time.monotonic() - started
        return result
    result["connect_ms"] = (time.monotonic() - started) * 1e3
    try:
        if payload_bytes:
            block = memoryview(bytearray(CHUNK))
            left = payload_bytes
            while left:
                sent = conn.send(block[: min(left, CHUNK)])
                left -= sent
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < ACK.size:
            data = conn.recv(ACK.size - len(reply))
            if not data:
                break
            reply += data
        result["seconds"] = time.monotonic() - started
        if len(reply) != ACK.size:
            result["error"] = "connected, but the listener is not netcheck's (no reply)"
        elif ACK.unpack(reply)[0] != payload_bytes:
            result["error"] = f"listener received {ACK.unpack(reply)[0]} of {payload_bytes} bytes"
        else:
            result["ok"] = True
    except OSError as exc:
        result["error"] = _describe(exc)
        result["seconds"] = time.monotonic() - started
    finally:
        conn.close()
    return result


def _all(args, payload_bytes) -> int:
    targets = _targets(args.targets)
    results = [None] * len(targets)

    def work(index):
        results[index] = _exchange(targets[index], args.source, args.timeout, payload_bytes)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _emit({"results": results})
    return 0


def stop(args) -> int:
    try:
        with open(args.pidfile) as handle:
            pid = int(handle.read().strip())
    except (OSError, ValueError):
        _emit({"stopped": False, "reason": "no pidfile"})
        return 0
    command = _process(pid)["command"]
    if args.token not in command:
        _emit({"stopped": False, "reason": f"pid {pid} is not ours"})
        return 0
    os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        if args.token not in _process(pid)["command"]:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
    try:
        os.unlink(args.pidfile)
    except OSError:
        pass
    _emit({"stopped": True, "pid": pid})
    return 0


def freeport(args) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((args.bind, 0))
        _emit({"port": sock.getsockname()[1]})
    except OSError as exc:
        _emit({"port": None, "error": _describe(exc)})
    finally:
        sock.close()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sockprobe")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve")
    p.add_argument("--ports", required=True)
    p.add_argument("--lifetime", type=float, default=30.0)
    p.add_argument("--pidfile", required=True)
    p.add_argument("--token", required=True)
    for name in ("connect", "send"):
        p = commands.add_parser(name)
        p.add_argument("--targets", required=True)
        p.add_argument("--source", default=None)
        p.add_argument("--timeout", type=float, default=2.0)
        if name == "send":
            p.add_argument("--bytes", type=int, required=True)
    p = commands.add_parser("stop")
    p.add_argument("--pidfile", required=True)
    p.add_argument("--token", required=True)
    p = commands.add_parser("freeport")
    p.add_argument("--bind", default="0.0.0.0")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "connect":
        return _all(args, 0)
    if args.command == "send":
        return _all(args, args.bytes)
    if args.command == "stop":
        return stop(args)
    return freeport(args)


if __name__ == "__main__":
    sys.exit(main())
