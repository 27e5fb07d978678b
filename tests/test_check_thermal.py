"""The thermal check: clock event reasons over a window, violation counters, temperatures against the GPU's
own thresholds, and the rules that judge them: on scenarios that trip them and on normal ones that must not
(power capping under load, an idle GPU, a momentary blip, a restart)."""

from __future__ import annotations

import pynvml
import pytest

from conftest import builtin_rules, Clock, diagnose_scenario
from test_cli import diagnose_json
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.checks.thermal import ThermalCheck
from detector.core.sweep import run_sweep
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


class Watch:
    """A thermal check sweeping a fake node every `step` seconds of a shared hand-moved clock."""

    def __init__(self, scenario: str, engine: RuleEngine, **config):
        self.clock = Clock(0.0)
        self.node = load_scenario(scenario).build(clock=self.clock)
        self.host = fake_host(self.node, threaded=False)
        self.check = ThermalCheck(config, clock=self.clock)
        self.engine = engine

    def sweep(self):
        out = run_sweep(self.host, [self.check])
        return out, self.engine.evaluate(out.observations)

    def run_for(self, seconds: float, step: float = 10.0) -> tuple[dict[str, set[int]], dict[int, dict]]:
        """Sweep for `seconds`; which rules fired on which GPUs at any time, and the last fields per GPU."""
        fired: dict[str, set[int]] = {}
        end = self.clock.now + seconds
        while self.clock.now <= end:
            out, problems = self.sweep()
            for p in problems:
                fired.setdefault(p.rule, set()).update(g.index for g in p.gpus)
            self.clock.now += step
        last = {o.gpu.index: dict(o.fields) for o in out.observations if o.gpu is not None}
        return fired, last


def fields_of(outcome, index: int) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations if o.gpu.index == index)


# ---- scenarios that must not fire ------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "a100-pcie-4", "v100-sxm-8", "rtx-4090-1",
                                      "h100-sxm-8-power-capped", "h100-sxm-8-throttle-blip"])
def test_normal_nodes_raise_nothing_over_a_whole_window(scenario, engine):
    fired, last = Watch(scenario, engine).run_for(900)
    assert fired == {}
    assert all(f["window_ready"] for f in last.values())


def test_a_busy_gpu_held_at_its_power_limit_all_window_long_is_normal(engine):
    fired, last = Watch("h100-sxm-8-power-capped", engine).run_for(900)
    assert fired == {}
    for fields in last.values():
        assert "sw_power_cap" in fields["reasons"] and "gpu_idle" not in fields["reasons"]
        assert fields["sw_power_cap_pct"] == 100.0 and fields["power_violation_pct"] == 100.0
        assert fields["hw_slowdown_pct"] == 0.0 and fields["thermal_pct"] == 0.0
        assert fields["power_pct_of_limit"] >= 99.5 and fields["power_limit_w"] == 700.0


def test_a_momentary_hw_slowdown_is_seen_but_not_judged(engine):
    watch = Watch("h100-sxm-8-throttle-blip", engine, min_span=0)
    fired, last = watch.run_for(600)
    assert fired == {}
    assert 0 < last[1]["hw_slowdown_pct"] < 20 and 0 < last[1]["below_base_clocks_pct"] < 2


# ---- scenarios that trip ---------------------------------------------------------------------------


def test_a_snapshot_host_judges_its_one_sample_as_held_a_live_one_waits(engine):
    """A replayed capture (host.snapshot) is the whole window: the first sweep is judged; a live node's
    first sweep of the same power brake is a window still filling."""
    node = load_scenario("h100-sxm-8-power-brake").build(clock=Clock(0.0))
    live = fake_host(node, threaded=False)
    check = ThermalCheck({}, clock=Clock(0.0))
    assert engine.evaluate(run_sweep(live, [check]).observations) == []
    held = fake_host(load_scenario("h100-sxm-8-power-brake").build(clock=Clock(0.0)), threaded=False)
    held.snapshot = True
    out = run_sweep(held, [ThermalCheck({}, clock=Clock(0.0))])
    thermal = [o.fields for o in out.observations if o.check == "thermal" and o.gpu is not None]
    assert len(thermal) == 8 and all(f["window_ready"] and f["samples"] == 1 for f in thermal)
    assert {p.rule for p in engine.evaluate(out.observations)} >= {"thermal-hw-power-brake"}


@pytest.mark.parametrize("folder,rule", [
    ("t-sonar-rtx2080ti-x4-545-sw-thermal", "thermal-sustained-thermal-slowdown"),
    ("t-gpud-h100x8-vm-535-power-brake-one-gpu", "thermal-hw-power-brake"),
])
def test_a_real_capture_of_a_held_slowdown_is_judged_without_thermal_settings(folder, rule, registry):
    """Real outputs (tests/fixtures/real_machines): the replay host alone makes them judged, whoever runs it."""
    from pathlib import Path
    from conftest import diagnose_host
    from detector.cli.replay_host import replay_host
    path = Path(__file__).parent / "fixtures" / "real_machines" / folder
    out = diagnose_host(replay_host(path), registry, checks=["thermal"])
    assert rule in {p.rule for p in out.problems}


