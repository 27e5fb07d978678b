"""Events about the node, deduplicated the way client-go's event correlator does it.

- The same (type, reason, message) again within `window_s` of its last occurrence is one event whose
  count grows (a PATCH of count and lastTimestamp), not a new object.
- More than `similar_limit` different messages for one (type, reason) within the window are combined
  into one event, "(combined from similar events): <latest message>".
- A token bucket per node (burst 25, one token per 5 minutes: client-go's spam filter) caps writes.
  Unlike client-go, an event that finds the bucket empty is not dropped: it stays pending and its
  repeats add to its count, so the count stays true. Pending series are bounded (`max_series`); the
  oldest is dropped, and counted, when a flood of distinct events overflows them.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import MESSAGE_LIMIT, rfc3339
from detector.kube.pacing import Backoff, TokenBucket

COMPONENT = "gpu-npd"
COMBINED = "(combined from similar events): "


@dataclass
class _Series:
    key: tuple[str, str, str]
    name: str
    message: str
    first: float
    last: float
    count: int = 1
    sent_count: int = 0           # the count the API server holds
    created: bool = False

    @property
    def pending(self) -> bool:
        return self.count != self.sent_count


@dataclass
class EventSettings:
    window_s: float = 600.0
    similar_limit: int = 10
    burst: int = 25
    refill_per_s: float = 1 / 300
    max_series: int = 256


@dataclass
class EventStats:
    created: int = 0
    patched: int = 0
    dropped: int = 0
    failed: int = 0


class EventReporter:
    def __init__(self, api: KubeApi, node: str, clock: Callable[[], float], settings: EventSettings | None = None,
                 rng: random.Random | None = None, backoff: Backoff | None = None):
        self.api, self.node, self.clock = api, node, clock
        self.settings = settings or EventSettings()
        self.rng = rng or random.Random()
        self.backoff = backoff or Backoff(rng=self.rng)
        self.bucket = TokenBucket(self.settings.refill_per_s, self.settings.burst, clock)
        self.stats = EventStats()
        self._series: OrderedDict[tuple[str, str, str], _Series] = OrderedDict()
        self._similar: dict[tuple[str, str], deque[tuple[float, str]]] = {}
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self.last_error: ApiError | None = None

    def record(self, event_type: str, reason: str, message: str, occurrences: int = 1) -> None:
        """`occurrences` of one event. `event_type` is Kubernetes' Normal or Warning."""
        now = self.clock()
        message = message[:MESSAGE_LIMIT]
        with self._lock:
            if self._is_flood_of_similar(event_type, reason, message, now):
                message = COMBINED + message
                key = (event_type, reason, COMBINED)
            else:
                key = (event_type, reason, message)
            series = self._series.get(key)
            if series is not None and (now - series.last <= self.settings.window_s or series.pending):
                series.count, series.last, series.message = series.count + occurrences, now, message
                self._series.move_to_end(key)
                return
            self._series[key] = _Series(key, self._name(now), message, now, now, occurrences)
            self._series.move_to_end(key)
            self._bound()

    def _is_flood_of_similar(self, event_type: str, reason: str, message: str, now: float) -> bool:
        seen = self._similar.setdefault((event_type, reason), deque(maxlen=self.settings.similar_limit * 4))
        while seen and now - seen[0][0] > self.settings.window_s:
            seen.popleft()
        if all(m != message for _, m in seen):
            seen.append((now, message))
        return len({m for _, m in seen}) > self.settings.similar_limit

    def _bound(self) -> None:
        while len(self._series) > self.settings.max_series:
            victim = next((k for k, s in self._series.items() if not s.pending), next(iter(self._series)))
            dropped = self._series.pop(victim)
            self.stats.dropped += dropped.count - dropped.sent_count

    def _name(self, now: float) -> str:
        # client-go's naming: the object's name and a hex timestamp; the random tail avoids collisions.
        return f"{self.node}.{int(now * 1e9):x}{self.rng.randrange(16 ** 4):04x}"

    # -- sending ----------------------------------------------------------------------------------

    def due_at(self) -> float | None:
        with self._lock:
            if not any(s.pending for s in self._series.values()):
                return None
            return max(self._retry_at, self.clock() + self.bucket.wait_s())

    def flush(self) -> bool:
        """Send what is pending while tokens last; False when the API server failed us."""
        while True:
            with self._lock:
                if self.clock() < self._retry_at:
                    return True
                series = next((s for s in self._series.values() if s.pending), None)
                if series is None or not self.bucket.try_take():
                    return True
                count = series.count
            try:
                self._send(series, count)
            except ApiError as e:
                with self._lock:
                    self.last_error = e
                    self.stats.failed += 1
                    self._retry_at = self.clock() + self.backoff.after(e.status, e.retry_after_s)
                return False
            with self._lock:
                series.sent_count = count
                self.backoff.reset()
                self.last_error = None

    def _send(self, series: _Series, count: int) -> None:
        if series.created:
            try:
                self.api.patch_event(series.name, {"count": count, "message": series.message,
                                                   "lastTimestamp": rfc3339(series.last)})
                self.stats.patched += 1
                return
            except ApiError as e:
                if e.status != 404:                 # the API server expired it (events live ~1 h)
                    raise
                series.name, series.created = self._name(self.clock()), False
        try:
            self.api.create_event(self._body(series, count))
        except ApiError as e:
            if e.status != 409:                     # our earlier create landed but its answer was lost
                raise
            self.api.patch_event(series.name, {"count": count, "lastTimestamp": rfc3339(series.last)})
        series.created = True
        self.stats.created += 1

    def _body(self, series: _Series, count: int) -> dict[str, Any]:
        event_type, reason, _ = series.key
        return {
            "metadata": {"name": series.name},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node},
            "reason": reason, "message": series.message, "type": event_type,
            "source": {"component": COMPONENT, "host": self.node},
            "firstTimestamp": rfc3339(series.first), "lastTimestamp": rfc3339(series.last), "count": count,
            "reportingComponent": COMPONENT, "reportingInstance": self.node,
        }
