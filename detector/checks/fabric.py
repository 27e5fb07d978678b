"""NVLink fabric health on NVSwitch systems: each GPU's registration with the fabric, and whether the
fabric manager runs where the node needs it.

What it follows:
- NVML API reference, nvmlDeviceGetGpuFabricInfo[V] ("for Hopper or newer fully supported devices";
  NotSupported before) and nvmlGpuFabricInfo_v2_t: `state` is the registration's progress (NOT_SUPPORTED,
  NOT_STARTED, IN_PROGRESS, COMPLETED) and `status` its result, "must be checked only if state returns
  complete". nvmlDeviceGetGpuFabricInfoV came with driver 550; older drivers have only the unversioned call.
  The caller passes ctypes.byref(struct): pynvml hands the pointer straight to the library.
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
from typing import Any, Callable

import pynvml

from detector.backends.nvmlcompat import GpuFabricInfo, GpuFabricInfoV2, constant as nvml_constant
from detector.backends.pci import nvswitch_count
from detector.core.check import Check, CheckOutput, GaugeSpec
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
        "cluster_uuid": "gpu: the fabric cluster's UUID, hex ('' when none)",
        "clique_id": "gpu: the fabric clique the GPU belongs to",
        "health_mask": "gpu: NVML's fabric health mask (null on drivers before 550)",
        "degraded_bandwidth": "gpu: true when the health mask reports the GPU's fabric bandwidth degraded "
                              "(null: not reported)",
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
    default_interval_s = 60.0
    default_timeout_s = 10.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._unfinished_since: dict[str, float] = {}   # uuid -> when first seen not completed

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
            observations.append(Observation(self.name, fields, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields})
        live = {g.uuid or str(g.index) for g in ctx.inventory.gpus}
        self._unfinished_since = {k: v for k, v in self._unfinished_since.items() if k in live}
        node, note = _node_fields(ctx)
        observations.append(Observation(self.name, node))
        result = {"node": {**node, **({"note": note} if note else {})}, "gpus": gpus}
        return CheckOutput(observations, result, summary=_summary(node, gpus), error="; ".join(read.errors))


def _gpu_fields(nvml: Any, handle: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"scope": "gpu", "fabric_state": "not_supported", "fabric_status": None,
                              "registered": None, "cluster_uuid": "", "clique_id": None, "health_mask": None,
                              "degraded_bandwidth": None}
    info, versioned = _fabric_info(nvml, handle)
    if info is None or info.state not in STATES or info.state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return fields
    fields["fabric_state"] = STATES[info.state]
    fields["clique_id"] = int(info.cliqueId)
    fields["cluster_uuid"] = bytes(info.clusterUuid).hex() if any(info.clusterUuid) else ""
    if info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        fields["fabric_status"] = RETURN_NAMES.get(info.status, f"ERROR_{info.status}")
        fields["registered"] = info.status == pynvml.NVML_SUCCESS
    else:
        fields["registered"] = False
    if versioned:
        fields["health_mask"] = int(info.healthMask)
        bw = (info.healthMask >> nvml_constant("NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW")) \
            & nvml_constant("NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW")
        fields["degraded_bandwidth"] = {nvml_constant("NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE"): True,
                                        nvml_constant("NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE"): False}.get(bw)
    return fields


def _fabric_info(nvml: Any, handle: Any) -> tuple[Any, bool]:
    """(struct, versioned) from the versioned call (driver 550+), else the original one; (None, False) when
    the GPU or driver has no fabric probe."""
    call = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if call is not None:
        info = GpuFabricInfoV2()      # the header's layout: some bindings' own is wrong
        try:
            call(handle, ctypes.byref(info))
            return info, True
        except pynvml.NVMLError_NotSupported:
            return None, False
        except pynvml.NVMLError as e:
            if e.value not in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                raise
    legacy = GpuFabricInfo()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(legacy))
    except _NOT_HERE:
        return None, False
    return legacy, False


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
