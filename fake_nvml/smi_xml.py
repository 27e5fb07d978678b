"""`nvidia-smi -q -x` of a fake node: the element names and value spellings of a real capture (driver 580,
../shared/real-machines/h100-vm-580/nvidia-smi-q.xml), each value read through the fake NVML as nvidia-smi
reads it through the real one; a read that fails prints N/A, as nvidia-smi does. It prints what the replay
reads back (detector/backends/replay/fields.py) and no more: a bundle of a fake node is a replay folder.
"""

from __future__ import annotations

import ctypes
from datetime import datetime
from typing import Any, Callable
from xml.sax.saxutils import escape

import pynvml

from detector.backends.pciaddr import normalize_bus_id

NA = "N/A"
_RECOVERY = {0: "None", 1: "GPU Reset", 2: "Node Reboot", 3: "Drain P2P", 4: "Drain and Reset"}
_FABRIC_STATES = {0: "Not Supported", 1: "Not Started", 2: "In Progress", 3: "Completed"}
_REASONS = (("gpu_idle", pynvml.nvmlClocksEventReasonGpuIdle),
            ("applications_clocks_setting", pynvml.nvmlClocksEventReasonApplicationsClocksSetting),
            ("sw_power_cap", pynvml.nvmlClocksEventReasonSwPowerCap),
            ("hw_slowdown", pynvml.nvmlClocksEventReasonHwSlowdown),
            ("hw_thermal_slowdown", pynvml.nvmlClocksEventReasonHwThermalSlowdown),
            ("hw_power_brake_slowdown", pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
            ("sync_boost", pynvml.nvmlClocksEventReasonSyncBoost),
            ("sw_thermal_slowdown", pynvml.nvmlClocksEventReasonSwThermalSlowdown),
            ("display_clocks_setting", pynvml.nvmlClocksEventReasonDisplayClockSetting))


def _read(fn: Callable[[], Any], show: Callable[[Any], str] = str) -> str:
    try:
        return show(fn())
    except pynvml.NVMLError:
        return NA


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _on(value: Any, yes: str = "Enabled", no: str = "Disabled") -> str:
    return yes if value else no


def query_xml(nvml: Any, now: datetime | None = None) -> str:
    """The whole `nvidia-smi -q -x` document for every GPU `nvml` enumerates."""
    count = nvml.nvmlDeviceGetCount()
    out = ['<?xml version="1.0" ?>', '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">', "<nvidia_smi_log>",
           f"\t<timestamp>{(now or datetime.now()).strftime('%a %b %d %H:%M:%S %Y')}</timestamp>",
           f"\t<driver_version>{escape(_read(nvml.nvmlSystemGetDriverVersion, _text))}</driver_version>",
           f"\t<attached_gpus>{count}</attached_gpus>"]
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            continue                     # nvidia-smi prints a lost GPU's line, not its section
        out.extend(_gpu(nvml, handle))
    out.append("</nvidia_smi_log>")
    return "\n".join(out) + "\n"


def _gpu(nvml: Any, h: Any) -> list[str]:
    pci = nvml.nvmlDeviceGetPciInfo(h)
    bus = normalize_bus_id(_text(pci.busId))
    rows: list[tuple[int, str, str | None]] = []      # (depth, tag, value or None to open a section)

    def value(tag: str, text: str, depth: int = 2) -> None:
        rows.append((depth, tag, text))

    def section(tag: str, depth: int = 2) -> None:
        rows.append((depth, tag, None))

    value("product_name", _read(lambda: nvml.nvmlDeviceGetName(h), _text))
    value("persistence_mode", _read(lambda: nvml.nvmlDeviceGetPersistenceMode(h), _on))
    mig = _read(lambda: nvml.nvmlDeviceGetMigMode(h), lambda m: f"{_on(m[0])}|{_on(m[1])}")
    section("mig_mode")
    value("current_mig", mig.split("|")[0], 3)
    value("pending_mig", mig.split("|")[-1], 3)
    value("serial", _read(lambda: nvml.nvmlDeviceGetSerial(h), _text))
    value("uuid", _read(lambda: nvml.nvmlDeviceGetUUID(h), _text))
    value("minor_number", _read(lambda: nvml.nvmlDeviceGetMinorNumber(h)))
    value("vbios_version", _read(lambda: nvml.nvmlDeviceGetVbiosVersion(h), _text))
    value("board_part_number", _read(lambda: nvml.nvmlDeviceGetBoardPartNumber(h), _text))
    value("gpu_recovery_action", _read(lambda: _recovery(nvml, h)))
    section("pci")
    value("pci_device_id", f"{pci.pciDeviceId:08X}", 3)
    value("pci_bus_id", bus, 3)
    value("pci_sub_system_id", f"{pci.pciSubSystemId:08X}", 3)
    section("pci_gpu_link_info", 3)
    section("pcie_gen", 4)
    value("max_link_gen", _read(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)), 5)
    value("current_link_gen", _read(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)), 5)
    value("max_device_link_gen", _read(lambda: nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)), 5)
    section("link_widths", 4)
    value("max_link_width", _read(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(h), lambda w: f"{w}x"), 5)
    value("current_link_width", _read(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h), lambda w: f"{w}x"), 5)
    value("replay_counter", _read(lambda: nvml.nvmlDeviceGetPcieReplayCounter(h)), 3)
    reasons = _read(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h), lambda r: str(int(r)))
    section("clocks_event_reasons")
    for name, bit in _REASONS:
        shown = NA if reasons == NA else _on(int(reasons) & bit, "Active", "Not Active")
        value(f"clocks_event_reason_{name}", shown, 3)
    section("fb_memory_usage")
    memory = _read(lambda: nvml.nvmlDeviceGetMemoryInfo(h), lambda m: f"{m.total >> 20}|{m.used >> 20}")
    value("total", f"{memory.split('|')[0]} MiB" if memory != NA else NA, 3)
    value("used", f"{memory.split('|')[-1]} MiB" if memory != NA else NA, 3)
    section("utilization")
    value("gpu_util", _read(lambda: nvml.nvmlDeviceGetUtilizationRates(h), lambda u: f"{u.gpu} %"), 3)
    ecc = _read(lambda: nvml.nvmlDeviceGetEccMode(h), lambda m: f"{_on(m[0])}|{_on(m[1])}")
    section("ecc_mode")
    value("current_ecc", ecc.split("|")[0], 3)
    value("pending_ecc", ecc.split("|")[-1], 3)
    section("ecc_errors")
    for counter, tag in ((pynvml.NVML_VOLATILE_ECC, "volatile"), (pynvml.NVML_AGGREGATE_ECC, "aggregate")):
        section(tag, 3)
        for memory_name, location in (("sram", pynvml.NVML_MEMORY_LOCATION_SRAM),
                                      ("dram", pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY)):
            for kind, error in (("correctable", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                ("uncorrectable", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                value(f"{memory_name}_{kind}", _read(
                    lambda e=error, c=counter, loc=location: nvml.nvmlDeviceGetMemoryErrorCounter(h, e, c, loc)), 4)
    section("retired_pages")
    section("multiple_single_bit_retirement", 3)
    value("retired_count", _read(lambda: len(nvml.nvmlDeviceGetRetiredPages(
        h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))), 4)
    section("double_bit_retirement", 3)
    value("retired_count", _read(lambda: len(nvml.nvmlDeviceGetRetiredPages(
        h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))), 4)
    value("pending_blacklist", _read(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h),
                                     lambda p: _on(p, "Yes", "No")), 3)
    remap = _read(lambda: nvml.nvmlDeviceGetRemappedRows(h), lambda r: "|".join(str(int(x)) for x in r))
    parts = remap.split("|") if remap != NA else [NA] * 4
    section("remapped_rows")
    value("remapped_row_corr", parts[0], 3)
    value("remapped_row_unc", parts[1], 3)
    value("remapped_row_pending", NA if parts[2] == NA else _on(int(parts[2]), "Yes", "No"), 3)
    value("remapped_row_failure", NA if parts[3] == NA else _on(int(parts[3]), "Yes", "No"), 3)
    section("temperature")
    value("gpu_temp", _read(lambda: nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                            lambda t: f"{t} C"), 3)
    for tag, threshold in (("gpu_temp_max_threshold", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                           ("gpu_temp_slow_threshold", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                           ("gpu_temp_max_gpu_threshold", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX)):
        value(tag, _read(lambda t=threshold: nvml.nvmlDeviceGetTemperatureThreshold(h, t), lambda t: f"{t} C"), 3)
    section("gpu_power_readings")
    value("instant_power_draw", _read(lambda: nvml.nvmlDeviceGetPowerUsage(h), lambda mw: f"{mw / 1000:.2f} W"), 3)
    value("current_power_limit", _read(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h),
                                       lambda mw: f"{mw / 1000:.2f} W"), 3)
    section("clocks")
    value("sm_clock", _read(lambda: nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), lambda c: f"{c} MHz"), 3)
    section("applications_clocks")
    value("graphics_clock", _read(lambda: nvml.nvmlDeviceGetApplicationsClock(h, pynvml.NVML_CLOCK_GRAPHICS),
                                  lambda c: f"{c} MHz"), 3)
    section("max_clocks")
    value("sm_clock", _read(lambda: nvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM), lambda c: f"{c} MHz"), 3)
    fabric = _fabric(nvml, h)
    section("fabric")
    value("state", fabric[0], 3)
    value("status", fabric[1], 3)
    return _render(bus, rows)


def _recovery(nvml: Any, h: Any) -> str:
    field = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    slot = nvml.nvmlDeviceGetFieldValues(h, [field])[0]
    if slot.nvmlReturn != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(slot.nvmlReturn)
    return _RECOVERY.get(slot.value.uiVal, NA)


def _fabric(nvml: Any, h: Any) -> tuple[str, str]:
    info = pynvml.c_nvmlGpuFabricInfo_t()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    except (pynvml.NVMLError, TypeError, AttributeError):
        return NA, NA
    state = _FABRIC_STATES.get(info.state, NA)
    if state != "Completed":
        return state, NA
    return state, "Success" if info.status == pynvml.NVML_SUCCESS else str(pynvml.NVMLError(info.status))


def _render(bus: str, rows: list[tuple[int, str, str | None]]) -> list[str]:
    """Rows into nested elements: a section stays open until a row at its depth or above comes."""
    out = [f'\t<gpu id="{bus}">']
    open_sections: list[tuple[int, str]] = []
    for depth, tag, text in rows:
        while open_sections and open_sections[-1][0] >= depth:
            d, t = open_sections.pop()
            out.append("\t" * d + f"</{t}>")
        if text is None:
            out.append("\t" * depth + f"<{tag}>")
            open_sections.append((depth, tag))
        else:
            out.append("\t" * depth + f"<{tag}>{escape(text)}</{tag}>")
    while open_sections:
        d, t = open_sections.pop()
        out.append("\t" * d + f"</{t}>")
    out.append("\t</gpu>")
    return out
