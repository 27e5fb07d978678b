"""Fake NVML calls of the nvlink and fabric checks: NVLink state and error counters, GPU fabric state.
Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu and `node` the FakeNode.

What real NVML does, and so what this fake does:
- nvmlDeviceGetNvLinkState: NotSupported on a GPU without NVLink; InvalidArgument for a link index the
  GPU does not have (the NVML API reference: "NVML_ERROR_INVALID_ARGUMENT if device or link is invalid";
  GB200 answers so for links 18..35 of NVML_NVLINK_MAX_LINKS = 36, NVIDIA/TensorRT-LLM#17060).
- error counters: from driver 525 (Hopper) per link through nvmlDeviceGetFieldValues with
  NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY / _RECOVERY / _CRC and scopeId = link, which replaced the per-lane
  field ids; nvmlDeviceGetNvLinkErrorCounter still answers before Blackwell, which dropped it and the
  DL_* field ids (NVML change log, v520->v525 and v560->v565). Each field value carries its own return.
- nvmlDeviceGetGpuFabricInfo[V]: "for Hopper or newer fully supported devices", NotSupported before; the
  caller passes ctypes.byref(struct) as pynvml's wrapper hands the pointer straight to the library.
  The versioned call fills v2's healthMask and, asked for v3, its healthSummary: healthy as a driver-580
  GB200/GB300 tray reports it once registered, 0 (not supported) before; a fabric_health fault sets any
  of the mask's fields and the summary on one GPU.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from dataclasses import asdict, replace
from typing import Any

import pynvml

from detector.backends.fabric_health import CONFIGURATIONS, HEALTHY, FabricHealth, encode, summarise
from detector.backends.nvmlcompat import constant as nvml_constant
from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.node import FakeGpu, FakeNode, NodeState

COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")        # FakeGpu.nvlink_errors / nvlink_rising names
_LEGACY = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
           pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data"}
_FIELDS = {pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: "recovery",
           pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: "crc_flit"}
def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


# -- the GPU's NVLink state over node time ----------------------------------------------------------


def link_down(gpu: FakeGpu, link: int, now_s: float) -> bool:
    """Down for good (nvlink_down), or in the down part of a flap's period."""
    if link in gpu.nvlinks_down:
        return True
    for flap in gpu.nvlink_flaps:
        if flap["link"] == link and now_s >= flap["since_s"]:
            if (now_s - flap["since_s"]) % flap["period_s"] < flap["down_s"]:
                return True
    return False


def error_count(gpu: FakeGpu, link: int, counter: str, now_s: float) -> int:
    """A counter now: what was added, what a rising fault has added since it began, and for recovery one
    retrain per flap period begun (each time a flapping link comes back it went through recovery)."""
    total = float(gpu.nvlink_errors.get(f"{link}/{counter}", 0))
    for rise in gpu.nvlink_rising:
        if rise["link"] == link and rise["counter"] == counter:
            total += max(0.0, now_s - rise["since_s"]) * rise["per_min"] / 60
    if counter == "recovery":
        for flap in gpu.nvlink_flaps:
            if flap["link"] == link and now_s >= flap["since_s"]:
                total += (now_s - flap["since_s"]) // flap["period_s"]
    return int(total)


