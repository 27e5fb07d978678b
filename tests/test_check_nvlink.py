"""The nvlink check: link counts against the model, down links, error counters as rates over the window,
the rules' thresholds, the counter-reading fallbacks, the cost of a run, diagnose JSON and the daemon."""

from __future__ import annotations

import dataclasses
from typing import Any

import pynvml
import pytest

from conftest import builtin_rules, Clock, diagnose_host, diagnose_scenario, node_for
from test_cli import diagnose_json
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.checks.nvlink import NvlinkCheck
from detector.core.sweep import run_sweep
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario


def nvlink(scenario: str, registry, **settings):
    return diagnose_scenario(scenario, registry, checks=["nvlink"], settings={"nvlink": settings} if settings else None)


def gpu_fields(outcome, index: int) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations
                if o.gpu.index == index and o.fields["scope"] == "gpu")


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


class Timed:
    """A scenario's node, host and check on one hand-moved clock, swept and judged as the daemon would."""

    def __init__(self, scenario: str, engine: RuleEngine, **config: Any):
        self.clock = Clock(0.0)
        self.node = load_scenario(scenario).build(clock=self.clock)
        self.host = fake_host(self.node, threaded=False)
        self.check = NvlinkCheck(config, clock=self.clock)
        self.engine = engine

    def at(self, t: float) -> tuple[dict[int, dict], dict[str, Any]]:
        self.clock.now = t
        sweep = run_sweep(self.host, [self.check])
        fields = {o.gpu.index: o.fields for o in sweep.runs[0].observations if o.fields.get("scope") == "gpu"}
        return fields, {p.rule: p for p in self.engine.evaluate(sweep.observations)}


# ---- scenarios ------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario,links", [("h100-sxm-8", 18), ("v100-sxm-8", 6)])
def test_healthy_nvlink_nodes_have_every_link_up_and_raise_nothing(scenario, links, registry):
    out = nvlink(scenario, registry)
    assert out.problems == [] and out.sweep.runs[0].status == "ok"
    for i in range(8):
        f = gpu_fields(out, i)
        assert (f["nvlink"], f["links_expected"], f["links_reported"], f["links_active"]) == \
            ("supported", links, links, links)
        assert f["counters"] == "field_values" and f["replay_total"] == 0 and f["crc_data_total"] == 0


@pytest.mark.parametrize("scenario", ["a100-pcie-4", "rtx-4090-1"])
def test_cards_without_nvlink_are_not_applicable_not_healthy(scenario, registry):
    out = nvlink(scenario, registry)
    f = gpu_fields(out, 0)
    assert (f["nvlink"], f["links_expected"], f["links_reported"], f["counters"]) == ("not_supported", 0, 0,
                                                                                      "not_supported")
    assert f["replay_total"] is None and f["replay_per_min"] is None
    assert out.problems == [] and "not supported" in out.sweep.runs[0].summary


def test_a_down_link_is_critical_and_named(registry):
    out = nvlink("h100-sxm-8-nvlink-down", registry)
    assert out.rules() == {"nvlink-link-down"}
    problem = out.by_rule()["nvlink-link-down"]
    assert (problem.type, problem.reason, problem.severity, problem.action) == \
        ("GpuNvlinkDown", "NvlinkDown", Severity.CRITICAL, "CHECK_NVLINK")
    assert [g.index for g in problem.gpus] == [2] and "NVLink 4 is down" in problem.message
    assert gpu_fields(out, 2)["links_active"] == 17 and gpu_fields(out, 2)["inactive_links"] == "4"


def test_expected_links_setting_overrides_the_model(registry):
    # a PCIe A100 with NVLink bridges: expected_links makes missing links a finding
    out = nvlink("a100-pcie-4", registry, expected_links=12)
    assert out.rules() == {"nvlink-links-missing"}
    assert "NVML reports 0 NVLinks, expected 12" in out.by_rule()["nvlink-links-missing"].message
    # expecting none: a down link is reported but not judged
    out = nvlink("h100-sxm-8-nvlink-down", registry, expected_links=0)
    assert out.problems == [] and gpu_fields(out, 2)["links_inactive"] == 1


def links_answered(host, answer):
    """Replace the fake NVML's link state with answer(gpu_index, link, real_answer)."""
    real = host.nvml.nvmlDeviceGetNvLinkState
    index = {host.nvml.nvmlDeviceGetHandleByIndex(i): i for i in range(host.nvml.nvmlDeviceGetCount())}

    def state(handle, link):
        return answer(index[handle], link, lambda: real(handle, link))
    host.nvml.nvmlDeviceGetNvLinkState = state


