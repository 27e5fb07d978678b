"""NVML conformance: what real NVML (through pynvml) does, checked against the fake and, on a GPU
machine, against the real library.

Part 1 runs on both backends (the `nvml` fixture) and asserts only shapes, types and invariants that
real NVML guarantees. Part 2 runs on the fake only: the failure behaviour of real NVML (lost GPUs,
missing GPUs, no driver, unsupported features, XID events) that the fake must reproduce, since no
healthy GPU machine can show it on demand.

Run the real half on a GPU machine with `pytest -m gpu tests/conformance`.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import pynvml
import pytest

from fake_nvml.faults import Fault
from fake_nvml.nvml import FakeNvml

from .conftest import node_of

NVML_BUS_ID = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")
GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DRIVER_VERSION = re.compile(r"^\d+\.\d+(\.\d+)*$")
ZERO_UUID = "GPU-00000000-0000-0000-0000-000000000000"
NVIDIA_VENDOR_ID = 0x10DE


def short_bus_id(nvml_bus_id: str) -> str:
    """`00000000:3B:00.0` -> `0000:3b:00.0`, the sysfs spelling."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def memory_slack(nvml: Any, total: int) -> int:
    """How far free + used may fall short of total: none on the fake, 1% on real drivers."""
    return 0 if isinstance(nvml, FakeNvml) else total // 100


def started(scenario: str, name: str | None = None) -> tuple[FakeNvml, Any]:
    """An initialised FakeNvml over a fresh node of `scenario`, and the node (to inject faults)."""
    node = node_of(scenario, name)
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    return nvml, node


# ================================================================================================
# Part 1: both backends
# ================================================================================================


def test_device_count_is_a_positive_int(nvml: Any) -> None:
    count = nvml.nvmlDeviceGetCount()
    assert isinstance(count, int)
    assert count >= 1


def test_uuid_is_a_gpu_uuid_string_and_unique_per_gpu(nvml: Any, handles: list[Any]) -> None:
    uuids = [nvml.nvmlDeviceGetUUID(h) for h in handles]
    for uuid in uuids:
        assert isinstance(uuid, str)
        assert uuid.startswith("GPU-")
        assert GPU_UUID.match(uuid), uuid
    assert len(set(uuids)) == len(uuids)


def test_name_is_a_nonempty_str(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        name = nvml.nvmlDeviceGetName(h)
        assert isinstance(name, str)
        assert name.strip()


def test_handle_by_index_uuid_and_bus_id_lead_to_the_same_gpu(nvml: Any, handles: list[Any]) -> None:
    for index, h in enumerate(handles):
        uuid = nvml.nvmlDeviceGetUUID(h)
        bus_id = nvml.nvmlDeviceGetPciInfo(h).busId
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByUUID(uuid)) == uuid
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByPciBusId(bus_id)) == uuid
        assert nvml.nvmlDeviceGetIndex(h) == index


def test_pci_bus_id_is_nvml_spelling_and_agrees_with_the_fields(nvml: Any, handles: list[Any]) -> None:
    bus_ids = []
    for h in handles:
        info = nvml.nvmlDeviceGetPciInfo(h)
        assert isinstance(info.busId, str)
        assert NVML_BUS_ID.match(info.busId), info.busId
        domain, bus, dev_fn = info.busId.split(":")
        assert (info.domain, info.bus, info.device) == (int(domain, 16), int(bus, 16), int(dev_fn[:2], 16))
        assert info.pciDeviceId & 0xFFFF == NVIDIA_VENDOR_ID
        bus_ids.append(info.busId)
    assert len(set(bus_ids)) == len(bus_ids)


def test_handle_by_bus_id_accepts_the_short_lower_case_form(nvml: Any, handles: list[Any]) -> None:
    # NVML documents "domain:bus:device.function in format %x:%x:%x.%x" (hex, so any case, any width).
    for h in handles:
        short = short_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId)
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByPciBusId(short)) == nvml.nvmlDeviceGetUUID(h)


