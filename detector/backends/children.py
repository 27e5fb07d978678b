"""Child process groups gpu-npd starts (nvidia-smi, nvidia-imex-ctl, NCCL probes) and must not leave behind,
and the one way a node tool is run.

Each child runs in its own session, so a hung one can be killed whole and neither Ctrl-C nor the
daemon's SIGTERM reaches it: whatever is still running when gpu-npd exits is killed then. A tool's output is
read from outside gpu-npd, so only its first `cap` bytes are kept (the rest is drained and dropped, so the
child never blocks on a full pipe).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import IO


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


@dataclass(frozen=True)
class ToolOutcome:
    """How one run of a node tool ended."""

    status: str                # "ok" (ran, any exit code), "timeout", "not_found", "error"
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    detail: str = ""
    truncated: bool = False    # more output than the cap: the rest was read and dropped


def run_tool(argv: list[str], timeout_s: float, cap: int, env: dict[str, str] | None = None) -> ToolOutcome:
    """Run `argv` (no shell) in its own session; kill its group if it outlives `timeout_s`. Never waits long
    on a child stuck in the kernel (D state): it is abandoned rather than stall the caller."""
    name = argv[0]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    except FileNotFoundError:
        return ToolOutcome("not_found", detail=f"{name} not found")
    except OSError as e:
        return ToolOutcome("error", detail=f"cannot run {name}: {e.strerror or e}")
    LIVE_GROUPS.add(proc.pid)            # killed at exit if still running (Ctrl-C while it hangs)
    out, err = _CappedPipe(proc.stdout, cap), _CappedPipe(proc.stderr, cap)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return ToolOutcome("timeout", detail=f"{name} did not finish within {timeout_s:g}s")
    finally:
        LIVE_GROUPS.discard(proc.pid)
    out.join(1.0)
    err.join(1.0)
    return ToolOutcome("ok", proc.returncode, out.text(), err.text(), truncated=out.dropped or err.dropped)


class _CappedPipe:
    """Drains a pipe in a thread, keeping its first `cap` bytes."""

    def __init__(self, pipe: IO[bytes] | None, cap: int):
        self._kept, self._cap, self.dropped = bytearray(), cap, False
        self._thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._thread.start()

    def _drain(self, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        with pipe:
            while chunk := pipe.read(65536):
                room = self._cap - len(self._kept)
                self._kept += chunk[:max(room, 0)]
                self.dropped = self.dropped or len(chunk) > room

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def text(self) -> str:
        return bytes(self._kept).decode("utf-8", errors="replace")