def invalid_past(n):
    def answer(gpu, link, real):
        if link >= n:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return real()
    return answer


def test_a_gpu_reporting_fewer_links_than_its_peers_of_the_same_model(registry):
    host = fake_host(node_for("h100-sxm-8"))
    links_answered(host, lambda gpu, link, real: invalid_past(12 if gpu == 5 else 18)(gpu, link, real))
    out = diagnose_host(host, registry, checks=["nvlink"])
    assert out.rules() == {"nvlink-links-missing"}
    [problem] = out.problems
    assert [g.index for g in problem.gpus] == [5] and "expected 18" in problem.message
    assert "NVSwitches on the PCI bus" in problem.message


def test_every_gpu_reporting_the_same_links_is_what_the_board_is_unless_a_setting_says_more(registry):
    """No data sheet: 8 GPUs that all report 12 links are a board of 12 links; expected_links overrides."""
    host = fake_host(node_for("h100-sxm-8"))
    links_answered(host, invalid_past(12))
    assert diagnose_host(host, registry, checks=["nvlink"]).problems == []
    host = fake_host(node_for("h100-sxm-8"))
    links_answered(host, invalid_past(12))
    out = diagnose_host(host, registry, checks=["nvlink"], settings={"nvlink": {"expected_links": 18}})
    assert out.rules() == {"nvlink-links-missing"} and len(out.by_rule()["nvlink-links-missing"].gpus) == 8


def lone(model_scenario: str, bus_id: str):
    base = load_scenario(model_scenario)
    return dataclasses.replace(base, pci_bus_ids=[bus_id], nvswitches=[]).build("lone")


def test_a_lone_h100_in_a_vm_expects_no_nvlink(registry):
    """The real H100 VM (../shared/real-machines/h100-vm-580/nvml-answers.txt): NVML answers NotSupported on
    links 0-17 and InvalidArgument from 18; no NVSwitch, no peer. Nothing to expect, nothing missing."""
    host = fake_host(lone("h100-sxm-8", "0000:00:06.0"))

    def vm(gpu, link, real):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED if link < 18 else pynvml.NVML_ERROR_INVALID_ARGUMENT)
    links_answered(host, vm)
    out = diagnose_host(host, registry, checks=["nvlink"])
    assert out.problems == []
    f = gpu_fields(out, 0)
    assert (f["nvlink"], f["links_reported"], f["links_expected"]) == ("not_supported", 0, 0)
    assert "NVLink not supported" in out.sweep.runs[0].summary


def test_links_reported_inactive_on_a_gpu_alone_are_not_down(registry):
    """NVIDIA/NVSentinel#1481: a single A100 PCIe without a bridge, whose 12 links NVML lists as down, was
    called failed by DCGM's health watch. Nothing is connected there; the links are reported, not judged."""
    host = fake_host(lone("h100-sxm-8", "0000:3b:00.0"))
    links_answered(host, lambda gpu, link, real: pynvml.NVML_FEATURE_DISABLED if link < 12 else invalid_past(12)(gpu, link, real))
    out = diagnose_host(host, registry, checks=["nvlink"])
    assert out.problems == []
    f = gpu_fields(out, 0)
    assert (f["links_reported"], f["links_inactive"], f["links_expected"]) == (12, 12, 0)
    assert "nothing connected" in f["expected_because"]


def test_a_gpu_on_an_nvswitch_board_that_trained_no_link_is_critical(registry):
    node = node_for("h100-sxm-8")
    for link in range(18):
        node.inject(Fault("nvlink_down", 2, {"link": link}))
    out = diagnose_host(fake_host(node), registry, checks=["nvlink"])
    assert out.rules() == {"nvlink-link-down"}
    assert [g.index for g in out.by_rule()["nvlink-link-down"].gpus] == [2]
    assert gpu_fields(out, 2)["links_active"] == 0 and gpu_fields(out, 2)["links_expected"] == 18


def test_links_training_after_a_reboot_are_not_down_until_the_debounce(engine):
    t = Timed("h100-sxm-8-nvlink-down", engine)
    _, problems = t.at(0.0)                     # up for an hour already: the link had time to train
    assert set(problems) == {"nvlink-link-down"}
    t.node.inject(Fault("reboot"))             # the reboot cures the fake; the link fails again in the new boot
    t.node.inject(Fault("nvlink_down", 2, {"link": 4}))
    fields, problems = t.at(30.0)               # 30 s into the new boot: still training, as far as we know
    assert problems == {} and fields[2]["links_settling"] == 1
    fields, problems = t.at(150.0)
    assert problems == {} and fields[2]["links_settling"] == 1
    fields, problems = t.at(200.0)              # held down past the 180 s debounce
    assert set(problems) == {"nvlink-link-down"} and fields[2]["links_settling"] == 0


