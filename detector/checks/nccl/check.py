"""The NCCL all-reduce probe: bus bandwidth across the node's GPUs, judged by rules per GPU model.

It needs the GPUs to itself, so it runs only when NVML shows no compute process on any of them (or
skips and asks to be tried again soon), never twice at once on a node, and is killed with its whole
process group at its timeout. Which program measures is a backend: nccl-tests' all_reduce_perf,
torch.distributed, or the fake node's model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from detector.checks.nccl.metrics import NcclMetrics
from detector.checks.nccl.probe import ProbeBackend, ProbeRequest, ProbeResult, ProbeUnavailable
from detector.checks.nccl.size import parse_size, show_size
from detector.core.check import Check, CheckOutput, CheckSkipped, ConfigField
from detector.core.inventory import Inventory, nvml_error_name
from detector.core.sweep import SweepContext
from detector.core.types import Observation

BACKENDS = ("auto", "nccl-tests", "torch", "torch-gloo", "fake")
DEFAULT_LOCK = os.path.join(tempfile.gettempdir(), "gpu-npd-nccl.lock")


class NcclCheck(Check):
    name = "nccl"
    description = "NCCL all-reduce bus bandwidth across the node's GPUs (needs idle GPUs; opt-in)"
    fields = {
        "probe_status": "ok (measured), failed (crashed, errored, printed FAILED) or timeout (killed)",
        "probe_error": "why the probe failed, in one line; empty when it measured",
        "backend": "what measured: nccl-tests, torch, torch-gloo or fake",
        "transport": "nccl, or gloo (CPU tensors: a test of the probe's logic, no bandwidth meaning)",
        "ranks": "GPUs in the all-reduce",
        "gpus": "GPUs NVML enumerates on the node",
        "gpu_model": "NVML's name of the GPUs, e.g. 'NVIDIA H100 80GB HBM3'",
        "topology": "nvlink when the GPUs have NVLink, else pcie",
        "size_bytes": "bytes all-reduced per iteration",
        "size": "the same, readable (8 GiB)",
        "avg_busbw_gbps": "average bus bandwidth, GB/s (nccl-tests' '# Avg bus bandwidth'; torch: mean of ranks)",
        "min_busbw_gbps": "lowest bus bandwidth, GB/s (nccl-tests: slowest row; torch: slowest rank)",
        "busbw_gbps": "the figure thresholds judge: nccl-tests' average, or torch's slowest rank",
        "wrong": "elements that came back wrong (sum of #wrong); null when not validated",
    }
    config_fields = {
        "backend": ConfigField(str, "auto", "auto (the node's fake probe, else nccl-tests if found, else torch), "
                                            "nccl-tests, torch, torch-gloo or fake"),
        "nccl_tests": ConfigField(str, "", "path of all_reduce_perf (default: all_reduce_perf on PATH)"),
        "size": ConfigField(str, "8G", "bytes to all-reduce (8G = 8 GiB): large, so the links are measured"),
        "warmup": ConfigField(int, 5, "untimed iterations first"),
        "iterations": ConfigField(int, 20, "timed iterations"),
        "ranks": ConfigField(int, 0, "GPUs to use (0: every GPU NVML enumerates)"),
        "require_idle": ConfigField(bool, True, "skip while any GPU has a compute process"),
        "busy_retry": ConfigField(float, 600.0, "seconds until the next try after a skip (GPUs busy)"),
        "lock_file": ConfigField(str, DEFAULT_LOCK, "file locked while a real probe runs, so two gpu-npd "
                                                   "processes on a node never probe at once"),
    }
    default_interval_s = 6 * 3600.0
    default_timeout_s = 300.0
    enabled_by_default = False
    long_running = True
    metrics = NcclMetrics

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        if self.config["backend"] not in BACKENDS:
            raise ValueError(f"check 'nccl': backend {self.config['backend']!r} is not one of {', '.join(BACKENDS)}")
        try:
            self.size_bytes = parse_size(self.config["size"])
        except ValueError as e:
            raise ValueError(f"check 'nccl': setting size: {e}") from None
        for key in ("warmup", "iterations"):
            if self.config[key] < (0 if key == "warmup" else 1):
                raise ValueError(f"check 'nccl': {key} must be at least {0 if key == 'warmup' else 1}")
        self._running = threading.Lock()

    @property
    def probe_timeout_s(self) -> float:
        """The probe is killed a little before the check's own timeout, so the check reports the kill
        itself (a probe timeout, with what it printed) instead of being abandoned."""
        return self.timeout_s - min(10.0, self.timeout_s * 0.1)

    def run(self, ctx: SweepContext) -> CheckOutput:
        inventory = ctx.inventory
        if inventory.nvml_error:
            raise CheckSkipped(f"NVML is unusable ({inventory.nvml_error}); no probe without GPUs")
        ranks = self.config["ranks"] or len(inventory.gpus)
        if ranks < 2:
            raise CheckSkipped(f"an all-reduce needs at least 2 GPUs; this node has {len(inventory.gpus)}")
        if ranks > len(inventory.gpus):
            raise ValueError(f"ranks is {ranks} but NVML enumerates only {len(inventory.gpus)} GPUs")
        if self.config["require_idle"]:
            busy = _busy_gpus(ctx.host.nvml, inventory)
            if busy:
                raise CheckSkipped(f"{busy}: the probe needs idle GPUs", self.config["busy_retry"])
        backend = self._backend(ctx, ranks)
        if not self._running.acquire(blocking=False):
            raise CheckSkipped("the previous NCCL probe is still running", self.config["busy_retry"])
        progress = ctx.report_progress(self.name)
        try:
            with self._node_lock(backend):
                progress(f"all-reduce of {show_size(self.size_bytes)} across {ranks} GPUs with {backend.name} "
                         f"(killed after {self.probe_timeout_s:g}s)")
                result = backend.run(ProbeRequest(ranks, self.size_bytes, self.probe_timeout_s,
                                                  self.config["warmup"], self.config["iterations"], progress))
        finally:
            self._running.release()
        fields = {**_probe_fields(result), "gpus": len(inventory.gpus), "gpu_model": _gpu_model(inventory),
                  "topology": _topology(ctx.host.nvml, inventory), "size": show_size(result.size_bytes)}
        return CheckOutput([Observation(self.name, fields)], result.to_dict(), _summary(result, fields))

    def _backend(self, ctx: SweepContext, ranks: int) -> ProbeBackend:
        choice = self.config["backend"]
        fake = ctx.host.nccl_probe
        if choice == "fake" or (choice == "auto" and fake is not None):
            if fake is None:
                raise ProbeUnavailable("backend 'fake' needs a fake node (--nvml fake:SCENARIO)")
            return fake
        from detector.checks.nccl.nccl_tests import BINARY, NcclTestsBackend, find_all_reduce_perf
        from detector.checks.nccl.torch_backend import TorchBackend

        on_path = shutil.which(BINARY) is not None
        if choice == "nccl-tests" or (choice == "auto" and (self.config["nccl_tests"] or on_path)):
            return NcclTestsBackend(find_all_reduce_perf(self.config["nccl_tests"] or None))
        transport = "gloo" if choice == "torch-gloo" else "nccl"
        torch = TorchBackend(transport)
        why_not = torch.available(ranks)
        if why_not is None:
            return torch
        if choice == "auto":
            raise ProbeUnavailable("no NCCL probe backend here: all_reduce_perf (nccl-tests) is not on PATH "
                                   f"and torch cannot run ({why_not}); install one, or set checks.nccl.nccl_tests")
        raise ProbeUnavailable(f"backend {choice!r} cannot run: {why_not}")

    @contextmanager
    def _node_lock(self, backend: ProbeBackend) -> Iterator[None]:
        """Real probes take a file lock, so a `diagnose` beside the daemon waits its turn by skipping.
        Fake nodes share a process by the thousand, so they rely on the per-check lock alone."""
        path = self.config["lock_file"]
        if backend.name == "fake" or not path:
            yield
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ProbeUnavailable(f"cannot open the probe lock {path}: {e.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckSkipped(f"another NCCL probe holds {path}", self.config["busy_retry"]) from None
            yield
        finally:
            os.close(fd)


def _summary(result: ProbeResult, fields: dict[str, Any]) -> str:
    what = f"{result.backend}, {result.ranks} ranks, {fields['size']}"
    if result.status != "ok":
        return f"{what}: probe {result.status}: {result.error}"
    wrong = "not validated" if result.wrong is None else f"{result.wrong} wrong"
    return (f"{what}: bus bandwidth {_gbps(result.avg_busbw_gbps)} GB/s avg, {_gbps(result.min_busbw_gbps)} min, "
            f"{wrong} ({result.duration_s:.1f} s)")


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _probe_fields(result: ProbeResult) -> dict[str, Any]:
    return {"probe_status": result.status, "probe_error": result.error, "backend": result.backend,
            "transport": result.transport, "ranks": result.ranks, "size_bytes": result.size_bytes,
            "avg_busbw_gbps": result.avg_busbw_gbps, "min_busbw_gbps": result.min_busbw_gbps,
            "busbw_gbps": result.busbw_gbps, "wrong": result.wrong}


def _busy_gpus(nvml: Any, inventory: Inventory) -> str:
    """'GPU 2 runs 1 compute process (pid 4242)', or '' when every GPU is idle. A GPU NVML cannot ask
    (lost, not supported) does not count as busy: the probe itself will say what is wrong with it."""
    busy = []
    for gpu in inventory.gpus:
        if gpu.handle is None or gpu.error:
            continue
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(gpu.handle)
        except Exception:  # noqa: BLE001 - NVMLError of any kind: not a reason to call the GPU busy
            continue
        if processes:
            pids = ", ".join(str(p.pid) for p in processes[:3])
            busy.append(f"GPU {gpu.index} runs {len(processes)} compute process"
                        f"{'es' if len(processes) > 1 else ''} (pid {pids})")
    return "; ".join(busy)


def _gpu_model(inventory: Inventory) -> str:
    return next((g.name for g in inventory.gpus if g.name), "")


def _topology(nvml: Any, inventory: Inventory) -> str:
    """nvlink when the GPUs have NVLink at all (a link that is down still counts: that is what the
    bandwidth threshold is for), else pcie."""
    for gpu in inventory.gpus:
        if gpu.handle is None or gpu.error:
            continue
        try:
            nvml.nvmlDeviceGetNvLinkState(gpu.handle, 0)
            return "nvlink"
        except Exception as e:  # noqa: BLE001
            return "pcie" if nvml_error_name(e) in ("NotSupported", "InvalidArgument", "FunctionNotFound") \
                else "unknown"
    return "unknown"
