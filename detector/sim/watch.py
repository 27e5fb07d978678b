"""One watch for a whole fleet's nodes: list once, then follow the changes from that resourceVersion.

A simulator speaking for 7,500 nodes must never poll them one by one. It lists the nodes matching its
selector once, hands each to `on_node`, and then watches from the list's resourceVersion, with bookmarks
so a quiet fleet's resourceVersion stays fresh. A watch the server ends is started again from the last
resourceVersion seen; 410 Gone (too old) lists again; a failure waits a jittered backoff. Nothing here
stops the simulator: the API server's troubles cost delay only.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any, Callable

import urllib3

from detector.kube.api import MAX_LIST_BYTES, ApiError, KubeApi, end_watch
from detector.kube.pacing import Backoff

log = logging.getLogger("gpu_npd.sim")


class NodeWatch:
    def __init__(self, api: KubeApi, selector: str, on_node: Callable[[dict[str, Any]], None],
                 timeout_s: int = 300, rng: random.Random | None = None):
        self.api, self.selector, self.on_node, self.timeout_s = api, selector, on_node, timeout_s
        self.backoff = Backoff(0.5, 30.0, rng or random.Random(), refused_s=60.0)
        self.resource_version: str | None = None
        self.lists = self.watches = self.events = 0          # for the benchmark and the tests
        self._stop = threading.Event()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            end_watch(response)                  # ends a read blocked on a quiet watch
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch()
                self._recovered()
            except ApiError as e:
                if self._stop.is_set():
                    return
                if e.status == 410:              # too old: everything since must be read from a new list
                    log.info("node watch: resourceVersion %s expired; listing again", self.resource_version)
                    self.resource_version = None
                    continue
                delay = self.backoff.after(e.status, e.retry_after_s)
                if not self._failing:
                    log.warning("node watch failing (%s); retrying, next in %.1fs (annotation faults wait)", e, delay)
                self._failing = True
                self._stop.wait(delay)
            except Exception:                    # a bug in a handler must not end the watch for every node
                log.exception("node watch: handling a node failed; listing again")
                self.resource_version = None
                self._stop.wait(1.0)

    def _list(self) -> None:
        collection = self.api.list_node_collection(self.selector, max_bytes=MAX_LIST_BYTES)
        self.lists += 1
        for node in collection.get("items") or []:
            self.on_node(node)
        self.resource_version = (collection.get("metadata") or {}).get("resourceVersion") or "0"

    def _watch(self) -> None:
        assert self.resource_version is not None
        self.watches += 1
        try:
            for event in self.api.watch_nodes(self.selector, self.resource_version, self.timeout_s, self._opened):
                if self._stop.is_set():
                    return
                self.events += 1
                node = event.get("object") or {}
                version = (node.get("metadata") or {}).get("resourceVersion")
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self.on_node(node)
                if version:
                    self.resource_version = version
        finally:
            with self._lock:
                self._response = None

    def _opened(self, response: urllib3.BaseHTTPResponse) -> None:
        with self._lock:
            self._response = response
        if self._stop.is_set():
            end_watch(response)

    def _recovered(self) -> None:
        if self._failing:
            log.info("node watch working again")
        self._failing = False
        self.backoff.reset()
