"""A hostile API server for tests and benchmarks: a proxy on loopback in front of the Kubernetes API
emulator that answers chosen requests the way a broken API server, proxy or attacker would, and passes the
rest through.

Each request is matched against the behaviours in force (first match wins); a behaviour writes whatever it
likes to the client's socket. Everything answered here closes its connection afterwards, so every request
of the client comes through `decide` (none hides on a kept-alive connection). `requests` records each one
(time, method, path) for counting.
"""

from __future__ import annotations

import http.client
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


@dataclass(frozen=True)
class Seen:
    at: float
    method: str
    path: str

    @property
    def watch(self) -> bool:
        return "watch=1" in self.path or "watch=true" in self.path

    def is_node_list_or_watch(self) -> bool:
        return self.method == "GET" and self.path.startswith("/api/v1/nodes") and "/status" not in self.path \
            and ("?" in self.path)


Behaviour = Callable[[socket.socket, Seen], None]


@dataclass
class Rule:
    matches: Callable[[Seen], bool]
    behaviour: Behaviour
    remaining: int | None = None            # None: for as long as the rule is in force


@dataclass
class HostileApi:
    upstream: str                           # http://127.0.0.1:PORT of the emulator
    rules: list[Rule] = field(default_factory=list)
    requests: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: socketserver.ThreadingTCPServer | None = None
    _sockets: set[socket.socket] = field(default_factory=set)

    # -- control ----------------------------------------------------------------------------------

    def when(self, matches: Callable[[Seen], bool], behaviour: Behaviour, times: int | None = None) -> None:
        with self._lock:
            self.rules.append(Rule(matches, behaviour, times))

    def clear(self) -> None:
        """Heal: every request passes through again; connections held open by a behaviour are cut."""
        with self._lock:
            self.rules.clear()
            held = list(self._sockets)
        for s in held:
            _close(s)

    def count(self, predicate: Callable[[Seen], bool], since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.at >= since and predicate(r))

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HostileApi":
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

            def handle_error(self, request: object, client_address: object) -> None:
                pass                        # a client gone mid-answer is the normal case here

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="hostile-api", daemon=True).start()
        return self

    def stop(self) -> None:
        self.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "HostileApi":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ----------------------------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.add(client)
        try:
            head, body = _read_request(client)
            if head is None:
                return
            method, path, headers = head
            seen = Seen(time.monotonic(), method, path)
            with self._lock:
                self.requests.append(seen)
                behaviour = self._take(seen)
            (behaviour or self._forward(method, path, headers, body))(client, seen)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(client)
            _close(client)

    def _take(self, seen: Seen) -> Behaviour | None:
        for rule in self.rules:
            if rule.remaining is not None and rule.remaining <= 0:
                continue
            if rule.matches(seen):
                if rule.remaining is not None:
                    rule.remaining -= 1
                return rule.behaviour
        return None

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Behaviour:
        def forward(client: socket.socket, seen: Seen) -> None:
            target = urlsplit(self.upstream)
            upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
            try:
                upstream.request(method, path, body=body or None,
                                 headers={k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP})
                response = upstream.getresponse()
                lines = [f"HTTP/1.1 {response.status} {response.reason}"]
                lines += [f"{k}: {v}" for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
                client.sendall(("\r\n".join(lines + ["Connection: close", "", ""])).encode("latin-1"))
                while chunk := response.read1(65536):
                    client.sendall(chunk)
            finally:
                upstream.close()
        return forward


# -- behaviours ------------------------------------------------------------------------------------

def respond(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Behaviour:
    """A whole answer at once."""
    def behaviour(client: socket.socket, seen: Seen) -> None:
        client.sendall(_head(status, {"Content-Length": str(len(body)), **(headers or {})}) + body)
    return behaviour


def too_many_requests(retry_after: str) -> Behaviour:
    return respond(429, b'{"kind":"Status","code":429,"reason":"TooManyRequests","message":"slow down"}',
                   {"Content-Type": "application/json", "Retry-After": retry_after})


def watch_lines(*lines: bytes, hold_s: float = 0.0) -> Behaviour:
    """A watch answer (200, close-delimited) of these lines, then held open `hold_s`, then ended."""
    def behaviour(client: socket.socket, seen: Seen) -> None:
        client.sendall(_head(200, {"Content-Type": "application/json"}) + b"".join(lines))
        time.sleep(hold_s)
    return behaviour


def endless_line(chunk: int = 64 * 1024, for_s: float = 600.0) -> Behaviour:
    """A watch whose first line never ends: bytes without a newline, as fast as they are taken."""
    def behaviour(client: socket.socket, seen: Seen) -> None:
        client.sendall(_head(200, {"Content-Type": "application/json"}) + b'{"type":"ADDED","object":{"x":"')
        block, end = b"a" * chunk, time.monotonic() + for_s
        while time.monotonic() < end:
            client.sendall(block)
    return behaviour


def trickle(bytes_per_s: float = 1.0, for_s: float = 600.0) -> Behaviour:
    """An answer that never completes: its head and body one byte at a time."""
    def behaviour(client: socket.socket, seen: Seen) -> None:
        payload = _head(200, {"Content-Type": "application/json", "Content-Length": "100000"}) + b"{" + b" " * 99999
        end = time.monotonic() + for_s
        for byte in payload:
            if time.monotonic() >= end:
                return
            client.sendall(bytes([byte]))
            time.sleep(1.0 / bytes_per_s)
    return behaviour


GONE = (b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","message":'
        b'"too old resource version","reason":"Expired","code":410}}\n')
BOOKMARK = b'{"type":"BOOKMARK","object":{"kind":"Node","metadata":{"resourceVersion":"1"}}}\n'


def _head(status: int, headers: dict[str, str]) -> bytes:
    reason = http.client.responses.get(status, "Unknown")
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers.items()] + ["Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _read_request(client: socket.socket) -> tuple[tuple[str, str, dict[str, str]] | None, bytes]:
    client.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > 1 << 20:
            return None, b""
    head, _, body = data.partition(b"\r\n\r\n")
    first, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = first.split(" ", 2)
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    length = int(headers.get("Content-Length") or headers.get("content-length") or 0)
    while len(body) < length:
        chunk = client.recv(65536)
        if not chunk:
            break
        body += chunk
    client.settimeout(None)
    return (method, path, headers), body


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def node_watch(seen: Seen) -> bool:
    return seen.watch and seen.path.startswith("/api/v1/nodes")


def node_list(seen: Seen) -> bool:
    return not seen.watch and seen.is_node_list_or_watch()


__all__ = ["BOOKMARK", "GONE", "HostileApi", "Seen", "endless_line", "node_list", "node_watch", "respond",
           "too_many_requests", "trickle", "watch_lines"]
