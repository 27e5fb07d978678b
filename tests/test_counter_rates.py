"""Counters judged as rates, not totals (issue 31): NVLink per-link replay/recovery/CRC, the PCIe replay
counter and corrected ECC, over simulated time on a fake node (the node and the checks on one clock, swept
every 15 s for 120 s, as `diagnose --duration 120` does); and, in one sweep, totals since the driver loaded
compared across same-model GPUs, saying so."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Clock, diagnose_host, node_for
from detector.checks.memory import MemoryCheck
from detector.checks.nvlink import NvlinkCheck
from detector.checks.pcie import PcieCheck
from detector.core.check import CheckRegistry
from detector.core.rates import CounterWindow, span_text
from detector.core.siblings import standouts
from detector.core.sweep import run_sweep
from detector.core.types import Problem, Severity
from detector.rules.engine import RuleEngine
from detector.rules.loader import load_rules
from detector.rules.sources import builtin_rules_dir
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario

CHECKS = (NvlinkCheck, PcieCheck, MemoryCheck)


@pytest.fixture(scope="module")
def engine(registry: CheckRegistry) -> RuleEngine:
    fields = registry.fields_by_check()
    fields.update({cls.name: cls.all_fields() for cls in CHECKS})     # the classes under test, as built here
    return RuleEngine(load_rules([builtin_rules_dir()], fields))


class Watched:
    """A scenario's node and the three counter checks on one hand-moved clock."""

    def __init__(self, scenario: str, engine: RuleEngine, settings: dict[str, dict[str, Any]] | None = None):
        self.clock = Clock(0.0)
        self.node = load_scenario(scenario).build(clock=self.clock)
        self.host = fake_host(self.node, threaded=False)
        self.checks = [cls((settings or {}).get(cls.name), clock=self.clock) for cls in CHECKS]
        self.engine = engine

    def sweep(self, t: float) -> tuple[list[Problem], dict[str, dict[int, dict]]]:
        self.clock.now = t
        sweep = run_sweep(self.host, self.checks)
        assert all(run.status == "ok" and not run.error for run in sweep.runs), [r.to_dict() for r in sweep.runs]
        fields = {run.name: {o.gpu.index: o.fields for o in run.observations
                             if o.gpu is not None and o.fields.get("scope", "gpu") == "gpu"} for run in sweep.runs}
        return self.engine.evaluate(sweep.observations), fields

    def watch(self, seconds: float = 120, every: float = 15) -> tuple[float | None, list[Problem]]:
        """Sweeps from 0 to `seconds`; (the first time any problem showed, the problems of the last sweep)."""
        first, t, problems = None, 0.0, []
        while t <= seconds:
            problems, _ = self.sweep(t)
            if problems and first is None:
                first = t
            t += every
        return first, problems


# ---- the scenarios over 120 s of simulated sweeps ----------------------------------------------------------


@pytest.mark.parametrize("scenario,gpu,rule,words", [
    ("h100-sxm-8-nvlink-recovering", 3, "nvlink-recovery-errors",
     ["link 14: ", "recover", "in the last", "505" , "since the driver loaded", "the node has been up"]),
    ("h100-sxm-8-nvlink-replay", 3, "nvlink-replay-errors", ["link 7: ", "replay error", "since the driver loaded"]),
    ("h100-sxm-8-pcie-replays", 2, "pcie-replays-rising", ["60/min", "DCGM's limit is 8", "since the driver loaded"]),
    ("h100-sxm-8-sbe-storm", 6, "memory-corrected-storm", ["5000/s", "SBE storm", "since the driver loaded"]),
])
@pytest.mark.parametrize("every", [15, 60])
def test_a_rising_counter_is_named_on_its_gpu_within_120_s(scenario, gpu, rule, words, every, engine):
    first, problems = Watched(scenario, engine).watch(120, every)
    assert first is not None and first <= 60
    assert [p.rule for p in problems] == [rule]
    [problem] = problems
    assert [g.index for g in problem.gpus] == [gpu] and problem.severity == Severity.WARNING
    text = problem.message
    for word in words:
        if word == "505":
            assert any(f"{n} since the driver loaded" in text for n in range(505, 510)), text
        else:
            assert word in text, text


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-ecc-corrected", "h100-sxm-8-power-capped",
                                      "h100-sxm-8-throttle-blip"])
def test_look_alikes_stay_silent_over_the_window(scenario, engine):
    w = Watched(scenario, engine)
    first, _ = w.watch(120, 15)
    assert first is None
    _, fields = w.sweep(600.0)                     # and with a full window behind them
    assert all(f["corrected_rising"] is False for f in fields["memory"].values())
    assert all(f["replays_rising"] is False for f in fields["pcie"].values())


