"""Calls that may never return (a wedged GPU blocks NVML in the kernel) run on a daemon thread
that the caller stops waiting for at a deadline. The thread is abandoned, never joined."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Hung(TimeoutError):
    """The call did not return in time; it may still be running."""


class Pending:
    """A call started on its own daemon thread."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.name = name
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self._error = e
        finally:
            self.finished = time.monotonic()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def elapsed_ms(self) -> float:
        return ((self.finished or time.monotonic()) - self.started) * 1000

    def result(self, timeout_s: float) -> Any:
        if not self._done.wait(max(0.0, timeout_s)):
            raise Hung(f"{self.name} did not return within {timeout_s:g}s")
        if self._error is not None:
            raise self._error
        return self._value


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    return Pending(fn, name).result(timeout_s)
