"""Judge a burst of changes once: wait until the changes pause, but never longer than a bound.

A node label flapping a hundred times a second used to make the daemon judge the node about 290 times a
second. With a debounce, a burst is judged once, after it quiets down (`quiet_s`), and a change that never
stops is judged every `max_wait_s`, with what the node says then.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Debounce:
    quiet_s: float = 0.2
    max_wait_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _first: float | None = field(default=None, init=False)
    _last: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def poke(self) -> bool:
        """A change happened; True when it is the first of a new burst (the waiter may be asleep)."""
        with self._lock:
            now = self.clock()
            first = self._first is None
            if first:
                self._first = now
            self._last = now
            return first

    def due_in(self) -> float | None:
        """Seconds until the changes so far are due to be judged; None when none is waiting."""
        with self._lock:
            if self._first is None:
                return None
            due = min(self._last + self.quiet_s, self._first + self.max_wait_s)
            return max(0.0, due - self.clock())

    def take(self) -> bool:
        """True (once) when the waiting changes are due now; they are then no longer waiting."""
        with self._lock:
            if self._first is None:
                return False
            now = self.clock()
            if now < min(self._last + self.quiet_s, self._first + self.max_wait_s):
                return False
            self._first = None
            return True


__all__ = ["Debounce"]
