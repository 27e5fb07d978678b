"""The NCCL probe through torch.distributed: no nccl-tests binaries needed, only a torch install. torch
runs in a separate program (torch_worker), so the daemon stays small and a hung collective dies with
its process group instead of with the daemon."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import detector
from detector.checks.nccl.probe import FAILED, OK, TIMEOUT, ProbeRequest, ProbeResult
from detector.checks.nccl.process import ProcessOutcome, run_process
from detector.checks.nccl.torch_worker import ERROR_PREFIX, TRANSPORTS, ProbeLine

WORKER_MODULE = "detector.checks.nccl.torch_worker"
QUERY_TIMEOUT_S = 60.0          # importing torch (and CUDA) in another interpreter, once per question
_QUERY = ("import json, warnings; warnings.filterwarnings('ignore'); import torch, torch.distributed as d; "
          "c = torch.cuda.is_available(); print('GPU_NPD_TORCH_QUERY', json.dumps({'version': torch.__version__, "
          "'cuda': torch.version.cuda, 'devices': torch.cuda.device_count() if c else 0, "
          "'nccl': d.is_available() and d.is_nccl_available()}))")


class TorchBackend:
    """All-reduce bus bandwidth over `transport` (nccl on GPUs; gloo on CPUs, which tests the probe
    itself, not any link). Call `available()` first: `run()` reports a failing probe as a result."""

    def __init__(self, transport: str = "nccl", python: str = sys.executable):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.transport = transport
        self.python = python
        self.name = "torch" if transport == "nccl" else "torch-gloo"

    def available(self, ranks: int = 2) -> str | None:
        """None when the probe can run with `ranks` ranks, else why not. Never imports torch here: it
        looks at the install when `python` is this interpreter, and asks `python` itself otherwise
        (or when GPUs must be counted), which costs one torch import in a subprocess."""
        if self.python == sys.executable:
            spec = importlib.util.find_spec("torch")
            if spec is None:
                return f"torch is not installed for {self.python}: pip install torch"
            if self.transport == "gloo":
                return None
            cuda = _built_for_cuda(spec.submodule_search_locations)
            if cuda is False:
                return "torch is a CPU build (no CUDA): the nccl transport needs a CUDA build of torch and GPUs"
        return self._ask_python(ranks)

    def run(self, request: ProbeRequest) -> ProbeResult:
        argv = [self.python, "-m", WORKER_MODULE, "--transport", self.transport, "--ranks", str(request.ranks),
                "--size-bytes", str(request.size_bytes), "--warmup", str(request.warmup),
                "--iterations", str(request.iterations), "--timeout-s", f"{max(request.timeout_s, 1.0):g}"]
        lines: list[ProbeLine] = []

        def on_line(line: str) -> None:
            parsed = ProbeLine.parse(line)
            if parsed is not None:
                lines.append(parsed)
            elif line.strip():
                request.progress(line.strip())

        def on_tick(elapsed: float) -> None:
            request.progress(f"torch probe running for {elapsed:.0f}s (killed at {request.timeout_s:g}s)")

        outcome = run_process(argv, request.timeout_s, env=_worker_env(self.python), on_line=on_line,
                              on_tick=on_tick)
        return self._result(request, outcome, lines[-1] if lines else None)

    def _result(self, request: ProbeRequest, outcome: ProcessOutcome, line: ProbeLine | None) -> ProbeResult:
        base = dict(backend=self.name, transport=self.transport, ranks=request.ranks,
                    size_bytes=request.size_bytes, duration_s=outcome.duration_s)
        if outcome.status == "timeout":
            last = _last_line(outcome.output)
            return ProbeResult(status=TIMEOUT, error=outcome.error + (f"; last output: {last}" if last else ""),
                               **base)
        if outcome.status != "exited":
            return ProbeResult(status=FAILED, error=outcome.error or "the torch worker could not start", **base)
        if outcome.returncode != 0 or line is None:
            return ProbeResult(status=FAILED, error=_failure(outcome), **base)
        busbw = line.busbw_gbps
        return ProbeResult(status=OK, avg_busbw_gbps=sum(busbw) / len(busbw), min_busbw_gbps=min(busbw),
                           busbw_gbps=min(busbw), wrong=line.wrong, per_rank_busbw_gbps=tuple(busbw), **base)

    def _ask_python(self, ranks: int) -> str | None:
        outcome = run_process([self.python, "-c", _QUERY], QUERY_TIMEOUT_S)
        if outcome.status != "exited":
            return f"cannot ask {self.python} about torch: {outcome.error}"
        facts = _query_facts(outcome.output)
        if outcome.returncode != 0 or facts is None:
            return f"torch is not importable by {self.python}: {_last_line(outcome.output) or 'no output'}"
        if self.transport == "gloo":
            return None
        if not facts["cuda"]:
            return f"torch {facts['version']} is a CPU build (no CUDA): the nccl transport needs CUDA and GPUs"
        if not facts["nccl"]:
            return f"torch {facts['version']} was built without NCCL"
        if facts["devices"] < ranks:
            return f"{ranks} ranks need {ranks} CUDA devices, {facts['devices']} visible to torch {facts['version']}"
        return None


def _query_facts(output: str) -> dict | None:
    for line in output.splitlines():
        marker, _, payload = line.partition(" ")
        if marker == "GPU_NPD_TORCH_QUERY":
            try:
                return json.loads(payload)
            except ValueError:
                return None
    return None


def _built_for_cuda(locations) -> bool | None:
    """Reads torch/version.py rather than importing torch: False for a CPU build, None when unsure."""
    for location in locations or ():
        try:
            text = (Path(location) / "version.py").read_text()
        except OSError:
            continue
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.MULTILINE)
        if match:
            return match.group(1) != "None"
    return None


def _worker_env(python: str) -> dict[str, str]:
    """The worker imports this package; another interpreter may not have it installed, so it finds
    it after its own paths (appended, never ahead of that interpreter's own packages)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if python != sys.executable:
        root = str(Path(detector.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


def _failure(outcome: ProcessOutcome) -> str:
    """The worker's first error line (the root cause: peers fail after it), else exit code and last line."""
    for line in outcome.output.splitlines():
        if line.startswith(ERROR_PREFIX):
            return "torch worker: " + line[len(ERROR_PREFIX):].strip()
    last = _last_line(outcome.output)
    if outcome.returncode == 0:
        return "torch worker exited without a result line" + (f": {last}" if last else "")
    return f"torch worker exited with code {outcome.returncode}" + (f": {last}" if last else "")


def _last_line(output: str) -> str:
    return next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
