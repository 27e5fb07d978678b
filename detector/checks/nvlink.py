"""NVLink health: each GPU's links, up or down, against what this machine shows it should have, and the
links' error counters (replay, recovery, CRC) judged as rates over a window, not as totals since the
driver loaded.

NVML facts this follows (NVML API reference and change log, docs.nvidia.com/deploy/nvml-api):
- nvmlDeviceGetNvLinkState(handle, link) for link < NVML_NVLINK_MAX_LINKS (36 in nvidia-ml-py 13, an upper
  bound over all architectures): NotSupported on a GPU without NVLink, InvalidArgument (some drivers:
  NotSupported) for an index past the GPU's own links; both mean "no such link here". A real H100 SXM5
  passed alone into a VM answers NotSupported on all 18 of its links (../shared/real-machines/h100-vm-580).
- Counters: driver 525 replaced the per-lane field ids with NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY / _RECOVERY /
  _CRC, scopeId = link, so one nvmlDeviceGetFieldValues call reads every link's counters (each value
  carries its own return code). The data-CRC counter has no field id; nvmlDeviceGetNvLinkErrorCounter
  (NVML_NVLINK_ERROR_DL_CRC_DATA) reads it, and reads all four on drivers without the field ids. Blackwell
  removed both (change log v560->v565): there the counters are reported as not_supported.

Which links should be up comes from the machine, never from a model's data sheet alone:
- the `expected_links` setting, when set;
- else, on a node that shows NVLink is in use (NVSwitches on its PCI bus, or a GPU with a link up now or
  earlier in this boot), every link NVML reports for the GPU, and as many as the node's GPUs of the same
  model report (an 8-GPU NVSwitch board whose GPU trained none is critical);
- else (a GPU alone, a PCIe card without a bridge) none: NVML reporting links inactive there means
  nothing is connected. NVIDIA/NVSentinel#1481 had DCGM call all 12 links of a lone A100 PCIe down.
Each link's counters are also kept as rates of their own, so a finding names the link and its rate beside
its total since the driver loaded ("link 14: 3 recoveries in the last 3 min (1/min); 508 since the driver
loaded"): marin-community/marin#9086 had one GB200 link hold 505 recovery events over five days, still
rising, before it failed with XID 149, while every other link of 320 GPUs read 0. Which rise counts is set
by `replay_per_min`, `recovery_per_min` (0: any rise, as DCGM's health watch) and `crc_per_min`/`crc_min_count`.
One sweep and no more (diagnose without a duration, a replayed capture) has no rate: each link's totals are
compared with the same link on the node's other GPUs of the same model (detector/core/siblings.py), and
the finding says it compares totals since the driver loaded.
A down link is critical only once held down for `debounce` seconds: NVLinks are briefly down after every
boot while they train, and a single reading raised fatal alarms on 214 of 288 GB200 nodes, none faulty
(NVIDIA/NVSentinel#1701, fixed by a consecutive-poll debounce in #1715). A link first seen down when
the node has been up longer than the debounce had all that time to train, so it counts as held.
Verdicts are in rules/nvlink.yaml.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pynvml

from detector.backends.nvmlcompat import constant as nvml_constant
from detector.backends.pci import nvswitch_count
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo
from detector.core.per_gpu import read_each_gpu
from detector.core.rates import CounterWindow, Increase, span_text
from detector.core.siblings import standouts
from detector.core.sweep import SweepContext
from detector.core.types import Observation

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
_NOUN = {"replay": "replay errors", "recovery": "recoveries", "crc": "CRC errors"}
_ONE = {"replay": "replay error", "recovery": "recovery", "crc": "CRC error"}


class NvlinkCheck(Check):
    """One observation per GPU (link counts, error totals and rates) and one per link that is down. A GPU
    without NVLink is reported as not_supported, never as healthy."""

    name = "nvlink"
    description = ("NVLinks per GPU: active vs what the node shows it should have, error counters (replay, recovery, "
                   "CRC) as rates")
    fields = {
        "scope": "gpu (one per GPU: link counts, error totals and rates) or link (one per link that is down)",
        "nvlink": "supported, not_supported (NVML answers NotSupported: a PCIe card, GeForce, a GPU alone in a VM) "
                  "or unknown (nothing here can tell: a snapshot without `nvidia-smi nvlink -s`)",
        "link": "scope link: the link's number",
        "link_state": "scope link: inactive",
        "expected": "scope link: true when this link should be up (see expected_because)",
        "down_for_s": "scope link: seconds the link has been down (null: unknown, as in one snapshot)",
        "held_down": "scope link: down for at least debounce_s (or for an unknown time): no longer a link training",
        "debounce_s": "scope link: the debounce setting",
        "links_expected": "links that should be up: from the expected_links setting, or what this node shows "
                          "(NVSwitches, links up in this boot, the node's GPUs of the same model); 0 on a GPU alone",
        "expected_because": "where links_expected comes from",
        "links_settling": "expected links down for less than debounce_s (training after a boot, or a flap)",
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
        "replay_links": "links whose replay errors rose over the window past replay_per_min, each with its rise, "
                        "rate and total since the driver loaded ('' when none)",
        "recovery_links": "links whose recovery (retrain) events rose past recovery_per_min, as replay_links",
        "crc_links": "links whose CRC errors (flit and data) rose past crc_per_min and crc_min_count, as replay_links",
        "rising_links": "the numbers of the links in replay_links, recovery_links or crc_links, comma-separated",
        "links_above_siblings": "one sweep only (diagnose without a duration, a replay): links whose totals since "
                                "the driver loaded are far above the same link's on the node's other GPUs of the "
                                "same model ('' otherwise): a comparison of totals, not a rate",
    }
    config_fields = {
        "expected_links": ConfigField(int, -1, "NVLinks that should be up on every GPU (-1: from what the node "
                                               "shows: NVSwitches, links up, GPUs of the same model)"),
        # 3 readings at the default 60 s interval: boot-time training is over well within it (NVSentinel#1715
        # saw every boot transient at one poll), while a link really down is named within minutes.
        "debounce": ConfigField(float, 180.0, "seconds a link must stay down before it counts as down (links "
                                              "train after every boot, and a flap comes back)"),
        "window": ConfigField(float, 600.0, "seconds over which NVLink error counters are turned into rates"),
        # DCGM's NVLink health watch fails on any replay or recovery rise (DCGM_LIMIT_MAX_NVLINK_ERROR = 1) and
        # treats CRC errors as mattering from 100 a second (DCGM_LIMIT_MAX_NVLINK_CRC_ERROR): rules/nvlink.yaml.
        "replay_per_min": ConfigField(float, 0.0, "replay errors a minute on one link from which it counts as "
                                                  "rising (0: any rise in the window, as DCGM's health watch)"),
        "recovery_per_min": ConfigField(float, 0.0, "recovery (retrain) events a minute on one link from which it "
                                                    "counts as rising (0: any rise, as DCGM's health watch)"),
        "crc_per_min": ConfigField(float, 1.0, "CRC errors a minute on one link from which it counts as rising"),
        "crc_min_count": ConfigField(int, 10, "CRC errors one link must add in the window to count as rising (a "
                                              "single hit after a start is not a rate)"),
        "siblings_factor": ConfigField(float, 10.0, "one sweep only: a link's total since the driver loaded stands "
                                                    "out at this many times the median of the same link on the "
                                                    "node's other GPUs of the same model"),
        "siblings_floor_replay": ConfigField(float, 1000.0, "one sweep only: and at least this many replay errors "
                                                            "above that median"),
        "siblings_floor_recovery": ConfigField(float, 100.0, "one sweep only: and at least this many recovery "
                                                             "events above it (marin-community/marin#9086: 505 "
                                                             "before the link failed)"),
        "siblings_floor_crc": ConfigField(float, 1000.0, "one sweep only: and at least this many CRC errors above "
                                                         "it (healthy H100s keep historical CRC counts: "
                                                         "aws/eks-node-monitoring-agent#261)"),
    }
    gauges = {
        "gpu_npd_nvlink_links_active": GaugeSpec("links_active", "NVLinks up on the GPU"),
        "gpu_npd_nvlink_links_expected": GaugeSpec("links_expected", "NVLinks that should be up on the GPU"),
        "gpu_npd_nvlink_replay_errors": GaugeSpec("replay_total", "NVLink replay errors since the driver loaded"),
        "gpu_npd_nvlink_recovery_errors": GaugeSpec("recovery_total", "NVLink recovery events since the driver loaded"),
        "gpu_npd_nvlink_crc_errors": GaugeSpec("crc_total", "NVLink CRC errors (flit and data) since the driver loaded"),
        "gpu_npd_gpu_nvlink_replay_errors_per_minute": GaugeSpec("replay_per_min", "NVLink replay errors per minute "
                                                                 "over the nvlink check's window, all links"),
        "gpu_npd_gpu_nvlink_recovery_errors_per_minute": GaugeSpec("recovery_per_min", "NVLink recovery events per "
                                                                   "minute over the window, all links"),
        "gpu_npd_gpu_nvlink_crc_errors_per_minute": GaugeSpec("crc_per_min", "NVLink CRC errors per minute over "
                                                              "the window, all links"),
    }
    default_interval_s = 60.0
    default_timeout_s = 15.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._window = CounterWindow(float(self.config["window"]))
        self._links = CounterWindow(float(self.config["window"]))     # (uuid, link, counter): only links that count
        self._last_links: dict[str, dict[int, dict[str, int]]] = {}
        self._last_seen: dict[str, float] = {}
        self._history = LinkHistory()

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now = ctx.host.nvml, self._clock()
        self._history.start_boot(ctx.host.current_boot())
        uptime = ctx.host.uptime_s()
        observations, gpus = [], []
        answers = read_each_gpu(ctx.inventory.gpus, lambda gpu: _link_states(nvml, gpu.handle))
        states = {gpu.index: answer for gpu, answer in answers.readings if answer is not None}
        unknown = [gpu for gpu, answer in answers.readings if answer is None]
        for gpu in unknown:
            fields = {**dict.fromkeys(self.fields), "scope": "gpu", "nvlink": "unknown",
                      "expected_because": "NVLink state cannot be read here"}
            observations.append(Observation(self.name, fields, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields, "links": []})
        read = [g for g in ctx.inventory.gpus if g.index in states]
        held = {g.index: self._history.observe(g.uuid or str(g.index), states[g.index], now, uptime) for g in read}
        evidence = _nvlink_evidence(ctx, states, self._history)
        expectations = {g.index: self._expected(g, read, states, evidence) for g in read}
        counted = read_each_gpu(read, lambda g: self._read(nvml, g, now, states[g.index], *expectations[g.index],
                                                           uptime=uptime))
        above = self._above_siblings(counted.readings) if ctx.host.snapshot or ctx.host.one_sweep else {}
        for gpu, (fields, per_link) in counted.readings:
            fields["links_above_siblings"] = "; ".join(above.get(gpu.index, []))
            expected, because = expectations[gpu.index]
            debounce = float(self.config["debounce"])
            links = [Observation(self.name, {
                "scope": "link", "nvlink": "supported", "link": link, "link_state": "inactive",
                "expected": link in expected, "links_expected": fields["links_expected"], "expected_because": because,
                "inactive_links": fields["inactive_links"], "down_for_s": _rounded(down_for),
                "held_down": down_for is None or down_for >= debounce, "debounce_s": debounce}, gpu.ref())
                for link, down_for in sorted(held[gpu.index].items())]
            fields["links_settling"] = sum(o.fields["expected"] and not o.fields["held_down"] for o in links)
            observations += [Observation(self.name, fields, gpu.ref()), *links]
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields, "links": per_link})
        live = {g.uuid for g in ctx.inventory.gpus if g.uuid}
        self._window.keep_only({(u, c) for u in live for c in RATED})
        self._links.forget(lambda key: key[0] in live)
        self._last_links = {u: v for u, v in self._last_links.items() if u in live}
        self._last_seen = {u: v for u, v in self._last_seen.items() if u in live}
        return CheckOutput(observations, {"gpus": gpus}, summary=_summary(gpus),
                           error="; ".join(answers.errors + counted.errors))

    def _read(self, nvml: Any, gpu: GpuInfo, now: float, states: dict[int, bool], expected: set[int],
              because: str, uptime: float | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        fields: dict[str, Any] = dict.fromkeys(self.fields)
        down = [link for link, up in states.items() if not up]
        fields.update(scope="gpu", nvlink="supported" if states else "not_supported", links_reported=len(states),
                      links_active=len(states) - len(down), links_inactive=len(down),
                      inactive_links=", ".join(map(str, down)), links_expected=len(expected),
                      expected_because=because)
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
        fields.update(self._rising_links(gpu.uuid or "", per_link, now, uptime))
        self._last_links[gpu.uuid or ""] = per_link
        self._last_seen[gpu.uuid or ""] = now
        table = [{"link": link, "active": states[link], **per_link.get(link, {})} for link in sorted(states)]
        return fields, table

    def _rising_links(self, uuid: str, per_link: dict[int, dict[str, int]], now: float,
                      uptime: float | None) -> dict[str, str]:
        """Each counter's links that rose over the window past the settings, described. A link is kept in
        the window only once one of its counters is not 0 (a healthy 8-GPU board has 144 links at 0): when one
        leaves 0, its previous reading (0, in the previous run) starts its window."""
        before, then = self._last_links.get(uuid, {}), self._last_seen.get(uuid)
        found: dict[str, list[tuple[int, str]]] = {c: [] for c in RATED}
        for link, counts in sorted(per_link.items()):
            for c in RATED:
                value = _link_value(counts, c)
                key = (uuid, link, c)
                if value is None or (key not in self._links and not value):
                    continue
                previous = _link_value(before.get(link, {}), c)
                if key not in self._links and then is not None and previous is not None and previous <= value:
                    self._links.add(key, previous, then)
                rise = self._links.add(key, value, now)
                if rise is not None and self._rising(c, rise):
                    found[c].append((link, _describe(link, c, value, rise, uptime)))
        out = {f"{c}_links": "; ".join(text for _, text in hits) for c, hits in found.items()}
        out["rising_links"] = ", ".join(map(str, sorted({link for hits in found.values() for link, _ in hits})))
        return out

    def _rising(self, counter: str, rise: Increase) -> bool:
        if rise.amount <= 0 or rise.seconds <= 0:
            return False
        if counter == "crc":
            return rise.per_min() >= float(self.config["crc_per_min"]) and rise.amount >= int(self.config["crc_min_count"])
        return rise.per_min() >= float(self.config[f"{counter}_per_min"])

    def _above_siblings(self, readings: list[tuple[GpuInfo, tuple[dict[str, Any], list[dict[str, Any]]]]]
                        ) -> dict[int | None, list[str]]:
        """One sweep: each link whose totals since the driver loaded stand far above those of the same link on
        the node's other GPUs of the same model (on an NVSwitch board link i of every GPU meets the same switch,
        so a pattern shared by all GPUs is the board's, not one link's), described per GPU."""
        found: dict[int | None, list[str]] = {}
        gpu_names = {gpu.index: gpu.name for gpu, _ in readings}
        for c in RATED:
            values = {(gpu.index, row["link"]): _link_value(row, c) for gpu, (_, table) in readings for row in table}
            groups = {(gpu.index, row["link"]): f"{gpu.name}/{row['link']}" for gpu, (_, table) in readings
                      for row in table}
            hits = standouts(values, groups, factor=float(self.config["siblings_factor"]),
                             floor=float(self.config[f"siblings_floor_{c}"]))
            for (index, link), hit in sorted(hits.items()):
                found.setdefault(index, []).append(
                    f"link {link}: {int(hit.value)} {_NOUN[c]} since the driver loaded, against a median of "
                    f"{hit.median:g} on link {link} of the node's {hit.siblings} other {gpu_names[index]} GPUs: "
                    "a comparison of totals, not a rate (one sweep cannot measure one)")
        return found

    def _expected(self, gpu: GpuInfo, read: list[GpuInfo], states: dict[int, dict[int, bool]],
                  evidence: str) -> tuple[set[int], str]:
        """The links of this GPU that should be up, and why: from the setting, or from what this node shows."""
        setting = int(self.config["expected_links"])
        if setting >= 0:
            return set(range(setting)), f"{setting} by the expected_links setting"
        seen_up = self._history.seen_up.get(gpu.uuid or str(gpu.index), set())
        if not evidence:
            return set(seen_up), ("no NVSwitch and no NVLink up on this node: nothing connected, none expected"
                                  if not seen_up else "the links seen up in this boot")
        like = [len(states[g.index]) for g in read if g.name == gpu.name]
        wanted = set(states[gpu.index]) | seen_up
        if len(wanted) < max(like, default=0):          # fewer than its peers report: the rest are missing
            wanted |= set(range(max(like)))
        return wanted, (f"{evidence}: every link NVML reports, and as many as the node's other {gpu.name} GPUs "
                        f"({max(like, default=0)})" if len(like) > 1 else f"{evidence}: every link NVML reports")


@dataclass
class LinkHistory:
    """What this boot showed of each GPU's links: which were seen up (held as expected from then on, as the
    InfiniBand check learns its ports), and since when each down link has been down."""

    boot: str = ""
    seen_up: dict[str, set[int]] = field(default_factory=dict)
    down_since: dict[tuple[str, int], float | None] = field(default_factory=dict)

    def start_boot(self, boot: str) -> None:
        if boot != self.boot:
            self.boot, self.seen_up, self.down_since = boot, {}, {}

    def observe(self, gpu: str, states: dict[int, bool], now: float, uptime: float | None) -> dict[int, float | None]:
        """Each down link -> seconds it has been down (None: unknown, as in one snapshot). A link never seen up
        in this boot has been down, as far as anyone can tell, since the boot began."""
        up = self.seen_up.setdefault(gpu, set())
        down: dict[int, float | None] = {}
        for link, is_up in states.items():
            key = (gpu, link)
            if is_up:
                up.add(link)
                self.down_since.pop(key, None)
                continue
            if key not in self.down_since:
                self.down_since[key] = now if link in up else None if uptime is None else now - uptime
            since = self.down_since[key]
            down[link] = None if since is None else max(0.0, now - since)
        for key in [k for k in self.down_since if k[0] == gpu and k[1] not in down]:
            del self.down_since[key]
        return down


def _nvlink_evidence(ctx: SweepContext, states: dict[int, dict[int, bool]], history: LinkHistory) -> str:
    """Why this node is one whose GPUs use NVLink ('' when nothing shows it): NVSwitches on its bus, or links up."""
    try:
        switches = nvswitch_count(ctx.host.pci)
    except OSError:
        switches = 0
    if switches:
        return f"{switches} NVSwitches on the PCI bus"
    if any(any(links.values()) for links in states.values()) or any(history.seen_up.values()):
        return "NVLinks up on this node's GPUs in this boot"
    return ""


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _link_states(nvml: Any, handle: Any) -> dict[int, bool] | None:
    """link -> up, for every link the GPU has; {} when it has no NVLink; None when nothing can tell (a
    binding or snapshot without the call)."""
    try:
        states = {0: nvml.nvmlDeviceGetNvLinkState(handle, 0) == pynvml.NVML_FEATURE_ENABLED}
    except _NO_LINK:
        return {}
    except pynvml.NVMLError_FunctionNotFound:
        return None
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


def _link_value(counts: dict[str, Any], counter: str) -> int | None:
    """One link's count of a rated counter: crc is flit and data CRC together."""
    if counter != "crc":
        return counts.get(counter)
    return _sum([counts.get("crc_flit"), counts.get("crc_data")])


