"""NVML conformance for the driver check's calls: persistence mode, the GPU recovery action field
(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION through nvmlDeviceGetFieldValues) and nvmlInit's version check.
Part 1 asserts only what real NVML guarantees and runs on both backends; part 2 is the fake's behaviour
under faults."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from fake_nvml.faults import Fault
from fake_nvml.nvml import FakeNvml

from .conftest import node_of
from .test_nvml_conformance import started

RECOVERY = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
KNOWN_ACTIONS = {getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_GPU_RECOVERY_ACTION_")}


def recovery_slot(nvml: Any, handle: Any) -> Any:
    return nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY])[0]


# ---- both backends -----------------------------------------------------------------------------


def test_persistence_mode_is_enabled_or_disabled(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        assert nvml.nvmlDeviceGetPersistenceMode(h) in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED)


def test_recovery_action_field_is_a_known_action_or_its_own_error(nvml: Any, handles: list[Any]) -> None:
    """The call succeeds; before driver 565 the field's own nvmlReturn carries the error."""
    for h in handles:
        slot = recovery_slot(nvml, h)
        assert slot.fieldId == RECOVERY
        if slot.nvmlReturn == pynvml.NVML_SUCCESS:
            assert slot.value.uiVal in KNOWN_ACTIONS
        else:
            assert slot.nvmlReturn in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


def test_driver_version_is_dotted_digits(nvml: Any) -> None:
    version = nvml.nvmlSystemGetDriverVersion()
    assert isinstance(version, str) and all(part.isdigit() for part in version.split("."))


# ---- fake only ---------------------------------------------------------------------------------


def test_recovery_action_is_not_supported_before_driver_565() -> None:
    nvml, node = started("h100-sxm-8")                        # driver 550
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    node.inject(Fault("recovery_action", 0, {"action": "GPU_RESET"}))
    assert recovery_slot(nvml, h).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_recovery_action_follows_faults_and_resets_on_driver_570() -> None:
    nvml, node = started("h100-sxm-8-driver-570")
    h = nvml.nvmlDeviceGetHandleByIndex(4)
    assert recovery_slot(nvml, h).value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    node.inject(Fault("recovery_action", 4, {"action": "DRAIN_AND_RESET"}))
    slot = recovery_slot(nvml, h)
    assert (slot.nvmlReturn, slot.valueType) == (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT)
    assert slot.value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    node.inject(Fault("recover", 4))
    assert recovery_slot(nvml, h).value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NONE


def test_recovery_field_shares_a_call_with_nvlink_fields() -> None:
    nvml, _ = started("h100-sxm-8-driver-570")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    values = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, RECOVERY])
    assert values[0].value.uiVal == 18 and values[1].nvmlReturn == pynvml.NVML_SUCCESS


def test_an_unknown_recovery_action_name_is_refused() -> None:
    _, node = started("h100-sxm-8-driver-570")
    with pytest.raises(ValueError, match="GPU_RESET"):
        node.inject(Fault("recovery_action", 0, {"action": "REBOOT_PLEASE"}))


def test_version_mismatch_fails_nvml_init_until_a_reboot() -> None:
    node = node_of("h100-sxm-8")
    node.inject(Fault("version_mismatch", params={"kernel_version": "535.183.01"}))
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        FakeNvml(node).nvmlInit()
    node.inject(Fault("reboot"))
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    assert nvml.nvmlSystemGetDriverVersion() == "550.90.07"


def test_persistence_off_on_one_gpu_or_all_and_a_reboot_restores_it() -> None:
    nvml, node = started("h100-sxm-8")
    node.inject(Fault("persistence_off", 2))
    modes = [nvml.nvmlDeviceGetPersistenceMode(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(8)]
    assert modes.count(pynvml.NVML_FEATURE_DISABLED) == 1 and modes[2] == pynvml.NVML_FEATURE_DISABLED
    node.inject(Fault("persistence_off"))
    node.inject(Fault("recover", 2))                           # a GPU reset does not turn it back on
    assert nvml.nvmlDeviceGetPersistenceMode(nvml.nvmlDeviceGetHandleByIndex(2)) == pynvml.NVML_FEATURE_DISABLED
    node.inject(Fault("reboot"))
    assert nvml.nvmlDeviceGetPersistenceMode(nvml.nvmlDeviceGetHandleByIndex(2)) == pynvml.NVML_FEATURE_ENABLED