def test_a_link_seen_up_that_goes_down_must_stay_down_for_the_debounce(engine):
    t = Timed("h100-sxm-8", engine, debounce=120.0)
    t.at(0.0)
    t.node.inject(Fault("nvlink_down", 1, {"link": 7}))
    fields, problems = t.at(60.0)
    assert problems == {} and fields[1]["links_settling"] == 1
    fields, problems = t.at(181.0)
    assert set(problems) == {"nvlink-link-down"}
    assert "expected because 8 NVSwitches" in problems["nvlink-link-down"].message or \
        "NVSwitches" in problems["nvlink-link-down"].message


def test_rising_replay_errors_are_judged_over_the_window_not_as_totals(engine):
    t = Timed("h100-sxm-8-nvlink-replay", engine)
    fields, problems = t.at(0.0)
    assert fields[3]["replay_total"] == 40 and fields[3]["replay_increase"] is None and problems == {}
    fields, problems = t.at(120.0)
    assert (fields[3]["replay_increase"], fields[3]["replay_per_min"]) == (10, 5.0)
    assert fields[3]["links_with_new_errors"] == "7 (replay +10)"
    assert set(problems) == {"nvlink-replay-errors"} and problems["nvlink-replay-errors"].severity == Severity.WARNING
    t.node.inject(Fault("recover", 3))                      # counters start again at 0; the window with them
    fields, problems = t.at(180.0)
    assert fields[3]["replay_total"] == 0 and problems == {}
    fields, problems = t.at(900.0)
    assert fields[3]["replay_increase"] == 0 and problems == {}


def test_a_flapping_link_is_down_then_retrained(engine):
    t = Timed("h100-sxm-8-nvlink-flap", engine)
    _, problems = t.at(0.0)                                  # in its down spell
    assert set(problems) == {"nvlink-link-down"}
    fields, problems = t.at(60.0)                            # up again, no retrain counted yet
    assert problems == {} and fields[6]["links_active"] == 18
    fields, problems = t.at(150.0)                           # up after its second down spell: one retrain
    assert set(problems) == {"nvlink-recovery-errors"} and fields[6]["recovery_increase"] == 1
    assert "11 (recovery +1)" == fields[6]["links_with_new_errors"]


def test_crc_errors_count_flit_and_data(engine):
    t = Timed("h100-sxm-8", engine)
    t.at(0.0)
    t.node.inject(Fault("nvlink_errors", 0, {"link": 2, "counter": "crc_flit", "add": 30}))
    t.node.inject(Fault("nvlink_errors", 0, {"link": 3, "counter": "crc_data", "add": 20}))
    fields, problems = t.at(60.0)
    assert (fields[0]["crc_flit_total"], fields[0]["crc_data_total"], fields[0]["crc_increase"]) == (30, 20, 50)
    assert set(problems) == {"nvlink-crc-errors"}


# ---- counter reading on other drivers, and its cost -----------------------------------------------


def test_drivers_without_the_field_ids_fall_back_to_the_per_link_call(registry):
    node = node_for("h100-sxm-8-nvlink-replay")
    host = fake_host(node)

    def no_fields(handle, ids):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    host.nvml.nvmlDeviceGetFieldValues = no_fields
    out = diagnose_host(host, registry, checks=["nvlink"])
    assert gpu_fields(out, 3)["counters"] == "error_counter" and gpu_fields(out, 3)["replay_total"] == 40


def test_a_gpu_without_either_counter_api_reports_links_but_no_counters(registry):
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    calls: list[tuple] = []

    def not_supported(*args):
        calls.append(args)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    host.nvml.nvmlDeviceGetFieldValues = not_supported
    host.nvml.nvmlDeviceGetNvLinkErrorCounter = not_supported
    out = diagnose_host(host, registry, checks=["nvlink"])
    f = gpu_fields(out, 0)
    assert (f["counters"], f["replay_total"], f["crc_total"], f["links_active"]) == ("not_supported", None, None, 18)
    assert len(calls) == 8 * (1 + 4) and out.problems == []        # one try per API and counter, not per link


class Counting:
    """Counts the NVML calls a run makes."""

    def __init__(self, nvml: Any):
        self._nvml, self.calls = nvml, 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._nvml, name)
        if not callable(target) or not name.startswith("nvml"):
            return target

        def counted(*args: Any) -> Any:
            self.calls += 1
            return target(*args)
        return counted


