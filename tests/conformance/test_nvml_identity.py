"""NVML conformance for the identity calls an RMA ticket needs: serial number, board part number,
VBIOS version. Part 1 runs on the fake and (marked gpu) on the real library; part 2 is the fake's
behaviour that no healthy machine shows on demand."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from .test_nvml_conformance import started

# Buffer sizes from nvml.h (NVML_DEVICE_SERIAL_BUFFER_SIZE 30, _PART_NUMBER_BUFFER_SIZE 80,
# _VBIOS_VERSION_BUFFER_SIZE 32), each including the terminating NUL.
SERIAL_MAX, PART_NUMBER_MAX, VBIOS_MAX = 29, 79, 31


def _or_not_supported(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def test_serial_is_a_short_unique_string_or_not_supported(nvml: Any, handles: list[Any]) -> None:
    serials = [_or_not_supported(nvml.nvmlDeviceGetSerial, h) for h in handles]
    present = [s for s in serials if s is not None]
    assert all(isinstance(s, str) and 0 < len(s) <= SERIAL_MAX and s.strip() == s for s in present)
    assert len(set(present)) == len(present), "two GPUs with one serial number"


def test_board_part_number_is_a_string(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        part = _or_not_supported(nvml.nvmlDeviceGetBoardPartNumber, h)
        assert part is None or isinstance(part, str) and 0 < len(part) <= PART_NUMBER_MAX


def test_vbios_version_is_a_dotted_string(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        vbios = nvml.nvmlDeviceGetVbiosVersion(h)          # "for all products"
        assert isinstance(vbios, str) and 0 < len(vbios) <= VBIOS_MAX and "." in vbios


BRANDS = {getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_BRAND_") and n != "NVML_BRAND_COUNT"}


def test_brand_is_one_of_nvmls_brand_constants(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        assert nvml.nvmlDeviceGetBrand(h) in BRANDS          # "for all products": the memory check's ECC default


# ---- fake only ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario,brand", [("h100-sxm-8", pynvml.NVML_BRAND_NVIDIA),
                                            ("v100-sxm-8", pynvml.NVML_BRAND_TESLA),
                                            ("rtx-4090-1", pynvml.NVML_BRAND_GEFORCE)])
def test_each_fake_model_answers_its_brand(scenario: str, brand: int) -> None:
    nvml, _ = started(scenario)
    assert nvml.nvmlDeviceGetBrand(nvml.nvmlDeviceGetHandleByIndex(0)) == brand


def test_geforce_has_no_serial_but_has_vbios_and_part_number() -> None:
    nvml, _ = started("rtx-4090-1")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetSerial(h)
    assert nvml.nvmlDeviceGetVbiosVersion(h) and nvml.nvmlDeviceGetBoardPartNumber(h)


def test_vbios_update_shows_at_once_and_a_lost_gpu_answers_gpu_is_lost() -> None:
    from fake_nvml.faults import Fault
    nvml, node = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    node.inject(Fault("vbios", 2, {"version": "96.00.A5.00.99"}))
    assert nvml.nvmlDeviceGetVbiosVersion(h) == "96.00.A5.00.99"
    assert nvml.nvmlDeviceGetVbiosVersion(nvml.nvmlDeviceGetHandleByIndex(1)) != "96.00.A5.00.99"
    node.inject(Fault("lost", 2, {}))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetSerial(h)