def _describe(link: int, counter: str, total: int, rise: Increase, uptime: float | None) -> str:
    """'link 14: 3 recoveries in the last 3 min (1/min); 508 since the driver loaded (the node has been up 5 days)'"""
    up = f" (the node has been up {span_text(uptime)})" if uptime else ""
    noun = _ONE[counter] if int(rise.amount) == 1 else _NOUN[counter]
    return (f"link {link}: {int(rise.amount)} {noun} in the last {span_text(rise.seconds)} "
            f"({_rate(rise.per_min())}/min); {total} since the driver loaded{up}")


def _rate(per_min: float) -> str:
    return f"{per_min:.0f}" if per_min >= 10 else f"{per_min:.2g}"


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
    if any(g["nvlink"] == "unknown" for g in gpus):
        known = [g for g in gpus if g["nvlink"] != "unknown"]
        return "NVLink state unknown" + (f" on {len(gpus) - len(known)} GPUs; " + _summary(known) if known else "")
    if all(g["nvlink"] == "not_supported" and not g["links_expected"] for g in gpus):
        return "NVLink not supported on these GPUs"
    if all(not g["links_expected"] and not g["links_active"] for g in gpus):
        return f"no NVLink expected: {gpus[0]['expected_because']}"
    down = sum(g["links_inactive"] for g in gpus)
    missing = sum(max(0, (g["links_expected"] or 0) - g["links_reported"]) for g in gpus)
    erroring = [str(g["index"]) for g in gpus if g.get("rising_links")]
    standing = [str(g["index"]) for g in gpus if g.get("links_above_siblings")]
    text = f"{sum(g['links_active'] for g in gpus)} links up on {len(gpus)} GPUs"
    text += f", {down} down" if down else ""
    text += f", {missing} missing" if missing else ""
    settling = sum(g["links_settling"] or 0 for g in gpus)
    text += f" ({settling} down for less than the debounce)" if settling else ""
    text += f"; errors rising on GPU {', '.join(erroring)}" if erroring else ""
    return text + (f"; link totals since the driver loaded far above their siblings' on GPU {', '.join(standing)}"
                   if standing else "")
