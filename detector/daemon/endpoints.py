"""/metrics, /healthz, /livez and /readyz on one small HTTP server that a hostile client cannot sink.

Why not the stdlib's ThreadingHTTPServer: it spends a thread per connection and waits for a request
without a timeout, so 5,000 half-open connections were 5,000 threads and an OOM kill, and running out of
file descriptors put accept() in a busy loop printing tracebacks (issue 30). Here one thread waits on every
connection with a selector until its request's head has arrived, within a deadline and a byte cap; only a
complete request goes to one of a few worker threads, which answer with the stdlib's
BaseHTTPRequestHandler (its request-line and header parsing, not ours). A connection that sends nothing
costs a file descriptor and a few hundred bytes, never a thread. Open connections are capped; at the cap
the oldest one still sending its request is dropped for the newcomer, so a slowloris cannot lock out the
kubelet's probes or the scrape, which send their request at once.
"""

from __future__ import annotations

import errno
import io
import logging
import re
import resource
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("gpu_npd.daemon")

# (method, path) -> handler(request body) -> (status code, body, content type): extra routes (the fleet
# simulator's /faults).
Route = Callable[[bytes], tuple[int, bytes, str]]
Judgement = Callable[[], tuple[bool, str]]

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_ACCEPT_BURST = 64          # accepts per wake-up, so reading the waiting connections is never starved
_TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Limits:
    """What one client may take. The defaults leave the kubelet's probes and a scrape every 15-30 s far
    inside them; tests shorten the timeout."""
    request_timeout_s: float = 5.0        # accept to the request's last byte; then again to write the answer
    max_connections: int | None = None    # open at once; None: a quarter of RLIMIT_NOFILE, at most 256
    max_head_bytes: int = 16 * 1024       # the request line and headers together
    max_body_bytes: int = 1 << 20         # a POST body (the simulator's /faults)
    workers: int = 4                      # threads answering complete requests
    accept_pause_s: float = 0.5           # accept() rests this long when the process is out of descriptors
    log_every_s: float = 60.0             # one line per kind of trouble at most this often

    def connection_cap(self) -> int:
        """A quarter of the descriptors at most: the rest are the daemon's (kernel log, NVML, API server)."""
        if self.max_connections is not None:
            return max(1, self.max_connections)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        return max(8, min(256, soft // 4))


def parse_listen(address: str) -> tuple[str, int]:
    """HOST:PORT, an IPv6 host in brackets ([::]:9808). An empty host is every IPv4 address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen {address!r}: expected HOST:PORT, like 0.0.0.0:9808, [::]:9808 or 127.0.0.1:0")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


class _Throttled:
    """One warning per kind of trouble per interval, saying how many were left unsaid: an attack must not
    flood the daemon's log any more than its memory."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.every_s:
                self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
                return
            self._last[kind] = now
            unsaid = self._unsaid.pop(kind, 0)
        if unsaid:
            message += f" ({unsaid} more like it since the last such line)"
        log.warning(message, *args)


@dataclass
class _Waiting:
    """A connection whose request's head has not all arrived."""
    sock: socket.socket
    peer: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class _Request:
    """A complete head, what came after it, and the socket for the rest of the body and the answer."""
    sock: socket.socket
    head: bytes
    rest: bytes
    deadline: float


class _RequestReader:
    """The rfile BaseHTTPRequestHandler reads: the head from memory, a body from the socket within the
    request's deadline."""

    def __init__(self, request: _Request):
        self._head = io.BytesIO(request.head)
        self._rest = request.rest
        self._request = request

    def readline(self, limit: int = -1) -> bytes:
        return self._head.readline(limit)

    def read(self, n: int) -> bytes:
        data, self._rest = self._rest[:n], self._rest[n:]
        chunks, got = [data], len(data)
        while got < n:
            left = self._request.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's body did not arrive in time")
            self._request.sock.settimeout(left)
            chunk = self._request.sock.recv(min(n - got, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), answered from memory and written in one piece."""

    server: Endpoints          # type: ignore[assignment]
    request: _Request          # type: ignore[assignment]

    def setup(self) -> None:
        self.connection = self.request.sock
        self.rfile = _RequestReader(self.request)     # type: ignore[assignment]
        self.wfile = io.BytesIO()

    def handle(self) -> None:
        self.close_connection = True
        try:
            self.handle_one_request()
        except Exception:
            self.wfile = io.BytesIO(_refusal(HTTPStatus.INTERNAL_SERVER_ERROR))   # not half an answer
            raise

    def finish(self) -> None:
        self.connection.settimeout(self.server.limits.request_timeout_s)   # the whole answer, not each send
        self.connection.sendall(self.wfile.getvalue())          # type: ignore[union-attr]

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        route = self.server.routes.get(("POST", self.path.split("?")[0]))
        if route is None:
            self._send(404, b"not found\n", _TEXT)
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._send(400, b"bad Content-Length\n", _TEXT)
        elif length > self.server.limits.max_body_bytes:
            self._send(413, f"a body of at most {self.server.limits.max_body_bytes} bytes\n".encode(), _TEXT)
        else:
            self._send(*route(self.rfile.read(length)))

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        route = self.server.routes.get(("GET", path))
        if route is not None:
            self._send(*route(b""))
        elif path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/livez", "/readyz"):
            judge = self.server.readiness if path == "/readyz" else self.server.health
            ok, text = judge()
            self._send(200 if ok else 503, (text + "\n").encode(), _TEXT)
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", _TEXT)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass                                 # scrapes every 15 s would drown the daemon's own logs


def _refusal(status: HTTPStatus) -> bytes:
    body = f"{status.value} {status.phrase}\n".encode()
    return (f"HTTP/1.0 {status.value} {status.phrase}\r\nContent-Type: {_TEXT}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class Endpoints:
    """`health()` (liveness, /healthz and /livez) and `readiness()` (/readyz) return (ok, text): the
    daemon's own judgement. Readiness defaults to liveness. The port is bound here (an OSError says why
    not); `start` serves it on a thread of its own."""

    def __init__(self, address: str, registry: CollectorRegistry, health: Judgement,
                 readiness: Judgement | None = None, routes: Mapping[tuple[str, str], Route] | None = None,
                 limits: Limits | None = None):
        self.registry, self.health, self.readiness = registry, health, readiness or health
        self.routes = dict(routes or {})
        self.limits = limits or Limits()
        self._cap = self.limits.connection_cap()
        host, port = parse_listen(address)
        v6 = ":" in host
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if v6 else socket.AF_INET,
                                              backlog=socket.SOMAXCONN, dualstack_ipv6=v6 and host == "::")
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()          # every descriptor the server needs, taken now
        self._waiting: dict[socket.socket, _Waiting] = {}    # in accept order: the first is the oldest
        self._answering = 0                                   # handed to the workers; under _lock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._workers = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="endpoints-worker")
        self._say = _Throttled(self.limits.log_every_s)
        self.thread = threading.Thread(target=self._serve, name="endpoints", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        else:
            self._selector.close()
        self._workers.shutdown(wait=False)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # The selector thread: accept, read heads, drop the slow, hand complete requests to the workers.

    def _serve(self) -> None:
        sel = self._selector
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        resume_at: float | None = None          # accept() resting after running out of descriptors
        try:                                    # nothing above this can fail: the descriptors exist
            while not self._stopping.is_set():
                now = time.monotonic()
                if resume_at is not None and now >= resume_at:
                    sel.register(self._listener, selectors.EVENT_READ, "accept")
                    resume_at = None
                wakes = [w.deadline for w in list(self._waiting.values())[:1]]
                wakes += [resume_at] if resume_at is not None else []
                for key, _ in sel.select(max(0.0, min(wakes) - now) if wakes else None):
                    if key.data == "accept":
                        if not self._accept(sel):
                            sel.unregister(self._listener)
                            resume_at = time.monotonic() + self.limits.accept_pause_s
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.fileobj in self._waiting:
                        self._read(sel, self._waiting[key.fileobj])    # type: ignore[index]
                self._expire(sel, time.monotonic())
        except Exception as e:  # noqa: BLE001 - never a traceback on stderr; the probes will say it
            log.error("endpoints stopped serving: %s: %s", type(e).__name__, e)
        finally:
            for waiting in list(self._waiting.values()):
                self._close(sel, waiting)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> bool:
        """False when accept() must rest: out of descriptors with nothing of ours to let go."""
        for _ in range(_ACCEPT_BURST):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if e.errno == errno.ECONNABORTED:
                    continue
                if e.errno in _OUT_OF_DESCRIPTORS and self._waiting:
                    self._close(sel, next(iter(self._waiting.values())))   # the oldest goes, the newest comes
                    self._say.warning("descriptors", "endpoints: out of file descriptors (%s); dropping the "
                                      "oldest connections still sending their request", e.strerror)
                    continue
                self._say.warning("accept", "endpoints: cannot accept connections (%s); trying again every %gs",
                                  e.strerror or e, self.limits.accept_pause_s)
                return False
            with self._lock:
                open_now = len(self._waiting) + self._answering
            if open_now >= self._cap:
                if not self._waiting:            # every slot is being answered (milliseconds): drop the newcomer
                    sock.close()
                    continue
                self._close(sel, next(iter(self._waiting.values())))
                self._say.warning("cap", "endpoints: %d connections open, the most allowed; dropping the oldest "
                                  "still sending its request (a slow or hostile client?)", self._cap)
            sock.setblocking(False)
            waiting = _Waiting(sock, _peer(peer), time.monotonic() + self.limits.request_timeout_s)
            self._waiting[sock] = waiting
            sel.register(sock, selectors.EVENT_READ, "read")
        return True

    def _read(self, sel: selectors.BaseSelector, waiting: _Waiting) -> None:
        try:
            data = waiting.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sel, waiting)
            return
        seen = len(waiting.head)
        waiting.head += data
        end = _HEAD_END.search(waiting.head, max(0, seen - 3))
        if end is not None and end.end() <= self.limits.max_head_bytes:
            sel.unregister(waiting.sock)
            del self._waiting[waiting.sock]
            with self._lock:
                self._answering += 1
            request = _Request(waiting.sock, bytes(waiting.head[:end.end()]), bytes(waiting.head[end.end():]),
                               waiting.deadline)
            self._workers.submit(self._answer, request, waiting.peer)
        elif len(waiting.head) > self.limits.max_head_bytes:
            too_long = HTTPStatus.REQUEST_URI_TOO_LONG if b"\n" not in waiting.head[:self.limits.max_head_bytes] \
                else HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
            self._say.warning("head", "endpoints: refused a request from %s: %s (over %d bytes)",
                              waiting.peer, too_long.phrase.lower(), self.limits.max_head_bytes)
            self._close(sel, waiting, _refusal(too_long))

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        """Deadlines are in accept order, so the expired ones are a prefix."""
        for waiting in list(self._waiting.values()):
            if waiting.deadline > now:
                break
            self._say.warning("slow", "endpoints: dropped a connection from %s that sent no complete request "
                              "within %gs", waiting.peer, self.limits.request_timeout_s)
            self._close(sel, waiting, _refusal(HTTPStatus.REQUEST_TIMEOUT))

    def _close(self, sel: selectors.BaseSelector, waiting: _Waiting, last_words: bytes = b"") -> None:
        self._waiting.pop(waiting.sock, None)
        try:
            sel.unregister(waiting.sock)
        except (KeyError, ValueError):
            pass
        try:
            if last_words:
                waiting.sock.send(last_words)        # non-blocking, best effort: never waits on the client
                waiting.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        waiting.sock.close()

    # The workers.

    def _answer(self, request: _Request, peer: str) -> None:
        try:
            if not self._stopping.is_set():
                request.sock.setblocking(True)
                _Handler(request, (peer, 0), self)       # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - a route that raised, a client gone: one line, no traceback
            self._say.warning("answer", "endpoints: answering %s failed: %s: %s", peer, type(e).__name__, e)
        finally:
            with self._lock:
                self._answering -= 1
            try:
                request.sock.close()
            except OSError:
                pass


def _peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