def test_pcie_link_runs_within_its_maximum(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        width, max_width = nvml.nvmlDeviceGetCurrPcieLinkWidth(h), nvml.nvmlDeviceGetMaxPcieLinkWidth(h)
        gen, max_gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(h), nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
        gpu_max_gen = nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)
        assert 1 <= width <= max_width
        assert 1 <= gen <= max_gen <= gpu_max_gen


def test_memory_info_adds_up(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        assert mem.total > 0
        assert mem.free + mem.used <= mem.total
        assert mem.total - (mem.free + mem.used) <= memory_slack(nvml, mem.total)


def test_temperature_is_plausible(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        temperature = nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
        assert isinstance(temperature, int)
        assert 0 <= temperature <= 120


def test_driver_version_is_dotted_numbers(nvml: Any) -> None:
    version = nvml.nvmlSystemGetDriverVersion()
    assert isinstance(version, str)
    assert DRIVER_VERSION.match(version), version


def test_clocks_event_reasons_is_a_bitmask_int(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        assert isinstance(reasons, int)
        assert reasons >= 0


def test_handle_index_out_of_range_is_invalid_argument(nvml: Any) -> None:
    count = nvml.nvmlDeviceGetCount()
    for index in (count, count + 100):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceGetHandleByIndex(index)


def test_unknown_uuid_is_not_found(nvml: Any) -> None:
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID(ZERO_UUID)


def test_nvml_error_maps_its_code_to_the_subclass(nvml: Any) -> None:
    error = nvml.NVMLError(15)
    assert isinstance(error, pynvml.NVMLError_GpuIsLost)
    assert isinstance(error, pynvml.NVMLError)
    assert error.value == 15 == pynvml.NVML_ERROR_GPU_IS_LOST
    assert error == pynvml.NVMLError_GpuIsLost()
    assert error != pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    assert nvml.nvmlExceptionClass(15) is pynvml.NVMLError_GpuIsLost
    assert str(error) == "GPU is lost"


def test_error_string_of_gpu_is_lost(nvml: Any) -> None:
    assert nvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"


def test_init_and_shutdown_are_reference_counted(nvml: Any) -> None:
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    # One init (the fixture's) is still outstanding, so the library still answers.
    assert nvml.nvmlDeviceGetCount() >= 1
    assert isinstance(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0)), str)


@pytest.mark.parametrize("timeout_ms", [0, 10])
def test_event_wait_with_nothing_pending_times_out(nvml: Any, handles: list[Any], timeout_ms: int) -> None:
    h = handles[0]
    if not nvml.nvmlDeviceGetSupportedEventTypes(h) & nvml.nvmlEventTypeXidCriticalError:
        pytest.skip("this GPU does not report XID events")
    event_set = nvml.nvmlEventSetCreate()
    try:
        nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
        started_at = time.monotonic()
        with pytest.raises(pynvml.NVMLError_Timeout):
            nvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        assert time.monotonic() - started_at < 1.0
    finally:
        nvml.nvmlEventSetFree(event_set)


def test_event_sets_stay_distinct_after_one_is_freed(nvml: Any) -> None:
    first, second = nvml.nvmlEventSetCreate(), nvml.nvmlEventSetCreate()
    nvml.nvmlEventSetFree(first)
    third = nvml.nvmlEventSetCreate()
    nvml.nvmlEventSetFree(third)
    nvml.nvmlEventSetFree(second)      # still a live set: freeing it must succeed


def test_remapped_rows_is_four_ints(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        try:
            rows = nvml.nvmlDeviceGetRemappedRows(h)
        except pynvml.NVMLError_NotSupported:
            continue
        assert isinstance(rows, tuple) and len(rows) == 4
        assert all(isinstance(n, int) and n >= 0 for n in rows)
        assert rows[2] in (0, 1) and rows[3] in (0, 1)     # pending, failure are flags


def test_ecc_mode_is_current_and_pending(nvml: Any, handles: list[Any]) -> None:
    states = (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED)
    for h in handles:
        try:
            mode = nvml.nvmlDeviceGetEccMode(h)
        except pynvml.NVMLError_NotSupported:
            continue
        assert isinstance(mode, list) and len(mode) == 2
        assert mode[0] in states and mode[1] in states


def test_pure_python_helpers_work(nvml: Any, handles: list[Any]) -> None:
    mem = nvml.nvmlDeviceGetMemoryInfo(handles[0])
    friendly = nvml.nvmlStructToFriendlyObject(mem)
    assert friendly.total == mem.total


def test_memory_info_v2_reports_reserved_memory(nvml: Any, handles: list[Any]) -> None:
    mem = nvml.nvmlDeviceGetMemoryInfo(handles[0], version=pynvml.nvmlMemory_v2)
    assert isinstance(mem, pynvml.c_nvmlMemory_v2_t)
    assert mem.free + mem.used + mem.reserved <= mem.total


# ================================================================================================
# Part 2: fake only, the failure behaviour of real NVML
# ================================================================================================

# -- library lifecycle ---------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda nvml: nvml.nvmlDeviceGetCount(),
    lambda nvml: nvml.nvmlDeviceGetHandleByIndex(0),
    lambda nvml: nvml.nvmlSystemGetDriverVersion(),
    lambda nvml: nvml.nvmlEventSetCreate(),
], ids=["count", "handle", "driver-version", "event-set"])
def test_calls_before_init_are_uninitialized(call: Callable[[Any], Any]) -> None:
    nvml = FakeNvml(node_of("h100-sxm-8"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        call(nvml)


def test_shutdown_without_init_is_uninitialized() -> None:
    nvml = FakeNvml(node_of("h100-sxm-8"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_calls_after_the_last_shutdown_are_uninitialized() -> None:
    nvml, _ = started("h100-sxm-8")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetUUID(handle).startswith("GPU-")     # one init still outstanding
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetUUID(handle)                            # a handle does not outlive the library
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_no_driver_init_fails_and_leaves_the_library_uninitialized() -> None:
    nvml = FakeNvml(node_of("h100-sxm-8-no-driver"))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


# -- lost GPU (XID 79) ---------------------------------------------------------------------------

def test_lost_gpu_by_index_raises_gpu_is_lost_while_others_answer() -> None:
    nvml, _ = started("h100-sxm-8-xid79")
    assert nvml.nvmlDeviceGetCount() == 8          # a lost GPU is still enumerated
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as caught:
        nvml.nvmlDeviceGetHandleByIndex(3)
    assert isinstance(caught.value, pynvml.NVMLError)
    assert caught.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    for index in (0, 1, 2, 4, 5, 6, 7):
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)).startswith("GPU-")


def test_lost_gpu_by_bus_id_raises_gpu_is_lost() -> None:
    nvml, _ = started("h100-sxm-8-xid79")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByPciBusId("00000000:5D:00.0")


DEVICE_QUERIES: dict[str, Callable[[Any, Any], Any]] = {
    "uuid": lambda nvml, h: nvml.nvmlDeviceGetUUID(h),
    "name": lambda nvml, h: nvml.nvmlDeviceGetName(h),
    "index": lambda nvml, h: nvml.nvmlDeviceGetIndex(h),
    "pci-info": lambda nvml, h: nvml.nvmlDeviceGetPciInfo(h),
    "pcie-width": lambda nvml, h: nvml.nvmlDeviceGetCurrPcieLinkWidth(h),
    "temperature": lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
    "memory": lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h),
    "clocks-event-reasons": lambda nvml, h: nvml.nvmlDeviceGetCurrentClocksEventReasons(h),
    "ecc-mode": lambda nvml, h: nvml.nvmlDeviceGetEccMode(h),
    "remapped-rows": lambda nvml, h: nvml.nvmlDeviceGetRemappedRows(h),
}


def test_a_handle_taken_before_xid79_is_lost_on_every_query() -> None:
    nvml, node = started("h100-sxm-8")
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    for query in DEVICE_QUERIES.values():
        query(nvml, handle)                          # all answer while the GPU is healthy
    node.inject(Fault("xid", 3, {"code": 79}))
    for name, query in DEVICE_QUERIES.items():
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            query(nvml, handle)
            pytest.fail(f"{name} answered for a lost GPU")
    assert nvml.nvmlDeviceGetCount() == 8


# -- XID events ----------------------------------------------------------------------------------

def xid_event_set(nvml: FakeNvml, indices: range | list[int]) -> Any:
    event_set = nvml.nvmlEventSetCreate()
    for index in indices:
        nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index),
                                      nvml.nvmlEventTypeXidCriticalError, event_set)
    return event_set


