"""/metrics, /healthz and /readyz on one small HTTP server (stdlib; no framework needed for three paths)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

# (method, path) -> handler(request body) -> (status code, body, content type): extra routes (the fleet
# simulator's /faults).
Route = Callable[[bytes], tuple[int, bytes, str]]

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def parse_listen(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen {address!r}: expected HOST:PORT, like 0.0.0.0:9808 or 127.0.0.1:0")
    return host or "0.0.0.0", int(port)


Judgement = Callable[[], tuple[bool, str]]


class Endpoints:
    """`health()` (liveness, /healthz and /livez) and `readiness()` (/readyz) return (ok, text): the
    daemon's own judgement. Readiness defaults to liveness."""

    def __init__(self, address: str, registry: CollectorRegistry, health: Judgement,
                 readiness: Judgement | None = None, routes: Mapping[tuple[str, str], Route] | None = None):
        endpoints = self
        extra = dict(routes or {})

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                route = extra.get(("POST", self.path.split("?")[0]))
                if route is None:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                self._send(*route(self.rfile.read(min(length, 1 << 20))))

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                route = extra.get(("GET", self.path.split("?")[0]))
                if route is not None:
                    self._send(*route(b""))
                elif self.path.split("?")[0] == "/metrics":
                    self._send(200, generate_latest(endpoints.registry), CONTENT_TYPE_LATEST)
                elif self.path.split("?")[0] in ("/healthz", "/livez", "/readyz"):
                    judge = endpoints.readiness if self.path.startswith("/readyz") else endpoints.health
                    ok, text = judge()
                    self._send(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass                                 # scrapes every 15 s would drown the daemon's own logs

        self.registry, self.health, self.readiness = registry, health, readiness or health
        self.server = ThreadingHTTPServer(parse_listen(address), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="endpoints", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
