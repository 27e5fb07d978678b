"""The fake NVML's driver calls: persistence mode, the driver's recovery action, and nvmlInit's version
check. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu.

What real NVML does, and so what this fake does:
- nvmlDeviceGetPersistenceMode: NVML_FEATURE_ENABLED/DISABLED ("For all products. For Linux only.").
- NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230) through nvmlDeviceGetFieldValues: added in driver 565
  (NVML API reference, change log v560->v565), DRAIN_AND_RESET in 570. Before 565 the field's own
  nvmlReturn says NotSupported while the call succeeds.
- nvmlInit with a user-space library whose version differs from the loaded kernel module fails with
  NVML_ERROR_LIB_RM_VERSION_MISMATCH (nvidia-smi: "Failed to initialize NVML: Driver/library version
  mismatch").
"""

from __future__ import annotations

from typing import Any

import pynvml

from detector.backends.nvmlcompat import constant as nvml_constant

RECOVERY_ACTION_SINCE = (565,)          # driver branch that added NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
RECOVERY_FIELD = nvml_constant("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")    # 230, also where the binding lacks it
RECOVERY_ACTIONS = {                    # nvmlDeviceGpuRecoveryAction_t by the names faults use
    "NONE": nvml_constant("NVML_GPU_RECOVERY_ACTION_NONE"),
    "GPU_RESET": nvml_constant("NVML_GPU_RECOVERY_ACTION_GPU_RESET"),
    "NODE_REBOOT": nvml_constant("NVML_GPU_RECOVERY_ACTION_NODE_REBOOT"),
    "DRAIN_P2P": nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_P2P"),
    "DRAIN_AND_RESET": nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET"),
    "RECOVER_IMEX_DOMAIN": nvml_constant("NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN"),
    "BUS_RESET": nvml_constant("NVML_GPU_RECOVERY_ACTION_BUS_RESET"),
    "SYSTEM_REBOOT": nvml_constant("NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT"),
}


def driver_branch(version: str) -> tuple[int, ...]:
    """"570.133.20" -> (570,): what feature availability is keyed on."""
    head = version.split(".")[0]
    return (int(head),) if head.isdigit() else (0,)


class DriverCalls:
    """Mixed into FakeNvml, which supplies `_device(handle)`, `_state()` and `node`."""

    def _check_driver_versions(self) -> None:
        """Called by nvmlInit: a kernel module of another version than this library refuses it."""
        module, library = self.node.read(lambda s: (s.kernel_module_version, s.driver_version))  # type: ignore[attr-defined]
        if module and module != library:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        return pynvml.NVML_FEATURE_ENABLED if gpu.persistence_mode else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """The other mixins' fields (NVLink ...), then the recovery action in its slots."""
        values = super().nvmlDeviceGetFieldValues(handle, fieldIds)   # type: ignore[misc]
        if not any(_field_id(f) == RECOVERY_FIELD for f in fieldIds):
            return values
        gpu = self._device(handle)   # type: ignore[attr-defined]
        supported = driver_branch(self._state().driver_version) >= RECOVERY_ACTION_SINCE   # type: ignore[attr-defined]
        for slot in values:
            if slot.fieldId != RECOVERY_FIELD:
                continue
            if supported:
                slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                slot.value.uiVal = gpu.recovery_action
            else:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values


def _field_id(requested: Any) -> int:
    return requested[0] if isinstance(requested, tuple) else requested