def test_sustained_hw_slowdown_trips_once_the_window_is_ready_and_only_on_its_gpu(engine):
    watch = Watch("h100-sxm-8-hw-slowdown", engine)
    fired, last = watch.run_for(100)                      # under min_span (120 s): not judged yet
    assert fired == {} and last[2]["window_ready"] is False and last[2]["hw_slowdown_pct"] > 20
    fired, last = watch.run_for(600)
    assert fired == {"thermal-hw-slowdown": {2}}
    assert last[2]["below_base_clocks_pct"] == pytest.approx(40, abs=2)     # the counter: 24 s of every 60 s
    assert last[2]["window_s"] == 600.0 and last[2]["samples"] == 61


def test_power_brake_trips_both_rules_and_asks_for_the_power_supplies(engine):
    watch = Watch("h100-sxm-8-power-brake", engine)
    watch.run_for(300)
    _, problems = watch.sweep()
    by_rule = {p.rule: p for p in problems}
    assert set(by_rule) == {"thermal-hw-slowdown", "thermal-hw-power-brake"}
    brake = by_rule["thermal-hw-power-brake"]
    assert brake.type == "GpuPowerBrake" and brake.action == "CHECK_MECHANICALS" and brake.gpus[0].index == 6
    assert "power supply or the BMC" in brake.message


def test_a_restart_does_not_page_on_a_gpu_already_throttled(engine):
    watch = Watch("h100-sxm-8", engine)
    watch.node.inject(Fault("throttle", 0, {"reason": "hw_thermal"}))      # throttled all the time
    fired, last = watch.run_for(110)
    assert fired == {} and last[0]["hw_thermal_slowdown_pct"] == 100.0 and last[0]["samples"] == 12
    fired, _ = watch.run_for(20)
    assert fired.keys() == {"thermal-hw-slowdown", "thermal-hw-thermal-slowdown", "thermal-sustained-thermal-slowdown"}


def test_sw_thermal_slowdown_is_judged_on_the_counter_or_the_samples(engine):
    watch = Watch("h100-sxm-8", engine)
    watch.node.inject(Fault("throttle", 4, {"reason": "sw_thermal", "duty": 0.6, "period_s": 25}))
    fired, last = watch.run_for(700)
    assert fired == {"thermal-sustained-thermal-slowdown": {4}}
    assert last[4]["thermal_violation_pct"] == pytest.approx(60, abs=3)
    assert last[4]["hw_slowdown_pct"] == 0.0


def test_hot_gpu_is_a_warning_on_one_reading_and_near_shutdown_critical(registry, engine):
    out = diagnose_scenario("h100-sxm-8-hot-gpu", registry, checks=["thermal"])
    [problem] = out.problems
    assert problem.rule == "thermal-over-slowdown-temperature" and problem.severity == Severity.WARNING
    assert problem.gpus[0].index == 3 and "89 C, at or over its HW slowdown threshold of 89 C" in problem.message
    assert fields_of(out, 3)["slowdown_margin_c"] == 0 and fields_of(out, 3)["shutdown_margin_c"] == 3
    watch = Watch("h100-sxm-8-hot-gpu", engine)
    watch.node.inject(Fault("temperature", 3, {"celsius": 90}))
    _, problems = watch.sweep()
    assert [(p.rule, p.severity) for p in problems] == [("thermal-near-shutdown-temperature", Severity.CRITICAL)]


def test_hot_hbm_under_a_cool_core_is_a_warning(registry):
    out = diagnose_scenario("h100-sxm-8-hbm-hot", registry, checks=["thermal"])
    assert [(p.rule, p.gpus[0].index) for p in out.problems] == [("thermal-memory-over-max", 5)]
    fields = fields_of(out, 5)
    assert fields["memory_temperature_c"] == 97 and fields["memory_max_c"] == 95 and fields["memory_margin_c"] == -2
    assert fields["temperature_c"] < fields["gpu_max_c"]


def test_geforce_reports_what_it_lacks_as_unknown(registry):
    out = diagnose_scenario("rtx-4090-1", registry, checks=["thermal"])
    fields = fields_of(out, 0)
    assert fields["memory_temperature_c"] is None and fields["memory_max_c"] is None
    assert fields["memory_margin_c"] is None and fields["violation_counters"] == "not_supported"
    assert fields["thermal_violation_pct"] is None and fields["slowdown_c"] == 90 and fields["gpu_max_c"] == 88
    assert "violation counters not supported" in out.sweep.runs[0].summary and out.problems == []


# ---- how the check reads and remembers -------------------------------------------------------------


