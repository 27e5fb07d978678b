"""The metrics port under hostile clients (issue 30, finding 2): half-open connections, more connections than
the cap, oversized requests, a process out of file descriptors. Every connection goes to 127.0.0.1."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry

from detector.daemon.endpoints import Endpoints, Limits, parse_listen

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def serve():
    with ExitStack() as stack:
        def start(limits: Limits, **kwargs) -> Endpoints:
            endpoints = Endpoints("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"), limits=limits, **kwargs)
            endpoints.start()
            stack.callback(endpoints.stop)
            return endpoints
        yield start


def _port(endpoints: Endpoints) -> int:
    return int(endpoints.address.rsplit(":", 1)[1])


def _connect(port: int, timeout: float = 3.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return sock


def _get(port: int, path: str = "/healthz", timeout: float = 3.0) -> tuple[int, bytes, float]:
    start = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
        return answer.status, answer.read(), time.monotonic() - start


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (raises socket.timeout if it never does)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_half_open_connections_cost_no_thread_and_healthz_still_answers(serve):
    endpoints = serve(Limits(request_timeout_s=1.0))
    port = _port(endpoints)
    threads_before = threading.active_count()
    socks = [_connect(port) for _ in range(300)]          # more than the default cap (256)
    for sock in socks[::2]:
        sock.sendall(b"GET /metr")                        # half a request line; the rest send nothing
    try:
        status, body, took = _get(port)
        assert (status, body) == (200, b"ok\n")
        assert took < 1.0
        assert threading.active_count() - threads_before <= endpoints.limits.workers
        # Every half-open connection is closed by the server: dropped at the cap, or answered 408 at its
        # deadline. None stays open (recv would time out after 3 s).
        answers = [_answer(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.0 408 ")]
    assert timed_out and all(a in (b"", *timed_out[:1]) for a in answers)
    assert _get(port)[0] == 200


def test_at_the_cap_the_oldest_unfinished_connection_is_dropped_for_the_newcomer(serve):
    endpoints = serve(Limits(request_timeout_s=30.0, max_connections=4))
    port = _port(endpoints)
    socks = [_connect(port) for _ in range(4)]
    try:
        time.sleep(0.2)                                   # all four accepted, in this order
        status, body, took = _get(port)                   # the fifth: the oldest goes
        assert (status, body) == (200, b"ok\n") and took < 1.0
        assert _answer(socks[0]) == b""
        for sock in socks[1:]:                            # the other three are still held
            sock.settimeout(0.2)
            with pytest.raises(socket.timeout):
                sock.recv(1)
        socks[3].settimeout(3.0)
        socks[3].sendall(b"GET /livez HTTP/1.0\r\n\r\n")  # and still served when their request comes
        assert _answer(socks[3]).endswith(b"\r\n\r\nok\n")
    finally:
        for sock in socks:
            sock.close()


def test_oversized_request_line_and_headers_are_refused_and_logged_once(serve, caplog):
    endpoints = serve(Limits(max_head_bytes=4096))
    port = _port(endpoints)
    caplog.set_level(logging.WARNING, logger="gpu_npd.daemon")
    with _connect(port) as sock:
        sock.sendall(b"GET /" + b"a" * 5000 + b" HTTP/1.0\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.0 414 ")
    with _connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n" + (b"X-Filler: " + b"0123456789" * 4 + b"\r\n") * 90 + b"\r\n")
        assert _answer(sock).startswith(b"HTTP/1.0 431 ")
    with _connect(port) as sock:                           # just under the cap: answered
        sock.sendall(b"GET /healthz HTTP/1.0\r\n" + (b"X-Filler: " + b"0123456789" * 4 + b"\r\n") * 60 + b"\r\n")
        assert _answer(sock).endswith(b"\r\n\r\nok\n")
    refused = [r for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(refused) == 1 and refused[0].name == "gpu_npd.daemon" and not refused[0].exc_info


def test_a_post_body_is_capped_and_a_bad_length_refused(serve):
    bodies = []
    endpoints = serve(Limits(max_body_bytes=10),
                      routes={("POST", "/faults"): lambda body: (bodies.append(body) or 200, b"taken\n", "text/plain")})
    port = _port(endpoints)
    for length, body, code in [("5", b"hello", b"200"), ("11", b"x" * 11, b"413"), ("-1", b"", b"400"),
                               ("ten", b"", b"400")]:
        with _connect(port) as sock:
            sock.sendall(b"POST /faults HTTP/1.0\r\nContent-Length: " + length.encode() + b"\r\n\r\n" + body)
            assert _answer(sock).startswith(b"HTTP/1.0 " + code + b" ")
    assert bodies == [b"hello"]


def test_a_stalled_body_is_dropped_at_the_deadline_while_others_are_answered(serve):
    endpoints = serve(Limits(request_timeout_s=1.0, workers=1),
                      routes={("POST", "/faults"): lambda body: (200, body, "text/plain")})
    port = _port(endpoints)
    with _connect(port) as stalled:
        stalled.sendall(b"POST /faults HTTP/1.0\r\nContent-Length: 100\r\n\r\nonly this")
        time.sleep(0.1)
        start = time.monotonic()
        assert _answer(stalled) == b""                    # the only worker gives up at the deadline
        assert time.monotonic() - start < 2.5
        assert _get(port)[0] == 200


def test_a_route_that_raises_answers_500_and_logs_one_line_without_a_traceback(serve, caplog, capfd):
    def broken(body: bytes) -> tuple[int, bytes, str]:
        raise RuntimeError("the fleet is gone")

    endpoints = serve(Limits(), routes={("GET", "/faults"): broken})
    caplog.set_level(logging.WARNING, logger="gpu_npd.daemon")
    with _connect(_port(endpoints)) as sock:
        sock.sendall(b"GET /faults HTTP/1.0\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.0 500 ")
    [line] = [r for r in caplog.records if "answering" in r.getMessage()]
    assert "RuntimeError: the fleet is gone" in line.getMessage() and not line.exc_info
    assert "Traceback" not in capfd.readouterr().err


def test_parse_listen_takes_ipv6_in_brackets():
    assert parse_listen("[::]:9808") == ("::", 9808)
    assert parse_listen(":9808") == ("0.0.0.0", 9808)
    with pytest.raises(ValueError):
        parse_listen("9808")


# The process out of file descriptors: in a child, whose RLIMIT_NOFILE is 256 and whose stderr is the
# daemon's log (text format).
CHILD = textwrap.dedent("""
    import os, resource, sys, time
    from prometheus_client import CollectorRegistry
    from detector.daemon.endpoints import Endpoints, Limits
    from detector.daemon.logs import setup_logging

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    setup_logging("text", "info", "test-node")
    mode = sys.argv[1]
    cap = 10_000 if mode == "exhausted" else None       # exhausted: nothing of the server's own to drop
    endpoints = Endpoints("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"),
                          limits=Limits(request_timeout_s=30.0, max_connections=cap))
    endpoints.start()
    held = []
    if mode == "exhausted":
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    print(endpoints.address, flush=True)
    sys.stdin.readline()                                 # the parent says: let go
    for fd in held:
        os.close(fd)
    print("released", flush=True)
    sys.stdin.readline()
    endpoints.stop()
