"""The emulator: core/v1 REST over real HTTP on loopback, so an unmodified Kubernetes client (and
its connection pooling, retries and error handling) is what gets tested."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, urlsplit

from kube_emulator import discovery
from kube_emulator.access import impersonate, review
from kube_emulator.changes import DEFAULT_CAPACITY
from kube_emulator.faults import Decision, Faults
from kube_emulator.kinds import DEFAULT_DRA_VERSION, DRA_GROUP, GROUP_VERSIONS, LEASES, hidden_versions
from kube_emulator.kubeconfig import Identity, build_kubeconfig, write_kubeconfig
from kube_emulator.patch import (
    PATCH_TYPES,
    PatchError,
    UnsupportedPatchType,
    apply_patch,
)
from kube_emulator.protobuf import PROTOBUF, ProtobufError, decode_access_review
from kube_emulator.rbac import (
    ADMIN,
    MASTERS,
    Attributes,
    Authorizer,
    Tokens,
    User,
    deploy_rbac,
    forbidden_message,
    load_policy,
)
from kube_emulator.routes import HEALTH_PATHS, Route, allowed, route_for, verb_for
from kube_emulator.stats import Stats
from kube_emulator.store import (
    EVENTS,
    NODES,
    ApiError,
    Kind,
    Store,
    bad_request,
    clone,
    rfc3339,
    to_json,
)
from kube_emulator.table import to_table, wants_table
from kube_emulator.tls import ServerTls
from kube_emulator.watch import open_watch

log = logging.getLogger("kube_emulator")

DEFAULT_USER = "system:serviceaccount:gpu-npd:gpu-npd"
KUBECONFIG_IDENTITIES = (DEFAULT_USER, ADMIN)   # what `--kubeconfig-out` writes: the daemon's, then the admin's
BOOKMARK_INTERVAL_S = 10.0
NODE_LEASE_NAMESPACE = "kube-node-lease"
_BINARY_MEDIA_TYPES = ("application/vnd.kubernetes.protobuf", "application/cbor")
VERSION = discovery.VERSION

_FAIL_TEXT = {
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: the server failed to handle the request"),
    503: ("ServiceUnavailable", "The server is currently unable to handle the request"),
    504: ("Timeout", "The server was unable to return a response in the time allotted, but may still be "
                     "processing the request"),
}


# --- Requests, responses, routes ------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
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


@dataclass
class Response:
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


def _bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization") or headers.get("authorization") or ""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


# --- HTTP transport --------------------------------------------------------------------------------

class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False          # keep-alive connections are closed by close_connections instead
    request_queue_size = 1024       # hundreds of clients connecting at once must not overflow the backlog
    allow_reuse_address = True      # up() binds the same port again at once

    def __init__(self, address: tuple[str, int], app: "Emulator", tls: ssl.SSLContext | None = None):
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
    server: _HttpServer

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


# --- The emulator ---------------------------------------------------------------------------------

class Emulator:
    """An in-process Kubernetes API server: core/v1 Nodes, Events and Pods, coordination.k8s.io/v1
    Leases, with watches, discovery, RBAC, impersonation and server-side dry run.

    Several may run in one process: each has its own objects, tokens, RBAC, faults and stats.
    """

    def __init__(self, rbac_paths: Sequence[Path] | None = None, clock: Callable[[], float] = time.time,
                 https: bool = False, watch_history: int = DEFAULT_CAPACITY,
                 bookmark_interval_s: float = BOOKMARK_INTERVAL_S, dra_version: str | None = DEFAULT_DRA_VERSION):
        """`rbac_paths`: RBAC YAML files or directories (default: deploy/base's RBAC, as packaged).
        `https`: serve HTTPS with a certificate from a CA made for this emulator (`ca_pem`; the
        kubeconfigs it writes carry it). `watch_history`: how many changes are kept for watches
        that start from a resourceVersion (older ones answer 410 Gone). `bookmark_interval_s`: how
        often a watch with allowWatchBookmarks=true gets a BOOKMARK. `dra_version`: the one
        resource.k8s.io version whose ResourceSlices and DeviceTaintRules are served (None: none)."""
        self.clock = clock
        self.dra_version = dra_version
        self.hidden = hidden_versions(dra_version)
        self.https = https
        self.bookmark_interval_s = bookmark_interval_s
        self._tls: ServerTls | None = None
        self.store = Store(clock, watch_history)
        self.tokens = Tokens()
        self.authorizer = Authorizer(load_policy(rbac_paths if rbac_paths is not None else (deploy_rbac("base"),)))
        self.faults = Faults(clock)
        self._stats = Stats()
        self._lock = threading.RLock()
        self._server: _HttpServer | None = None
        self._address: tuple[str, int] | None = None
        self._up_timer: threading.Timer | None = None
        self.tokens.issue(ADMIN)

    # Lifecycle ---------------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 picks a free port) and return the base URL."""
        with self._lock:
            if self._address is not None:
                raise RuntimeError(f"emulator already started at {self.url}")
            self._listen((host, port))
            return self.url

    def stop(self) -> None:
        with self._lock:
            if self._address is not None:
                self.down()
            self._address = None

    def down(self, duration_s: float | None = None) -> None:
        """Stop listening and close every connection, so clients get 'connection refused'; with
        `duration_s`, come back up on the same port after that many seconds."""
        server = self._go_down(duration_s)
        if server is not None:
            server.close_connections()

    def _go_down(self, duration_s: float | None) -> "_HttpServer | None":
        """Stop accepting connections (requests still arriving on open ones are dropped from now
        on) and return the server whose connections are left to close."""
        with self._lock:
            self._require_started()
            self._cancel_up_timer()
            server, self._server = self._server, None
            self.store.changes.wake()     # open watches see the server gone and end
            if server is not None:
                server.shutdown()
                server.server_close()
            if duration_s is not None:
                self._up_timer = threading.Timer(duration_s, self._come_back)
                self._up_timer.daemon = True
                self._up_timer.start()
            return server

    def up(self) -> None:
        """Listen again on the port the emulator had before down()."""
        with self._lock:
            self._require_started()
            self._cancel_up_timer()
            if self._server is None:
                self._listen(self._address)

    def _come_back(self) -> None:
        with self._lock:
            if self._address is not None:   # not stopped meanwhile
                self.up()

    @property
    def is_up(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        host, port = self._require_started()
        scheme = "https" if self.https else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    @property
    def ca_pem(self) -> bytes | None:
        """The PEM certificate of the CA that signed the serving certificate (None over plain HTTP)."""
        return self._tls.ca_pem if self._tls is not None else None

    def write_ca(self, path: Path | str) -> Path:
        """Write the CA certificate (for clients configured by file, e.g. `curl --cacert`)."""
        if self._tls is None:
            raise RuntimeError("the emulator serves plain HTTP: there is no CA (start it with https=True)")
        return self._tls.write_ca(path)

    def __enter__(self) -> "Emulator":
        if self._address is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listen(self, address: tuple[str, int]) -> None:
        if self.https and self._tls is None:
            self._tls = ServerTls([address[0]])
        server = _HttpServer(address, self, self._tls.server_context() if self._tls is not None else None)
        self._server = server
        self._address = server.server_address[:2]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name=f"kube-emulator:{self._address[1]}").start()
        log.info("kube-emulator listening on %s", self.url)

    def _cancel_up_timer(self) -> None:
        if self._up_timer is not None:
            self._up_timer.cancel()
            self._up_timer = None

    def _require_started(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("emulator not started")
        return self._address

    # Credentials ---------------------------------------------------------------------------------

    def token_for(self, user: str, groups: Sequence[str] | None = None) -> str:
        """A bearer token for `user` ("admin", "system:serviceaccount:<ns>:<name>", or any name);
        groups default to those Kubernetes gives such a user."""
        return self.tokens.issue(user, groups)

    def write_kubeconfig(self, path: Path | str, user: str = DEFAULT_USER,
                         identities: Sequence[str] = ()) -> Path:
        """A kubeconfig that reaches this emulator (with its CA when it serves HTTPS), file mode 0600.

        It has one user (with its bearer token) and one context per identity: `user`, whose
        context is the current one, then each of `identities` ("admin", "system:serviceaccount:
        <ns>:<name>", or any name). Contexts are named after the identity (`admin`,
        `gpu-npd:gpu-npd`): `kubectl --context admin ...` switches."""
        names = list(dict.fromkeys([user, *identities]))
        config = build_kubeconfig(self.url, [Identity(name, self.token_for(name)) for name in names], self.ca_pem)
        return write_kubeconfig(path, config)

    # Faults and stats ----------------------------------------------------------------------------

    def latency(self, seconds: float) -> None:
        self.faults.latency(seconds)

    def fail(self, status: int, count: int | None = None, duration_s: float | None = None,
             retry_after: int | None = None, match: str | None = None) -> None:
        self.faults.fail(status, count, duration_s, retry_after, match)

    def drop(self, count: int, match: str | None = None) -> None:
        self.faults.drop(count, match)

    def clear(self) -> None:
        """Remove latency, failures and drops (does not bring a downed emulator back up)."""
        self.faults.clear()

    def stats(self) -> dict[str, Any]:
        return self._stats.snapshot()

    def request_count(self, verb: str | None = None, resource: str | None = None, code: int | None = None,
                      user: str | None = None) -> int:
        return self._stats.count(verb, resource, code, user)

    def reset_stats(self) -> None:
        self._stats.reset()

    # Direct access for tests (no HTTP, not counted) ---------------------------------------------

    def create_node(self, name: str, labels: Mapping[str, str] | None = None,
                    capacity: Mapping[str, str] | None = None, conditions: Sequence[dict] | None = None) -> dict:
        """A node as a kubelet registers it: Ready, no pressure, heartbeats now."""
        now = rfc3339(self.clock())
        resources = {"cpu": "8", "ephemeral-storage": "100Gi", "memory": "32Gi", "pods": "110", **(capacity or {})}
        conds = [dict(c) for c in conditions] if conditions is not None else [
            _condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            _condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            _condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            _condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ]
        for cond in conds:
            cond.setdefault("lastHeartbeatTime", now)
            cond.setdefault("lastTransitionTime", now)
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
                                                  "kubernetes.io/os": "linux", **(labels or {})}},
            "spec": {},
            "status": {
                "capacity": dict(resources), "allocatable": dict(resources), "conditions": conds,
                "addresses": [{"type": "InternalIP", "address": _internal_ip(name)},
                              {"type": "Hostname", "address": name}],
                "nodeInfo": {"architecture": "amd64", "bootID": "", "containerRuntimeVersion": "containerd://1.7.20",
                             "kernelVersion": "6.8.0-45-generic", "kubeProxyVersion": "v1.31.0",
                             "kubeletVersion": "v1.31.0", "machineID": "", "operatingSystem": "linux",
                             "osImage": "Ubuntu 24.04.1 LTS", "systemUUID": ""},
            },
        }
        created = self.store.create(NODES, None, node)
        self._renew_node_lease(created)
        return clone(created)

    def _renew_node_lease(self, node: dict) -> None:
        """The kubelet's heartbeat Lease (kube-node-lease/<node>), which `kubectl describe node` shows."""
        meta = node["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.clock())) + ".000000Z"
        lease = {"metadata": {"name": meta["name"], "namespace": NODE_LEASE_NAMESPACE,
                              "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": meta["name"],
                                                   "uid": meta["uid"]}]},
                 "spec": {"holderIdentity": meta["name"], "leaseDurationSeconds": 40, "renewTime": now}}
        self.store.update(LEASES, NODE_LEASE_NAMESPACE, meta["name"], lambda _: lease, allow_create=True)

    def node(self, name: str) -> dict:
        return clone(self.store.get(NODES, None, name))

    def nodes(self) -> list[dict]:
        return [self._with_kind(item, NODES) for item in self.store.list(NODES)["items"]]

    def events(self, namespace: str | None = None) -> list[dict]:
        return [self._with_kind(item, EVENTS) for item in self.store.list(EVENTS, namespace)["items"]]

    def _dra_kind(self, resource: str) -> Kind:
        if self.dra_version is None:
            raise RuntimeError("this emulator serves no resource.k8s.io version (dra_version=None)")
        return GROUP_VERSIONS[(DRA_GROUP, self.dra_version)][resource]

    def create_resource_slice(self, body: dict) -> dict:
        """Publish a ResourceSlice as a DRA driver would (at the served resource.k8s.io version)."""
        return self._dra_create("resourceslices", body)

    def resource_slices(self) -> list[dict]:
        return self._dra_list("resourceslices")

    def create_device_taint_rule(self, body: dict) -> dict:
        return self._dra_create("devicetaintrules", body)

    def device_taint_rules(self) -> list[dict]:
        return self._dra_list("devicetaintrules")

    def _dra_create(self, resource: str, body: dict) -> dict:
        kind = self._dra_kind(resource)
        return clone(self.store.create(kind, None, {"apiVersion": kind.api_version, "kind": kind.kind, **body}))

    def _dra_list(self, resource: str) -> list[dict]:
        kind = self._dra_kind(resource)
        return [self._with_kind(item, kind) for item in self.store.list(kind)["items"]]

    @staticmethod
    def _with_kind(item: dict, kind: Kind) -> dict:
        return {"apiVersion": kind.api_version, "kind": kind.kind, **clone(item)}

    def set_node_resources(self, name: str, capacity: Mapping[str, str], allocatable: Mapping[str, str]) -> dict:
        """What a device plugin's registration makes kubelet write: extended resources merged into the
        node's status.capacity and status.allocatable (the other resources are left as they are)."""
        def build(current: dict) -> dict:
            node = clone(current)
            status = node.setdefault("status", {})
            status["capacity"] = {**(status.get("capacity") or {}), **capacity}
            status["allocatable"] = {**(status.get("allocatable") or {}), **allocatable}
            return node

        node, _ = self.store.update(NODES, None, name, build, subresource="status")   # status changes only there
        return clone(node)

    def set_node_condition(self, name: str, condition: dict) -> dict:
        """Add or update one condition by type, as the kubelet does: heartbeat now, transition time
        moved only when the status changes."""
        if not condition.get("type"):
            raise ValueError("a condition needs a type")
        now = rfc3339(self.clock())

        def build(current: dict) -> dict:
            node = clone(current)
            conds = node.setdefault("status", {}).setdefault("conditions", [])
            old = next((c for c in conds if c.get("type") == condition["type"]), None)
            new = {**(old or {}), **condition}
            if "lastHeartbeatTime" not in condition:
                new["lastHeartbeatTime"] = now
            if "lastTransitionTime" not in condition and (old is None or old.get("status") != new.get("status")):
                new["lastTransitionTime"] = now
            if old is None:
                conds.append(new)
            else:
                conds[conds.index(old)] = new
            return node

        node, _ = self.store.update(NODES, None, name, build, subresource="status")
        return clone(node)

    # Request handling ----------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        """Answer one request: faults, authentication, authorization, then the API itself."""
        if self._server is None and self._address is not None:
            return Response(0, drop=True)    # down: a request on a connection not yet closed gets nothing
        if request.path == "/emulator" or request.path.startswith("/emulator/"):
            return self._guard(lambda: self._control(request))
        route = route_for(request.path, self.hidden)
        verb = verb_for(request.method, route, request.query)
        user = self.tokens.user(_bearer(request.headers))
        decision = self.faults.decide(verb, request.method, request.path)
        if decision.delay_s:
            time.sleep(decision.delay_s)
        if decision.drop:
            response = Response(0, drop=True)
        elif decision.status is not None:
            response = _fault_response(decision)
        else:
            response = self._guard(lambda: self._serve(request, route, verb, user))
        self._stats.record(user.name if user else "", verb, route.template if route else "unknown",
                           response.code, self.clock())
        return response

    @staticmethod
    def _guard(serve: Callable[[], Response]) -> Response:
        try:
            return serve()
        except ApiError as e:
            return Response.error(e)
        except PatchError as e:
            reason = {400: "BadRequest", 415: "UnsupportedMediaType"}.get(e.code, "Invalid")
            return Response.error(ApiError(e.code, reason, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not kill the connection
            log.exception("kube-emulator: internal error")
            return Response.error(ApiError(500, "InternalError", f"Internal error occurred: {e}"))

    def _serve(self, request: Request, route: Route | None, verb: str, user: User | None) -> Response:
        if route is not None and route.document in HEALTH_PATHS:
            return Response(200, b"ok", "text/plain; charset=utf-8")
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        user = impersonate(request.headers, user, self.authorizer)
        if route is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if route.review:
            if verb != "create":
                raise _method_not_allowed()
            return Response.of(201, review(route.review, _review_body(request), user, self.authorizer))
        if route.kind is None:
            attrs = Attributes(user, verb, path=request.path)
        else:
            if not allowed(route, verb):
                raise _method_not_allowed()
            attrs = Attributes(user, verb, route.kind.resource, route.subresource, route.namespace, route.name,
                               route.group)
        permitted, reason = self.authorizer.authorize(attrs)
        if not permitted:
            details: dict[str, Any] = {"kind": attrs.resource} if attrs.resource else {}
            if attrs.api_group:
                details = {"group": attrs.api_group, **details}
            if attrs.name:
                details = {"name": attrs.name, **details}
            raise ApiError(403, "Forbidden", forbidden_message(attrs, reason), details)
        if route.kind is None:
            return self._document(route, request)
        return self._resource(request, route, route.kind, verb)

    def _document(self, route: Route, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise _method_not_allowed()
        host, port = self._require_started()
        doc = discovery.document(route.document, f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                                 self.hidden)
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return Response.of(200, doc)

    def _resource(self, request: Request, route: Route, kind: Kind, verb: str) -> Response:
        namespace = route.namespace or None
        q = request.query
        if verb == "watch":
            return self._watch(request, route, kind)
        if verb == "list":
            try:
                limit = int(q.get("limit") or 0)
            except ValueError:
                raise bad_request(f"invalid limit {q.get('limit')!r}") from None
            found = self.store.list(kind, namespace, q.get("labelSelector", ""), q.get("fieldSelector", ""), limit,
                                    q.get("continue", ""))
            if wants_table(request.headers):
                return Response.of(200, to_table(kind, found["items"], self.clock(), q, found["metadata"]))
            return Response.of(200, found)
        if verb == "get":
            obj = self.store.get(kind, namespace, route.name)
            if wants_table(request.headers):
                meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
                return Response.of(200, to_table(kind, [obj], self.clock(), q, meta))
            return Response.raw(200, self.store.encode(kind, obj))
        dry_run = _dry_run(q.get("dryRun"))
        if verb == "create":
            obj = self.store.create(kind, namespace, request.json(), dry_run)
            return Response.raw(201, self.store.encode(kind, obj))
        if verb == "update":
            body = request.json()
            obj, created = self.store.update(kind, namespace, route.name, lambda _: body, route.subresource,
                                             allow_create=kind.create_on_update and not route.subresource,
                                             dry_run=dry_run)
            return Response.raw(201 if created else 200, self.store.encode(kind, obj))
        if verb == "patch":
            content_type = request.headers.get("Content-Type") or ""
            if content_type.split(";", 1)[0].strip().lower() not in PATCH_TYPES:
                raise UnsupportedPatchType(content_type)
            patch = request.json()
            obj, _ = self.store.update(
                kind, namespace, route.name,
                lambda current: apply_patch(content_type, current, patch, kind.merge_keys), route.subresource,
                dry_run=dry_run)
            return Response.raw(200, self.store.encode(kind, obj))
        options = request.json() if request.body.strip() else {}
        options = options if isinstance(options, dict) else {}
        if options.get("dryRun"):
            dry_run = _dry_run(options["dryRun"]) or dry_run
        deleted = self.store.delete(kind, namespace, route.name, options.get("preconditions"), dry_run)
        meta = deleted["metadata"]
        return Response.of(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                 "details": {"name": meta["name"], **({"group": kind.group} if kind.group else {}),
                                             "kind": kind.resource, "uid": meta["uid"]}})

    def _watch(self, request: Request, route: Route, kind: Kind) -> Response:
        query = dict(request.query)
        if route.name:   # GET .../nodes/{name}?watch=1: a watch of that one object
            by_name = f"metadata.name={route.name}"
            query["fieldSelector"] = f"{query['fieldSelector']},{by_name}" if query.get("fieldSelector") else by_name
        render: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        if wants_table(request.headers):   # kubectl get -w: each event's object is a one-row Table
            to_table(kind, [], self.clock(), query)    # a bad includeObject answers 400 before the stream starts

            def as_row(obj: dict[str, Any]) -> dict[str, Any]:
                meta = {"resourceVersion": (obj.get("metadata") or {}).get("resourceVersion", "")}
                return to_table(kind, [obj], self.clock(), query, meta)
            render = as_row
        server = self._server
        stream = open_watch(self.store, kind, route.namespace or None, query, lambda: self._server is server,
                            self.bookmark_interval_s, render)
        return Response(200, stream=stream)

    # Control API (/emulator/...) -----------------------------------------------------------------

    def _control(self, request: Request) -> Response:
        user = self.tokens.user(_bearer(request.headers))
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        if MASTERS not in user.groups:
            raise ApiError(403, "Forbidden", f'forbidden: User "{user.name}" cannot {request.method.lower()} '
                                             f'path "{request.path}"', {})
        action = request.path[len("/emulator/"):].strip("/")
        if request.method == "GET" and action == "stats":
            return Response.of(200, self.stats())
        if request.method == "GET" and action == "faults":
            return Response.of(200, {**self.faults.describe(), "up": self.is_up})
        if request.method != "POST":
            raise ApiError(405, "MethodNotAllowed", f"{request.method} {request.path} is not supported", {})
        args = request.json() if request.body.strip() else {}
        if not isinstance(args, dict):
            raise bad_request("the request body must be a JSON object")
        actions: dict[str, Callable[..., None]] = {
            "stats/reset": self.reset_stats, "latency": self.latency, "fail": self.fail, "drop": self.drop,
            "clear": self.clear, "down": self.down}
        if action not in actions:
            raise ApiError(404, "NotFound", f"no emulator action {action!r} (known: {', '.join(actions)})", {})
        ok = Response.of(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})
        if action == "down":   # stop listening now, answer, then close the remaining connections
            duration = args.get("duration_s")
            if duration is not None and not isinstance(duration, (int, float)):
                raise bad_request("emulator down: duration_s must be a number")
            server = self._go_down(duration)
            ok.close, ok.after = True, server.close_connections if server is not None else None
            return ok
        try:
            actions[action](**args)
        except (TypeError, ValueError) as e:
            raise bad_request(f"emulator {action}: {e}") from None
        return ok


def _review_body(request: Request) -> Any:
    """An access review's body: JSON, or the protobuf kubectl sends."""
    if (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower() != PROTOBUF:
        return request.json()
    try:
        return decode_access_review(request.body)
    except ProtobufError as e:
        raise bad_request(f"the request body is not a valid protobuf access review: {e}") from None


def _method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def _dry_run(value: Any) -> bool:
    """The dryRun parameter (query string or DeleteOptions): absent, or "All" (the one value Kubernetes
    knows); anything else is refused, never taken for a real write."""
    values = value if isinstance(value, list) else [value] if value not in (None, "") else []
    if not values:
        return False
    if values == ["All"]:
        return True
    raise ApiError(400, "BadRequest", f'dryRun: Unsupported value: {json.dumps(values[0] if len(values) == 1 else values)}: '
                                      'supported values: "All"')


def _fault_response(decision: Decision) -> Response:
    assert decision.status is not None
    reason, message = _FAIL_TEXT[decision.status]
    details: dict[str, Any] = {}
    headers: dict[str, str] = {}
    if decision.retry_after is not None:
        details["retryAfterSeconds"] = decision.retry_after
        headers["Retry-After"] = str(decision.retry_after)
    return Response.error(ApiError(decision.status, reason, message, details, headers))


def _condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _internal_ip(name: str) -> str:
    h = sum(name.encode()) * 2654435761 % (254 * 254)
    return f"10.0.{h // 254}.{h % 254 + 1}"
