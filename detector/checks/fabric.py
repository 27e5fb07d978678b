"""NVLink fabric health on NVSwitch and multi-node NVLink systems: each GPU's registration with the fabric
and the health NVML reports for it, and whether the fabric manager runs where the node needs it.

What it follows:
- NVML API reference, nvmlDeviceGetGpuFabricInfo[V] ("for Hopper or newer fully supported devices";
  NotSupported before) and nvmlGpuFabricInfo_v2_t: `state` is the registration's progress (NOT_SUPPORTED,
  NOT_STARTED, IN_PROGRESS, COMPLETED) and `status` its result, "must be checked only if state returns
  complete". nvmlDeviceGetGpuFabricInfoV came with driver 550; older drivers have only the unversioned call.
  The caller passes ctypes.byref(struct): pynvml hands the pointer straight to the library.
- nvmlGpuFabricInfo_v3_t adds healthSummary to v2's healthMask; both are decoded in
  detector/backends/fabric_health.py (every field of the mask, each tri-state NOT_SUPPORTED 0 / TRUE 1 /
  FALSE 2: 0 is unknown, never healthy). A route or access-timeout recovery in progress is transient:
  it counts once seen for `recovery_debounce` seconds, and never in one snapshot.
- NVIDIA Fabric Manager user guide (docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide): on an
  NVSwitch system the fabric manager trains the NVSwitch and GPU NVLinks and registers the GPUs with the
  fabric; a CUDA application started before it has initialised the system, or when it failed to, fails
  to initialise with cudaErrorSystemNotReady, and a GPU that fails to register loses NVLink peer-to-peer.
  So a failed or never-finished registration, or no fabric manager on an NVSwitch node, is critical.
- NVSwitches are NVIDIA PCI devices of class 0x0680 (bridge, other) on the node's own PCI bus (HGX/DGX
  8-GPU baseboards); the fabric manager's process state comes from the driver-plumbing reader
  (detector/backends/system.py), and what it cannot read is "unknown", never "stopped".
Verdicts are in rules/fabric.yaml.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from typing import Any, Callable

import pynvml

from detector.backends.fabric_health import FabricHealth, decode
from detector.backends.nvmlcompat import GpuFabricInfo, GpuFabricInfoV2, GpuFabricInfoV3
from detector.backends.pci import nvswitch_count
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.per_gpu import read_each_gpu
from detector.core.sweep import SweepContext
from detector.core.types import Observation

STATES = {pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
          pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
          pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
          pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed"}
# nvmlReturn_t value -> its name without NVML_ (SUCCESS, ERROR_UNKNOWN ...), for the registration status.
RETURN_NAMES = {getattr(pynvml, n): n[len("NVML_"):] for n in dir(pynvml)
                if n == "NVML_SUCCESS" or n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)}
_NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


class FabricCheck(Check):
    """One observation per GPU (its fabric registration) and one for the node (NVSwitches and the fabric
    manager). GPUs and nodes without a fabric are reported as not_supported / not required."""

    name = "fabric"
    description = "NVSwitch fabric: each GPU's fabric registration (Hopper and later) and the fabric manager's presence"
    fields = {
        "scope": "gpu (one per GPU: its fabric registration) or node (NVSwitches and the fabric manager)",
        "fabric_state": "gpu: not_supported (no fabric: pre-Hopper GPU or no NVSwitch), not_started, in_progress "
                        "or completed",
        "fabric_status": "gpu: the registration's result once completed: SUCCESS or an NVML error name (null before)",
        "registered": "gpu: true when the registration completed with SUCCESS (null when not applicable)",
        "cluster_uuid": "gpu: the fabric cluster's UUID as nvidia-smi prints it (8-4-4-4-12 hex; '' when none)",
        "clique_id": "gpu: the fabric clique the GPU belongs to",
        "health_mask": "gpu: NVML's fabric health mask (null on drivers before 550)",
        "health_summary": "gpu: NVML's fabric health summary (v3 struct): healthy, unhealthy, limited_capacity "
                          "(null: not reported)",
        "degraded_bandwidth": "gpu: true when the health mask reports the GPU's fabric bandwidth degraded "
                              "(null: not reported, here and in the mask's other fields)",
        "route_recovery": "gpu: true while a fabric route recovery is in progress (transient)",
        "route_unhealthy": "gpu: true when the health mask reports a fabric route unhealthy",
        "access_timeout_recovery": "gpu: true while an access-timeout recovery is in progress (transient)",
        "incorrect_configuration": "gpu: none, or what the fabric found misconfigured: incorrect_sysguid, "
                                   "incorrect_chassis_sn, no_partition, insufficient_nvlinks, incompatible_gpu_fw, "
                                   "invalid_location, gpu_state_invalid",
        "partition_assigned": "gpu: whether the fabric assigned the GPU a partition",
        "gfm_state": "gpu: the global fabric manager as the GPU sees it: connected or disconnected",
        "recovering": "gpu: true while a route or access-timeout recovery is in progress",
        "recovery_s": "gpu: seconds this check has seen the recovery in progress (null in one snapshot or when "
                      "none is)",
        "recovery_held": "gpu: true once a recovery has been seen in progress for recovery_debounce seconds "
                         "(never in one snapshot: it cannot tell a transient from a held state)",
        "not_completed_s": "gpu: seconds this check has seen the registration unfinished (0 once completed; null "
                           "in one snapshot)",
        "one_snapshot": "gpu: judged from one saved snapshot (a replay): an unfinished registration counts as held",
        "nvswitches": "node: NVSwitch devices on the PCI bus (null: the bus could not be read)",
        "fabric_manager": "node: running, stopped, or unknown (not readable from here)",
        "fabric_manager_required": "node: true on an NVSwitch system (null: unknown)",
    }
    gauges = {
        "gpu_npd_fabric_registered": GaugeSpec("registered", "1 when the GPU is registered with the NVLink fabric"),
        "gpu_npd_nvswitches": GaugeSpec("nvswitches", "NVSwitch devices on the node's PCI bus"),
    }
    config_fields = {
        # As fabric-registration-stuck's 300 s: a route or access-timeout recovery the fabric finishes on
        # its own is over well within it, one that stays is a fault.
        "recovery_debounce": ConfigField(float, 300.0, "seconds a fabric route or access-timeout recovery must "
                                                       "stay in progress before it counts"),
    }
    default_interval_s = 60.0
    default_timeout_s = 10.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._unfinished_since: dict[str, float] = {}   # uuid -> when first seen not completed
        self._recovering_since: dict[str, float] = {}   # uuid -> when first seen recovering

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now = ctx.host.nvml, self._clock()
        snapshot = ctx.host.snapshot
        observations, gpus = [], []
        read = read_each_gpu(ctx.inventory.gpus, lambda gpu: _gpu_fields(nvml, gpu.handle))
        for gpu, fields in read.readings:
            key = gpu.uuid or str(gpu.index)
            fields["one_snapshot"] = snapshot
            if fields["fabric_state"] in ("not_started", "in_progress"):
                since = self._unfinished_since.setdefault(key, now)
                fields["not_completed_s"] = None if snapshot else round(now - since, 1)
            else:
                self._unfinished_since.pop(key, None)
                fields["not_completed_s"] = 0.0 if fields["fabric_state"] == "completed" else None
            fields.update(self._recovery(key, fields["recovering"], now, snapshot))
            observations.append(Observation(self.name, fields, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields})
        live = {g.uuid or str(g.index) for g in ctx.inventory.gpus}
        self._unfinished_since = {k: v for k, v in self._unfinished_since.items() if k in live}
        self._recovering_since = {k: v for k, v in self._recovering_since.items() if k in live}
        node, note = _node_fields(ctx)
        observations.append(Observation(self.name, node))
        result = {"node": {**node, **({"note": note} if note else {})}, "gpus": gpus}
        return CheckOutput(observations, result, summary=_summary(node, gpus), error="; ".join(read.errors))

    def _recovery(self, key: str, recovering: bool | None, now: float, snapshot: bool) -> dict[str, Any]:
        """How long a recovery has been seen in progress, and whether past the debounce."""
        if not recovering:
            self._recovering_since.pop(key, None)
            return {"recovery_s": None, "recovery_held": False if recovering is False else None}
        since = self._recovering_since.setdefault(key, now)
        if snapshot:
            return {"recovery_s": None, "recovery_held": False}
        held_s = round(now - since, 1)
        return {"recovery_s": held_s, "recovery_held": held_s >= float(self.config["recovery_debounce"])}


def _gpu_fields(nvml: Any, handle: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"scope": "gpu", "fabric_state": "not_supported", "fabric_status": None,
                              "registered": None, "cluster_uuid": "", "clique_id": None, "health_mask": None,
                              **_health_fields(None)}
    info, version = _fabric_info(nvml, handle)
    if info is None or info.state not in STATES or info.state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return fields
    fields["fabric_state"] = STATES[info.state]
    fields["clique_id"] = int(info.cliqueId)
    fields["cluster_uuid"] = str(uuid.UUID(bytes=bytes(info.clusterUuid))) if any(info.clusterUuid) else ""
    if info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        fields["fabric_status"] = RETURN_NAMES.get(info.status, f"ERROR_{info.status}")
        fields["registered"] = info.status == pynvml.NVML_SUCCESS
    else:
        fields["registered"] = False
    if version >= 2:
        fields["health_mask"] = int(info.healthMask)
        fields.update(_health_fields(decode(int(info.healthMask), int(info.healthSummary) if version >= 3 else None)))
    return fields


def _health_fields(health: FabricHealth | None) -> dict[str, Any]:
    h = health or FabricHealth()
    return {"health_summary": h.summary, "degraded_bandwidth": h.degraded_bandwidth,
            "route_recovery": h.route_recovery, "route_unhealthy": h.route_unhealthy,
            "access_timeout_recovery": h.access_timeout_recovery,
            "incorrect_configuration": h.incorrect_configuration, "partition_assigned": h.partition_assigned,
            "gfm_state": h.gfm_state, "recovering": h.recovering}


def _fabric_info(nvml: Any, handle: Any) -> tuple[Any, int]:
    """(struct, version): v3 (health summary, drivers of the 570+ era), else v2 (health mask, driver 550+),
    else the original call (version 1); (None, 0) when the GPU or driver has no fabric probe. A driver
    that knows an older struct than asked answers ARGUMENT_VERSION_MISMATCH."""
    call = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if call is not None:
        for struct, version in ((GpuFabricInfoV3, 3), (GpuFabricInfoV2, 2)):
            info = struct()           # the header's layout: some bindings' own is wrong
            try:
                call(handle, ctypes.byref(info))
                return info, version
            except pynvml.NVMLError_NotSupported:
                return None, 0
            except pynvml.NVMLError as e:
                if e.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
                    continue
                if e.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                break
    legacy = GpuFabricInfo()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(legacy))
    except _NOT_HERE:
        return None, 0
    return legacy, 1


def _node_fields(ctx: SweepContext) -> tuple[dict[str, Any], str]:
    note = ""
    try:
        # a snapshot's bus lists its GPUs only: NVSwitches unknown, never "none"
        nvswitches: int | None = None if ctx.host.snapshot else nvswitch_count(ctx.host.pci)
    except OSError as e:
        nvswitches, note = None, f"PCI bus unreadable: {e}"
    running: bool | None = None
    if ctx.host.system is not None:
        try:
            running = ctx.host.system.read().fabric_manager_running
        except Exception as e:  # noqa: BLE001 - an unreadable /proc is "unknown", never a failure
            note = "; ".join(filter(None, [note, f"fabric manager state unreadable: {type(e).__name__}: {e}"]))
    manager = "unknown" if running is None else "running" if running else "stopped"
    required = None if nvswitches is None else nvswitches > 0
    return {"scope": "node", "nvswitches": nvswitches, "fabric_manager": manager,
            "fabric_manager_required": required}, note


def _summary(node: dict[str, Any], gpus: list[dict[str, Any]]) -> str:
    by_state: dict[str, int] = {}
    for g in gpus:
        state = g["fabric_state"] if g["registered"] is not False or g["fabric_state"] != "completed" else "failed"
        by_state[state] = by_state.get(state, 0) + 1
    states = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(by_state.items())) or "no GPU"
    if node["nvswitches"] == 0 and all(g["fabric_state"] == "not_supported" for g in gpus):
        return f"no NVSwitch fabric (not supported); fabric manager {node['fabric_manager']}"
    switches = "unknown" if node["nvswitches"] is None else node["nvswitches"]
    return f"{switches} NVSwitches, fabric manager {node['fabric_manager']}; GPU registration: {states}"
