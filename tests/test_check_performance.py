"""The performance check: a GPU slower than its busy same-model siblings (SM clock while busy, HW throttle
share, enforced power limit, application clocks), judged over a window on a fake node sharing the check's
hand-moved clock, and never on what is normal: SW power cap under load, idle low clocks, a blip, a restart,
every healthy real machine replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import builtin_rules, Clock, diagnose_host
from detector.agent.metrics import AgentMetrics
from detector.backends.nvmlcompat import throttle_counter_fields
from detector.checks.performance import PerformanceCheck
from detector.checks.thermal import ThermalCheck
from detector.core.check import CheckRegistry
from detector.core.gpu_health import gpu_health
from detector.core.sweep import run_sweep
from detector.core.types import Severity
from detector.rules.engine import RuleEngine
from detector.rules.sources import builtin_rules_dir
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from detector.cli.replay_host import replay_host
from fake_nvml.scenario import load_scenario

MACHINES = Path(__file__).parent / "fixtures" / "real_machines"


@pytest.fixture(scope="module")
def registry() -> CheckRegistry:
    """The installed checks, with this one even before the installed metadata names its entry point."""
    registry = CheckRegistry.from_entry_points()
    if "performance" not in registry.names():
        registry.register(PerformanceCheck)
    return registry


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


class Watch:
    """The performance check (and any others) sweeping a fake node every `step` s of one shared clock."""

    def __init__(self, scenario: str, engine: RuleEngine, driver: str | None = None, thermal: bool = False,
                 **config):
        self.clock = Clock(0.0)
        self.node = load_scenario(scenario).build(clock=self.clock)
        if driver:
            self.node.read(lambda state: setattr(state, "driver_version", driver))
        self.host = fake_host(self.node, threaded=False)
        self.checks = [PerformanceCheck(config, clock=self.clock)] + ([ThermalCheck({}, clock=self.clock)]
                                                                       if thermal else [])
        self.engine = engine
        self.problems = []

    def run_for(self, seconds: float, step: float = 15.0) -> tuple[dict[str, set[int]], dict[int, dict]]:
        """Sweep from now to now + `seconds` inclusive: the rules that fired on which GPUs, and the last
        performance fields per GPU."""
        fired: dict[str, set[int]] = {}
        end = self.clock.now + seconds
        while self.clock.now <= end:
            out = run_sweep(self.host, self.checks)
            self.problems = self.engine.evaluate(out.observations)
            for p in self.problems:
                fired.setdefault(p.rule, set()).update(g.index for g in p.gpus)
            self.clock.now += step
        last = {o.gpu.index: dict(o.fields) for o in out.observations
                if o.gpu is not None and o.check == "performance"}
        return fired, last


# ---- the slow GPU ---------------------------------------------------------------------------------------


def test_a_gpu_power_limited_to_400_w_among_700_w_siblings_is_named_within_120_s(engine):
    watch = Watch("h100-sxm-8-slow-gpu", engine)
    fired, last = watch.run_for(120)
    assert fired == {"performance-slower-than-peers": {5}, "performance-power-limit-below-peers": {5}}
    five = last[5]
    assert five["busy_ready"] and five["peers"] == 7 and five["peers_busy"] == 7
    assert five["power_limit_w"] == 400.0 and five["peers_power_limit_w"] == 700.0
    assert -35 < five["sm_clock_vs_peers_pct"] < -25             # about 30% below its siblings
    assert five["peers_busy_sm_clock_mhz"] == 1980.0 and five["busy_sm_clock_mhz"] < 1450
    # every busy GPU is SW power capped all window long: normal, on the slow one and on its siblings
    assert all(f["sw_power_cap_pct"] == 100.0 and f["hw_throttle_pct"] == 0.0 for f in last.values())
    problem = next(p for p in watch.problems if p.rule == "performance-slower-than-peers")
    assert problem.type == "GpuPerformanceDegraded" and problem.severity is Severity.WARNING
    assert problem.action == "INSPECT"
    assert "1383 MHz" in problem.message and "1980 MHz" in problem.message and "400 W" in problem.message
    assert "7 sibling(s)" in problem.message


def test_one_sweep_judges_the_power_limit_setting_but_not_the_clocks(engine):
    fired, last = Watch("h100-sxm-8-slow-gpu", engine).run_for(0)
    assert fired == {"performance-power-limit-below-peers": {5}}
    assert not last[5]["busy_ready"] and last[5]["sm_clock_vs_peers_pct"] is None
    assert last[5]["sm_clock_mhz"] < last[0]["sm_clock_mhz"]      # seen, not yet judged


def test_a_slow_gpu_degrades_that_gpu_only_and_asks_for_no_remediation(engine):
    watch = Watch("h100-sxm-8-slow-gpu", engine)
    watch.run_for(120)
    health = gpu_health([], watch.problems)
    assert [(h.gpu.index, h.state, h.action) for h in health] == [(5, "degraded", "INSPECT")]
    assert all(p.severity is not Severity.CRITICAL for p in watch.problems)


def test_application_clocks_set_below_the_siblings_are_named(engine):
    watch = Watch("h100-sxm-8-power-capped", engine)
    watch.node.inject(Fault("application_clocks", gpu=3, params={"mhz": 1410}))
    fired, last = watch.run_for(150)
    assert fired == {"performance-app-clocks-below-peers": {3}, "performance-slower-than-peers": {3}}
    assert last[3]["app_clock_mhz"] == 1410 and last[3]["peers_app_clock_mhz"] == 1980


def test_a_busy_gpu_in_hw_slowdown_among_calm_siblings_is_named_and_thermal_names_the_cause(engine):
    watch = Watch("h100-sxm-8-power-capped", engine, thermal=True)
    watch.node.inject(Fault("throttle", gpu=2, params={"reason": "hw_slowdown", "duty": 0.4, "period_s": 60}))
    fired, last = watch.run_for(600)
    assert fired["performance-hw-throttled-vs-peers"] == {2}
    assert fired["thermal-hw-slowdown"] == {2}                     # the cause, CHECK_COOLING
    assert all(gpus == {2} for gpus in fired.values())
    # 40% of the time, seen by 15 s samples of a 60 s pattern (no counter for plain HW slowdown): 2 in 4
    assert 35 <= last[2]["hw_throttle_pct"] <= 55 and last[2]["peers_hw_throttle_pct"] == 0.0


def test_a_gpu_alone_of_its_model_is_judged_against_its_rated_clock_only_when_halved(engine):
    calm = Watch("rtx-4090-1", engine)
    calm.node.inject(Fault("power_draw", gpu=0, params={"watts": 450, "utilization": 100}))
    fired, last = calm.run_for(300)
    assert fired == {} and last[0]["peers"] == 0 and last[0]["busy_ready"]      # at its power cap: normal
    slowed = Watch("rtx-4090-1", engine)
    slowed.node.inject(Fault("power_draw", gpu=0, params={"watts": 450, "utilization": 100}))
    slowed.node.inject(Fault("throttle", gpu=0, params={"reason": "hw_slowdown"}))
    fired, last = slowed.run_for(300)
    assert fired == {"performance-alone-below-rated": {0}}
    assert last[0]["sm_clock_vs_rated_pct"] <= 50


# ---- what must not fire ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-power-capped", "h100-sxm-8-throttle-blip",
                                      "h100-sxm-8-ecc-corrected", "h100-sxm-8-hw-slowdown", "a100-pcie-4",
                                      "v100-sxm-8", "rtx-4090-1"])
def test_normal_nodes_raise_nothing_over_a_whole_window(scenario, engine):
    fired, last = Watch(scenario, engine).run_for(900)
    assert fired == {}
    assert all(f["window_ready"] for f in last.values())


def test_idle_gpus_at_low_clocks_are_not_compared(engine):
    fired, last = Watch("h100-sxm-8", engine).run_for(300)
    assert fired == {}
    assert all(f["busy_sm_clock_mhz"] is None and f["sm_clock_mhz"] == 345 for f in last.values())


def test_a_restarted_check_does_not_judge_clocks_before_its_window_is_ready(engine):
    watch = Watch("h100-sxm-8-slow-gpu", engine, min_span=300)
    fired, last = watch.run_for(240)
    assert "performance-slower-than-peers" not in fired and not last[5]["busy_ready"]


@pytest.mark.parametrize("folder", sorted(p.parent for p in MACHINES.glob("*/expected.yaml")),
                         ids=lambda p: p.name)
def test_no_real_machine_replayed_is_called_slow(folder, registry):
    outcome = diagnose_host(replay_host(folder), registry, checks=["performance"])
    assert [p.message for p in outcome.problems if p.type == "GpuPerformanceDegraded"] == []
    assert outcome.sweep.runs[0].status == "ok"


def test_a_replayed_capture_compares_its_cumulative_hw_throttle_counters(tmp_path, registry):
    """A real 2-GPU capture (driver 590: counters at fields 269-271) with GPU 1's HW thermal counter raised
    to 15 minutes: that GPU, and only it, is named; the untouched capture names none (above)."""
    source = MACHINES / "x-telegraf-2x-rtx-a5000-590"
    text = (source / "nvidia-smi-q.xml").read_text(encoding="utf-8")
    tag = "<clocks_event_reasons_counters_hw_therm_slowdown>"
    first = text.index(tag)
    second = text.index(tag, first + 1)
    end = text.index("</", second)
    (tmp_path / "nvidia-smi-q.xml").write_text(text[:second + len(tag)] + "900000000 us" + text[end:],
                                               encoding="utf-8")
    outcome = diagnose_host(replay_host(tmp_path), registry, checks=["performance"])
    named = [(p.reason, [g.index for g in p.gpus]) for p in outcome.problems]
    assert named == [("HwThrottleCountersVsPeers", [1])]
    assert "field 270" in outcome.problems[0].message


# ---- throttle counters by driver version ------------------------------------------------------------------


@pytest.mark.parametrize("driver, ids", [
    ("550.90.07", {"sw_power_cap": 74, "sync_boost": 76}),
    ("575.57.08", {"sw_power_cap": 74, "sync_boost": 76, "sw_thermal_slowdown": 251, "hw_thermal_slowdown": 252,
                   "hw_power_brake_slowdown": 253}),
    ("580.65.06", {"sw_power_cap": 74, "sync_boost": 76, "sw_thermal_slowdown": 251, "hw_thermal_slowdown": 252,
                   "hw_power_brake_slowdown": 253}),
    ("595.58.03", {"sw_power_cap": 74, "sync_boost": 76, "sw_thermal_slowdown": 269, "hw_thermal_slowdown": 270,
                   "hw_power_brake_slowdown": 271}),
    # a real H100 on 580.159.04 answers 269-271 and refuses 251-268 (tests/fixtures/gpu_check/h100-vm-580-perf)
    ("580.159.04", {"sw_power_cap": 74, "sync_boost": 76, "sw_thermal_slowdown": 269, "hw_thermal_slowdown": 270,
                    "hw_power_brake_slowdown": 271}),
    ("580.95.05", {"sw_power_cap": 74, "sync_boost": 76}),     # between what was seen: neither is asked for
    (None, {"sw_power_cap": 74, "sync_boost": 76}),
    ("garbage", {"sw_power_cap": 74, "sync_boost": 76}),
])
def test_throttle_counter_field_ids_follow_the_driver_version(driver, ids):
    assert throttle_counter_fields(driver) == ids


@pytest.mark.parametrize("driver, field", [("580.65.06", 252), ("595.58.03", 270)])
def test_the_counters_are_read_at_the_driver_s_ids_and_say_so(engine, driver, field):
    watch = Watch("h100-sxm-8-power-capped", engine, driver=driver)
    watch.node.inject(Fault("throttle", gpu=4, params={"reason": "hw_thermal", "duty": 0.5, "period_s": 60}))
    fired, last = watch.run_for(600, step=15)
    four = last[4]
    assert four["throttle_source"]["hw_thermal_slowdown"] == "counter"
    assert four["hw_thermal_slowdown_pct"] == pytest.approx(50, abs=3)      # time, not samples
    assert f"hw_thermal_slowdown field {field}" in four["throttle_counters"] and driver in four["throttle_counters"]
    assert fired["performance-hw-throttled-vs-peers"] == {4}


def test_an_old_driver_s_shares_come_from_the_reasons_mask(engine):
    _, last = Watch("h100-sxm-8-power-capped", engine).run_for(150)
    assert last[0]["throttle_source"]["hw_thermal_slowdown"] == "samples"
    assert last[0]["throttle_source"]["sw_power_cap"] == "counter"
    assert "field 252" not in last[0]["throttle_counters"] and "field 74" in last[0]["throttle_counters"]


# ---- metrics --------------------------------------------------------------------------------------------


def test_the_metrics_carry_model_and_reason_and_drop_the_busy_clock_when_idle(engine):
    watch = Watch("h100-sxm-8-slow-gpu", engine)
    metrics = AgentMetrics()
    watch.run_for(0)
    metrics.sweep(run_sweep(watch.host, watch.checks), [])
    value = metrics.registry.get_sample_value
    five = {"gpu": "5", "pci_bus_id": "0000:ab:00.0", "model": "NVIDIA H100 80GB HBM3"}
    four = {**five, "gpu": "4", "pci_bus_id": "0000:9a:00.0"}
    assert value("gpu_npd_gpu_power_limit_watts", five) == 400.0
    assert value("gpu_npd_gpu_power_limit_watts", four) == 700.0
    assert value("gpu_npd_gpu_busy_sm_clock_mhz", five) == 1383.0
    assert value("gpu_npd_gpu_throttle_ratio", {**five, "reason": "sw_power_cap"}) == 1.0
    for reason in ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"):
        assert value("gpu_npd_gpu_throttle_ratio", {**five, "reason": reason}) == 0.0
    watch.node.inject(Fault("idle", gpu=5))
    watch.clock.now += 700                                         # the busy samples leave the window
    metrics.sweep(run_sweep(watch.host, watch.checks), [])
    assert value("gpu_npd_gpu_busy_sm_clock_mhz", five) is None    # absent, not its last busy value
    assert value("gpu_npd_gpu_busy_sm_clock_mhz", four) == 1980.0


def test_the_rules_say_where_their_thresholds_come_from():
    text = (Path(builtin_rules_dir()) / "performance.yaml").read_text(encoding="utf-8")
    assert "NVSentinel #890" in text and "DCGM #122" in text and "SW Power Cap" in text
    rules = yaml.safe_load(text)["rules"]
    assert {r["type"] for r in rules} == {"GpuPerformanceDegraded"}
    assert {(r["severity"], r["action"]) for r in rules} == {("warning", "INSPECT")}