def test_corrected_errors_that_do_not_rise_are_never_judged_however_many(engine):
    w = Watched("h100-sxm-8-ecc-corrected", engine)
    for t in (0.0, 300.0, 600.0, 1200.0):
        problems, fields = w.sweep(t)
        assert problems == []
    assert fields["memory"][3]["volatile_corrected"] == 1200 and fields["memory"][3]["corrected_increase"] == 0


def test_the_first_sweep_judges_no_rate_and_says_so(engine):
    """The daemon's first sweep, and every check's before its window covers min_span, judge no rate."""
    w = Watched("h100-sxm-8-sbe-storm", engine)
    problems, fields = w.sweep(0.0)
    assert problems == [] and fields["memory"][6]["corrected_per_s"] is None
    problems, fields = w.sweep(30.0)                 # a rate already, but over less than min_span (60 s)
    assert problems == [] and fields["memory"][6]["corrected_per_s"] == 5000.0
    assert fields["memory"][6]["corrected_window_ready"] is False
    problems, _ = w.sweep(60.0)
    assert [p.rule for p in problems] == ["memory-corrected-storm"]


def test_a_reset_starts_the_counters_and_their_windows_afresh(engine):
    w = Watched("h100-sxm-8-pcie-replays", engine)
    w.sweep(0.0)
    assert [p.rule for p in w.sweep(60.0)[0]] == ["pcie-replays-rising"]
    w.node.inject(Fault("recover", 2))
    problems, fields = w.sweep(75.0)
    assert problems == [] and fields["pcie"][2]["replays_total"] == 0
    problems, fields = w.sweep(400.0)
    assert problems == [] and fields["pcie"][2]["replays_increase"] == 0


def test_thresholds_are_settings(engine):
    # DCGM's 8 a minute by default; a site that sets 100 keeps a 60-a-minute link quiet
    assert Watched("h100-sxm-8-pcie-replays", engine, {"pcie": {"replays_per_min": 100}}).watch()[0] is None
    # any NVLink replay rise by default; a setting of 10 a minute keeps the 5-a-minute link quiet
    assert Watched("h100-sxm-8-nvlink-replay", engine, {"nvlink": {"replay_per_min": 10}}).watch()[0] is None
    assert Watched("h100-sxm-8-sbe-storm", engine, {"memory": {"corrected_per_s": 10000}}).watch()[0] is None
    assert Watched("h100-sxm-8-nvlink-recovering", engine, {"nvlink": {"recovery_per_min": 2}}).watch()[0] is None


def test_crc_needs_a_count_in_the_window_not_a_single_hit(engine):
    w = Watched("h100-sxm-8", engine)
    w.sweep(0.0)
    w.node.inject(Fault("nvlink_errors", 1, {"link": 5, "counter": "crc_flit", "add": 9}))
    problems, fields = w.sweep(60.0)
    assert problems == [] and fields["nvlink"][1]["crc_increase"] == 9
    w.node.inject(Fault("nvlink_errors", 1, {"link": 5, "counter": "crc_data", "add": 1}))
    problems, fields = w.sweep(120.0)
    assert [p.rule for p in problems] == ["nvlink-crc-errors"]
    assert fields["nvlink"][1]["rising_links"] == "5" and fields["nvlink"][1]["crc_links"].startswith("link 5: 10 ")


def test_each_link_is_named_on_its_own(engine):
    w = Watched("h100-sxm-8", engine)
    w.sweep(0.0)
    for link in (2, 9):
        w.node.inject(Fault("nvlink_errors", 4, {"link": link, "counter": "recovery", "per_min": 2}))
    w.sweep(30.0)
    problems, fields = w.sweep(90.0)
    assert fields["nvlink"][4]["rising_links"] == "2, 9"
    [problem] = problems
    assert "link 2: 3 recoveries in the last 90 s (2/min)" in problem.message
    assert "link 9: 3 recoveries" in problem.message


def test_only_links_with_errors_are_kept_in_the_window():
    """A healthy 8-GPU board has 144 links at 0: none is kept; a link is kept from its first error on."""
    clock = Clock(0.0)
    node = load_scenario("h100-sxm-8-nvlink-replay").build(clock=clock)
    host = fake_host(node, threaded=False)
    check = NvlinkCheck(clock=clock)
    for t in (0.0, 15.0, 30.0):
        clock.now = t
        run_sweep(host, [check])
    assert {key[1:] for key in check._links._samples} == {(7, "replay")}


# ---- one sweep: totals since the driver loaded, compared across same-model GPUs -----------------------------


def one_sweep(node, registry, checks: list[str]):
    host = fake_host(node)
    host.one_sweep = True
    return diagnose_host(host, registry, checks=checks)


