"""Can every GPU the node has actually be used? The PCI bus (what is plugged in), NVML (what the
driver offers) and `nvidia-smi -L` (what tools see) should tell the same story; where they do not,
the bus ids that differ are named. A bus id only nvidia-smi names (it cannot open a GPU that neither
NVML nor the PCI bus lists, as after a GPU dropped off a passthrough VM's bus) is a GPU of its own,
never dropped.

NVML answering slowly for one GPU is the same failure earlier: every NVML call is timed per GPU (the host's
TimedNvml), and each GPU's p95 over the window is set beside its same-model siblings' (detector/checks/
latency.py), so a GPU whose calls take seconds while its siblings answer in microseconds is named before its
calls hang."""

from __future__ import annotations

import time
from typing import Any, Callable

from detector.backends.nvml_timing import TimedNvml
from detector.backends.pci import PciDevice
from detector.backends.smi_listing import SmiListing, parse_smi_list
from detector.checks.latency import LatencyWindow, Timed, latency_fields, node_fields
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.deadline import Hung, call_with_deadline
from detector.core.inventory import GpuInfo, Inventory, nvml_error_name
from detector.core.sweep import SweepContext
from detector.core.types import GpuRef, Observation


RECHECK_TIMEOUT_S = 2.0      # NVML asked once more about a GPU nvidia-smi -L did not list (one call)

# A GPU's latency fields where nothing was timed for it (not in NVML, or the host's NVML is not timed).
_UNTIMED: dict[str, Any] = {"nvml_calls": 0, "nvml_p95_s": None, "nvml_max_s": None, "nvml_latency_ready": False,
                            "nvml_siblings": 0, "nvml_siblings_p95_s": None, "nvml_slowdown": None}