def fabric_of(gpu: FakeGpu, state: NodeState) -> tuple[int, int]:
    """(state, status) of the GPU's fabric registration: completed on a node with NVSwitches unless a fault
    says otherwise; a fabric-capable GPU without NVSwitches has no fabric to join (NOT_SUPPORTED)."""
    if gpu.fabric_state is not None:
        return gpu.fabric_state, gpu.fabric_status
    if not state.nvswitches and not gpu.model.multinode_nvlink:
        return pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, pynvml.NVML_SUCCESS
    return pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset or reboot: NVLink error counters start again at 0 (they count since the driver loaded
    the GPU), faults driving them stop, and the GPU registers with the fabric afresh. Repairing the whole
    node starts the fabric manager again."""
    for g in gpus:
        g.nvlink_errors, g.nvlink_rising, g.nvlink_flaps = {}, [], []
        g.fabric_state, g.fabric_status, g.fabric_health = None, pynvml.NVML_SUCCESS, None
    if whole_node:
        state.fabric_manager_running = True


class NvlinkCalls:
    """Mixed into FakeNvml, which supplies `_device(handle)`, `_state()` and `node`."""

    def _now_s(self) -> float:
        return self.node.elapsed_s()    # type: ignore[attr-defined]

    def _nvlink_gpu(self, handle: Any, link: Any) -> FakeGpu:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if gpu.model.nvlink_links == 0:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(link, int) or not 0 <= link < gpu.model.nvlink_links:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._nvlink_gpu(handle, link)
        return pynvml.NVML_FEATURE_DISABLED if link_down(gpu, link, self._now_s()) else pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._nvlink_gpu(handle, link)
        if counter == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA:
            return 0
        if counter not in _LEGACY:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return error_count(gpu, link, _LEGACY[counter], self._now_s())

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """Every requested field, each with its own nvmlReturn, as pynvml's ctypes array. Only the NVLink
        fields are served; any other answers NotSupported in its slot (the call itself succeeds)."""
        gpu = self._device(handle)   # type: ignore[attr-defined]
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now, stamp = self._now_s(), int(time.time() * 1e6)
        for slot, requested in zip(values, fieldIds):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            slot.fieldId, slot.scopeId, slot.timestamp, slot.latencyUsec = field_id, scope, stamp, 0
            slot.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            slot.nvmlReturn = pynvml.NVML_SUCCESS
            if field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                slot.valueType, slot.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, gpu.model.nvlink_links
            elif field_id in _FIELDS and gpu.model.nvlink_links == 0:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif field_id in _FIELDS and not 0 <= scope < gpu.model.nvlink_links:
                slot.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
            elif field_id in _FIELDS:
                slot.value.ullVal = error_count(gpu, scope, _FIELDS[field_id], now)
            else:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    # -- fabric ----------------------------------------------------------------------------------

    def _fill_fabric(self, handle: Any, pointer: Any, versioned: bool) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        info = _pointee(pointer)
        if not gpu.model.fabric_probe:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if versioned and info.version not in (nvml_constant("nvmlGpuFabricInfo_v2"),
                                              nvml_constant("nvmlGpuFabricInfo_v3")):
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        state, status = fabric_of(gpu, self._state())   # type: ignore[attr-defined]
        node = self._state()   # type: ignore[attr-defined]
        info.state, info.status, info.cliqueId = state, status, node.fabric_clique_id
        ctypes.memset(ctypes.addressof(info.clusterUuid), 0, nvml_constant("NVML_GPU_FABRIC_UUID_LEN"))
        if node.fabric_cluster_uuid and state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
            ctypes.memmove(ctypes.addressof(info.clusterUuid), uuid.UUID(node.fabric_cluster_uuid).bytes,
                           nvml_constant("NVML_GPU_FABRIC_UUID_LEN"))
        if versioned:
            done = state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
            mask, summary = encode(FabricHealth(**gpu.fabric_health) if gpu.fabric_health is not None
                                   else HEALTHY) if done else (0, 0)
            info.healthMask = mask
            if info.version == nvml_constant("nvmlGpuFabricInfo_v3"):
                info.healthSummary = summary
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, gpuFabricInfo: Any) -> int:
        return self._fill_fabric(handle, gpuFabricInfo, versioned=False)

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, gpuFabricInfo: Any) -> int:
        return self._fill_fabric(handle, gpuFabricInfo, versioned=True)


def _pointee(pointer: Any) -> Any:
    """The struct behind ctypes.byref(...) or ctypes.pointer(...). A struct passed by value would reach
    the real library as garbage, so the fake refuses it."""
    obj = getattr(pointer, "_obj", None)          # ctypes.byref
    if obj is None and isinstance(pointer, ctypes._Pointer):
        obj = pointer.contents
    if not isinstance(obj, ctypes.Structure):
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return obj


# -- faults (declared in FAULTS below; node time from node.elapsed_s()) --------------------------------


def nvlink_errors(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """An error counter of one link jumps by `add` and/or rises `per_min` from now on."""
    assert gpu is not None
    link, counter = f.params["link"], f.params["counter"]
    if counter not in COUNTERS:
        raise ValueError(f"fault 'nvlink_errors': counter must be one of {', '.join(COUNTERS)}, got {counter!r}")
    key = f"{link}/{counter}"
    gpu.nvlink_errors[key] = gpu.nvlink_errors.get(key, 0) + f.params.get("add", 0)
    if f.params.get("per_min"):
        gpu.nvlink_rising.append({"link": link, "counter": counter, "per_min": float(f.params["per_min"]),
                                  "since_s": node.elapsed_s()})


def nvlink_flap(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """One link goes down for `down_s` at the start of every `period_s` from now on, retraining each time."""
    assert gpu is not None
    period, down = float(f.params.get("period_s", 120.0)), float(f.params.get("down_s", 20.0))
    if not 0 < down < period:
        raise ValueError("fault 'nvlink_flap': needs 0 < down_s < period_s")
    gpu.nvlink_flaps.append({"link": f.params["link"], "period_s": period, "down_s": down,
                             "since_s": node.elapsed_s()})


def fabric_failed(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The GPU's fabric registration completed with an error status (an nvmlReturn_t)."""
    assert gpu is not None
    gpu.fabric_state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    gpu.fabric_status = f.params.get("status", pynvml.NVML_ERROR_UNKNOWN)


