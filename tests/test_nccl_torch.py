"""The torch.distributed probe backend, run for real on gloo with 2 CPU processes: the same worker and
process handling as on GPUs, only the transport differs."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from detector.checks.nccl.probe import FAILED, OK, TIMEOUT, ProbeRequest
from detector.checks.nccl.torch_worker import FAIL_RANK_ENV, RESULT_MARKER, ProbeLine

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: pip install torch (CPU build) to test the torch probe backend",
                allow_module_level=True)

from detector.checks.nccl.torch_backend import TorchBackend  # noqa: E402

MIB = 1 << 20
MARKER_ENV = "GPU_NPD_TEST_PROBE_MARK"


def small(ranks: int = 2, size_bytes: int = MIB, timeout_s: float = 60.0, progress=None) -> ProbeRequest:
    return ProbeRequest(ranks=ranks, size_bytes=size_bytes, timeout_s=timeout_s, warmup=1, iterations=3,
                        progress=progress or (lambda message: None))


def marked_pids(mark: str) -> set[int]:
    """Live processes whose environment carries `mark`: the worker and every rank it spawned."""
    found = set()
    needle = f"{MARKER_ENV}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


class ProcessWatch:
    """Records every marked process seen while a probe runs, then tells which are still alive."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.mark = uuid.uuid4().hex
        monkeypatch.setenv(MARKER_ENV, self.mark)
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.seen |= marked_pids(self.mark)
            time.sleep(0.05)

    def survivors(self, wait_s: float = 3.0) -> set[int]:
        """SIGKILL is delivered asynchronously: give the kernel a moment before calling a process a survivor."""
        end = time.monotonic() + wait_s
        while (alive := marked_pids(self.mark)) and time.monotonic() < end:
            time.sleep(0.05)
        return alive


def test_gloo_two_ranks_measures_and_validates():
    messages: list[str] = []
    result = TorchBackend("gloo").run(small(progress=messages.append))
    assert result.status == OK, result.error
    assert (result.backend, result.transport, result.ranks, result.size_bytes) == ("torch-gloo", "gloo", 2, MIB)
    assert result.wrong == 0
    assert all(math.isfinite(v) and v > 0 for v in (result.avg_busbw_gbps, result.min_busbw_gbps))
    assert result.min_busbw_gbps <= result.avg_busbw_gbps
    assert result.busbw_gbps == result.min_busbw_gbps          # the slowest rank is what thresholds judge
    assert result.error == "" and result.duration_s > 0
    assert set(result.to_dict()) == {"backend", "ranks", "size_bytes", "avg_busbw_gbps", "min_busbw_gbps",
                                     "wrong", "status", "transport", "busbw_gbps", "error", "duration_s",
                                     "per_rank_busbw_gbps"}
    assert len(result.per_rank_busbw_gbps) == 2 and min(result.per_rank_busbw_gbps) == result.min_busbw_gbps
    assert "rendezvous done: 2 ranks" in messages
    assert any(m.startswith("warm-up done") for m in messages)
    assert any(m.startswith("timed 3 iterations: busbw") for m in messages)
    assert not any(RESULT_MARKER in m for m in messages)         # the result is parsed, not shown


def test_timeout_kills_the_worker_and_every_rank(monkeypatch):
    messages: list[str] = []
    # Far more iterations than 1.5 s allows, so the deadline strikes even when torch imports fast (a
    # warm page cache), and the ranks are alive to be killed.
    request = replace(small(timeout_s=1.5, progress=messages.append), iterations=1_000_000)
    with ProcessWatch(monkeypatch) as watch:
        result = TorchBackend("gloo").run(request)
    assert result.status == TIMEOUT
    assert "killed after 1.5s" in result.error and result.busbw_gbps is None
    assert "starting 2 gloo ranks, 1048576 bytes per all-reduce" in messages
    assert len(watch.seen) >= 3, f"expected the worker and 2 ranks, saw {watch.seen}"
    assert watch.survivors() == set()
    assert result.duration_s < 10


def test_a_failing_rank_fails_the_probe_without_waiting_for_the_others(monkeypatch):
    monkeypatch.setenv(FAIL_RANK_ENV, "1")
    with ProcessWatch(monkeypatch) as watch:
        result = TorchBackend("gloo").run(small(timeout_s=60.0))
    assert result.status == FAILED
    assert result.error == f"torch worker: rank 1: RuntimeError: failure injected by {FAIL_RANK_ENV}"
    assert result.busbw_gbps is None and result.wrong is None
    assert result.duration_s < 30                            # not the 60s process-group timeout
    assert watch.survivors() == set()


@pytest.mark.parametrize("ranks, size_bytes, expected", [
    (1, MIB, "--ranks must be at least 2"),
    (2, 3, "--size-bytes must be a positive multiple of 4"),
])
def test_worker_refuses_what_measures_nothing(ranks, size_bytes, expected):
    result = TorchBackend("gloo").run(small(ranks=ranks, size_bytes=size_bytes))
    assert result.status == FAILED
    assert result.error.startswith("torch worker: " + expected), result.error


def test_a_python_that_cannot_run_is_a_failed_probe_and_unavailable():
    backend = TorchBackend("gloo", python="/nonexistent/python3")
    result = backend.run(small())
    assert result.status == FAILED and "cannot run /nonexistent/python3" in result.error
    assert "/nonexistent/python3" in backend.available()


def test_nccl_needs_cuda_on_this_machine():
    # The same interpreter under another name takes the subprocess path that asks it about torch.
    alias = os.path.join(os.path.dirname(sys.executable), ".", os.path.basename(sys.executable))
    asked = TorchBackend("nccl", python=alias).available()
    if asked is None:
        pytest.skip("this machine has CUDA GPUs for torch: the nccl transport is available")
    looked = TorchBackend("nccl").available()
    assert "CUDA" in asked and "CUDA" in looked, (asked, looked)
    assert TorchBackend("gloo").available() is None


def test_nccl_run_without_cuda_fails_with_the_ranks_reason():
    if TorchBackend("nccl").available() is None:
        pytest.skip("this machine has CUDA GPUs for torch")
    result = TorchBackend("nccl").run(small())
    assert result.status == FAILED and result.backend == "torch" and result.transport == "nccl"
    assert result.error.startswith("torch worker: rank ") and "CUDA" in result.error


def test_result_line_round_trip():
    line = ProbeLine(2, "gloo", MIB, [1.5, 2.5], 0, 3)
    text = line.line()
    assert text.startswith(RESULT_MARKER + " {")
    assert ProbeLine.parse(text) == line
    assert ProbeLine.parse(RESULT_MARKER + " {not json") is None
    assert ProbeLine.parse("rendezvous done: 2 ranks") is None


def test_the_check_on_gloo_is_never_judged_for_bandwidth(registry):
    """Through the check and the builtin rules: a gloo run measures CPU copies, so however low its
    figure, no bandwidth threshold applies (8x H100 would want 460 GB/s)."""
    from conftest import diagnose_host, node_for
    from fake_nvml.host import fake_host

    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["nccl"], settings={"nccl": {
        "backend": "torch-gloo", "ranks": 2, "size": "1M", "warmup": 1, "iterations": 3}})
    (run,) = out.sweep.runs
    assert run.status == "ok" and run.result["backend"] == "torch-gloo" and run.result["status"] == OK
    assert run.result["busbw_gbps"] < 460 and out.problems == []