class VisibilityCheck(Check):
    name = "visibility"
    description = "expected GPUs (config or PCI bus) vs NVML vs nvidia-smi -L, naming missing bus ids"
    fields = {
        # one observation per GPU
        "pci_bus_id": "the GPU's bus id, 0000:bb:dd.f",
        "on_pci": "the GPU is on the PCI bus",
        "driver": "kernel driver bound to it on the PCI bus ('' when none)",
        "in_nvml": "NVML enumerates it and answers for it (null when NVML is unusable)",
        "nvml_error": "the NVML error for this GPU (GpuIsLost, Hung, ...), '' when none",
        "in_smi": "nvidia-smi -L lists it; false when it named this GPU as failing or a complete listing "
                  "left it out; null when it did not run, or its listing was not clean and did not name it",
        "smi_error": "what nvidia-smi printed about it (or about itself, on the node observation)",
        # one observation for the node
        "expected_gpus": "GPUs expected: the configured count, else NVIDIA GPUs on the PCI bus",
        "pci_gpus": "NVIDIA GPUs on the PCI bus (null when the bus could not be read)",
        "nvml_gpus": "GPUs NVML enumerates",
        "usable_gpus": "GPUs NVML answers for without error",
        "nvml_status": "ok, or why NVML as a whole is unusable (DriverNotLoaded, Hung, ...)",
        "smi_status": "ok (a complete listing: exit 0, no error line), partial (it listed or named GPUs but "
                      "exited non-zero or printed an error line: GPUs it neither listed nor named are not "
                      "judged), failed (no GPU listed or named), timeout, not_found, error or disabled",
        "smi_reason": "why nvidia-smi failed, from its messages, else its exit code (nvidia-smi(1)): "
                      "driver_not_loaded, no_devices, version_mismatch, nvml_init_failed, library_not_found, "
                      "gpu_lost, not_found, no_permission, inforom_corrupted, unknown_error, ... ('' when ok)",
        "smi_gpus": "GPUs nvidia-smi -L listed",
        # NVML call latency: on each GPU observation (null or 0 where the host's NVML is not timed)
        "nvml_calls": "NVML calls on this GPU timed in the window",
        "nvml_p95_s": "95th percentile of their durations, seconds (null: none timed)",
        "nvml_max_s": "the slowest of them, seconds",
        "nvml_latency_ready": "true once the window holds nvml_latency_min_calls calls: the latency is judged",
        "nvml_siblings": "same-model GPUs NVML answers for with a ready window, compared with (0: none)",
        "nvml_siblings_p95_s": "the median of those siblings' p95 (the upper one of an even count), seconds "
                               "(null when none)",
        "nvml_slowdown": "nvml_p95_s / nvml_siblings_p95_s (null when no sibling)",
        # and on the node observation
        "nvml_timed": "the host's NVML calls are timed per GPU (false for a replayed capture)",
        "nvml_gpus_timed": "GPUs NVML answers for with a ready latency window",
        "nvml_median_p95_s": "the lower median of their p95, seconds: high only when more than half of them "
                             "are slow (the driver or the host, not one GPU); null when none is ready",
    }
    config_fields = {
        "expected_gpus": ConfigField(int, 0, "GPUs this node must have; 0 = as many as are on the PCI bus"),
        "nvidia_smi": ConfigField(bool, True, "also compare with nvidia-smi -L"),
        "smi_timeout": ConfigField(float, 10.0, "seconds before nvidia-smi counts as hung"),
        "nvml_latency_window": ConfigField(float, 300.0, "seconds of NVML call durations judged per GPU"),
        "nvml_latency_min_calls": ConfigField(int, 20, "calls a GPU's window must hold before its latency is "
                                              "judged (a sweep makes about 100 per GPU, the inventory 13)"),
    }
    # p95 and max over the window, one series each per GPU: bounded cardinality at fleet scale, and a histogram
    # of every call would cost ~10 series per GPU for a signal judged on its tail.
    gauges = {
        "gpu_npd_gpu_nvml_call_p95_seconds": GaugeSpec("nvml_p95_s", "95th percentile of the duration of the NVML "
                                                       "calls on this GPU over the visibility check's window"),
        "gpu_npd_gpu_nvml_call_max_seconds": GaugeSpec("nvml_max_s", "The slowest NVML call on this GPU over the "
                                                       "visibility check's window"),
    }
    default_interval_s = 60.0
    default_timeout_s = 20.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._latency = LatencyWindow(self.config["nvml_latency_window"], clock)
        # bus id -> UUID from earlier runs: a GPU that falls off the bus can no longer tell NVML its UUID,
        # and the message about it should still carry it (bounded by the GPUs a node can hold).
        self._uuids: dict[str, str] = {}

    def run(self, ctx: SweepContext) -> CheckOutput:
        pci, pci_error = ctx.pci_gpus, ctx.pci_error
        smi = self._smi(ctx)
        inv = ctx.inventory
        if len(self._uuids) < 1024:
            self._uuids.update({g.pci_bus_id: g.uuid for g in inv.gpus if g.pci_bus_id and g.uuid})
        by_bus = inv.by_bus_id()
        bus_ids = sorted({d.bus_id for d in pci or []} | set(by_bus) | set(smi.errors))
        pci_by_bus = {d.bus_id: d for d in pci or []}

        observations = [self._gpu_observation(b, pci_by_bus.get(b), by_bus.get(b), inv, smi, ctx) for b in bus_ids]
        timed, node_latency = self._time_gpus(ctx)
        for obs in observations:
            if obs.gpu is not None and obs.gpu.pci_bus_id in timed:
                obs.fields.update(timed[obs.gpu.pci_bus_id])
        expected = self.config["expected_gpus"] or (len(pci) if pci is not None else None)
        node = {
            "expected_gpus": expected,
            "pci_gpus": len(pci) if pci is not None else None,
            "nvml_gpus": len(inv.gpus) if inv.nvml_error is None else None,
            "usable_gpus": sum(1 for g in inv.gpus if g.error is None) if inv.nvml_error is None else None,
            "nvml_status": inv.nvml_error or "ok",
            "smi_status": smi.status,
            "smi_reason": smi.reason,
            "smi_gpus": len(smi.uuids) if smi.status in ("ok", "partial") else None,
            "smi_error": smi.detail,
            "nvml_timed": isinstance(ctx.host.nvml, TimedNvml),
            "nvml_gpus_timed": 0, "nvml_median_p95_s": None, **node_latency,
        }
        observations.append(Observation(self.name, node))
        known = set(pci_by_bus) | set(by_bus)
        result = {**node, "pci_error": pci_error,
                  "missing_bus_ids": [o.gpu.pci_bus_id for o in observations
                                      if o.gpu and o.fields["in_nvml"] is False],
                  "smi_only_bus_ids": sorted(set(smi.errors) - known)}
        return CheckOutput(observations, result)

    def _gpu_observation(self, bus_id: str, dev: PciDevice | None, info: GpuInfo | None, inv: Inventory,
                         smi: SmiListing, ctx: SweepContext) -> Observation:
        nvml_ok = inv.nvml_error is None
        in_nvml = (info is not None and info.error is None) if nvml_ok else None
        in_smi = smi.in_smi(info.uuid if info else None, bus_id) if smi.status in ("ok", "partial") else None
        nvml_error = (info.error or "") if info else ""
        if in_nvml and in_smi is False and info is not None:
            nvml_error = _nvml_error_now(ctx, info)       # fell off between NVML's read and nvidia-smi's?
            in_nvml = not nvml_error
        fields: dict[str, Any] = {
            "pci_bus_id": bus_id,
            "on_pci": dev is not None,
            "driver": (dev.driver or "") if dev else "",
            "in_nvml": in_nvml,
            "nvml_error": nvml_error,
            "in_smi": in_smi,
            "smi_error": smi.errors.get(bus_id, ""),
            **_UNTIMED,
        }
        # A GPU NVML does not enumerate has no index: NVML numbers only the GPUs it sees, so its PCI-order
        # position is another GPU's index whenever a GPU before the last is missing. Its bus id names it.
        uuid = (info.uuid if info else None) or self._uuids.get(bus_id)
        return Observation(self.name, fields, GpuRef(info.index if info else None, uuid, bus_id))

    def _time_gpus(self, ctx: SweepContext) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Each GPU's latency fields by bus id, and the node's, after taking the calls timed since the last run
        into the window; none where the host's NVML is not timed."""
        nvml = ctx.host.nvml
        if not isinstance(nvml, TimedNvml):
            return {}, {}
        gpus = [g for g in ctx.inventory.gpus if g.pci_bus_id]
        by_key = {nvml.device_key(g.handle): g.pci_bus_id for g in gpus if g.handle is not None}
        # A GPU whose inventory read missed its deadline has no handle, but its calls go on and return (slowly):
        # they are its by the index it was opened by, so its latency is still shown (judged as hung, above).
        unopened = {g.index: g.pci_bus_id for g in gpus if g.handle is None}
        for key, durations in nvml.times.drain().items():
            bus_id = by_key.get(key) or unopened.get(nvml.opened_index(key))
            if bus_id is not None:          # a GPU the inventory no longer sees: its calls are not judged
                self._latency.add(bus_id, durations)
        self._latency.keep_only({g.pci_bus_id for g in gpus if g.pci_bus_id})
        timed = {g.pci_bus_id: Timed(g.name, g.error is None, self._latency.latency(g.pci_bus_id))
                 for g in gpus if g.pci_bus_id}
        min_calls = self.config["nvml_latency_min_calls"]
        return latency_fields(timed, min_calls), node_fields(timed, min_calls)

    def _smi(self, ctx: SweepContext) -> SmiListing:
        if not self.config["nvidia_smi"]:
            return SmiListing("disabled")
        outcome = ctx.host.smi.run(["-L"], self.config["smi_timeout"])
        if outcome.status != "ok":
            return SmiListing(outcome.status, detail=outcome.detail)
        return parse_smi_list(outcome.returncode or 0, outcome.stdout + "\n" + outcome.stderr)


def _nvml_error_now(ctx: SweepContext, info: GpuInfo) -> str:
    """NVML's error for a GPU it read at the sweep's start but nvidia-smi, run after, does not list ("" when it
    still answers): a GPU that fell off the bus in between is judged by what NVML says of it now
    (GpuIsLost), not as a disagreement of the two tools. One call, bounded: a hung one changes nothing."""
    if info.handle is None:
        return ""
    try:
        call_with_deadline(lambda: ctx.host.nvml.nvmlDeviceGetUUID(info.handle), RECHECK_TIMEOUT_S, "nvml-recheck")
    except Hung:
        return ""
    except Exception as e:  # noqa: BLE001 - NVMLError mostly; any failure is what NVML says of the GPU now
        return nvml_error_name(e)
    return ""
