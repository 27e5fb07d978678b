"""The emulator: core/v1 REST over real HTTP on loopback, so an unmodified Kubernetes client (and
its connection pooling, retries and error handling) is what gets tested.

`Emulator` is the front tests, demos and the command line use: it starts and stops the server
(transport.py), which hands each request to it; it answers its control API (/emulator/...) itself and
the Kubernetes API through its dispatcher (dispatch.py). Its direct methods reach the store without
HTTP, as a kubelet or a DRA driver would write (kubelet.py)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kube_emulator.changes import DEFAULT_CAPACITY
from kube_emulator.dispatch import Dispatcher, guard
from kube_emulator.errors import ApiError, bad_request
from kube_emulator.faults import Faults
from kube_emulator.kinds import (
    DEFAULT_DRA_VERSION,
    DRA_GROUP,
    EVENTS,
    GROUP_VERSIONS,
    LEASES,
    NODES,
    Kind,
    hidden_versions,
)
from kube_emulator.kubeconfig import Identity, build_kubeconfig, write_kubeconfig
from kube_emulator.kubelet import NODE_LEASE_NAMESPACE, node_lease, registered_node, with_condition, with_resources
from kube_emulator.rbac import ADMIN, MASTERS, Authorizer, Tokens, deploy_rbac, load_policy
from kube_emulator.stats import Stats
from kube_emulator.store import Store
from kube_emulator.tls import ServerTls
from kube_emulator.transport import HttpServer, Request, Response
from kube_emulator.values import clone, rfc3339

log = logging.getLogger("kube_emulator")

DEFAULT_USER = "system:serviceaccount:gpu-npd:gpu-npd"
KUBECONFIG_IDENTITIES = (DEFAULT_USER, ADMIN)   # what `--kubeconfig-out` writes: the daemon's, then the admin's
BOOKMARK_INTERVAL_S = 10.0


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
        self._server: HttpServer | None = None
        self._address: tuple[str, int] | None = None
        self._up_timer: threading.Timer | None = None
        self._api = Dispatcher(self.store, self.tokens, self.authorizer, self.faults, self._stats, clock, self.hidden,
                               bookmark_interval_s, lambda: self._server, self._authority)
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

    def _go_down(self, duration_s: float | None) -> HttpServer | None:
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
        return f"{'https' if self.https else 'http'}://{self._authority()}"

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
        server = HttpServer(address, self, self._tls.server_context() if self._tls is not None else None)
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

    def _authority(self) -> str:
        """host:port as URLs and discovery documents name the server (an IPv6 host in brackets)."""
        host, port = self._require_started()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

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
        """A node as a kubelet registers it: Ready, no pressure, heartbeats now, and its Lease."""
        created = self.store.create(NODES, None, registered_node(name, rfc3339(self.clock()), labels, capacity,
                                                                 conditions))
        lease = node_lease(created, self.clock())
        self.store.update(LEASES, NODE_LEASE_NAMESPACE, created["metadata"]["name"], lambda _: lease,
                          allow_create=True)
        return clone(created)

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
        """Extended resources merged into the node's status.capacity and status.allocatable, as a device
        plugin's registration makes kubelet write them."""
        node, _ = self.store.update(NODES, None, name, with_resources(capacity, allocatable),
                                    subresource="status")   # status changes only there
        return clone(node)

    def set_node_condition(self, name: str, condition: dict) -> dict:
        """Add or update one condition by type, as the kubelet does: heartbeat now, transition time
        moved only when the status changes."""
        if not condition.get("type"):
            raise ValueError("a condition needs a type")
        node, _ = self.store.update(NODES, None, name, with_condition(condition, rfc3339(self.clock())),
                                    subresource="status")
        return clone(node)

    # Request handling (the transport's App) ------------------------------------------------------

    def handle(self, request: Request) -> Response:
        """Answer one request: nothing while down, the control API here, the Kubernetes API by the dispatcher."""
        if self._server is None and self._address is not None:
            return Response(0, drop=True)    # down: a request on a connection not yet closed gets nothing
        if request.path == "/emulator" or request.path.startswith("/emulator/"):
            return guard(lambda: self._control(request))
        return self._api.handle(request)

    # Control API (/emulator/...) -----------------------------------------------------------------

    def _control(self, request: Request) -> Response:
        user = self.tokens.user(request.bearer_token())
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