""")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


@pytest.mark.parametrize("mode", ["cap", "exhausted"])
def test_out_of_descriptors_is_no_busy_loop_and_no_traceback(mode, tmp_path):
    """cap: the default cap (a quarter of 256) keeps the server inside its descriptors while 400 clients
    connect. exhausted: every descriptor is taken, so accept() fails with EMFILE: it rests instead of
    spinning, says so once, and answers again once descriptors are free."""
    stderr = open(tmp_path / "stderr", "w+b")
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, "PYTHONPATH": str(ROOT)})
    socks: list[socket.socket] = []
    try:
        port = int(child.stdout.readline().decode().rsplit(":", 1)[1])
        for _ in range(400 if mode == "cap" else 50):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))          # past the backlog, a connect waits: never block on it
            socks.append(sock)
        time.sleep(0.5)
        proc = psutil.Process(child.pid)
        cpu0 = _cpu_s(proc)
        time.sleep(3.0)
        assert _cpu_s(proc) - cpu0 < 0.3                  # a busy loop burns a core
        if mode == "cap":
            assert _get(port)[0] == 200                   # answered during the attack
        for sock in socks:
            sock.close()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"released\n"
        status, body, took = _get(port)
        assert (status, body) == (200, b"ok\n")
        child.stdin.write(b"stop\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 0
    finally:
        for sock in socks:
            sock.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    stderr.seek(0)
    log = stderr.read().decode()
    assert "Traceback" not in log
    lines = [line for line in log.splitlines() if line.strip()]
    assert all(" gpu_npd.daemon: endpoints: " in line for line in lines), log
    if mode == "exhausted":
        assert sum("cannot accept connections (Too many open files)" in line for line in lines) == 1, log
