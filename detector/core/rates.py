"""Counters judged as rates, not totals: an NVLink replay count of 40,000 after a year says nothing,
40 more in the last ten minutes does. Checks keep one CounterWindow per counter family; time comes
from the caller, so tests need no sleeping."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable


@dataclass(frozen=True)
class Increase:
    amount: float           # how much the counter rose over `seconds`
    seconds: float          # how long the samples span (up to the window; less soon after a start or reset)

    def per_s(self) -> float:
        return self.amount / self.seconds if self.seconds > 0 else 0.0

    def per_min(self) -> float:
        return self.per_s() * 60

    def fraction(self, scale: float = 1.0) -> float:
        """A time counter (nanoseconds of throttling, `scale`=1e9) as the fraction of the span it covers."""
        return self.amount / scale / self.seconds if self.seconds > 0 else 0.0


@dataclass
class CounterWindow:
    """Samples of monotonically rising counters, per key, over the last `window_s` seconds.

    The oldest sample kept is the newest one at or before the window's start, so the increase covers
    the whole window once the counter has been watched that long. A counter that goes down (a driver
    reload, a GPU reset, a port's counters cleared) starts afresh: its old samples are dropped."""

    window_s: float
    _samples: dict[Hashable, deque[tuple[float, float]]] = field(default_factory=dict)

    def add(self, key: Hashable, value: float, now: float) -> Increase | None:
        """Record a sample and return the increase over the window; None until there are two samples."""
        samples = self._samples.setdefault(key, deque())
        if samples and value < samples[-1][1]:
            samples.clear()
        samples.append((now, value))
        while len(samples) >= 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        return self.increase(key)

    def increase(self, key: Hashable) -> Increase | None:
        samples = self._samples.get(key)
        if not samples or len(samples) < 2:
            return None
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        return Increase(v1 - v0, t1 - t0)

    def keep_only(self, keys: set[Hashable]) -> None:
        """Forget counters no longer seen (a GPU gone, a port removed), so memory stays bounded."""
        for key in set(self._samples) - keys:
            del self._samples[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._samples

    def forget(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget every counter whose key `keep` rejects (keys that are tuples of a GPU and more)."""
        for key in [k for k in self._samples if not keep(k)]:
            del self._samples[key]


def span_text(seconds: float) -> str:
    """A duration as people say it: '45 s', '21 min', '3 h 5 min', '5 days'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        hours, minutes = divmod(int(seconds // 60), 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{seconds / 86400:.0f} days"
