"""Child process groups gpu-npd starts (nvidia-smi, NCCL probes) and must not leave behind.

Each child runs in its own session, so a hung one can be killed whole and neither Ctrl-C nor the
daemon's SIGTERM reaches it: whatever is still running when gpu-npd exits is killed then.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LiveGroups:
    def __init__(self) -> None:
        self._pgids: set[int] = set()
        self._lock = threading.Lock()
        atexit.register(self.kill_all)

    def add(self, pgid: int) -> None:
        with self._lock:
            self._pgids.add(pgid)

    def discard(self, pgid: int) -> None:
        with self._lock:
            self._pgids.discard(pgid)

    def kill_all(self) -> None:
        with self._lock:
            for pgid in self._pgids:
                kill_group(pgid, signal.SIGKILL)
            self._pgids.clear()


LIVE_GROUPS = LiveGroups()   # process-wide by nature: process groups belong to this process, not to an agent