_SUMMARIES = ("auto", "healthy", "unhealthy", "limited_capacity", "not_supported")
_CONFIGURATIONS = tuple(CONFIGURATIONS.values())


def fabric_health(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The GPU's fabric health mask and summary report what the fault names; the rest stays healthy."""
    assert gpu is not None
    p = f.params
    summary, bandwidth = p.get("summary", "auto"), p.get("bandwidth", "full")
    config = p.get("incorrect_config", "none")
    for name, value, allowed in (("summary", summary, _SUMMARIES), ("bandwidth", bandwidth, ("full", "degraded")),
                                 ("incorrect_config", config, _CONFIGURATIONS)):
        if value not in allowed:
            raise ValueError(f"fault 'fabric_health': {name} must be one of {', '.join(allowed)}, got {value!r}")
    health = FabricHealth(degraded_bandwidth=bandwidth == "degraded",
                          route_recovery=bool(p.get("route_recovery", False)),
                          route_unhealthy=bool(p.get("route_unhealthy", False)),
                          access_timeout_recovery=bool(p.get("access_timeout", False)),
                          incorrect_configuration=config)
    named = {"auto": summarise(health), "not_supported": None}.get(summary, summary)
    gpu.fabric_health = asdict(replace(health, summary=named))


_UNFINISHED = {"not_started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
               "in_progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS}


def fabric_unfinished(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The fabric registration of one GPU (or, without a gpu, every GPU) stays not started / in progress."""
    name = f.params.get("state", "not_started")
    if name not in _UNFINISHED:
        raise ValueError(f"fault 'fabric_not_started': state must be not_started or in_progress, got {name!r}")
    for g in [gpu] if gpu is not None else state.gpus:
        g.fabric_state, g.fabric_status = _UNFINISHED[name], pynvml.NVML_SUCCESS


def fabric_manager_stopped(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    state.fabric_manager_running = False


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("nvlink_errors", True, {"link": int, "counter": str, "add": int, "per_min": float}, ("link", "counter"),
              nvlink_errors, "an NVLink error counter (replay, recovery, crc_flit, crc_data) jumps by add "
              "and/or rises per_min from now until a reset"),
    FaultKind("nvlink_flap", True, {"link": int, "period_s": float, "down_s": float}, ("link",), nvlink_flap,
              "an NVLink goes down for down_s (default 20) at the start of every period_s (default 120), "
              "retraining (a recovery) each time, until a reset"),
    FaultKind("fabric_failed", True, {"status": int}, (), fabric_failed,
              "the GPU's NVLink fabric registration completes with an error status (an nvmlReturn_t, default "
              "999 Unknown): it loses NVLink peer-to-peer"),
    FaultKind("fabric_health", True, {"summary": str, "bandwidth": str, "route_recovery": bool,
                                      "route_unhealthy": bool, "access_timeout": bool, "incorrect_config": str},
              (), fabric_health,
              "the GPU's NVLink fabric health (NVML's health mask and v3 summary): bandwidth full|degraded, "
              "route_recovery / route_unhealthy / access_timeout true|false, incorrect_config none|"
              + "|".join(_CONFIGURATIONS[1:]) + ", summary auto (from the rest)|healthy|unhealthy|"
              "limited_capacity|not_supported; a reset clears it"),
    FaultKind("fabric_not_started", False, {"state": str}, (), fabric_unfinished,
              "the fabric registration of a GPU (every GPU without gpu) stays not_started (default) or in_progress"),
    FaultKind("fabric_manager_stopped", False, {}, (), fabric_manager_stopped,
              "nv-fabricmanager stops (recover without a gpu, or reboot, starts it again)"),
)