def test_one_sweep_names_a_link_far_above_its_siblings_and_says_it_compares_totals(registry):
    out = one_sweep(node_for("h100-sxm-8-nvlink-recovering"), registry, ["nvlink"])
    [problem] = out.problems
    assert problem.rule == "nvlink-errors-above-siblings" and [g.index for g in problem.gpus] == [3]
    assert problem.severity == Severity.WARNING
    assert "link 14: 505 recoveries since the driver loaded, against a median of 0 on link 14 of the node's 7 " \
           "other NVIDIA H100 80GB HBM3 GPUs" in problem.message
    assert "a comparison of totals, not a rate" in problem.message


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-ecc-corrected", "h100-sxm-8-power-capped",
                                      "h100-sxm-8-throttle-blip", "h100-sxm-8-nvlink-replay"])
def test_one_sweep_leaves_ordinary_totals_alone(scenario, registry):
    # 1200 corrected ECC errors on one GPU, 40 replays on one link: far under the floors
    assert one_sweep(node_for(scenario), registry, ["nvlink", "pcie", "memory"]).problems == []


def test_one_sweep_compares_pcie_replays_and_corrected_ecc(registry):
    node = node_for("h100-sxm-8")
    for gpu in range(8):
        node.inject(Fault("pcie_replays", gpu, {"add": 60 + gpu}))
    node.inject(Fault("pcie_replays", 5, {"add": 4000}))
    node.inject(Fault("ecc", 1, {"corrected": 250_000}))
    out = one_sweep(node, registry, ["pcie", "memory"])
    assert out.rules() == {"pcie-replays-above-siblings", "memory-corrected-above-siblings"}
    pcie, memory = out.by_rule()["pcie-replays-above-siblings"], out.by_rule()["memory-corrected-above-siblings"]
    assert [g.index for g in pcie.gpus] == [5] and [g.index for g in memory.gpus] == [1]
    assert "4065 PCIe replays since the driver loaded, against a median of 63 on its 7 same-model" in pcie.message
    assert "250000 corrected ECC errors since the driver loaded" in memory.message
    for problem in out.problems:
        assert "a comparison of totals, not a rate" in problem.message and problem.severity == Severity.WARNING


def test_one_sweep_a_uniform_fleet_of_large_totals_never_stands_out(registry):
    node = node_for("h100-sxm-8")
    for gpu in range(8):
        node.inject(Fault("pcie_replays", gpu, {"add": 50_000 + 1000 * gpu}))
        node.inject(Fault("ecc", gpu, {"corrected": 400_000}))
        node.inject(Fault("nvlink_errors", gpu, {"link": 3, "counter": "recovery", "add": 700}))
        node.inject(Fault("nvlink_errors", gpu, {"link": 4, "counter": "recovery", "add": 700}))
        for link in range(18):
            node.inject(Fault("nvlink_errors", gpu, {"link": link, "counter": "crc_flit", "add": 5000}))
    assert one_sweep(node, registry, ["nvlink", "pcie", "memory"]).problems == []


def test_the_daemon_never_judges_totals(engine):
    """Without one_sweep (the daemon, diagnose --duration) a first sweep compares nothing: a total that stands
    out but does not rise is not judged, so a condition is never set on a lifetime count and then cleared."""
    w = Watched("h100-sxm-8-nvlink-recovering", engine, {"nvlink": {"recovery_per_min": 5}})
    w.node.inject(Fault("ecc", 1, {"corrected": 250_000}))
    for t in (0.0, 60.0, 600.0):
        problems, fields = w.sweep(t)
        assert problems == [] and fields["nvlink"][3]["links_above_siblings"] == ""


# ---- the fake node's counters -------------------------------------------------------------------------------


def test_fake_pcie_replays_and_sbe_storm_rise_with_node_time_until_a_reset():
    clock = Clock(0.0)
    node = load_scenario("h100-sxm-8").build(clock=clock)
    node.inject(Fault("pcie_replays", 2, {"add": 5, "per_min": 30}))
    node.inject(Fault("sbe_storm", 6, {"per_s": 100}))
    host = fake_host(node, threaded=False)
    nvml = host.nvml
    h2, h6 = nvml.nvmlDeviceGetHandleByIndex(2), nvml.nvmlDeviceGetHandleByIndex(6)
    clock.now = 60.0
    assert nvml.nvmlDeviceGetPcieReplayCounter(h2) == 35
    assert nvml.nvmlDeviceGetTotalEccErrors(h6, 0, 0) == 6000                    # corrected, volatile
    assert nvml.nvmlDeviceGetPcieReplayCounter(nvml.nvmlDeviceGetHandleByIndex(0)) == 0
    node.inject(Fault("recover", 2))
    node.inject(Fault("recover", 6))
    clock.now = 120.0
    assert nvml.nvmlDeviceGetPcieReplayCounter(h2) == 0
    assert nvml.nvmlDeviceGetTotalEccErrors(h6, 0, 0) == 0


