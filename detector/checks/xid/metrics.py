"""The xid check's metric: the XID and SXid lines it saw, counted per GPU (or NVSwitch) and code."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from detector.core.check import CheckMetrics, gpu_labels
from detector.core.sweep import CheckRun


class XidMetrics(CheckMetrics):
    def __init__(self, registry: CollectorRegistry):
        self.lines = Counter("gpu_npd_xid", "XID and SXid lines seen, per GPU (or NVSwitch) and code",
                             ["kind", "code", "gpu", "pci_bus_id"], registry=registry)

    def export(self, run: CheckRun, when: float) -> None:
        """An incident adds its lines (`count`), so a flood of one XID counts every line it printed."""
        for obs in run.observations:
            gpu, bus = gpu_labels(obs)
            self.lines.labels(obs.fields.get("kind", ""), str(obs.fields.get("code", "")), gpu,
                              bus).inc(int(obs.fields.get("count") or 1))
