"""Ctrl-C and SIGTERM: the first asks the command to stop, the second ends the process at once.

The first signal is the polite one: the daemon finishes its last send, diagnose abandons a hung NVML
call or nvidia-smi and exits 130. If that still takes too long for the person at the keyboard, a second
Ctrl-C (or SIGTERM) kills the child process groups gpu-npd started and exits on the spot.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

from detector.backends.children import LIVE_GROUPS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal reached a one-shot command; it exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def raise_interrupted(signum: int) -> None:
    raise Interrupted(signum)


def on_stop_signals(first: Callable[[int], None] = raise_interrupted) -> dict[int, Any]:
    """Install the handlers (main thread only); returns the ones they replace, for `restore`.
    `first(signum)` runs on the first stop signal."""
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if received:
            LIVE_GROUPS.kill_all()
            os._exit(128 + signum)           # no cleanup left to wait for: the person asked twice
        received.append(signum)
        first(signum)

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
