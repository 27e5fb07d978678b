"""HTTP/1.1 on loopback: the threaded server, a lean request parser, and the Request and Response
an `App` turns one into the other with. Chunked responses carry watches."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Mapping, Protocol
from urllib.parse import parse_qsl, urlsplit

from kube_emulator.errors import ApiError, bad_request
from kube_emulator.values import to_json

log = logging.getLogger("kube_emulator")

_BINARY_MEDIA_TYPES = ("application/vnd.kubernetes.protobuf", "application/cbor")


@dataclass(frozen=True)
class Request:
    """One request as the App sees it: path and query apart, headers by lower-cased name."""

    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]
    body: bytes = b""

    def json(self) -> Any:
        media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media in _BINARY_MEDIA_TYPES:   # client-go then sends the request again as JSON
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                         f"accepted media types include: application/json (not {media})")
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    def bearer_token(self) -> str | None:
        """The token of an `Authorization: Bearer <token>` header (None without one)."""
        value = self.headers.get("Authorization") or self.headers.get("authorization") or ""
        scheme, _, token = value.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None


@dataclass
class Response:
    """What the App answers: a body, or with `stream` a watch's chunks; `drop` closes the connection
    unanswered."""

    code: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    drop: bool = False
    close: bool = False
    after: Callable[[], None] | None = None   # run once the response has been written
    stream: Iterator[bytes] | None = None     # a watch: `body` is unused, each item is sent as one chunk

    @classmethod
    def of(cls, code: int, obj: Any, headers: dict[str, str] | None = None) -> "Response":
        return cls(code, to_json(obj), headers=headers or {})

    @classmethod
    def raw(cls, code: int, body: bytes) -> "Response":
        return cls(code, body)

    @classmethod
    def error(cls, e: ApiError) -> "Response":
        return cls.of(e.code, e.status(), e.headers)


class App(Protocol):
    """What the server hands each request to."""

    def handle(self, request: Request) -> Response: ...


class HttpServer(ThreadingHTTPServer):
    """Threads per connection, tracked so down() can close them; TLS handshakes in those threads."""

    daemon_threads = True
    block_on_close = False          # keep-alive connections are closed by close_connections instead
    request_queue_size = 1024       # hundreds of clients connecting at once must not overflow the backlog
    allow_reuse_address = True      # up() binds the same port again at once

    def __init__(self, address: tuple[str, int], app: App, tls: ssl.SSLContext | None = None):
        self.app = app
        self.tls = tls
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._closing = False
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:   # the handshake happens in the connection's own thread (_Handler.setup)
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return   # the client went away, or down() closed the connection under the handler
        log.exception("kube-emulator: error serving %s", client_address)

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._connections_lock:
            (self._connections.add if alive else self._connections.discard)(conn)
            late = alive and self._closing   # accepted just before down(): must not outlive it
        if late:
            _shutdown(conn)

    def close_connections(self) -> None:
        with self._connections_lock:
            self._closing = True
            connections = list(self._connections)
        for conn in connections:
            _shutdown(conn)


def _shutdown(conn: socket.socket) -> None:
    try:   # the TCP socket itself: SSLSocket.shutdown would also drop its TLS state under a reading thread
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass


class _Headers(dict):
    """Request headers by lower-cased name; the stdlib's email-based parser costs more than the
    rest of a request."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


_MAX_HEADERS = 100
_HANDSHAKE_TIMEOUT_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: HttpServer

    def setup(self) -> None:
        self.server.track(self.request, True)
        try:
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(_HANDSHAKE_TIMEOUT_S)
                self.request.do_handshake()
                self.request.settimeout(None)
            super().setup()
        except BaseException:
            self.server.track(self.request, False)
            raise

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def parse_request(self) -> bool:
        """A lean HTTP/1.x request-line and header parser; the stdlib's is the bottleneck under load."""
        self.command, self.request_version = "", self.default_request_version
        self.close_connection = True
        line = str(self.raw_requestline, "latin-1").rstrip("\r\n")
        self.requestline = line
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.send_error(400, f"Bad request line {line!r}")
            return False
        self.command, self.path, self.request_version = parts
        headers = _Headers()
        for _ in range(_MAX_HEADERS + 1):
            raw = self.rfile.readline(65537)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = str(raw, "latin-1").partition(":")
            key = name.strip().lower()
            # a repeated header (kubectl --as-group a --as-group b) is one comma-separated value
            headers[key] = f"{headers[key]},{value.strip()}" if key in headers else value.strip()
        else:
            self.send_error(431, "Too many headers")
            return False
        self.headers = headers  # type: ignore[assignment]
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (self.request_version == "HTTP/1.0"
                                                          and connection != "keep-alive")
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return True

    def _serve(self) -> None:
        body = self._read_body()
        url = urlsplit(self.path)
        request = Request(self.command, url.path, dict(parse_qsl(url.query, keep_blank_values=True)),
                          self.headers, body)
        response = self.server.app.handle(request)
        if response.drop:
            self.close_connection = True
            return
        if response.stream is not None:
            self._write_stream(response)
        else:
            self._write(response)
        if response.after is not None:
            response.after()

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _serve

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _write(self, response: Response) -> None:
        reason = self.responses.get(response.code, ("",))[0]
        lines = [f"HTTP/1.1 {response.code} {reason}", f"Content-Type: {response.content_type}",
                 f"Content-Length: {len(response.body)}", "Cache-Control: no-cache, private"]
        lines += [f"{k}: {v}" for k, v in response.headers.items()]
        if response.close:
            self.close_connection = True
        if self.close_connection:
            lines.append("Connection: close")
        elif self.request_version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.wfile.write(head if self.command == "HEAD" else head + response.body)

    def _write_stream(self, response: Response) -> None:
        """A watch: chunked transfer encoding, one chunk per event, each sent as soon as it is made."""
        assert response.stream is not None
        lines = [f"HTTP/1.1 {response.code} OK", f"Content-Type: {response.content_type}",
                 "Transfer-Encoding: chunked", "Cache-Control: no-cache, private"]
        lines += [f"{k}: {v}" for k, v in response.headers.items()]
        stream = response.stream
        try:
            self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for chunk in stream:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