# ---- helpers -------------------------------------------------------------------------------------------------


def test_standouts_are_robust_to_a_uniform_fleet_and_need_siblings():
    same = {i: "H100" for i in range(8)}
    assert standouts({i: 5000.0 + i for i in range(8)}, same, factor=10, floor=100) == {}
    values = {i: float(i % 3) for i in range(8)} | {4: 900.0}
    hit = standouts(values, same, factor=10, floor=100)
    assert list(hit) == [4] and (hit[4].median, hit[4].siblings) == (1.0, 7)
    assert standouts(values, same, factor=10, floor=1000) == {}                 # under the floor
    assert standouts({0: 0.0, 1: 900.0}, {0: "A", 1: "A"}, factor=10, floor=100) == {}   # one sibling: no median
    # another model's GPUs are not siblings; an unread one (None) is left out
    mixed = {0: 0.0, 1: 0.0, 2: 900.0, 3: 900.0, 4: None}
    assert standouts(mixed, {0: "A", 1: "A", 2: "B", 3: "B", 4: "A"}, factor=10, floor=100) == {}


def test_span_text_and_forget():
    assert [span_text(s) for s in (45, 1260, 3 * 3600 + 300, 5 * 86400)] == ["45 s", "21 min", "3 h 5 min", "5 days"]
    window = CounterWindow(60.0)
    window.add(("a", 1), 1, 0.0)
    window.add(("b", 1), 1, 0.0)
    window.forget(lambda key: key[0] == "a")
    assert ("a", 1) in window and ("b", 1) not in window


def test_rate_gauges_are_declared_on_fields_the_checks_fill():
    for cls, metric in ((PcieCheck, "gpu_npd_gpu_pcie_replays_per_minute"),
                        (MemoryCheck, "gpu_npd_gpu_ecc_corrected_per_second"),
                        (NvlinkCheck, "gpu_npd_gpu_nvlink_recovery_errors_per_minute")):
        assert cls.gauges[metric].field in cls.fields


# ---- diagnose, as a person runs it ---------------------------------------------------------------------------


def test_diagnose_without_a_duration_compares_totals_and_says_so():
    from test_cli import diagnose_json
    code, report = diagnose_json("h100-sxm-8-nvlink-recovering", "--checks", "nvlink,pcie,memory")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["nvlink-errors-above-siblings"]
    assert "a comparison of totals, not a rate" in report["problems"][0]["message"]
    assert "GPU 3 " in report["problems"][0]["message"] and "link 14: 505 recoveries" in report["problems"][0]["message"]
    for scenario in ("h100-sxm-8-ecc-corrected", "h100-sxm-8-pcie-replays", "h100-sxm-8-sbe-storm"):
        code, report = diagnose_json(scenario, "--checks", "nvlink,pcie,memory")   # one reading: no rate, small totals
        assert code == 0 and report["problems"] == [], scenario


# ---- diagnose --duration: issue 31's acceptance for the counter scenarios -------------------------------------

WATCH_NAMES = {"h100-sxm-8-nvlink-recovering": (3, "NvlinkRecoveryErrors"),
               "h100-sxm-8-nvlink-replay": (3, "NvlinkReplayErrors"),
               "h100-sxm-8-pcie-replays": (2, "PcieReplayRate"),
               "h100-sxm-8-sbe-storm": (6, "CorrectedEccStorm")}


@pytest.mark.parametrize("scenario", sorted(WATCH_NAMES))
def test_a_two_minute_watch_names_the_gpu_by_its_rate_not_its_totals(capsys, scenario):
    import json

    from detector.cli.main import main
    code = main(["diagnose", "--nvml", f"fake:{scenario}", "--duration", "120", "-q", "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    gpu, reason = WATCH_NAMES[scenario]
    assert code == 1 and [p["reason"] for p in out["problems"]] == [reason], out["problems"]
    assert {g["index"] for p in out["problems"] for g in p["gpu_details"]} == {gpu}
    assert "comparison of totals" not in out["problems"][0]["message"]       # a watch judges rates only


@pytest.mark.parametrize("values, middle, low, high", [
    ([3.0], 3.0, 3.0, 3.0), ([4.0, 1.0], 2.5, 1.0, 4.0), ([5.0, 1.0, 3.0], 3.0, 3.0, 3.0),
    ([0.0, 0.0, 9.0, 1e6], 4.5, 0.0, 9.0),
])
def test_medians_as_the_statistics_module_gives_them(values, middle, low, high):
    import statistics

    from detector.core.siblings import median, median_high, median_low

    assert (median(values), median_low(values), median_high(values)) == (middle, low, high)
    assert (middle, low, high) == (statistics.median(values), statistics.median_low(values),
                                   statistics.median_high(values))
    with pytest.raises(ValueError):
        median([])
