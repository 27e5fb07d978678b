"""Watches: `?watch=1` on a list URL answers a stream of newline-delimited JSON events,
`{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": {...}}`, as the API server does.

What a watch starts from (its `resourceVersion` parameter):
- absent or "0": one ADDED event per existing object, then every change after them;
- "N": every change after resourceVersion N (a List's metadata.resourceVersion), or 410 Gone
  (reason Expired) when the change history no longer reaches back to N.
With `sendInitialEvents=true` the ADDED events come whatever the resourceVersion, followed by a
BOOKMARK annotated `k8s.io/initial-events-end: "true"` when bookmarks were asked for.

labelSelector and fieldSelector apply to each change as the API server's watch cache applies them:
an object entering the selection is ADDED, one leaving it is DELETED. `allowWatchBookmarks=true`
adds a BOOKMARK every `bookmark_interval_s` carrying only kind, apiVersion and
metadata.resourceVersion (where the watch has got to). `timeoutSeconds` ends the stream cleanly.

The stream waits on the change log, never on the store's lock, and ends when `alive()` turns false
(the server went down) or when a watcher falls so far behind that its changes have been dropped
(an ERROR event with a 410 Expired Status, after which a client lists again).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from kube_emulator.changes import ADDED, DELETED, MODIFIED, Change, Expired
from kube_emulator.errors import ApiError, bad_request
from kube_emulator.kinds import Kind
from kube_emulator.matchers import field_matcher, label_matcher
from kube_emulator.store import Store
from kube_emulator.values import to_json

BOOKMARK, ERROR = "BOOKMARK", "ERROR"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
MAX_TIMEOUT_S = 1800.0          # the API server's --min-request-timeout
ALIVE_CHECK_S = 1.0             # the longest a stream waits without looking whether the server still runs

Render = Callable[[dict[str, Any]], Any]


def expired(e: Expired) -> ApiError:
    return ApiError(410, "Expired", str(e))


def is_watch(query: Mapping[str, str]) -> bool:
    return query.get("watch", "").lower() in ("1", "true")


@dataclass(frozen=True)
class WatchRequest:
    """A watch's parameters, checked before the stream starts (a bad one answers 400, not a stream)."""

    resource_version: int | None     # None: start with ADDED events for what exists
    label_selector: str = ""
    field_selector: str = ""
    bookmarks: bool = False
    timeout_s: float = MAX_TIMEOUT_S
    initial_events: bool = False

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> "WatchRequest":
        rv_text = query.get("resourceVersion", "")
        try:
            rv = int(rv_text) if rv_text not in ("", "0") else None
            timeout_text = query.get("timeoutSeconds", "")
            timeout = float(int(timeout_text)) if timeout_text else MAX_TIMEOUT_S
        except ValueError:
            raise bad_request(f"invalid resourceVersion {rv_text!r} or timeoutSeconds "
                              f"{query.get('timeoutSeconds')!r}: both are integers") from None
        if rv is not None and rv < 0:
            raise bad_request(f"invalid resourceVersion {rv_text!r}")
        initial = query.get("sendInitialEvents", "").lower()
        if initial not in ("", "true", "false"):
            raise bad_request(f"invalid sendInitialEvents {initial!r}: true or false")
        return cls(rv if initial != "true" else None, query.get("labelSelector", ""),
                   query.get("fieldSelector", ""), query.get("allowWatchBookmarks", "").lower() in ("1", "true"),
                   min(timeout, MAX_TIMEOUT_S) if timeout > 0 else MAX_TIMEOUT_S, initial == "true")


def open_watch(store: Store, kind: Kind, namespace: str | None, query: Mapping[str, str],
               alive: Callable[[], bool], bookmark_interval_s: float, render: Render | None = None
               ) -> Iterator[bytes]:
    """Check the request and return its stream of encoded events (one bytes per event).

    Raises ApiError (400 bad parameters, 410 a resourceVersion older than the history) before any
    event is produced. `render` turns an object into what an event carries (default: the object).
    """
    watch = WatchRequest.parse(query)
    labels = label_matcher(watch.label_selector) if watch.label_selector else None
    fields = field_matcher(watch.field_selector, kind) if watch.field_selector else None

    def selected(obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return ((namespace is None or not kind.namespaced or meta.get("namespace") == namespace)
                and (labels is None or labels(meta.get("labels") or {}))
                and (fields is None or fields(obj)))

    if watch.resource_version is None:
        initial, start = store.snapshot(kind)
    else:
        initial, start = [], watch.resource_version
        try:
            store.changes.check(start)
        except Expired as e:
            raise expired(e) from None
    stream = _Stream(store, kind, watch, selected, render or (lambda obj: obj), alive, bookmark_interval_s)
    return stream.run([obj for obj in initial if selected(obj)], start)


class _Stream:
    def __init__(self, store: Store, kind: Kind, watch: WatchRequest, selected: Callable[[dict], bool],
                 render: Render, alive: Callable[[], bool], bookmark_interval_s: float):
        self.store, self.kind, self.watch, self.selected = store, kind, watch, selected
        self.render, self.alive, self.interval = render, alive, max(bookmark_interval_s, 0.01)

    def run(self, initial: list[dict], position: int) -> Iterator[bytes]:
        clock = time.monotonic
        deadline = clock() + self.watch.timeout_s
        next_bookmark = clock() + self.interval
        for obj in initial:
            yield self.event(ADDED, obj)
        if self.watch.initial_events and self.watch.bookmarks:
            yield self.bookmark(position, initial_end=True)
        while self.alive():
            now = clock()
            if now >= deadline:
                return
            if self.watch.bookmarks and now >= next_bookmark:
                yield self.bookmark(position)
                next_bookmark = now + self.interval
            until = min(deadline, next_bookmark) if self.watch.bookmarks else deadline
            try:
                changes = self.store.changes.after(position, min(until - now, ALIVE_CHECK_S))
            except Expired as e:
                yield self.encode(ERROR, expired(e).status())
                return
            for change in changes:
                position = change.rv
                if change.resource == self.kind.resource:
                    event = self.translate(change)
                    if event is not None:
                        yield event

    def translate(self, change: Change) -> bytes | None:
        """The event a change makes for this watch's selection, if any."""
        now_in = change.type != DELETED and self.selected(change.new)
        was_in = change.old is not None and self.selected(change.old)
        if now_in:
            return self.event(MODIFIED if was_in else ADDED, change.new)
        if was_in:   # deleted, or changed so that it left the selection: its last selected state
            old = change.old
            assert old is not None
            return self.event(DELETED, {**old, "metadata": {**old["metadata"], "resourceVersion": str(change.rv)}})
        return None

    def event(self, type_: str, obj: dict[str, Any]) -> bytes:
        return self.encode(type_, self.render(obj))

    def bookmark(self, position: int, initial_end: bool = False) -> bytes:
        meta: dict[str, Any] = {"resourceVersion": str(position)}
        if initial_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        return self.encode(BOOKMARK, {"kind": self.kind.kind, "apiVersion": self.kind.api_version, "metadata": meta})

    @staticmethod
    def encode(type_: str, obj: Any) -> bytes:
        return b'{"type":' + json.dumps(type_).encode() + b',"object":' + to_json(obj) + b"}\n"
