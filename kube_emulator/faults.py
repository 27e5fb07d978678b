"""Misbehaviour on demand: slow answers, error statuses, dropped connections.

The faults only decide what should happen to a request; the server carries it out. Durations are
measured with the emulator's clock, so a test with a fake clock controls when a fault ends.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

FAIL_STATUSES = (429, 500, 503, 504)


@dataclass
class _Rule:
    """One injected behaviour: answer with `status`, or drop the connection when `status` is None."""

    status: int | None
    remaining: int | None
    until: float | None
    retry_after: int | None
    match: str | None

    def applies(self, verb: str, method: str, path: str, now: float) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.until is not None and now >= self.until:
            return False
        if self.match is None:
            return True
        m = self.match.lower()
        return m in (verb.lower(), method.lower()) or self.match in path

    def expired(self, now: float) -> bool:
        return (self.remaining is not None and self.remaining <= 0) or (self.until is not None and now >= self.until)


@dataclass(frozen=True)
class Decision:
    """What to do with one request: wait `delay_s`, then drop it, fail it with `status`, or serve it."""

    delay_s: float = 0.0
    drop: bool = False
    status: int | None = None
    retry_after: int | None = None


class Faults:
    """The faults in force for one emulator; safe to change while requests are being served."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._latency = 0.0
        self._rules: list[_Rule] = []

    def latency(self, seconds: float) -> None:
        """Delay every request (including failed and dropped ones) by `seconds`; 0 turns it off."""
        if seconds < 0:
            raise ValueError("latency must be >= 0")
        with self._lock:
            self._latency = float(seconds)

    def fail(self, status: int, count: int | None = None, duration_s: float | None = None,
             retry_after: int | None = None, match: str | None = None) -> None:
        """Answer the next `count` matching requests (or those in the next `duration_s`, or all until
        cleared) with `status`. `match` is a verb (get, list, patch, ...), an HTTP method, or a
        substring of the path."""
        if status not in FAIL_STATUSES:
            raise ValueError(f"status must be one of {FAIL_STATUSES}, got {status}")
        self._add(_Rule(status, *self._limits(count, duration_s), _retry_after(retry_after), match))

    def drop(self, count: int, match: str | None = None) -> None:
        """Close the connection of the next `count` matching requests without answering."""
        self._add(_Rule(None, *self._limits(count, None), None, match))

    def clear(self) -> None:
        with self._lock:
            self._latency = 0.0
            self._rules.clear()

    def _limits(self, count: int | None, duration_s: float | None) -> tuple[int | None, float | None]:
        if count is not None and count < 1:
            raise ValueError("count must be >= 1")
        if duration_s is not None and duration_s <= 0:
            raise ValueError("duration_s must be > 0")
        return count, (self._clock() + duration_s if duration_s is not None else None)

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def decide(self, verb: str, method: str, path: str) -> Decision:
        """Consume one use of the first rule that applies to this request."""
        with self._lock:
            if not self._rules and not self._latency:
                return Decision()
            now = self._clock()
            self._rules = [r for r in self._rules if not r.expired(now)]
            for rule in self._rules:
                if rule.applies(verb, method, path, now):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    if rule.status is None:
                        return Decision(self._latency, drop=True)
                    return Decision(self._latency, status=rule.status, retry_after=rule.retry_after)
            return Decision(self._latency)

    def describe(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            return {"latency_s": self._latency,
                    "rules": [{**asdict(r), "kind": "drop" if r.status is None else "fail"}
                              for r in self._rules if not r.expired(now)]}


def _retry_after(value: int | float | None) -> int | None:
    if value is None:
        return None
    if value < 0:
        raise ValueError("retry_after must be >= 0")
    return int(-(-value // 1))  # whole seconds, rounded up, as the Retry-After header wants
