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


class ScaledClock:
    """Monotonic seconds running `factor` times faster than real time: a fake node's ten-minute windows fill in
    seconds under a daemon whose loops keep real time (drills, the emulator tests). `sleep` waits the real
    time that covers `seconds` of it."""

    def __init__(self, factor: float, start: float | None = None):
        if factor <= 0:
            raise ValueError("a scaled clock's factor must be positive")
        self.factor = factor
        self._real0 = time.monotonic()
        self._start = self._real0 if start is None else start

    def __call__(self) -> float:
        return self._start + (time.monotonic() - self._real0) * self.factor

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds) / self.factor)