def test_a_driver_without_the_event_reasons_name_is_read_through_the_throttle_name(engine):
    watch = Watch("h100-sxm-8", engine)
    nvml = watch.host.nvml

    def missing(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    nvml.nvmlDeviceGetCurrentClocksEventReasons = missing
    out, _ = watch.sweep()
    assert out.runs[0].status == "ok"
    assert all(o.fields["reasons"] == ["gpu_idle"] for o in out.runs[0].observations)


def test_memory_per_gpu_stays_bounded_and_gone_gpus_are_forgotten(engine):
    watch = Watch("h100-sxm-8", engine, window=10_000, min_span=0)
    watch.run_for(600, step=1.0)
    assert all(len(s) == 512 for s in watch.check._samples.values())
    watch.node.inject(Fault("nvml_invisible", 7))
    watch.sweep()
    assert len(watch.check._samples) == len(watch.check._limits) == 7
    assert len({key[0] for key in watch.check._counters._samples}) == 7


def test_thresholds_are_read_once_per_gpu(engine):
    watch = Watch("h100-sxm-8", engine)
    calls = []
    real = watch.host.nvml.nvmlDeviceGetTemperatureThreshold
    watch.host.nvml.nvmlDeviceGetTemperatureThreshold = lambda h, t: calls.append(t) or real(h, t)
    watch.run_for(30)
    assert len(calls) == 8 * 4


# ---- rule thresholds, on observations --------------------------------------------------------------


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(ThermalCheck.fields)
    base.update(window_ready=True, hw_slowdown_pct=0.0, hw_thermal_slowdown_pct=0.0, hw_power_brake_pct=0.0,
                sw_thermal_slowdown_pct=0.0, sw_power_cap_pct=0.0, thermal_pct=0.0, temperature_c=60,
                slowdown_c=89, shutdown_c=92, slowdown_margin_c=29, shutdown_margin_c=32)
    base.update(fields)
    return {p.rule for p in engine.evaluate([Observation("thermal", base)])}


@pytest.mark.parametrize("pct,ready,expected", [
    (19.9, True, set()), (20.0, True, {"thermal-hw-slowdown"}), (100.0, False, set()),
])
def test_hw_slowdown_threshold(engine, pct, ready, expected):
    assert judge(engine, hw_slowdown_pct=pct, window_ready=ready) == expected


@pytest.mark.parametrize("field,rule", [("hw_thermal_slowdown_pct", "thermal-hw-thermal-slowdown"),
                                        ("hw_power_brake_pct", "thermal-hw-power-brake")])
def test_hw_cause_thresholds(engine, field, rule):
    assert judge(engine, **{field: 19.9}) == set()
    assert judge(engine, **{field: 20.0}) == {rule}


def test_thermal_share_threshold(engine):
    assert judge(engine, thermal_pct=49.9) == set()
    assert judge(engine, thermal_pct=50.0) == {"thermal-sustained-thermal-slowdown"}
    assert judge(engine, thermal_pct=50.0, window_ready=False) == set()


def test_power_cap_and_idle_never_fire(engine):
    assert judge(engine, sw_power_cap_pct=100.0, power_violation_pct=100.0, below_base_clocks_pct=30.0,
                 reasons=["sw_power_cap"], power_pct_of_limit=100.0) == set()
    assert judge(engine, reasons=["gpu_idle"], reasons_mask=1) == set()


@pytest.mark.parametrize("slowdown_margin,shutdown_margin,expected", [
    (1, 4, set()), (0, 3, {"thermal-over-slowdown-temperature"}), (-1, 3, {"thermal-over-slowdown-temperature"}),
    (-1, 2, {"thermal-near-shutdown-temperature"}), (-5, -2, {"thermal-near-shutdown-temperature"}),
    (None, None, set()),
])
def test_temperature_thresholds(engine, slowdown_margin, shutdown_margin, expected):
    assert judge(engine, slowdown_margin_c=slowdown_margin, shutdown_margin_c=shutdown_margin) == expected


@pytest.mark.parametrize("margin,expected", [(1, set()), (0, {"thermal-memory-over-max"}), (None, set())])
def test_memory_temperature_threshold(engine, margin, expected):
    assert judge(engine, memory_margin_c=margin, memory_temperature_c=90, memory_max_c=95) == expected


# ---- end to end ------------------------------------------------------------------------------------


def test_diagnose_json_end_to_end():
    code, report = diagnose_json("h100-sxm-8-hot-gpu", "--checks", "thermal")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["thermal-over-slowdown-temperature"]
    gpu = report["checks"][0]["result"]["gpus"][3]
    assert gpu["temperature_c"] == 89 and "hw_thermal_slowdown" in gpu["reasons"] and gpu["window_ready"] is False
    code, report = diagnose_json("rtx-4090-1", "--checks", "thermal")
    assert code == 0 and report["checks"][0]["result"]["gpus"][0]["memory_temperature_c"] is None


def test_daemon_sets_and_clears_the_thermal_condition(running):
    settings = {"thermal": {"interval": 0.2, "window": 2.0, "min_span": 0.5, "min_samples": 3}}
    local = running(name="gpu-thermal", checks=["thermal"], check_settings=settings)

    def status() -> str | None:
        return local.conditions().get("GpuThermal", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuThermal") and status() is None, 10), local.conditions()
    local.node.inject(Fault("throttle", 1, {"reason": "hw_thermal"}))
    assert local.wait_for(lambda: status() == "True", 10)
    assert "GPU 1" in local.conditions()["GpuThermal"]["message"]
    local.node.inject(Fault("recover", 1))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()