def test_xid_event_carries_code_type_and_device() -> None:
    nvml, node = started("h100-sxm-8")
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3))
    event_set = xid_event_set(nvml, range(8))
    node.inject(Fault("xid", 3, {"code": 48}))
    event = nvml.nvmlEventSetWait_v2(event_set, 1000)
    assert event.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert event.eventData == 48
    assert nvml.nvmlDeviceGetUUID(event.device) == uuid
    with pytest.raises(pynvml.NVMLError_Timeout):   # one XID, one event
        nvml.nvmlEventSetWait_v2(event_set, 0)
    nvml.nvmlEventSetFree(event_set)


def test_xid79_event_is_delivered_but_its_device_is_lost() -> None:
    nvml, node = started("h100-sxm-8")
    event_set = xid_event_set(nvml, range(8))
    node.inject(Fault("xid", 3, {"code": 79}))
    event = nvml.nvmlEventSetWait_v2(event_set, 1000)
    assert (event.eventType, event.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(event.device)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(3)


def test_xid_events_come_in_order_one_per_xid() -> None:
    nvml, node = started("h100-sxm-8")
    event_set = xid_event_set(nvml, range(8))
    for gpu, code in ((1, 13), (5, 63), (1, 31)):
        node.inject(Fault("xid", gpu, {"code": code}))
    codes = [nvml.nvmlEventSetWait_v2(event_set, 100).eventData for _ in range(3)]
    assert codes == [13, 63, 31]


def test_xid_events_come_only_from_registered_gpus() -> None:
    nvml, node = started("h100-sxm-8")
    event_set = xid_event_set(nvml, [0])
    node.inject(Fault("xid", 1, {"code": 48}))
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 10)


