"""Every write the store makes, in resourceVersion order, for watches to replay: a bounded history.

The store records each change under its own lock, so the history holds one global order. A watch
starting from resourceVersion R gets every change after R while the history still reaches back to
R; once older changes have been dropped, R is too old and the watch answers 410 Gone (Expired), as
the real API server does once etcd has been compacted. Memory stays bounded by `capacity` changes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class Change:
    """One write. `new` is the object after it; for DELETED, its last state carrying the deletion's
    resourceVersion. `old` is the object before it (None for ADDED): a watch with a selector needs
    both to tell an object leaving the selection from one changing inside it."""

    rv: int
    resource: str
    type: str
    old: dict[str, Any] | None
    new: dict[str, Any]


class Expired(Exception):
    """The history no longer reaches back to the resourceVersion asked for."""

    def __init__(self, rv: int, oldest: int):
        super().__init__(f"too old resource version: {rv} ({oldest})")
        self.rv, self.oldest = rv, oldest


class ChangeLog:
    """The last `capacity` changes; readers wait on it without holding the store's lock."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("the change history needs room for at least one change")
        self._capacity = capacity
        self._cond = threading.Condition()
        self._changes: deque[Change] = deque()
        self._floor = 0     # every change after this resourceVersion is still held
        self._last = 0

    @property
    def last_rv(self) -> int:
        with self._cond:
            return self._last

    @property
    def oldest_rv(self) -> int:
        """The oldest resourceVersion a watch may still start from."""
        with self._cond:
            return self._floor

    def record(self, change: Change) -> None:
        with self._cond:
            self._changes.append(change)
            self._last = change.rv
            if len(self._changes) > self._capacity:
                self._floor = self._changes.popleft().rv
            self._cond.notify_all()

    def check(self, rv: int) -> None:
        """Raise Expired when changes after `rv` have already been dropped."""
        with self._cond:
            if rv < self._floor:
                raise Expired(rv, self._floor)

    def after(self, rv: int, timeout: float) -> list[Change]:
        """The changes after `rv`, waiting up to `timeout` seconds for one when there is none yet; an
        empty list when the wait ended (timeout or wake()) with nothing new."""
        with self._cond:
            if self._last <= rv:
                self._cond.wait(timeout)
            if rv < self._floor:
                raise Expired(rv, self._floor)
            found: list[Change] = []
            for change in reversed(self._changes):    # watchers are mostly near the end: walk back
                if change.rv <= rv:
                    break
                found.append(change)
            found.reverse()
            return found

    def wake(self) -> None:
        """Wake every waiting reader now (the server is going down: its watches must end)."""
        with self._cond:
            self._cond.notify_all()
