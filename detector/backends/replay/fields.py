"""Read a parsed log (either form) into a Snapshot. Each field lists the spellings drivers used, XML tag
first, then the text label (normalised, tree.norm):

- reasons: <clocks_throttle_reasons> / "Clocks Throttle Reasons" until driver 530, then "Clocks Event
  Reasons"; text nests "HW Thermal Slowdown" and "HW Power Brake Slowdown" under "HW Slowdown".
- ECC: "Single Bit"/"Double Bit" per location (device_memory, register_file, ...) before Ampere-era
  drivers, then "SRAM/DRAM Correctable/Uncorrectable", and from 565 "SRAM Uncorrectable Parity/SEC-DED".
- retired pages: <multiple_single_bit_retirement><retired_count> / "Single Bit ECC"; pending as
  <pending_blacklist>, <pending_retirement>, "Pending Page Blacklist" or "Pending".
- temperatures: absolute thresholds ("GPU Slowdown Temp"), or from driver 565 only T.Limit margins
  ("GPU T.Limit Temp" = degrees left to the GPU's max operating temperature, "GPU Slowdown T.Limit Temp"
  = the margin at which slowdown begins): the absolute value is then current + margin - threshold margin.
"""

from __future__ import annotations

import re

from detector.backends.pciaddr import normalize_bus_id
from detector.backends.replay.fabric import health_lines
from detector.backends.replay.raw import RawLog, SnapshotError
from detector.backends.replay.snapshot import EccCounts, GpuSnapshot, Reasons, Snapshot
from detector.backends.replay.tree import Node

_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?")
_YES = {"yes", "enabled", "active", "on", "true"}
_NO = {"no", "disabled", "not active", "off", "false"}
# Locations of the old per-location ECC layout, by their XML tag / text label.
_OLD_LOCATIONS = {"device_memory": "device_memory", "register_file": "register_file", "l1_cache": "l1_cache",
                  "l2_cache": "l2_cache", "texture_memory": "texture_memory", "texture_shm": "texture_shm",
                  "texture_shared": "texture_shm", "cbu": "cbu", "sram": "sram", "dram": "device_memory"}


def read_snapshot(raw: RawLog, path: str) -> Snapshot:
    top = raw.top
    gpus = tuple(_gpu(g, path) for g in raw.gpus)
    return Snapshot(path=path, form=raw.form, timestamp=top.get("timestamp"),
                    driver_version=top.get("driver_version"), cuda_version=top.get("cuda_version"),
                    attached_gpus=_int(top.get("attached_gpus")), gpus=gpus)