def test_xids_from_before_the_event_set_are_not_delivered() -> None:
    nvml, _ = started("h100-sxm-8-xid79")          # GPU 3's XID 79 happened at boot
    event_set = xid_event_set(nvml, [0, 1, 2, 4, 5, 6, 7])
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 10)


# -- missing GPU, degraded link, unsupported features ---------------------------------------------

def test_missing_gpu_is_not_enumerated_nor_found_by_bus_id() -> None:
    nvml, _ = started("h100-sxm-8-gpu-missing")
    assert nvml.nvmlDeviceGetCount() == 7
    for spelling in ("00000000:BA:00.0", "0000:ba:00.0"):
        with pytest.raises(pynvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetHandleByPciBusId(spelling)


def test_missing_gpu_leaves_no_hole_in_the_indices() -> None:
    nvml, _ = started("h100-sxm-8-gpu-missing")
    bus_ids = [nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(i)).busId for i in range(7)]
    assert bus_ids[5:] == ["00000000:AB:00.0", "00000000:DB:00.0"]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(7)


def test_degraded_link_reports_current_width_below_max() -> None:
    nvml, _ = started("h100-sxm-8-pcie-x8")
    h = nvml.nvmlDeviceGetHandleByIndex(5)
    assert (nvml.nvmlDeviceGetCurrPcieLinkWidth(h), nvml.nvmlDeviceGetMaxPcieLinkWidth(h)) == (8, 16)
    assert nvml.nvmlDeviceGetCurrPcieLinkWidth(nvml.nvmlDeviceGetHandleByIndex(4)) == 16


