"""Request counts, so a test can assert what a client did and a benchmark can measure the load it
puts on the API server (peak and percentile requests per second)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

DAY_S = 24 * 3600


class Stats:
    """Counts by (user, verb, resource, code) and by second of the emulator's clock.

    Per-second counts keep at most `keep_seconds` distinct seconds (the oldest go first), so a long
    run cannot grow memory without bound. Code 0 stands for a connection dropped on purpose.
    """

    def __init__(self, keep_seconds: int = DAY_S):
        self._keep = keep_seconds
        self._lock = threading.Lock()
        self._total = 0
        self._counts: Counter[tuple[str, str, str, int]] = Counter()
        self._per_second: dict[int, int] = {}

    def record(self, user: str, verb: str, resource: str, code: int, now: float) -> None:
        second = int(now)
        with self._lock:
            self._total += 1
            self._counts[(user, verb, resource, code)] += 1
            if second in self._per_second:
                self._per_second[second] += 1
            else:
                self._per_second[second] = 1
                if len(self._per_second) > self._keep:
                    del self._per_second[min(self._per_second)]

    def reset(self) -> None:
        with self._lock:
            self._total = 0
            self._counts.clear()
            self._per_second.clear()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able: total, by_verb_resource_code rows, per_second (epoch second as a string -> count)
        and peak_per_second."""
        with self._lock:
            rows = [{"user": u, "verb": v, "resource": r, "code": c, "count": n}
                    for (u, v, r, c), n in sorted(self._counts.items())]
            per_second = {str(s): n for s, n in sorted(self._per_second.items())}
            return {"total": self._total, "by_verb_resource_code": rows, "per_second": per_second,
                    "peak_per_second": max(self._per_second.values(), default=0)}

    def count(self, verb: str | None = None, resource: str | None = None, code: int | None = None,
              user: str | None = None) -> int:
        """Requests matching every filter given."""
        with self._lock:
            return sum(n for (u, v, r, c), n in self._counts.items()
                       if (verb is None or v == verb) and (resource is None or r == resource)
                       and (code is None or c == code) and (user is None or u == user))