def _gpu(g: Node, path: str) -> GpuSnapshot:
    bus = g.value or g.get("pci/pci_bus_id", "pci/bus_id")
    temps = _temperatures(g)
    return GpuSnapshot(
        bus_id=_bus_id(bus, path),
        name=g.get("product_name"),
        brand=g.get("product_brand"),
        uuid=g.get("uuid", "gpu_uuid"),
        serial=g.get("serial", "serial_number"),
        board_part_number=g.get("board_part_number"),
        vbios_version=g.get("vbios_version"),
        minor_number=_int(g.get("minor_number")),
        pci_device_id=_hex(g.get("pci/pci_device_id", "pci/device_id")),
        pci_subsystem_id=_hex(g.get("pci/pci_sub_system_id", "pci/sub_system_id")),
        pci_class=_pci_class(g),
        pcie_max_gen=_int(g.get("pci/pci_gpu_link_info/pcie_gen/max_link_gen", "pci/gpu_link_info/pcie_generation/max")),
        pcie_current_gen=_int(g.get("pci/pci_gpu_link_info/pcie_gen/current_link_gen",
                                    "pci/gpu_link_info/pcie_generation/current")),
        pcie_gpu_max_gen=_int(g.get("pci/pci_gpu_link_info/pcie_gen/max_device_link_gen",
                                    "pci/gpu_link_info/pcie_generation/device_max")),
        pcie_max_width=_int(g.get("pci/pci_gpu_link_info/link_widths/max_link_width", "pci/gpu_link_info/link_width/max")),
        pcie_current_width=_int(g.get("pci/pci_gpu_link_info/link_widths/current_link_width",
                                      "pci/gpu_link_info/link_width/current")),
        pcie_replays=_int(g.get("pci/replay_counter", "pci/replays_since_reset")),
        persistence_mode=_bool(g.get("persistence_mode")),
        mig_mode=_pair(g, "mig_mode", ("current_mig", "current"), ("pending_mig", "pending")),
        mig_devices=_mig_devices(g),
        driver_model=g.get("driver_model/current_dm", "driver_model/current"),
        virtualization_mode=g.get("gpu_virtualization_mode/virtualization_mode"),
        recovery_action=g.get("gpu_recovery_action"),
        ecc_mode=_pair(g, "ecc_mode", ("current_ecc", "current"), ("pending_ecc", "pending")),
        ecc_volatile=_ecc(g.section("ecc_errors/volatile")),
        ecc_aggregate=_ecc(g.section("ecc_errors/aggregate")),
        retired_sbe=_int(g.get("retired_pages/multiple_single_bit_retirement/retired_count",
                               "retired_pages/single_bit_ecc")),
        retired_dbe=_int(g.get("retired_pages/double_bit_retirement/retired_count", "retired_pages/double_bit_ecc")),
        retired_pending=_bool(g.get("retired_pages/pending_blacklist", "retired_pages/pending_retirement",
                                    "retired_pages/pending_page_blacklist", "retired_pages/pending")),
        remapped_corrected=_int(g.get("remapped_rows/remapped_row_corr", "remapped_rows/correctable_error")),
        remapped_uncorrected=_int(g.get("remapped_rows/remapped_row_unc", "remapped_rows/uncorrectable_error")),
        remap_pending=_bool(g.get("remapped_rows/remapped_row_pending", "remapped_rows/pending")),
        remap_failure=_bool(g.get("remapped_rows/remapped_row_failure", "remapped_rows/remapping_failure_occurred")),
        reasons=_reasons(g.section("clocks_event_reasons", "clocks_throttle_reasons")),
        reason_counters_us=_counters(g.section("clocks_event_reasons_counters", "clocks_throttle_reasons_counters")),
        **temps,
        **_clocks(g),
        power_w=_float(g.get("gpu_power_readings/power_draw", "power_readings/power_draw",
                             "gpu_power_readings/instant_power_draw", "gpu_power_readings/instantaneous_power_draw",
                             "gpu_power_readings/average_power_draw")),
        power_limit_w=_float(g.get("gpu_power_readings/current_power_limit", "power_readings/enforced_power_limit",
                                   "gpu_power_readings/enforced_power_limit", "power_readings/power_limit")),
        utilization_pct=_int(g.get("utilization/gpu_util", "utilization/gpu")),
        memory_total_mib=_int(g.get("fb_memory_usage/total")),
        memory_used_mib=_int(g.get("fb_memory_usage/used")),
        processes=_processes(g.section("processes")),
        fabric_state=g.get("fabric/state"),
        fabric_status=g.get("fabric/status"),
        fabric_clique_id=_int(g.get("fabric/cliqueid")),
        fabric_cluster_uuid=g.get("fabric/clusteruuid"),
        fabric_health=health_lines(g),
    )


# -- values ------------------------------------------------------------------------------------------


def _bus_id(text: str | None, path: str) -> str | None:
    if text is None:
        return None
    try:
        return normalize_bus_id(text)
    except ValueError:
        raise SnapshotError(f"{path}: GPU bus id {text!r} is not a PCI address") from None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    match = _NUMBER.match(text.strip())
    return int(float(match.group(0))) if match else None


def _float(text: str | None) -> float | None:
    match = _NUMBER.match(text.strip()) if text is not None else None
    return float(match.group(0)) if match else None


def _hex(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip().lower().removeprefix("0x"), 16)
    except ValueError:
        return None


def _bool(text: str | None) -> bool | None:
    if text is None:
        return None
    lowered = text.strip().lower()
    return True if lowered in _YES else False if lowered in _NO else None


def _pair(g: Node, section: str, current: tuple[str, ...], pending: tuple[str, ...]) -> tuple[bool | None, bool | None] | None:
    node = g.section(section)
    if node is None:
        return None
    pair = (_bool(node.get(*current)), _bool(node.get(*pending)))
    return None if pair == (None, None) else pair


def _pci_class(g: Node) -> int | None:
    base = _hex(g.get("pci/pci_base_class", "pci/base_classcode"))
    sub = _hex(g.get("pci/pci_sub_class", "pci/sub_classcode"))
    return None if base is None or sub is None else base << 8 | sub


def _mig_devices(g: Node) -> int | None:
    node = g.section("mig_devices")
    if node is None:
        return None
    return sum(1 for c in node.children if c.name in ("mig_device",) or c.name.startswith("device"))


def _ecc(node: Node | None) -> EccCounts | None:
    """Either layout into {location: (corrected, uncorrected)}."""
    if node is None:
        return None
    found: dict[str, tuple[int | None, int | None]] = {}
    old = {c.name: c for c in node.children if c.name in ("single_bit", "double_bit")}
    if old:
        for name, location in _OLD_LOCATIONS.items():
            corrected = _int(old["single_bit"].get(name)) if "single_bit" in old else None
            uncorrected = _int(old["double_bit"].get(name)) if "double_bit" in old else None
            if corrected is not None or uncorrected is not None:
                found[location] = (corrected, uncorrected)
        if not found:              # only totals printed
            totals = (_int(old["single_bit"].get("total")) if "single_bit" in old else None,
                      _int(old["double_bit"].get("total")) if "double_bit" in old else None)
            if totals != (None, None):
                found["device_memory"] = totals
        return EccCounts(found) if found else None
    for memory, location in (("sram", "sram"), ("dram", "device_memory")):
        corrected = _int(node.get(f"{memory}_correctable"))
        parts = [_int(node.get(f"{memory}_uncorrectable"))] + [
            _int(node.get(f"{memory}_uncorrectable_{kind}")) for kind in ("parity", "secded")]
        known = [p for p in parts if p is not None]
        uncorrected = sum(known) if known else None
        if corrected is not None or uncorrected is not None:
            found[location] = (corrected, uncorrected)
    return EccCounts(found) if found else None


