"""The NVIDIA driver's plumbing and state: kernel modules loaded, device files present, the kernel module
matching the user-space driver, persistence mode, and the recovery action the driver asks for.

Sources (NVIDIA): the driver README ("Using the /proc File System Interface"; nvidia-modprobe(1) for the
device files); the Driver Persistence guide (without persistence the driver tears a GPU's state down when
its last client exits, so every job pays the initialisation again; NVIDIA recommends nvidia-persistenced);
the NVML API reference (nvmlDeviceGetPersistenceMode; NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver 565 and
later, through nvmlDeviceGetFieldValues; NVML_ERROR_LIB_RM_VERSION_MISMATCH from nvmlInit) and the GPU
memory error management guide's "recovery action flag". Verdicts are in rules/driver.yaml; this module
only reads and derives. Reads are file reads (detector/backends/system.py) and four NVML calls per GPU.
"""

from __future__ import annotations

from typing import Any

import pynvml

from detector.backends.nvmlcompat import constant as nvml_constant
from detector.backends.system import SystemInfo
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo, _optional, nvml_error_name
from detector.core.per_gpu import read_each_gpu
from detector.core.sweep import SweepContext
from detector.core.types import Observation

MISMATCH = "LibRmVersionMismatch"     # nvmlInit's NVML_ERROR_LIB_RM_VERSION_MISMATCH, as the inventory names it
_FIELD = nvml_constant("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
# nvmlDeviceGpuRecoveryAction_t -> (its name, the action gpu-npd recommends: detector/core/types.py ACTIONS).
RECOVERY_ACTIONS: dict[int, tuple[str, str]] = {
    nvml_constant("NVML_GPU_RECOVERY_ACTION_NONE"): ("NONE", "NONE"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_GPU_RESET"): ("GPU_RESET", "RESET_GPU"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_NODE_REBOOT"): ("NODE_REBOOT", "RESTART_BM"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_P2P"): ("DRAIN_P2P", "DRAIN_P2P"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET"): ("DRAIN_AND_RESET", "DRAIN_AND_RESET"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN"): ("RECOVER_IMEX_DOMAIN", "INSPECT"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_BUS_RESET"): ("BUS_RESET", "RESET_GPU"),
    nvml_constant("NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT"): ("SYSTEM_REBOOT", "RESTART_BM"),
}
_RESET_ACTIONS = {"RESET_GPU", "DRAIN_AND_RESET"}
NODE_FIELDS = ("plumbing", "nvml_status", "nvml_driver_version", "kernel_module_version", "kernel_module_flavor",
               "version_mismatch", "modules_missing", "modules_missing_count", "modules_conflicting",
               "modules_conflicting_count", "modules_optional", "device_files_missing",
               "device_files_missing_count", "gpus_registered")


class DriverCheck(Check):
    """One observation for the node (modules, device files, versions) and one per GPU (persistence,
    recovery action, its device file). What cannot be read here is null or "unknown", never healthy."""

    name = "driver"
    description = "NVIDIA kernel modules, device files, kernel module vs library version, persistence mode, " \
                  "and the recovery action the driver asks for"
    fields = {
        "scope": "node or gpu",
        # node
        "plumbing": "node: readable, or unknown (this container cannot see the host's /proc and /dev)",
        "nvml_status": "node: ok, or why nvmlInit failed (LibRmVersionMismatch, DriverNotLoaded, ...)",
        "nvml_driver_version": "node: the driver version NVML reports (null when NVML is unusable)",
        "kernel_module_version": "node: the loaded nvidia.ko's version, from /proc/driver/nvidia/version",
        "kernel_module_flavor": "node: open or proprietary kernel modules",
        "version_mismatch": "node: true when the kernel module and the user-space library differ (null: unknown)",
        "modules_missing": "node: required kernel modules not loaded, comma-separated ('' when none)",
        "modules_missing_count": "node: how many required kernel modules are not loaded (null: unknown)",
        "modules_conflicting": "node: conflicting modules loaded (nouveau), comma-separated",
        "modules_conflicting_count": "node: how many conflicting modules are loaded",
        "modules_optional": "node: optional modules and whether loaded (nvidia_peermem=loaded, ...)",
        "device_files_missing": "node: required /dev entries missing (nvidiactl, nvidia-uvm, nvidiaN ...)",
        "device_files_missing_count": "node: how many required /dev entries are missing (null: unknown)",
        "gpus_registered": "node: GPUs the driver registered (/proc/driver/nvidia/gpus)",
        # gpu
        "persistence_mode": "gpu: enabled, disabled or not_supported",
        "persistence_required": "gpu: the require_persistence setting",
        "persistence_on_others": "gpu: how many of the node's other GPUs run with persistence mode on (persistence "
                                 "off is a problem when the setting requires it, or when others have it)",
        "recovery_action": "gpu: the action the driver asks for, as a gpu-npd action (NONE, RESET_GPU, RESTART_BM, "
                           "DRAIN_P2P, DRAIN_AND_RESET, INSPECT), or unknown (driver before 565)",
        "recovery_action_nvml": "gpu: NVML's name for it (GPU_RESET, NODE_REBOOT, ...), or unknown",
        "retired_pages_pending": "gpu: a retired page waits for a reset (pre-Ampere; null where not applicable)",
        "remap_pending": "gpu: a row remapping waits for a reset (Ampere and later; null where not applicable)",
        "reset_required": "gpu: the driver needs a GPU reset (recovery action, pending retirement or remapping); "
                          "null when none of these can be read",
        "device_file": "gpu: its /dev entry (nvidiaN, N its minor number)",
        "device_file_present": "gpu: whether that entry exists (null: unknown)",
    }
    config_fields = {
        # Only what compute cannot work without: a real H100 node ran CUDA with nvidia and nvidia_uvm alone.
        "required_modules": ConfigField(list, ["nvidia", "nvidia_uvm"],
                                        "kernel modules that must be loaded (add nvidia_modeset, nvidia_drm or "
                                        "nvidia_peermem where this site's nodes need them)"),
        "optional_modules": ConfigField(list, ["nvidia_modeset", "nvidia_drm", "nvidia_peermem"],
                                        "kernel modules reported when loaded, never required"),
        "conflicting_modules": ConfigField(list, ["nouveau"], "kernel modules that must not be loaded"),
        "required_device_files": ConfigField(list, ["nvidiactl", "nvidia-uvm"],
                                             "/dev entries that must exist (besides each GPU's nvidiaN)"),
        # Persistence is off by the driver's default and jobs run without it (they wait for the GPU to initialise):
        # a site policy, not a fault, so it is judged only where a site asks for it.
        "require_persistence": ConfigField(bool, False,
                                           "report every GPU running without persistence mode (off by the "
                                           "driver's default; jobs run without it, each waiting for the GPU to "
                                           "initialise); without it, only GPUs whose node-mates have it on"),
    }
    gauges = {
        "gpu_npd_driver_modules_missing": GaugeSpec("modules_missing_count", "Required NVIDIA kernel modules not "
                                                    "loaded"),
        "gpu_npd_driver_device_files_missing": GaugeSpec("device_files_missing_count", "Required NVIDIA device "
                                                         "files missing"),
    }
    default_interval_s = 60.0
    default_timeout_s = 10.0

    def run(self, ctx: SweepContext) -> CheckOutput:
        info, error = _read_system(ctx)
        read = read_each_gpu(ctx.inventory.gpus, lambda gpu: _gpu_fields(ctx.host.nvml, gpu, info),
                             describe=nvml_error_name)
        gpus = [fields for _, fields in read.readings]
        node = self._node_fields(ctx, info, gpus)
        observations = [Observation(self.name, node)]
        # A node whose other GPUs run with persistence shows it is set up for it: one without it lost it
        # (a GPU reset or a driver reload drops the setting), whatever require_persistence says.
        enabled = sum(g["persistence_mode"] == "enabled" for g in gpus)
        required = {"persistence_required": bool(self.config["require_persistence"])}
        observations += [Observation(self.name, {**dict.fromkeys(self.fields), **_without_ids(f), **required,
                                                 "persistence_on_others": enabled - (f["persistence_mode"] == "enabled")},
                                     gpu.ref())
                         for gpu, f in read.readings]
        result = {"node": {k: v for k, v in node.items() if k in NODE_FIELDS}, "gpus": gpus}
        unreadable = list(info.errors) if info is not None else [error] if error else []
        if unreadable:
            result["node"]["unreadable"] = unreadable      # "unknown" in the fields, never a failed check
        return CheckOutput(observations, result, summary=_summary(node, gpus), error="; ".join(read.errors))

    def _node_fields(self, ctx: SweepContext, info: SystemInfo | None, gpus: list[dict[str, Any]]) -> dict[str, Any]:
        fields: dict[str, Any] = dict.fromkeys(self.fields)
        nvml_status = ctx.inventory.nvml_error or "ok"
        kernel = info.kernel_module_version if info is not None else None
        library = ctx.inventory.driver_version
        fields.update(scope="node", plumbing="unknown" if info is None or info.modules is None else "readable",
                      nvml_status=nvml_status, nvml_driver_version=library, kernel_module_version=kernel,
                      kernel_module_flavor=info.kernel_module_flavor if info is not None else None)
        if nvml_status == MISMATCH:
            fields["version_mismatch"] = True
        elif kernel and library:
            fields["version_mismatch"] = kernel != library
        if info is not None and info.modules is not None:
            missing = [m for m in self.config["required_modules"] if not info.loaded(m)]
            conflicting = [m for m in self.config["conflicting_modules"] if info.loaded(m)]
            fields.update(modules_missing=",".join(missing), modules_missing_count=len(missing),
                          modules_conflicting=",".join(conflicting), modules_conflicting_count=len(conflicting),
                          modules_optional=",".join(f"{m}={'loaded' if info.loaded(m) else 'not_loaded'}"
                                                    for m in self.config["optional_modules"]),
                          gpus_registered=len(info.gpu_minors or {}))
        if info is not None and info.device_files is not None:
            wanted = list(self.config["required_device_files"])
            wanted += [g["device_file"] for g in gpus if g["device_file"] and g["device_file"] not in wanted]
            missing_files = [name for name in wanted if name not in info.device_files]
            fields.update(device_files_missing=",".join(missing_files), device_files_missing_count=len(missing_files))
        return fields


def _without_ids(gpu_fields: dict[str, Any]) -> dict[str, Any]:
    """A GPU's result entry less its index and UUID, which its observation carries as its GpuRef."""
    return {k: v for k, v in gpu_fields.items() if k not in ("index", "uuid")}


def _read_system(ctx: SweepContext) -> tuple[SystemInfo | None, str]:
    """The plumbing, or None (with why, when it failed) where it cannot be read from here."""
    if ctx.host.system is None:
        return None, ""
    try:
        return ctx.host.system.read(), ""
    except Exception as e:  # noqa: BLE001 - an unreadable /proc is "unknown", never a failure of the node
        return None, f"driver plumbing unreadable: {type(e).__name__}: {e}"


def _gpu_fields(nvml: Any, gpu: GpuInfo, info: SystemInfo | None) -> dict[str, Any]:
    handle = gpu.handle
    mode = _optional(nvml.nvmlDeviceGetPersistenceMode, handle)
    nvml_name, action = _recovery_action(nvml, handle)
    retired = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    remap = _optional(nvml.nvmlDeviceGetRemappedRows, handle)
    retired_pending = None if retired is None else retired == pynvml.NVML_FEATURE_ENABLED
    remap_pending = None if remap is None else bool(remap[2])
    signals = [s for s in (retired_pending, remap_pending, None if action == "unknown" else action in _RESET_ACTIONS)
               if s is not None]
    minor = _optional(nvml.nvmlDeviceGetMinorNumber, handle)
    if minor is None and info is not None and gpu.pci_bus_id:
        minor = (info.gpu_minors or {}).get(gpu.pci_bus_id)
    device_file = f"nvidia{minor}" if minor is not None else None
    present = None
    if device_file and info is not None and info.device_files is not None:
        present = device_file in info.device_files
    return {"index": gpu.index, "uuid": gpu.uuid, "scope": "gpu",
            "persistence_mode": "not_supported" if mode is None else
            "enabled" if mode == pynvml.NVML_FEATURE_ENABLED else "disabled",
            "recovery_action": action, "recovery_action_nvml": nvml_name,
            "retired_pages_pending": retired_pending, "remap_pending": remap_pending,
            "reset_required": any(signals) if signals else None,
            "device_file": device_file, "device_file_present": present}


def _recovery_action(nvml: Any, handle: Any) -> tuple[str, str]:
    """(NVML's name, gpu-npd's action); ("unknown", "unknown") before driver 565 or where not supported."""
    try:
        value = nvml.nvmlDeviceGetFieldValues(handle, [_FIELD])[0]
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_InvalidArgument):
        return "unknown", "unknown"
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return "unknown", "unknown"
    return RECOVERY_ACTIONS.get(value.value.uiVal, (f"ACTION_{value.value.uiVal}", "INSPECT"))


def _summary(node: dict[str, Any], gpus: list[dict[str, Any]]) -> str:
    parts = [f"driver {node['nvml_driver_version'] or 'unknown'}"]
    if node["kernel_module_version"]:
        parts[0] += f", kernel module {node['kernel_module_version']} ({node['kernel_module_flavor']})"
    if node["nvml_status"] != "ok":
        parts.append(f"NVML {node['nvml_status']}")
    if node["plumbing"] == "unknown":
        parts.append("modules and device files unknown (host /proc, /dev not readable here)")
    else:
        parts.append(f"modules missing: {node['modules_missing'] or 'none'}")
        if node["device_files_missing_count"] is not None:
            parts.append(f"device files missing: {node['device_files_missing'] or 'none'}")
    if gpus:
        off = sum(g["persistence_mode"] == "disabled" for g in gpus)
        parts.append(f"persistence off on {off}/{len(gpus)} GPU(s)")
        actions = sorted({g["recovery_action"] for g in gpus} - {"NONE"})
        parts.append(f"recovery action {','.join(actions) if actions else 'none'}")
    return "; ".join(parts)