@pytest.mark.parametrize("query", [
    lambda nvml, h: nvml.nvmlDeviceGetEccMode(h),
    lambda nvml, h: nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     nvml.NVML_VOLATILE_ECC),
    lambda nvml, h: nvml.nvmlDeviceGetRemappedRows(h),
    lambda nvml, h: nvml.nvmlDeviceGetNvLinkState(h, 0),
    lambda nvml, h: nvml.nvmlDeviceGetMigMode(h),
], ids=["ecc-mode", "ecc-errors", "remapped-rows", "nvlink", "mig"])
def test_geforce_lacks_datacenter_features(query: Callable[[Any, Any], Any]) -> None:
    nvml, _ = started("rtx-4090-1")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        query(nvml, nvml.nvmlDeviceGetHandleByIndex(0))


def test_pcie_a100_has_ecc_but_no_nvlink() -> None:
    nvml, _ = started("a100-pcie-4")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetEccMode(h) == [pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(h, 0)


def test_clocks_event_reasons_follow_load_and_heat() -> None:
    nvml, node = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonGpuIdle
    node.inject(Fault("busy", 0))
    assert not nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonGpuIdle
    node.inject(Fault("temperature", 0, {"celsius": 95}))
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonHwThermalSlowdown


# -- what the fake is made of --------------------------------------------------------------------

def test_a_real_pynvml_function_the_fake_lacks_is_function_not_found() -> None:
    nvml, _ = started("h100-sxm-8")
    assert hasattr(pynvml, "nvmlDeviceGetFanSpeed")
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetFanSpeed(nvml.nvmlDeviceGetHandleByIndex(0))


def test_a_name_pynvml_lacks_is_attribute_error() -> None:
    nvml, _ = started("h100-sxm-8")
    assert not hasattr(pynvml, "nvmlDeviceGetWarpDrive")
    with pytest.raises(AttributeError):
        nvml.nvmlDeviceGetWarpDrive


def test_constants_and_error_classes_are_pynvmls_own() -> None:
    nvml = FakeNvml(node_of("h100-sxm-8"))
    assert nvml.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert nvml.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert nvml.nvmlExceptionClass is pynvml.nvmlExceptionClass


def test_two_instances_over_two_nodes_are_independent() -> None:
    nvml_a, node_a = started("h100-sxm-8", "node-a")
    nvml_b, _ = started("h100-sxm-8", "node-b")
    node_a.inject(Fault("xid", 3, {"code": 79}))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml_a.nvmlDeviceGetHandleByIndex(3)
    assert nvml_b.nvmlDeviceGetUUID(nvml_b.nvmlDeviceGetHandleByIndex(3)).startswith("GPU-")
    nvml_b.nvmlShutdown()
    assert nvml_a.nvmlDeviceGetCount() == 8         # one library's shutdown is not the other's


def test_a_handle_from_another_instance_is_invalid_argument() -> None:
    nvml_a, _ = started("h100-sxm-8", "node-a")
    nvml_b, _ = started("h100-sxm-8", "node-b")
    foreign = nvml_a.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml_b.nvmlDeviceGetUUID(foreign)


def test_nvml_hang_blocks_calls_on_that_gpu_only() -> None:
    nvml, node = started("h100-sxm-8")
    hung, healthy = nvml.nvmlDeviceGetHandleByIndex(2), nvml.nvmlDeviceGetHandleByIndex(0)
    node.inject(Fault("nvml_hang", 2, {"seconds": 0.3}))
    began = time.monotonic()
    nvml.nvmlDeviceGetTemperature(hung, pynvml.NVML_TEMPERATURE_GPU)
    assert time.monotonic() - began >= 0.3
    began = time.monotonic()
    nvml.nvmlDeviceGetTemperature(healthy, pynvml.NVML_TEMPERATURE_GPU)
    assert time.monotonic() - began < 0.3