def _reason_name(name: str) -> str | None:
    """A reason line's name (any driver's spelling) -> the replay's name for it."""
    words = name.replace("clocks_event_reasons_counters_", "").replace("clocks_event_reason_", "") \
        .replace("clocks_throttle_reason_", "").split("_")
    has = set(words)
    if "idle" in has:
        return "gpu_idle"
    if has & {"application", "applications"}:
        return "applications_clocks_setting"
    if "display" in has:
        return "display_clock_setting"
    if "sync" in has:
        return "sync_boost"
    thermal = bool(has & {"thermal", "therm"})
    if "sw" in has:
        return "sw_thermal_slowdown" if thermal else "sw_power_cap" if "power" in has else None
    if "hw" in has:
        if thermal:
            return "hw_thermal_slowdown"
        if has & {"power", "brake", "braking"}:
            return "hw_power_brake_slowdown"
        return "hw_slowdown"
    return None


def _reasons(node: Node | None) -> Reasons | None:
    if node is None:
        return None
    active: dict[str, bool] = {}
    for child in node.walk():
        name = _reason_name(child.name)
        value = _bool(child.value) if child.value else None
        if name is not None and value is not None:
            active[name] = value
    return Reasons(active) if active else None


def _counters(node: Node | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for child in node.children if node is not None else []:
        name, value = _reason_name(child.name), _int(child.value)
        if name is not None and value is not None:
            out[name] = value
    return out


def _clocks(g: Node) -> dict:
    """SM clock now, the rated max SM clock and the application (target) graphics clock: XML <clocks><sm_clock>,
    <max_clocks><sm_clock>, <applications_clocks><graphics_clock>; text "Clocks / SM", "Max Clocks / SM",
    "Applications Clocks / Graphics". "N/A" (a VM, GeForce application clocks) reads as not captured."""
    return {"sm_clock_mhz": _int(g.get("clocks/sm_clock", "clocks/sm")),
            "max_sm_clock_mhz": _int(g.get("max_clocks/sm_clock", "max_clocks/sm")),
            "app_clock_mhz": _int(g.get("applications_clocks/graphics_clock", "applications_clocks/graphics"))}


def _temperatures(g: Node) -> dict:
    t = g.section("temperature")
    if t is None:
        return {}
    current = _int(t.get("gpu_temp", "gpu_current_temp"))
    out = {"temperature_c": current, "memory_temperature_c": _int(t.get("memory_temp", "memory_current_temp")),
           "shutdown_c": _int(t.get("gpu_temp_max_threshold", "gpu_shutdown_temp")),
           "slowdown_c": _int(t.get("gpu_temp_slow_threshold", "gpu_slowdown_temp")),
           "gpu_max_c": _int(t.get("gpu_temp_max_gpu_threshold", "gpu_max_operating_temp")),
           "memory_max_c": _int(t.get("gpu_temp_max_mem_threshold", "memory_max_operating_temp"))}
    margin = _int(t.get("gpu_temp_tlimit", "gpu_tlimit_temp"))
    if current is None or margin is None:
        return out
    tlimit = {"shutdown_c": ("gpu_temp_max_tlimit_threshold", "gpu_shutdown_tlimit_temp"),
              "slowdown_c": ("gpu_temp_slow_tlimit_threshold", "gpu_slowdown_tlimit_temp"),
              "gpu_max_c": ("gpu_temp_max_gpu_tlimit_threshold", "gpu_max_operating_tlimit_temp")}
    for key, names in tlimit.items():
        offset = _int(t.get(*names))
        if out[key] is None and offset is not None:
            out[key] = current + margin - offset
            out["thresholds_from_tlimit"] = True
    return out


def _processes(node: Node | None) -> tuple[tuple[int, int | None], ...] | None:
    """(pid, used MiB) per process: XML nests each in <process_info>, text lists them flat."""
    if node is None:
        return None
    if not node.children:
        return () if (node.value or "").strip().lower() in ("", "none") else None
    found: list[list[int | None]] = []
    for child in node.walk():
        if child.name in ("pid", "process_id"):
            pid = _int(child.value)
            if pid is not None:
                found.append([pid, None])
        elif child.name in ("used_memory", "used_gpu_memory") and found:
            found[-1][1] = _int(child.value)
    return tuple((int(p), m) for p, m in found)
