"""NVML conformance for the fabric check's calls: nvmlDeviceGetGpuFabricInfoV (driver 550+) and the older
nvmlDeviceGetGpuFabricInfo. Part 1 asserts only what real NVML guarantees and runs on both backends;
part 2 is the fake: which models have a fabric probe, and the fabric faults."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from fake_nvml.faults import Fault

from .test_nvml_conformance import started

NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
STATES = (pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
          pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)


def fabric_v(nvml: Any, h: Any) -> Any:
    info = pynvml.c_nvmlGpuFabricInfo_v2_t()
    assert nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    return info


# ---- part 1: what real NVML guarantees ---------------------------------------------------------


def test_versioned_fabric_info_is_a_known_state_or_not_supported(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        try:
            info = fabric_v(nvml, h)
        except NOT_HERE:
            continue
        assert info.state in STATES
        assert info.version == pynvml.nvmlGpuFabricInfo_v2          # the library leaves the version as set
        if info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
            assert isinstance(info.status, int)


def test_unversioned_fabric_info_agrees_with_the_versioned_one(nvml: Any, handles: list[Any]) -> None:
    h = handles[0]
    legacy = pynvml.c_nvmlGpuFabricInfo_t()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(legacy))
        info = fabric_v(nvml, h)
    except NOT_HERE:
        pytest.skip("no fabric probe on this GPU or driver")
    assert (legacy.state, legacy.status, legacy.cliqueId) == (info.state, info.status, info.cliqueId)


# ---- part 2: the fake ---------------------------------------------------------------------------


def test_hgx_h100_gpus_are_registered_with_a_healthy_mask() -> None:
    nvml, _ = started("h100-sxm-8")
    info = fabric_v(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    assert (info.state, info.status) == (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS)
    degraded = (info.healthMask >> pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW) \
        & pynvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW
    assert degraded == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE


@pytest.mark.parametrize("scenario", ["a100-pcie-4", "rtx-4090-1", "v100-sxm-8"])
def test_pre_hopper_and_geforce_have_no_fabric_probe(scenario) -> None:
    nvml, _ = started(scenario)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fabric_v(nvml, nvml.nvmlDeviceGetHandleByIndex(0))


def test_a_hopper_gpu_without_nvswitches_reports_the_state_not_supported() -> None:
    nvml, node = started("h100-sxm-8")
    node.read(lambda s: s.nvswitches.clear())
    assert fabric_v(nvml, nvml.nvmlDeviceGetHandleByIndex(0)).state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED


def test_registration_faults_and_their_recovery() -> None:
    nvml, node = started("h100-sxm-8-fabric-failed")
    h1, h2 = nvml.nvmlDeviceGetHandleByIndex(1), nvml.nvmlDeviceGetHandleByIndex(2)
    info = fabric_v(nvml, h1)
    assert (info.state, info.status) == (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_ERROR_UNKNOWN)
    node.inject(Fault("fabric_not_started", 2, {"state": "in_progress"}))
    assert fabric_v(nvml, h2).state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
    node.inject(Fault("recover", 1))
    assert fabric_v(nvml, h1).status == pynvml.NVML_SUCCESS
    assert fabric_v(nvml, h2).state == pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS     # only GPU 1 was reset
    node.inject(Fault("fabric_manager_stopped"))
    assert node.read(lambda s: s.fabric_manager_running) is False
    node.inject(Fault("reboot"))
    assert node.read(lambda s: s.fabric_manager_running) is True
    assert fabric_v(nvml, h2).state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


def test_the_struct_must_be_passed_by_reference_with_a_known_version() -> None:
    nvml, _ = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuFabricInfoV(h, pynvml.c_nvmlGpuFabricInfo_v2_t())     # by value: garbage in C
    info = pynvml.c_nvmlGpuFabricInfo_v2_t()
    info.version = 0x01000000
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    assert nvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.pointer(pynvml.c_nvmlGpuFabricInfo_t())) == pynvml.NVML_SUCCESS
