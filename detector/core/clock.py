"""A clock that moves only when told, so `diagnose --duration` can watch a fake node's two minutes of life
in a moment: the fake node, its counters and the checks' windows all read the same simulated time."""

from __future__ import annotations

import threading
import time


class SimulatedClock:
    """Monotonic seconds that pass by `sleep`, never by themselves. Starts at the real monotonic time, so
    the values look like the real clock's to anything that prints or compares them."""

    def __init__(self, start: float | None = None):
        self._now = time.monotonic() if start is None else start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass at once (a negative or zero wait passes none)."""
        with self._lock:
            self._now += max(0.0, seconds)
