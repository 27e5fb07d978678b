"""Threads that are kept: a loop that dies of an exception is started again, and one that keeps dying
makes the daemon unhealthy, so kubelet restarts the pod instead of a loop being silently gone.

A daemon thread that raised used to end for good while /healthz stayed 200 (an OverflowError from a wait
on an infinite Retry-After ended the node watch that way): nothing noticed, nothing restarted it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

RESTART_CAP_S = 60.0          # the longest wait before starting a crashed loop again
STEADY_S = 300.0              # a loop that ran this long before crashing starts its count of crashes over
FAILING_AFTER = 3             # crashes in a row that make the daemon unhealthy


@dataclass
class Kept:
    """One kept loop: its thread and its crashes, read by the daemon's health judgement."""

    name: str
    crashes: int = 0              # in a row, without a steady run between
    last_error: str = ""
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def failing(self) -> bool:
        return self.crashes >= FAILING_AFTER

    def describe(self) -> str:
        return f"the {self.name} loop crashed {self.crashes} times in a row (last: {self.last_error})"


def keep(name: str, target: Callable[[], None], stop: threading.Event, log: logging.Logger,
         clock: Callable[[], float] = time.monotonic) -> Kept:
    """Run `target` on a daemon thread named `name` until it returns or `stop` is set; when it raises,
    log it (one line and the traceback, for the developers: it is a bug) and start it again after a
    doubling pause of at most RESTART_CAP_S."""
    kept = Kept(name)

    def run() -> None:
        while not stop.is_set():
            began = clock()
            try:
                target()
                return
            except Exception as e:  # noqa: BLE001 - the point: no loop of the daemon may die of a bug
                if clock() - began >= STEADY_S:
                    kept.crashes = 0
                kept.crashes += 1
                kept.last_error = f"{type(e).__name__}: {e}"[:300]
                pause = min(RESTART_CAP_S, 2.0 ** (kept.crashes - 1))
                log.error("the %s loop crashed (%s); starting it again in %.0fs", name, kept.last_error, pause,
                          exc_info=kept.crashes == 1)
                stop.wait(pause)

    kept.thread = threading.Thread(target=run, name=name, daemon=True)
    kept.thread.start()
    return kept


__all__ = ["Kept", "keep"]
