"""The NCCL probe's metrics: the last probe's bus bandwidth, wrong values, success and time.

They are made on the probe's first run: a node where it is off (the default) exports none of them,
rather than zeros that read like a failed or empty measurement."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from detector.core.check import CheckMetrics
from detector.core.sweep import CheckRun


class NcclMetrics(CheckMetrics):
    def __init__(self, registry: CollectorRegistry):
        self.busbw = Gauge("gpu_npd_nccl_bus_bandwidth_gbps", "All-reduce bus bandwidth of the last NCCL probe "
                           "that measured, GB/s (stat: avg or min)", ["stat"], registry=registry)
        self.wrong = Gauge("gpu_npd_nccl_wrong_values", "Values the last NCCL probe got wrong", registry=registry)
        self.ok = Gauge("gpu_npd_nccl_probe_success", "1 when the last NCCL probe measured with no wrong "
                        "values, 0 when it failed, hung or got values wrong", registry=registry)
        self.last = Gauge("gpu_npd_nccl_probe_timestamp_seconds", "When the last NCCL probe ran (not skipped)",
                          registry=registry)

    def export(self, run: CheckRun, when: float) -> None:
        probe = run.result
        if not probe:
            return
        self.last.set(when)
        measured = probe.get("status") == "ok"
        self.ok.set(1 if measured and not probe.get("wrong") else 0)
        if measured:
            for stat in ("avg", "min"):
                if probe.get(f"{stat}_busbw_gbps") is not None:
                    self.busbw.labels(stat).set(probe[f"{stat}_busbw_gbps"])
            self.wrong.set(probe.get("wrong") or 0)