def test_a_run_on_an_8_gpu_node_costs_a_bounded_number_of_nvml_calls():
    host = fake_host(node_for("h100-sxm-8"), threaded=False)
    run_sweep(host, [])                                            # the inventory's calls are not the check's
    check = NvlinkCheck()
    inventory = run_sweep(host, []).inventory
    host.nvml = counting = Counting(host.nvml)
    run_sweep(host, [check], inventory=inventory)
    first = counting.calls
    counting.calls = 0
    run_sweep(host, [check], inventory=inventory)
    # per GPU: 36 link states, 1 batched field-value read, 18 data-CRC reads (no model look-up: the
    # expectation comes from what the node shows)
    assert first == counting.calls == 8 * (36 + 1 + 18)


# ---- the rules, at and around their thresholds -----------------------------------------------------


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(NvlinkCheck.fields)
    base.update(scope="gpu", nvlink="supported", links_expected=18, links_reported=18, links_active=18)
    return {p.rule for p in engine.evaluate([Observation("nvlink", {**base, **fields})])}


@pytest.mark.parametrize("per_min,links,expected", [
    (None, "", set()), (None, None, set()), (5.0, "link 2: 10 CRC errors in the last 60 s (10/min); 10 since the "
                                              "driver loaded", {"nvlink-crc-errors"}),
    (5999.0, "link 2: ...", {"nvlink-crc-errors"}), (6000.0, "link 2: ...", {"nvlink-crc-errors-critical"}),
    (6000.0, "", {"nvlink-crc-errors-critical"}),
])
def test_crc_rules(engine, per_min, links, expected):
    """Which link's rise counts is the check's (crc_per_min, crc_min_count: test_counter_rates.py); the rules
    warn on the links it names and go critical at DCGM's 100/s over the GPU."""
    assert judge(engine, crc_per_min=per_min, crc_links=links) == expected


@pytest.mark.parametrize("counter", ["replay", "recovery"])
@pytest.mark.parametrize("links,fires", [(None, False), ("", False), ("link 7: 1 replay error in the last 15 s", True)])
def test_replay_and_recovery_fire_on_the_links_the_check_names(engine, counter, links, fires):
    assert judge(engine, **{f"{counter}_links": links}) == ({f"nvlink-{counter}-errors"} if fires else set())


@pytest.mark.parametrize("reported,expected_links,fires", [(18, 18, False), (17, 18, True), (0, 0, False),
                                                          (0, None, False), (0, 6, True)])
def test_links_missing_threshold(engine, reported, expected_links, fires):
    got = judge(engine, links_reported=reported, links_expected=expected_links)
    assert got == ({"nvlink-links-missing"} if fires else set())


@pytest.mark.parametrize("expected,held,fires", [(True, True, True), (False, True, False), (True, False, False)])
def test_a_down_link_fires_only_when_expected_and_held_down(engine, expected, held, fires):
    obs = Observation("nvlink", {**dict.fromkeys(NvlinkCheck.fields), "scope": "link", "link": 4,
                                 "link_state": "inactive", "expected": expected, "links_expected": 18,
                                 "held_down": held, "down_for_s": 200.0 if held else 20.0, "debounce_s": 180.0})
    assert {p.rule for p in engine.evaluate([obs])} == ({"nvlink-link-down"} if fires else set())


# ---- end to end ------------------------------------------------------------------------------------


def test_diagnose_json_end_to_end():
    code, report = diagnose_json("h100-sxm-8-nvlink-down", "--checks", "nvlink")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["nvlink-link-down"]
    gpu2 = report["checks"][0]["result"]["gpus"][2]
    assert gpu2["inactive_links"] == "4" and gpu2["links_expected"] == 18 and len(gpu2["links"]) == 18
    assert gpu2["links"][4] == {"link": 4, "active": False, "replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}
    code, report = diagnose_json("rtx-4090-1", "--checks", "nvlink")
    assert code == 0 and report["checks"][0]["result"]["gpus"][0]["nvlink"] == "not_supported"


def test_daemon_sets_and_clears_the_nvlink_condition(running):
    local = running(name="gpu-nvl", checks=["nvlink"], check_settings={"nvlink": {"interval": 0.3, "debounce": 1.0}})

    def status() -> str | None:
        return local.conditions().get("GpuNvlinkDown", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuNvlinkDown") and status() is None, 10), local.conditions()
    local.node.inject(Fault("nvlink_down", 5, {"link": 9}))
    assert local.wait_for(lambda: status() == "True", 10)
    condition = local.conditions()["GpuNvlinkDown"]
    assert condition["reason"] == "NvlinkDown" and "GPU 5" in condition["message"] and "NVLink 9" in condition["message"]
    local.node.inject(Fault("recover", 5))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()
