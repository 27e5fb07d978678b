"""A real H100 idle and then busy at its power limit (tests/fixtures/gpu_check/h100-vm-580-perf, captured by
tools/perf_capture.py on a GPU machine): what NVML answered there, played back call by call to the
performance and thermal checks. A busy H100 held by the SW power cap runs its SM clock at 65-71 % of its
rated 1980 MHz: normal, and neither check may call it slow or throttled."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from conftest import REPO, Clock
from detector.checks.performance import PerformanceCheck
from detector.checks.thermal import ThermalCheck
from detector.core.inventory import GpuInfo, Inventory
from detector.core.sweep import Host, SweepContext
from detector.rules.engine import RuleEngine
from detector.rules.sources import load_ruleset

CAPTURE = REPO / "tests" / "fixtures" / "gpu_check" / "h100-vm-580-perf" / "perf-capture.json"
INTERVAL_S = 2.0       # as the capture sampled: the throttle counters are real nanoseconds of that time
# The capture's load lasted 40 s: the window is a minute, judged once it covers 30 s (the defaults, 600 and 120
# s, are for a load that lasts; what is judged is the same).
SETTINGS = {"window": 60.0, "min_span": 30.0, "min_samples": 6}


class CapturedNvml:
    """The NVML calls the two checks make, answered from one captured sample at a time."""

    def __init__(self, capture: dict[str, Any]):
        self.ids = {v: k for k, v in capture["field_ids"].items()}
        self.sample: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML") or name.startswith("nvml_"):
            return getattr(pynvml, name)
        def not_captured(*args: Any) -> Any:                        # a call the capture did not make
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return not_captured

    def _value(self, key: str) -> Any:
        value = self.sample[key]
        if isinstance(value, str) and value.startswith("error"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return self._value({pynvml.NVML_CLOCK_SM: "clock_sm_mhz", pynvml.NVML_CLOCK_MEM: "clock_mem_mhz",
                            pynvml.NVML_CLOCK_GRAPHICS: "clock_graphics_mhz"}[clock])

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return self._value({pynvml.NVML_CLOCK_SM: "max_clock_sm_mhz", pynvml.NVML_CLOCK_MEM: "max_clock_mem_mhz",
                            pynvml.NVML_CLOCK_GRAPHICS: "max_clock_graphics_mhz"}[clock])

    def nvmlDeviceGetApplicationsClock(self, handle, clock):
        return self._value({pynvml.NVML_CLOCK_SM: "app_clock_sm_mhz", pynvml.NVML_CLOCK_MEM: "app_clock_mem_mhz",
                            pynvml.NVML_CLOCK_GRAPHICS: "app_clock_graphics_mhz"}[clock])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(**self._value("utilization"))

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._value("power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._value("enforced_power_limit_mw")

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return self._value("power_management_limit_mw")

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._value("temperature_c")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._value("clocks_event_reasons")

    def nvmlDeviceGetViolationStatus(self, handle, policy):
        name = next(n for n in self.sample["violation_ns"] if getattr(pynvml, n) == policy)
        return SimpleNamespace(**self.sample["violation_ns"][name])

    def nvmlDeviceGetFieldValues(self, handle, ids):
        out = []
        for fid in ids:
            field = self.sample["fields"].get(self.ids.get(fid, ""))
            if field is None:
                out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=0, value=None))
                continue
            kind = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal"}[field["type"]]
            out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, valueType=field["type"],
                                       value=SimpleNamespace(**{kind: field["value"]})))
        return out


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    return json.loads(CAPTURE.read_text())


def test_the_capture_is_of_a_busy_gpu_at_its_power_cap(capture):
    """What the verdict below rests on: the load really held the GPU busy at its limit, below its rated clock."""
    busy = capture["load"]["samples"][0]
    assert all(s["utilization"]["gpu"] >= 99 for s in busy)
    assert all(s["clocks_event_reasons"] & pynvml.nvmlClocksEventReasonSwPowerCap for s in busy)
    assert all(s["enforced_power_limit_mw"] - s["power_mw"] < 15_000 for s in busy)
    ratios = [s["clock_sm_mhz"] / s["max_clock_sm_mhz"] for s in busy]
    assert 0.6 < min(ratios) and max(ratios) < 0.75


@pytest.mark.parametrize("check_class", [PerformanceCheck, ThermalCheck])
def test_a_real_h100_busy_at_its_power_cap_is_neither_slow_nor_throttled(capture, registry, check_class):
    nvml, clock = CapturedNvml(capture), Clock(0.0)
    gpu = capture["gpus"][0]
    info = GpuInfo(0, "GPU-bc21289a-92c1-d7fe-f9a5-dee014696641", gpu["name"], "0000:00:06.0", handle=object())
    inventory = Inventory(capture["driver"], None, [info])
    host = Host("h100-vm", nvml, smi=None, pci=None)
    check = check_class(SETTINGS, clock=clock)
    engine = RuleEngine(load_ruleset(None, registry))
    samples = capture["idle"]["samples"][0] + capture["load"]["samples"][0]
    problems, last = [], None
    for sample in samples:
        nvml.sample = sample
        out = check.run(SweepContext(host, inventory, [], "", clock(), lambda c, m: None))
        problems += engine.evaluate(out.observations)
        assert out.observations, out.error
        last = out.observations[0].fields
        clock.now += INTERVAL_S
    assert last["window_ready"], last
    if check_class is PerformanceCheck:
        assert last["busy_ready"] and 1290 <= last["busy_sm_clock_mhz"] <= 1410, last
        assert last["throttle_ratio"]["sw_power_cap"] > 0.5
    assert problems == [], [p.message for p in problems]


def test_the_throttle_counter_ids_asked_of_this_driver_are_the_ones_it_answers():
    """The ids the performance check asks driver 580.159.04 for answered there as counters, and the other
    header's ids did not (a real machine's scan of ids 240-280, idle and busy)."""
    from detector.backends.nvmlcompat import throttle_counter_fields

    scan = json.loads((CAPTURE.parent / "field-id-scan.json").read_text())
    asked = throttle_counter_fields(scan["driver"])
    moved = {name: fid for name, fid in asked.items() if name not in ("sw_power_cap", "sync_boost")}
    assert set(moved) == {"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
    for phase in ("idle", "busy"):
        for fid in moved.values():
            assert scan[phase][str(fid)].get("type") == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, (phase, fid)
        for fid in (251, 252, 253):
            assert scan[phase][str(fid)] == {"return": pynvml.NVML_ERROR_NOT_SUPPORTED}, (phase, fid)
