"""Running nvidia-smi without ever letting it stall the caller."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Protocol

from detector.backends.children import LIVE_GROUPS, kill_group


@dataclass(frozen=True)
class SmiOutcome:
    status: str                # "ok" (ran, any exit code), "timeout", "not_found", "error"
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    detail: str = ""


class NvidiaSmi(Protocol):
    def run(self, args: list[str], timeout_s: float) -> SmiOutcome: ...


class SubprocessSmi:
    """The real binary (or any stand-in, such as fake-nvidia-smi), run with an argument list: no shell."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.command = command
        self.env = env

    def run(self, args: list[str], timeout_s: float) -> SmiOutcome:
        env = {**os.environ, **self.env} if self.env else None
        try:
            proc = subprocess.Popen([*self.command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        except FileNotFoundError:
            return SmiOutcome("not_found", detail=f"{self.command[0]} not found")
        except OSError as e:
            return SmiOutcome("error", detail=f"cannot run {self.command[0]}: {e.strerror or e}")
        LIVE_GROUPS.add(proc.pid)            # killed at exit if still running (Ctrl-C while it hangs)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return SmiOutcome("timeout", detail=f"{self.command[0]} did not finish within {timeout_s:g}s")
        finally:
            LIVE_GROUPS.discard(proc.pid)
        return SmiOutcome("ok", proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the whole process group; never wait long for a child stuck in the kernel (D state)."""
    kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=1)
    except subprocess.TimeoutExpired:
        pass                   # unkillable until the kernel lets go; abandon it rather than stall
