"""What the cluster says of this node, kept current by one watch on the node itself (not by polling).

The daemon lists its node with a field selector (`metadata.name=<node>`: one object, and the List's
resourceVersion to start from), then watches from there with bookmarks, so the API server sends only this
node's changes. A watch the server ends (timeoutSeconds, about 5 minutes) is started again from the last
resourceVersion seen; 410 Gone (the history no longer reaches back) lists again; a refusal (401, 403) is
said once in the log with the RBAC that grants it, and asked again only every `refused_retry_s`. Nothing
here raises into the daemon: `current()` is the latest NodeStatus (None until the node was read, or while
it does not exist).

Gentle when the API server is in trouble: every failure waits a jittered, doubling backoff from the first
one (2-4 s, then 4-8, 8-16, ... up to the watch period itself, 5 minutes), and a watch that ends before it has
lived `healthy_watch_s` counts as a failure too, however it ended (at once, after a bookmark, with a 410):
only a watch that lived resets the backoff, and only a 410 ending such a watch is listed again at once.
So a server or proxy that answers every watch with 410, or ends every watch at once, or answers 429 or 5xx,
gets at most 12 node LIST/WATCH requests in any minute from one daemon (the waits' lower bounds, 2 + 4 +
8 + 16 + 32 = 62 s, leave room for five LIST+WATCH rounds: 10 requests), falling to the normal one watch per 5 minutes
as the fault lasts. A reply of the wrong shape is a failure like any other: one log line per failing spell.

`on_change` fires only when something a check reads changed: capacity, allocatable, labels,
annotations, a condition's type, status or reason, taints, the cordon, the DRA devices. kubelet writes the node's status every
10 s to 1 min (heartbeats, images, resourceVersion), which must not wake the node checks each time.

ResourceSlices (`read_slices`: the `allocatable` check or --dra-taints needs them) are watched too, not
re-listed on a timer: a watch with the field selector `spec.nodeName=<node>,spec.driver=gpu.nvidia.com`
asks only for this node's slices of the NVIDIA DRA driver, costs one request per watch period (12 an
hour, the same as the node's) instead of one a minute for a re-list, and sees a slice republished after a
GPU was lost at once. The resource.k8s.io version is discovered (kube/dra.py); a cluster serving no
ResourceSlice leaves `dra_devices` None with no error, one that refuses them says in `dra_error` which
permission is missing. Both watches use a client of their own (own connections: a watch holds one open for
minutes), sharing the daemon's request counts but not its ApiHealth, since a refused watch must not mark
the daemon not ready while its reports still reach the API server.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import urllib3

from detector.core.keeper import Kept, keep
from detector.core.nodestatus import NodeStatus
from detector.kube.annotations import UNHEALTHY_GPUS
from detector.kube.api import WATCH_TIMEOUT_S, ApiError, KubeApi, end_watch
from detector.kube.conditions import MARKER
from detector.kube.dra import discover
from detector.kube.health import refusal_line
from detector.kube.node_status import NVIDIA_DRA_DRIVER, dra_devices, node_status
from detector.kube.pacing import Backoff
from detector.kube.shapes import obj as shape
from detector.kube.shapes import text

log = logging.getLogger("gpu_npd.kube")

RBAC_HINT = ("deploy/base/rbac.yaml does (get, list and watch nodes; get, list and watch resourceslices), or run "
             "gpu-npd with --no-node-watch")
HEALTHY_WATCH_S = 60.0       # a watch that lived this long (or half its timeout) was a working one
NOT_YET = "ResourceSlices not read yet"

Opened = Callable[[urllib3.BaseHTTPResponse], None]


@dataclass
class NodeWatchSettings:
    timeout_s: int = WATCH_TIMEOUT_S
    read_slices: bool = False               # the allocatable check or --dra-taints: watch the node's slices too
    driver: str = NVIDIA_DRA_DRIVER
    qps: float = 2.0
    burst: int = 5
    backoff_base_s: float = 4.0             # the first failure waits 2-4 s, each further one twice that
    backoff_cap_s: float = float(WATCH_TIMEOUT_S)   # a lasting fault costs what a working watch does
    refused_retry_s: float = 300.0          # after a 401/403: ask again this rarely
    healthy_watch_s: float = HEALTHY_WATCH_S     # only a watch that lived this long resets the backoff

    def healthy_after_s(self) -> float:
        """How long a watch must live to count as working: HEALTHY_WATCH_S, or half the timeout asked of
        the server when that is shorter (tests ask for watches of a second or two)."""
        return min(self.healthy_watch_s, self.timeout_s / 2)


def signature(status: NodeStatus | None) -> tuple | None:
    """What checks read of a NodeStatus: equal signatures mean nothing a check sees has changed. What gpu-npd
    writes itself (its conditions, its unhealthy-GPUs annotation) is left out: its own writes coming back
    through the watch must not make the node be judged again (at 7,500 simulated nodes that is real CPU)."""
    if status is None:
        return None
    annotations = {k: v for k, v in status.annotations.items() if k != UNHEALTHY_GPUS}
    conditions = tuple(sorted((c.type, c.status, c.reason) for c in status.conditions.values()
                              if not c.message.startswith(MARKER)))
    return (status.name, _items(status.capacity), _items(status.allocatable), _items(status.labels),
            _items(annotations), conditions, status.dra_devices, status.dra_error, tuple(sorted(status.taints)),
            status.unschedulable)


class _Follow:
    """One selection kept current: list, then watch from the list's resourceVersion, again and again."""

    def __init__(self, what: str, list_: Callable[[], dict[str, Any]],
                 watch: Callable[[str, Opened], Iterator[dict[str, Any]]],
                 reset: Callable[[list[dict[str, Any]]], None], event: Callable[[str, dict[str, Any]], None],
                 bookmark: Callable[[], None], failed: Callable[[ApiError, float], None],
                 recovered: Callable[[str, bool], None], backoff: Backoff, healthy_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.list_, self.watch = what, list_, watch
        self.reset, self.event, self.bookmark, self.failed, self.recovered = reset, event, bookmark, failed, recovered
        self.backoff, self.healthy_after_s, self.clock = backoff, healthy_after_s, clock
        self.version: str | None = None
        self.watch_began: float | None = None               # when the watch now running (or last run) began
        self.lists = self.watches = self.events = 0          # for the tests and the benchmark
        self._response: urllib3.BaseHTTPResponse | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.watch_began = None
            try:
                if self.version is None:
                    self._list()
                self._watch(stop)
                lived = self._lived()
                self.recovered("watch", lived)
                if stop.is_set() or lived:
                    continue                     # the server's timeout: watch again at once
                error = ApiError(0, "EndedEarly", "the watch ended after "
                                 f"{self.clock() - (self.watch_began or 0):.1f}s, before its timeout")
                delay = self.backoff.next_delay()
            except ApiError as e:
                if stop.is_set():
                    return
                if e.status == 410:              # too old: what changed since must be read from a new list
                    self.version = None
                    if self._lived():
                        log.info("%s watch: resourceVersion expired; reading again", self.what)
                        continue
                error, delay = e, self.backoff.after(e.status, e.retry_after_s)
            except Exception as e:  # noqa: BLE001 - a bug or a malformed object must not end the watch
                self.version = None
                error = ApiError(0, "BadObject", f"{type(e).__name__}: {e}", None, "watch")
                delay = self.backoff.next_delay()
            self.failed(error, delay)
            stop.wait(delay)

    def _lived(self) -> bool:
        """The last watch lived long enough to count as working: the backoff starts over."""
        if self.watch_began is not None and self.clock() - self.watch_began >= self.healthy_after_s:
            self.backoff.reset()
            return True
        return False

    def _list(self) -> None:
        collection = self.list_()
        self.lists += 1
        items = collection.get("items")
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ApiError(0, "BadResponse", f"a {self.what} list whose items are not a list of objects",
                           None, "list")
        self.reset(items)
        self.version = text(shape(collection.get("metadata")).get("resourceVersion"))[:256] or "0"
        self.recovered("list", False)

    def _watch(self, stop: threading.Event) -> int:
        assert self.version is not None
        self.watches += 1
        self.watch_began = self.clock()
        seen = 0
        try:
            for event in self.watch(self.version, self._opened):
                if stop.is_set():
                    break
                seen += 1
                self.events += 1
                kind, obj = event.get("type", ""), event.get("object") or {}
                if kind == "BOOKMARK":
                    self.bookmark()
                elif kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.event(kind, obj)
                if version := text(shape(obj.get("metadata")).get("resourceVersion"))[:256]:
                    self.version = version
        finally:
            with self._lock:
                self._response = None
        return seen

    def _opened(self, response: urllib3.BaseHTTPResponse) -> None:
        with self._lock:
            self._response = response
            closed = self._closed
        if closed:
            end_watch(response)

    def close(self) -> None:
        """End a watch blocked on a quiet stream at once (on the daemon's stop)."""
        with self._lock:
            self._closed = True
            response = self._response
        if response is not None:
            end_watch(response)


class NodeWatch:
    def __init__(self, api: KubeApi, node: str, settings: NodeWatchSettings | None = None,
                 on_change: Callable[[], None] | None = None, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None):
        """`api`: the daemon's client; the watch talks through a client of its own on the same connection
        (same request counts, own connection pool, no ApiHealth). `on_change` is called from the watch's
        thread; it must be quick (the daemon's sets two flags)."""
        self.settings = s = settings or NodeWatchSettings()
        self.api = KubeApi(api.connection, qps=s.qps, burst=s.burst, counts=api.counts, pool=api.connection.pool(2),
                           watchdog=api.watchdog)
        self.node, self.on_change, self.clock = node, on_change, clock
        rng = rng or random.Random()
        self._lock = threading.Lock()
        self._node: dict[str, Any] | None = None
        self._slices: dict[str, dict[str, Any]] = {}
        self._dra: tuple | None = None
        self._dra_error = NOT_YET if s.read_slices else ""
        self._status: NodeStatus | None = None
        self._signature: tuple | None = None
        self._refused: dict[str, str] = {}         # "verb resource" -> the line said
        self._failing: set[str] = set()
        self.changes = 0                            # on_change calls, for the tests and the benchmark
        self.kept: list[Kept] = []                  # the watch threads: the daemon's health reads them
        selector = f"metadata.name={node}"
        self.nodes = _Follow(
            "node", lambda: self.api.list_node_collection(field_selector=selector),
            lambda rv, opened: self.api.watch_nodes("", rv, s.timeout_s, opened, field_selector=selector),
            self._nodes_listed, self._node_event, self._bookmark, self._failed("node"), self._recovered("node"),
            self._backoff(rng), s.healthy_after_s())
        self.slices: _Follow | None = None
        self._slice_backoff = self._backoff(rng)
        self._rng = rng

    def _backoff(self, rng: random.Random) -> Backoff:
        s = self.settings
        return Backoff(s.backoff_base_s, s.backoff_cap_s, rng, refused_s=s.refused_retry_s)

    def current(self) -> NodeStatus | None:
        """The node as last read; None until it was, and while it does not exist."""
        with self._lock:
            return self._status

    # -- the thread ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set: follow the node (and its slices) on threads of their own, then end their
        watches at once. Never raises."""
        log.info("watching node %s%s", self.node, f" and its ResourceSlices of driver {self.settings.driver}"
                 if self.settings.read_slices else "")
        kept = [keep("node-watch", lambda: self.nodes.run(stop), stop, log)]
        if self.settings.read_slices:
            kept.append(keep("slice-watch", lambda: self._run_slices(stop), stop, log))
        self.kept = kept
        stop.wait()
        for follow in (self.nodes, self.slices):
            if follow is not None:
                follow.close()
        for k in kept:
            if k.thread is not None:
                k.thread.join(2.0)

    def _run_slices(self, stop: threading.Event) -> None:
        version = self._discover(stop)
        if version is None:
            return
        selector = f"spec.nodeName={self.node},spec.driver={self.settings.driver}"
        self.slices = _Follow(
            "ResourceSlice", lambda: self.api.list_resource_slice_collection(version, selector),
            lambda rv, opened: self.api.watch_resource_slices(version, selector, rv, self.settings.timeout_s, opened),
            self._slices_listed, self._slice_event, self._bookmark, self._failed("slices"),
            self._recovered("slices"), self._slice_backoff, self.settings.healthy_after_s())
        if not stop.is_set():
            self.slices.run(stop)

    def _discover(self, stop: threading.Event) -> str | None:
        """The resource.k8s.io version serving ResourceSlices, retried until known; None when none is served
        (no DRA here: nothing to read, and no error) or on stop."""
        while not stop.is_set():
            try:
                version = discover(self.api).version_of("resourceslices")
            except ApiError as e:
                delay = self._slice_backoff.after(e.status, e.retry_after_s)
                self._failed("slices")(e, delay)
                stop.wait(delay)
                continue
            except Exception:  # noqa: BLE001
                log.exception("ResourceSlice discovery failed")
                stop.wait(self._slice_backoff.next_delay())
                continue
            self._slice_backoff.reset()
            if version is None:
                log.info("the cluster serves no ResourceSlice (resource.k8s.io): no DRA devices to read")
                self._set_dra(None, "")
            return version
        return None

    # -- events (the follow threads) -------------------------------------------------------------

    def _nodes_listed(self, items: list[dict[str, Any]]) -> None:
        mine = [n for n in items if (n.get("metadata") or {}).get("name") == self.node]
        with self._lock:
            self._node = mine[0] if mine else None
        self._publish()

    def _node_event(self, kind: str, obj: dict[str, Any]) -> None:
        if (obj.get("metadata") or {}).get("name") != self.node:
            return
        with self._lock:
            self._node = None if kind == "DELETED" else obj
        self._publish()

    def _slices_listed(self, items: list[dict[str, Any]]) -> None:
        self._slices = {(s.get("metadata") or {}).get("name", ""): s for s in items}
        self._set_dra(dra_devices(self._slices.values(), self.node, self.settings.driver), "")

    def _slice_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = obj
        self._set_dra(dra_devices(self._slices.values(), self.node, self.settings.driver), "")

    def _set_dra(self, devices: tuple | None, error: str) -> None:
        with self._lock:
            self._dra, self._dra_error = devices, error
        self._publish()

    def _bookmark(self) -> None:
        """The API server vouches that nothing changed up to now: the status is as fresh as this."""
        with self._lock:
            if self._status is not None:
                self._status = replace(self._status, read_at=self.clock())

    def _publish(self) -> None:
        with self._lock:
            node = self._node
            status = None if node is None else node_status(node, self.clock(), self._dra, self._dra_error)
            mark = signature(status)
            changed = mark != self._signature
            self._status, self._signature = status, mark
            if changed:
                self.changes += 1
        if changed and self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - the daemon's callback must not end the watch
                log.exception("node watch: on_change failed")

    # -- failures --------------------------------------------------------------------------------

    def _failed(self, topic: str) -> Callable[[ApiError, float], None]:
        def failed(e: ApiError, delay: float) -> None:
            what = f"{e.verb} {e.resource}".strip()
            if e.status in (401, 403):
                line = refusal_line(e.verb, e.resource, e.status, e.message, self.node, RBAC_HINT)
                if topic == "slices":
                    self._set_dra(None, f"not permitted to {what} ({e.status}): grant it as {RBAC_HINT}")
                if self._refused.get(what) != line:
                    self._refused[what] = line
                    log.error("%s; checks that read the node object judge without it%s", line,
                              "" if topic == "node" else " (its DRA devices)")
                return
            if topic not in self._failing:
                self._failing.add(topic)
                # Info, not a warning: an unreachable API server is already said once a minute by the
                # reporter's outage log (kube/health.py), and one outage should read as one warning.
                log.info("%s watch failing (%s); retrying in %.1fs", topic, e, delay)
            else:
                log.debug("%s watch still failing (%s); retrying in %.1fs", topic, e, delay)
        return failed

    def _recovered(self, topic: str) -> Callable[[str, bool], None]:
        """A request answered: a refusal of it is over; and, once a watch has lived (`working`), the
        failing spell is over too (a list that works while every watch fails is still a failing spell)."""
        resource = "nodes" if topic == "node" else "resourceslices"

        def recovered(verb: str, working: bool) -> None:
            if working and topic in self._failing:
                self._failing.discard(topic)
                log.info("%s watch working again", topic)
            if self._refused.pop(f"{verb} {resource}", None) is not None:
                log.info("the API server now lets gpu-npd %s %s", verb, resource)
        return recovered


def _items(mapping: Any) -> tuple:
    return tuple(sorted(mapping.items()))


__all__ = ["NodeWatch", "NodeWatchSettings", "signature"]
