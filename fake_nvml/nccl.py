"""The fake node's NCCL probe: the node's one state decides bandwidth and failures, so an NVLink
fault that the fake NVML shows also slows the probe, and a lost GPU makes it fail."""

from __future__ import annotations

import time
from typing import Callable

from detector.checks.nccl.probe import FAILED, OK, TIMEOUT, ProbeRequest, ProbeResult
from fake_nvml.node import FakeNode


class FakeNcclProbe:
    name = "fake"

    def __init__(self, node: FakeNode, sleep: Callable[[float], None] = time.sleep):
        self.node = node
        self._sleep = sleep

    def run(self, request: ProbeRequest) -> ProbeResult:
        def result(status: str, **figures) -> ProbeResult:
            return ProbeResult(self.name, "nccl", request.ranks, request.size_bytes, status, **figures)

        hang_s = self.node.read(lambda state: state.nccl_hang_s)
        if hang_s > 0:
            self._sleep(min(hang_s, request.timeout_s))
            if hang_s >= request.timeout_s:
                return result(TIMEOUT, error=f"killed after {request.timeout_s:g}s (the whole process group)",
                              duration_s=request.timeout_s)
        state = self.node.snapshot()          # as the node is when the collective ends: faults meanwhile count
        gpus = state.nvml_gpus()[:request.ranks]
        for rank, gpu in enumerate(gpus):
            if gpu.lost or gpu.nvml_hang_s > 0:
                return result(FAILED, error=f"rank {rank} (GPU {gpu.index}, {gpu.pci_bus_id}): "
                                            "NCCL failure 'unhandled cuda error' (the GPU does not answer)")
        if len(gpus) < request.ranks:
            return result(FAILED, error=f"only {len(gpus)} GPUs usable for {request.ranks} ranks")
        healthy = min(g.model.nccl_busbw_gbps for g in gpus)
        avg = round(healthy * state.nccl_busbw_factor, 2)
        slowest = round(avg * 0.99, 2)
        request.progress(f"busbw {avg} GB/s, {state.nccl_wrong} wrong")
        return result(OK, avg_busbw_gbps=avg, min_busbw_gbps=slowest, busbw_gbps=avg, wrong=state.nccl_wrong)
