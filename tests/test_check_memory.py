"""The memory check: ECC counts, row remapping, retired pages, and the rules that judge them: on
scenarios that trip them and on normal ones that must not (corrected errors, GeForce without ECC)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import builtin_rules, Clock, diagnose_host, diagnose_scenario, node_for
from test_cli import diagnose_json
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.checks.memory import MemoryCheck
from detector.core.sweep import run_sweep
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host

REAL_MACHINES = Path(__file__).parent / "fixtures" / "real_machines"


def memory(scenario: str, registry):
    return diagnose_scenario(scenario, registry, checks=["memory"])


def fields_of(outcome, index: int) -> dict:
    run = outcome.sweep.runs[0]
    return next(o.fields for o in run.observations if o.gpu.index == index)


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "a100-pcie-4", "v100-sxm-8", "h100-sxm-8-ecc-corrected"])
def test_healthy_and_normal_nodes_raise_nothing(scenario, registry):
    out = memory(scenario, registry)
    assert out.problems == [] and out.sweep.runs[0].status == "ok"


def test_corrected_errors_are_counted_but_judged_normal(registry):
    out = memory("h100-sxm-8-ecc-corrected", registry)
    assert fields_of(out, 3)["volatile_corrected"] == 1200 and fields_of(out, 3)["aggregate_corrected"] == 1200
    assert out.problems == []


def test_geforce_reports_ecc_not_supported_not_healthy(registry):
    out = memory("rtx-4090-1", registry)
    f = fields_of(out, 0)
    assert f["ecc_mode"] == "not_supported" and f["volatile_uncorrected"] is None
    assert f["row_remapping"] == "not_supported" and f["retired_total"] is None
    assert out.problems == []
    assert "not supported" in out.sweep.runs[0].summary


def test_ampere_and_later_have_row_remapping_and_no_page_retirement(registry):
    f = fields_of(memory("h100-sxm-8", registry), 0)
    assert f["row_remapping"] == "supported" and f["remap_pending"] is False and f["retired_total"] is None
    v = fields_of(memory("v100-sxm-8", registry), 0)
    assert v["row_remapping"] == "not_supported" and v["retired_total"] == 0 and v["retired_pending"] is False


def test_remap_pending_asks_for_a_reset_and_the_reset_clears_it(registry):
    node = node_for("h100-sxm-8-remap-pending")
    out = diagnose_host(fake_host(node), registry, checks=["memory"])
    problem = out.by_rule()["memory-remap-pending"]
    assert (problem.type, problem.reason, problem.action) == ("GpuMemoryError", "RowRemapPending", "RESET_GPU")
    assert [g.index for g in problem.gpus] == [2]
    assert "memory-uncorrectable-since-load" in out.rules()       # the error that caused it
    node.inject(Fault("recover", 2))
    assert diagnose_host(fake_host(node), registry, checks=["memory"]).problems == []


def test_remap_failure_is_critical_replace_and_survives_a_reset(registry):
    node = node_for("h100-sxm-8-remap-failure")
    problem = diagnose_host(fake_host(node), registry, checks=["memory"]).by_rule()["memory-remap-failure"]
    assert (problem.severity, problem.action) == (Severity.CRITICAL, "CONTACT_SUPPORT")
    node.inject(Fault("reboot"))
    assert diagnose_host(fake_host(node), registry, checks=["memory"]).rules() == {"memory-remap-failure"}


def test_retired_pages_limit_and_pending_on_a_v100(registry):
    out = memory("v100-sxm-8-retired-pages", registry)
    assert out.rules() == {"memory-retired-pages-limit", "memory-retirement-pending"}
    assert [g.index for g in out.by_rule()["memory-retired-pages-limit"].gpus] == [1]
    assert fields_of(out, 1)["retired_total"] == 64 and fields_of(out, 1)["retired_dbe"] == 24


def test_ecc_disabled_is_reported_as_disabled(registry):
    out = memory("h100-sxm-8-ecc-disabled", registry)
    assert out.rules() == {"memory-ecc-disabled"}
    assert fields_of(out, 0)["ecc_mode"] == "disabled" and fields_of(out, 0)["volatile_uncorrected"] is None
    assert fields_of(out, 0)["ecc_default"] == "on"            # the fake H100 answers NVML_BRAND_NVIDIA


@pytest.mark.parametrize("scenario,default", [("h100-sxm-8", "on"), ("v100-sxm-8", "on"), ("rtx-4090-1", "off")])
def test_ecc_default_follows_the_brand_nvml_reports(scenario, default, registry):
    assert fields_of(memory(scenario, registry), 0)["ecc_default"] == default


@pytest.mark.parametrize("folder,brand", [("x-telegraf-2x-rtx-a5000-590", "NVIDIA RTX"),
                                          ("t-gpud-rtx4090x8-535-mixed-load", "GeForce")])
def test_ecc_off_on_a_real_workstation_or_geforce_card_is_its_default_not_a_fault(folder, brand, registry):
    """Real healthy machines whose cards ship with ECC off: reported disabled, judged as their default."""
    from detector.cli.replay_host import replay_host
    from detector.backends.replay.load import load_snapshot
    path = REAL_MACHINES / folder
    assert load_snapshot(path).gpus[0].brand == brand
    out = diagnose_host(replay_host(path), registry, checks=["memory"])
    assert (fields_of(out, 0)["ecc_mode"], fields_of(out, 0)["ecc_default"]) == ("disabled", "off")
    assert out.problems == []


def test_a_rising_uncorrectable_count_is_measured_over_the_window(registry):
    clock = Clock(0.0)
    node = node_for("h100-sxm-8")
    host = fake_host(node, threaded=False)
    check = MemoryCheck({"window": 600}, clock=clock)
    engine = RuleEngine(builtin_rules())
    first = run_sweep(host, [check])
    assert engine.evaluate(first.observations) == []
    node.inject(Fault("ecc", 5, {"uncorrected": 3}))
    clock.now = 60.0
    second = run_sweep(host, [check])
    problems = {p.rule: p for p in engine.evaluate(second.observations)}
    assert set(problems) == {"memory-uncorrectable-rising"}
    assert problems["memory-uncorrectable-rising"].severity == Severity.CRITICAL
    assert "3 uncorrectable ECC error(s) in the last 60 s" in problems["memory-uncorrectable-rising"].message
    clock.now = 60.0 + 700                                    # no new errors for longer than the window
    third = run_sweep(host, [check])
    assert {p.rule for p in engine.evaluate(third.observations)} == {"memory-uncorrectable-since-load"}


def test_ecc_rising_fault_moves_with_node_time():
    clock = Clock(0.0)
    from fake_nvml.scenario import load_scenario
    from fake_nvml.nvml import FakeNvml
    node = load_scenario("h100-sxm-8-ecc-rising").build(clock=clock)
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(5)
    assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0) == 1
    clock.now = 300.0                                          # 5 minutes at 2 a minute
    assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0) == 11
    node.inject(Fault("recover", 5))
    assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0) == 0     # volatile resets; the rising stops
    clock.now = 900.0
    assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0) == 0
    assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 1) >= 1     # aggregate keeps the history


# ---- rule thresholds, on observations ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(MemoryCheck.fields)
    base.update(ecc_mode="enabled", row_remapping="supported")
    return {p.rule for p in engine.evaluate([Observation("memory", {**base, **fields})])}


@pytest.mark.parametrize("total,dbe,expected", [
    (62, 0, set()), (63, 0, {"memory-retired-pages-limit"}), (64, 24, {"memory-retired-pages-limit"}),
    (20, 14, set()), (20, 15, {"memory-retired-dbe-pages"}),
])
def test_retired_page_thresholds(engine, total, dbe, expected):
    assert judge(engine, retired_total=total, retired_dbe=dbe, retired_sbe=total - dbe) == expected


@pytest.mark.parametrize("increase,volatile,expected", [
    (None, 0, set()), (0, 0, set()), (None, 1, {"memory-uncorrectable-since-load"}),
    (0, 2, {"memory-uncorrectable-since-load"}), (1, 1, {"memory-uncorrectable-rising"}),
])
def test_uncorrectable_thresholds(engine, increase, volatile, expected):
    assert judge(engine, uncorrected_increase=increase, volatile_uncorrected=volatile) == expected


@pytest.mark.parametrize("default,expected", [("on", {"memory-ecc-disabled"}), ("off", set()), ("unknown", set())])
def test_ecc_off_is_a_fault_only_where_it_ships_on(engine, default, expected):
    assert judge(engine, ecc_mode="disabled", ecc_default=default) == expected
    assert judge(engine, ecc_mode="enabled", ecc_default=default) == set()


def test_remap_failure_outranks_pending(engine):
    assert judge(engine, remap_pending=True, remap_failure=True) == {"memory-remap-failure"}
    assert judge(engine, remap_pending=True, remap_failure=False) == {"memory-remap-pending"}
    assert judge(engine, ecc_mode="not_supported", row_remapping="not_supported") == set()


# ---- end to end --------------------------------------------------------------------------------


def test_diagnose_json_end_to_end():
    code, report = diagnose_json("h100-sxm-8-remap-pending", "--checks", "memory")
    assert code == 1
    assert {p["rule"] for p in report["problems"]} == {"memory-remap-pending", "memory-uncorrectable-since-load"}
    result = report["checks"][0]["result"]["gpus"]
    assert result[2]["remap_pending"] is True and result[2]["by_location"]["device_memory"]["uncorrected"] == 1
    code, report = diagnose_json("rtx-4090-1", "--checks", "memory")
    assert code == 0 and report["checks"][0]["result"]["gpus"][0]["ecc_mode"] == "not_supported"


def test_daemon_sets_and_clears_the_memory_condition(running):
    local = running(name="gpu-mem", checks=["memory"], check_settings={"memory": {"interval": 0.3}})

    def status() -> str | None:
        return local.conditions().get("GpuMemoryError", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuMemoryError") and status() is None, 10), local.conditions()
    local.node.inject(Fault("remap_pending", 4))
    assert local.wait_for(lambda: status() == "True", 10)
    condition = local.conditions()["GpuMemoryError"]
    assert condition["reason"] == "RowRemapPending" and "GPU 4" in condition["message"]
    local.node.inject(Fault("recover", 4))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()
