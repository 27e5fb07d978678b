"""NVLink health: each GPU's links, up or down, against what its model should have, and the links' error
counters (replay, recovery, CRC) judged as rates over a window, not as totals since the driver loaded.

NVML facts this follows (NVML API reference and change log, docs.nvidia.com/deploy/nvml-api):
- nvmlDeviceGetNvLinkState(handle, link) for link < NVML_NVLINK_MAX_LINKS (36 in nvidia-ml-py 13, an upper
  bound over all architectures): NotSupported on a GPU without NVLink, InvalidArgument (some drivers:
  NotSupported) for an index past the GPU's own links; both mean "no such link here".
- Counters: driver 525 replaced the per-lane field ids with NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY / _RECOVERY /
  _CRC, scopeId = link, so one nvmlDeviceGetFieldValues call reads every link's counters (each value
  carries its own return code). The data-CRC counter has no field id; nvmlDeviceGetNvLinkErrorCounter
  (NVML_NVLINK_ERROR_DL_CRC_DATA) reads it, and reads all four on drivers without the field ids. Blackwell
  removed both (change log v560->v565): there the counters are reported as not_supported.
- Links per GPU: V100 SXM2 6 (NVLink 2), A100 SXM4 12 (NVLink 3), H100/H200 SXM 18 (NVLink 4), B200 18
  (NVLink 5) (NVIDIA NVLink pages; Fabric Manager user guide, HGX baseboard topologies). A PCIe card has
  NVLink only through an optional bridge, so nothing is expected of it unless `expected_links` says so.
Verdicts are in rules/nvlink.yaml.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pynvml

from detector.backends.nvmlcompat import constant as nvml_constant
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo
from detector.core.rates import CounterWindow
from detector.core.sweep import SweepContext
from detector.core.types import Observation

# PCI device id (the high 16 bits of pciDeviceId) -> (model, NVLinks every board of it has connected).
EXPECTED_BY_DEVICE_ID: dict[int, tuple[str, int]] = {
    0x1DB1: ("V100 SXM2 16GB", 6), 0x1DB5: ("V100 SXM2 32GB", 6),
    0x20B0: ("A100 SXM4 40GB", 12), 0x20B2: ("A100 SXM4 80GB", 12),
    0x2330: ("H100 SXM5 80GB", 18), 0x2335: ("H200 SXM 141GB", 18), 0x2901: ("B200", 18),
    0x20F1: ("A100 PCIe 40GB", 0), 0x20B5: ("A100 PCIe 80GB", 0), 0x2331: ("H100 PCIe", 0),
    0x2321: ("H100 NVL", 0), 0x2684: ("GeForce RTX 4090", 0),
}
# NVML device names, for a device id not in the table above (exact names: "NVIDIA H200 NVL" is a PCIe card).
EXPECTED_BY_NAME: dict[str, int] = {
    "Tesla V100-SXM2-16GB": 6, "Tesla V100-SXM2-32GB": 6, "NVIDIA A100-SXM4-40GB": 12,
    "NVIDIA A100-SXM4-80GB": 12, "NVIDIA H100 80GB HBM3": 18, "NVIDIA H200": 18, "NVIDIA B200": 18,
}
COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")
_FIELD_IDS = {"replay": pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, "recovery": pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY,
              "crc_flit": pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC}
_LEGACY = {"replay": pynvml.NVML_NVLINK_ERROR_DL_REPLAY, "recovery": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
           "crc_flit": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, "crc_data": pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA}
_NO_LINK = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)
_NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
_VALUE = {pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
          pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
          pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal", nvml_constant("NVML_VALUE_TYPE_UNSIGNED_SHORT"): "usVal"}
RATED = ("replay", "recovery", "crc")


class NvlinkCheck(Check):
    """One observation per GPU (link counts, error totals and rates) and one per link that is down. A GPU
    without NVLink is reported as not_supported, never as healthy."""

    name = "nvlink"
    description = "NVLinks per GPU: active vs expected for the model, error counters (replay, recovery, CRC) as rates"
    fields = {
        "scope": "gpu (one per GPU: link counts, error totals and rates) or link (one per link that is down)",
        "nvlink": "supported, or not_supported (NVML answers NotSupported: a PCIe card, GeForce)",
        "link": "scope link: the link's number",
        "link_state": "scope link: inactive",
        "expected": "scope link: true when this link should be up (its number is below links_expected)",
        "links_expected": "links that should be up: the model's count or the expected_links setting (null: unknown model)",
        "expected_because": "where links_expected comes from",
        "links_reported": "links NVML answers for on this GPU (up or down)",
        "links_active": "links up",
        "links_inactive": "links present but down",
        "inactive_links": "the numbers of the links down, comma-separated ('' when none)",
        "counters": "how the error counters were read: field_values, error_counter (older drivers) or not_supported",
        "replay_total": "NVLink replay errors since the driver loaded, all links (null: not readable)",
        "recovery_total": "NVLink recovery (link retrain) events since the driver loaded, all links",
        "crc_flit_total": "flow-control (flit) CRC errors since the driver loaded, all links",
        "crc_data_total": "data CRC errors since the driver loaded, all links (null where only flit CRC is readable)",
        "crc_total": "flit and data CRC errors together",
        "replay_increase": "replay errors in the last rate_window_s seconds (null until two readings)",
        "recovery_increase": "recovery events in the last rate_window_s seconds",
        "crc_increase": "CRC errors in the last rate_window_s seconds",
        "replay_per_min": "replay errors per minute over the window",
        "recovery_per_min": "recovery events per minute over the window",
        "crc_per_min": "CRC errors per minute over the window",
        "rate_window_s": "seconds the increases cover (up to the window setting; less soon after a start)",
        "links_with_new_errors": "links whose counters rose since the previous run, as '3 (replay +4)' ('' when none)",
    }
    config_fields = {
        "expected_links": ConfigField(int, -1, "NVLinks that should be up on every GPU (-1: by GPU model; set it for "
                                               "PCIe cards with NVLink bridges)"),
        "window": ConfigField(float, 600.0, "seconds over which NVLink error counters are turned into rates"),
    }
    gauges = {
        "gpu_npd_nvlink_links_active": GaugeSpec("links_active", "NVLinks up on the GPU"),
        "gpu_npd_nvlink_links_expected": GaugeSpec("links_expected", "NVLinks that should be up on the GPU"),
        "gpu_npd_nvlink_replay_errors": GaugeSpec("replay_total", "NVLink replay errors since the driver loaded"),
        "gpu_npd_nvlink_recovery_errors": GaugeSpec("recovery_total", "NVLink recovery events since the driver loaded"),
        "gpu_npd_nvlink_crc_errors": GaugeSpec("crc_total", "NVLink CRC errors (flit and data) since the driver loaded"),
    }
    default_interval_s = 60.0
    default_timeout_s = 15.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._window = CounterWindow(float(self.config["window"]))
        self._device_ids: dict[str, int | None] = {}            # uuid -> PCI device id, read once
        self._last_links: dict[str, dict[int, dict[str, int]]] = {}

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now = ctx.host.nvml, self._clock()
        observations, gpus, errors = [], [], []
        for gpu in ctx.inventory.gpus:
            if gpu.handle is None or gpu.error:
                continue
            try:
                fields, per_link, down = self._read(nvml, gpu, now)
            except pynvml.NVMLError as e:
                errors.append(f"GPU {gpu.index}: {e}")
                continue
            observations.append(Observation(self.name, fields, gpu.ref()))
            for link in down:
                observations.append(Observation(self.name, {
                    "scope": "link", "nvlink": "supported", "link": link, "link_state": "inactive",
                    "expected": fields["links_expected"] is not None and link < fields["links_expected"],
                    "links_expected": fields["links_expected"], "expected_because": fields["expected_because"],
                    "inactive_links": fields["inactive_links"]}, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields, "links": per_link})
        live = {g.uuid for g in ctx.inventory.gpus if g.uuid}
        self._window.keep_only({(u, c) for u in live for c in RATED})
        self._last_links = {u: v for u, v in self._last_links.items() if u in live}
        return CheckOutput(observations, {"gpus": gpus}, summary=_summary(gpus), error="; ".join(errors))

    def _read(self, nvml: Any, gpu: GpuInfo, now: float) -> tuple[dict[str, Any], list[dict[str, Any]], list[int]]:
        fields: dict[str, Any] = dict.fromkeys(self.fields)
        fields["scope"] = "gpu"
        fields["links_expected"], fields["expected_because"] = self._expected(nvml, gpu)
        states = _link_states(nvml, gpu.handle)
        down = [link for link, up in states.items() if not up]
        fields.update(nvlink="supported" if states else "not_supported", links_reported=len(states),
                      links_active=len(states) - len(down), links_inactive=len(down),
                      inactive_links=", ".join(map(str, down)))
        source, per_link = _counters(nvml, gpu.handle, sorted(states))
        fields["counters"] = source
        totals = {c: _sum(v.get(c) for v in per_link.values()) for c in COUNTERS}
        totals["crc"] = _sum([totals["crc_flit"], totals["crc_data"]])
        for c in COUNTERS:
            fields[f"{c}_total"] = totals[c]
        fields["crc_total"] = totals["crc"]
        fields["rate_window_s"] = 0.0
        for c in RATED:
            rise = self._window.add((gpu.uuid, c), totals[c], now) if totals[c] is not None else None
            fields[f"{c}_increase"] = int(rise.amount) if rise else None
            fields[f"{c}_per_min"] = round(rise.per_min(), 2) if rise else None
            if rise:
                fields["rate_window_s"] = round(rise.seconds, 1)
        fields["links_with_new_errors"] = _new_errors(self._last_links.get(gpu.uuid or "", {}), per_link)
        self._last_links[gpu.uuid or ""] = per_link
        table = [{"link": link, "active": states[link], **per_link.get(link, {})} for link in sorted(states)]
        return fields, table, down

    def _expected(self, nvml: Any, gpu: GpuInfo) -> tuple[int | None, str]:
        setting = int(self.config["expected_links"])
        if setting >= 0:
            return setting, f"{setting} by the expected_links setting"
        key = gpu.uuid or str(gpu.index)
        if key not in self._device_ids:
            try:
                self._device_ids[key] = nvml.nvmlDeviceGetPciInfo(gpu.handle).pciDeviceId >> 16
            except pynvml.NVMLError:
                self._device_ids[key] = None
        known = EXPECTED_BY_DEVICE_ID.get(self._device_ids[key] or -1)
        if known is None and gpu.name in EXPECTED_BY_NAME:
            known = (gpu.name, EXPECTED_BY_NAME[gpu.name])
        if known is None:
            return None, f"unknown model {gpu.name!r}: set expected_links to judge its links"
        model, links = known
        if links == 0:
            return 0, f"{model}: no NVLink expected (a PCIe card; set expected_links if it has NVLink bridges)"
        return links, f"{model} has {links} NVLinks"


def _link_states(nvml: Any, handle: Any) -> dict[int, bool]:
    """link -> up, for every link the GPU has; {} when it has no NVLink."""
    try:
        states = {0: nvml.nvmlDeviceGetNvLinkState(handle, 0) == pynvml.NVML_FEATURE_ENABLED}
    except (*_NO_LINK, pynvml.NVMLError_FunctionNotFound):
        return {}
    for link in range(1, pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            states[link] = nvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
        except _NO_LINK:
            continue
    return states


def _counters(nvml: Any, handle: Any, links: list[int]) -> tuple[str, dict[int, dict[str, int]]]:
    """Each link's counters: one batched field-value read, then the per-link call for what it left out
    (data CRC always; everything on drivers before 525). A counter NotSupported on one link is not asked
    of the others, so a GPU that has neither API (Blackwell) costs a handful of calls."""
    per_link: dict[int, dict[str, int]] = {link: {} for link in links}
    if not links:
        return "not_supported", per_link
    source = "not_supported"
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, [(fid, link) for link in links for fid in _FIELD_IDS.values()])
    except _NOT_HERE:
        values = []
    names = {fid: name for name, fid in _FIELD_IDS.items()}
    for v in values:
        value = _field_value(v)
        if value is not None and v.scopeId in per_link and v.fieldId in names:
            per_link[v.scopeId][names[v.fieldId]] = value
            source = "field_values"
    for name, counter in _LEGACY.items():
        for link in links:
            if name in per_link[link]:
                continue
            try:
                per_link[link][name] = nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)
            except _NOT_HERE:
                break
            except pynvml.NVMLError_InvalidArgument:
                continue
            source = "error_counter" if source == "not_supported" else source
    return source, per_link


def _field_value(v: Any) -> int | None:
    if v.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    if v.valueType == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return int(v.value.dVal)
    member = _VALUE.get(v.valueType)
    return int(getattr(v.value, member)) if member else None


def _sum(values: Any) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _new_errors(before: dict[int, dict[str, int]], now: dict[int, dict[str, int]]) -> str:
    parts = []
    for link, counts in sorted(now.items()):
        rises = [f"{c} +{v - before[link][c]}" for c, v in counts.items()
                 if link in before and c in before[link] and v > before[link][c]]
        if rises:
            parts.append(f"{link} ({', '.join(rises)})")
    return "; ".join(parts)


def _summary(gpus: list[dict[str, Any]]) -> str:
    if not gpus:
        return "no GPU to look at"
    if all(g["nvlink"] == "not_supported" and not g["links_expected"] for g in gpus):
        return "NVLink not supported on these GPUs"
    down = sum(g["links_inactive"] for g in gpus)
    missing = sum(max(0, (g["links_expected"] or 0) - g["links_reported"]) for g in gpus)
    erroring = [str(g["index"]) for g in gpus if any(g[f"{c}_increase"] for c in RATED)]
    text = f"{sum(g['links_active'] for g in gpus)} links up on {len(gpus)} GPUs"
    text += f", {down} down" if down else ""
    text += f", {missing} missing" if missing else ""
    return text + (f"; errors rising on GPU {', '.join(erroring)}" if erroring else "")
