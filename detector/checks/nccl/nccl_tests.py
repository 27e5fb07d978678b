"""The nccl-tests backend: NVIDIA's own all_reduce_perf, the reference figure for NCCL bus bandwidth.

One process drives every GPU (`-g RANKS`), so no MPI is needed; one message size (`-b SIZE -e SIZE`),
because small sizes measure latency, not links; validation on (`-c 1`), so corruption is counted.
Options as parsed by nccl-tests' src/common.cu (getopt "t:g:b:e:i:f:n:m:w:...c:...") and its README.
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping

from detector.checks.nccl.parse import AllReducePerfParser, parse_all_reduce_perf
from detector.checks.nccl.probe import ProbeRequest, ProbeResult, ProbeUnavailable
from detector.checks.nccl.process import run_process

BINARY = "all_reduce_perf"


def find_all_reduce_perf(configured: str | None, *, path: str | None = None) -> str:
    """The all_reduce_perf to run: the configured one (a path, or a name looked up on PATH), else
    all_reduce_perf on PATH (`path` overrides $PATH). A configured binary that is unusable is an error,
    never a reason to run another one. Raises ProbeUnavailable saying what was looked for and the fix."""
    fix = (f"Install nccl-tests (NVIDIA/nccl-tests; `make` builds build/{BINARY}) or pass --nccl-tests PATH "
           f"/ set checks.nccl.nccl_tests to the binary.")
    if configured:
        if os.sep not in configured:                      # a bare command name: look it up on PATH
            found = shutil.which(configured, path=path)
            if found:
                return found
            raise ProbeUnavailable(f"configured {configured!r} is not on PATH. {fix}")
        if os.path.isfile(configured) and os.access(configured, os.X_OK):
            return configured
        raise ProbeUnavailable(f"configured {configured} {_why_unusable(configured)}. {fix}")
    found = shutil.which(BINARY, path=path)
    if found:
        return found
    search = path if path is not None else os.environ.get("PATH", "")
    raise ProbeUnavailable(f"nccl-tests' {BINARY} is not on PATH ({search or 'empty'}). {fix}")


class NcclTestsBackend:
    """Runs all_reduce_perf once per request and judges its output (see parse.AllReducePerfRun)."""

    name = "nccl-tests"

    def __init__(self, binary: str, *, env: Mapping[str, str] | None = None,
                 tick_s: float = 5.0, kill_grace_s: float = 3.0) -> None:
        self.binary = binary
        self.env = dict(env) if env else {}     # added to the agent's environment (NCCL_DEBUG=WARN, ...)
        self.tick_s = tick_s
        self.kill_grace_s = kill_grace_s

    def argv(self, request: ProbeRequest) -> list[str]:
        size = str(request.size_bytes)
        return [self.binary, "-b", size, "-e", size, "-g", str(request.ranks),
                "-w", str(request.warmup), "-n", str(request.iterations), "-c", "1"]

    def run(self, request: ProbeRequest) -> ProbeResult:
        """Never raises for a probe that fails: a missing binary, a crash or a hang is a result."""
        progress = request.progress
        argv = self.argv(request)
        progress(f"running {' '.join(argv)} (killed at {request.timeout_s:g}s)")
        live = AllReducePerfParser()

        def on_line(line: str) -> None:
            seen = live.feed(line)
            if seen is not None:
                progress(seen.text)

        def on_tick(elapsed: float) -> None:
            progress(f"all_reduce_perf running for {elapsed:.0f}s (killed at {request.timeout_s:g}s)")

        env = {**os.environ, **self.env} if self.env else None
        outcome = run_process(argv, request.timeout_s, env=env, on_line=on_line, on_tick=on_tick,
                              tick_s=self.tick_s, kill_grace_s=self.kill_grace_s)
        return parse_all_reduce_perf(outcome.output).to_result(outcome, request.ranks, request.size_bytes)


def _why_unusable(path: str) -> str:
    if not os.path.exists(path):
        return "does not exist"
    if os.path.isdir(path):
        return "is a directory"
    return "is not executable"
