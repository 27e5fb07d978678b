"""Run a probe program in its own process group, relay its output as it comes, and kill the whole group
at the deadline (mpirun, torch's rank processes and NCCL's helper threads die with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from detector.backends.children import LIVE_GROUPS, kill_group

HEAD_LINES, TAIL_LINES = 2000, 5000      # output kept for parsing; a chatty NCCL_DEBUG=INFO run is bounded
POLL_S = 0.05




@dataclass(frozen=True)
class ProcessOutcome:
    status: str                  # exited | timeout | error (could not start)
    returncode: int | None
    output: str                  # stdout and stderr interleaved (head and tail when very long)
    duration_s: float
    error: str = ""
    dropped_lines: int = 0


class _Capture:
    def __init__(self) -> None:
        self.head: list[str] = []
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.dropped = 0

    def add(self, line: str) -> None:
        if len(self.head) < HEAD_LINES:
            self.head.append(line)
            return
        if len(self.tail) == self.tail.maxlen:
            self.dropped += 1
        self.tail.append(line)

    def text(self) -> str:
        middle = [f"... {self.dropped} lines not kept ...\n"] if self.dropped else []
        return "".join(self.head + middle + list(self.tail))


def run_process(argv: Sequence[str], timeout_s: float, *, env: Mapping[str, str] | None = None,
                on_line: Callable[[str], None] | None = None, on_tick: Callable[[float], None] | None = None,
                tick_s: float = 5.0, kill_grace_s: float = 3.0) -> ProcessOutcome:
    """Never raises for the program's sake: a missing binary, a crash or a hang are outcomes.
    `on_line` gets each output line as it arrives; `on_tick` the elapsed seconds every `tick_s`."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=dict(env) if env is not None else None,
                                start_new_session=True, text=True, errors="replace", bufsize=1)
    except OSError as e:
        return ProcessOutcome("error", None, "", time.monotonic() - started, f"cannot run {argv[0]}: {e.strerror or e}")
    LIVE_GROUPS.add(proc.pid)
    capture = _Capture()
    reader = threading.Thread(target=_read, args=(proc, capture, on_line), daemon=True, name="probe-output")
    reader.start()
    deadline, next_tick = started + timeout_s, started + tick_s
    timed_out = False
    while not _exited(proc.pid):
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            kill_group(proc.pid, signal.SIGTERM)
            _wait_exit(proc.pid, kill_grace_s)
            break
        if on_tick and now >= next_tick:
            _quietly(on_tick, now - started)
            next_tick += tick_s
        time.sleep(POLL_S)
    # The leader is gone (or going) but not yet reaped, so its group id cannot have been reused:
    # whatever it left behind dies now.
    kill_group(proc.pid, signal.SIGKILL)
    returncode = proc.wait()
    LIVE_GROUPS.discard(proc.pid)
    reader.join(timeout=2.0)
    duration = time.monotonic() - started
    output = capture.text()
    if timed_out:
        return ProcessOutcome("timeout", returncode, output, duration,
                              f"killed after {timeout_s:g}s (the whole process group)", capture.dropped)
    return ProcessOutcome("exited", returncode, output, duration, dropped_lines=capture.dropped)


def _read(proc: subprocess.Popen, capture: _Capture, on_line: Callable[[str], None] | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        capture.add(line)
        if on_line:
            _quietly(on_line, line.rstrip("\n"))


def _quietly(callback: Callable[..., None], *args: object) -> None:
    """A broken progress display must neither lose the output nor leave the probe running."""
    try:
        callback(*args)
    except Exception:  # noqa: BLE001
        pass


def _exited(pid: int) -> bool:
    """Has it exited? Looks without reaping (WNOWAIT), so the pid and group id stay ours."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _wait_exit(pid: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not _exited(pid):
        time.sleep(POLL_S)
