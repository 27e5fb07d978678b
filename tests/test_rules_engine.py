"""From observations to problems: one problem per matching rule, GPUs merged, messages bounded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detector.core.check import CheckRegistry
from detector.core.types import ACTIONS, GpuRef, Observation, Problem, Severity
from detector.rules.engine import RuleEngine
from detector.rules.loader import RuleSet, load_rules
from detector.rules.model import MESSAGE_LIMIT, compose_message, render, template_names

REPO = Path(__file__).resolve().parent.parent
BUILTIN = REPO / "rules"

RULES = """\
version: 1
rules:
  - name: pcie-width-degraded
    check: pcie
    when: current_width < max_width
    type: GpuPcieDegraded
    reason: PcieLinkWidthDegraded
    severity: warning
    action: RESTART_BM
    message: "link at x{current_width}, expected x{max_width}"

  - name: gpu-lost
    check: visibility
    when: nvml_error == "GpuIsLost"
    type: GpuMissing
    reason: GpuFellOffBus
    severity: critical
    action: RESET_GPU
    message: "fell off the bus (driver {driver})"

  - name: gpu-count-low
    check: visibility
    when: expected_gpus > 0 and pci_gpus < expected_gpus
    type: GpuMissing
    reason: GpuCountBelowExpected
    severity: critical
    action: RESTART_BM
    message: "only {pci_gpus} of {expected_gpus} GPUs"

  - name: check-timed-out
    check: "*"
    when: check_status == "timeout"
    type: GpuHealthCheckFailing
    reason: CheckTimedOut
    severity: warning
    action: INSPECT
    message: "the {check} check timed out"
"""

SUFFIX = {a: f" Recommended action: {a} ({ACTIONS[a]})." for a in ACTIONS}


def gpu(i: int) -> GpuRef:
    return GpuRef(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}", f"00000000:{i + 16:02X}:00.0")


def pcie(i: int | None, width: int = 8, max_width: int = 16, t: float = 100.0) -> Observation:
    return Observation("pcie", {"current_width": width, "max_width": max_width, "check": "pcie",
                                "check_status": "ok"}, None if i is None else gpu(i), time=t)


@pytest.fixture()
def engine(tmp_path) -> RuleEngine:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return RuleEngine(load_rules([path], CheckRegistry.from_entry_points().fields_by_check()))


def single_rule(tmp_path, message: str, action: str = "RESET_GPU", check: str = "pcie",
                when: str = "current_width < max_width") -> RuleEngine:
    path = tmp_path / "one.yaml"
    path.write_text(f"version: 1\nrules:\n  - name: only\n    check: {check}\n    when: {when}\n"
                    f"    type: GpuThing\n    reason: ThingHappened\n    severity: info\n"
                    f"    action: {action}\n    message: '{message}'\n")
    return RuleEngine(load_rules([path]))


def test_rule_matching_two_gpus_gives_one_problem_with_both(engine) -> None:
    problems = engine.evaluate([pcie(3, 8, t=10.0), pcie(1, 16), pcie(0, 4, t=12.0)])
    assert len(problems) == 1
    p = problems[0]
    assert (p.rule, p.check, p.type, p.reason) == ("pcie-width-degraded", "pcie", "GpuPcieDegraded",
                                                   "PcieLinkWidthDegraded")
    assert p.severity is Severity.WARNING and p.action == "RESTART_BM" and p.report == "condition"
    assert p.gpus == (gpu(3), gpu(0))                   # observation order, non-matching GPU 1 absent
    assert p.message == (f"{gpu(3).label()}: link at x8, expected x16; "
                         f"{gpu(0).label()}: link at x4, expected x16." + SUFFIX["RESTART_BM"])
    assert p.time == 12.0                               # the latest hit


def test_same_gpu_twice_is_listed_once(engine) -> None:
    p, = engine.evaluate([pcie(2), pcie(5), pcie(2), pcie(2, 4)])
    assert p.gpus == (gpu(2), gpu(5))
    # identical findings are said once; different findings about one GPU are both kept
    assert p.message.count(f"{gpu(2).label()}: link at x8") == 1
    assert f"{gpu(2).label()}: link at x4" in p.message


def test_node_level_observation(engine) -> None:
    obs = Observation("visibility", {"expected_gpus": 8, "pci_gpus": 6, "check": "visibility",
                                     "check_status": "ok", "nvml_error": ""})
    p, = engine.evaluate([obs])
    assert p.rule == "gpu-count-low" and p.gpus == ()
    assert p.message == "only 6 of 8 GPUs." + SUFFIX["RESTART_BM"]
    assert p.to_dict()["gpus"] == []


def test_star_rule_sees_every_check(engine) -> None:
    obs = [Observation("pcie", {"check": "pcie", "check_status": "timeout"}),
           Observation("visibility", {"check": "visibility", "check_status": "ok"}),
           Observation("nccl", {"check": "nccl", "check_status": "timeout"})]
    p, = engine.evaluate(obs)
    assert p.rule == "check-timed-out"
    assert p.check == "pcie"                            # the first hit's check
    assert p.message == "the pcie check timed out; the nccl check timed out." + SUFFIX["INSPECT"]


def test_rule_for_one_check_ignores_another_checks_observations(engine) -> None:
    # the fields would match the pcie rule, but the observation is the visibility check's
    looks_like_pcie = Observation("visibility", {"current_width": 1, "max_width": 16}, gpu(0))
    assert engine.evaluate([looks_like_pcie]) == []
    # and a visibility-looking observation from pcie does not trip the visibility rules
    assert engine.evaluate([Observation("pcie", {"nvml_error": "GpuIsLost", "driver": "x"}, gpu(0))]) == []


def test_no_hits_produce_nothing(engine) -> None:
    assert engine.evaluate([]) == []
    assert engine.evaluate([pcie(0, 16), pcie(1, 16)]) == []
    # missing fields do not match either
    assert engine.evaluate([Observation("pcie", {}, gpu(0)), Observation("visibility", {})]) == []


def test_problem_order_follows_rule_order_not_observation_order(engine) -> None:
    obs = [Observation("visibility", {"check": "visibility", "check_status": "timeout", "nvml_error": "",
                                      "expected_gpus": 2, "pci_gpus": 1}),
           Observation("visibility", {"nvml_error": "GpuIsLost", "driver": "nvidia"}, gpu(1)),
           pcie(0)]
    assert [p.rule for p in engine.evaluate(obs)] == ["pcie-width-degraded", "gpu-lost", "gpu-count-low",
                                                      "check-timed-out"]


def test_one_observation_can_match_several_rules(engine) -> None:
    obs = Observation("visibility", {"nvml_error": "GpuIsLost", "driver": "nvidia", "check": "visibility",
                                     "check_status": "timeout"}, gpu(4))
    problems = engine.evaluate([obs])
    assert [p.rule for p in problems] == ["gpu-lost", "check-timed-out"]
    assert all(p.gpus == (gpu(4),) for p in problems)


def test_message_template_renders_fields(tmp_path) -> None:
    e = single_rule(tmp_path, "w={current_width} m={max_width} d={driver} r={ratio} z={zero} "
                              "b={busy} e={empty} {nope}", action="NONE")
    obs = Observation("pcie", {"current_width": 4, "max_width": 16, "driver": None, "ratio": 0.25,
                               "zero": 0, "busy": False, "empty": ""})
    p, = e.evaluate([obs])
    # None and absent fields say "unknown", an empty string says "none"; NONE adds no action text
    assert p.message == "w=4 m=16 d=unknown r=0.25 z=0 b=False e=none unknown."


def test_templates_use_plain_names_only() -> None:
    fields = {"x": "{y}", "y": "secret", "obj": object()}
    assert render("{x}", fields) == "{y}"               # a value is never re-rendered
    assert render("{obj.__class__} {0} {x!r} {{x}}", fields) == "{obj.__class__} {0} {x!r} {{y}}"
    assert template_names("{a} {b.c} {0} {_d1} {a}") == {"a", "_d1"}


def test_float_values_render_compactly() -> None:
    assert render("{a} {b} {c}", {"a": 1.0, "b": 71.5, "c": 1e-7}) == "1 71.5 1e-07"


def test_message_is_capped_with_many_gpus(engine) -> None:
    n = 300
    p, = engine.evaluate([pcie(i) for i in range(n)])
    assert len(p.gpus) == n                             # every GPU is still listed, only the text is capped
    assert len(p.message) <= MESSAGE_LIMIT
    assert p.message.endswith(SUFFIX["RESTART_BM"])
    left_out = re.search(r" \(\+(\d+) more\)\.", p.message)
    assert left_out, p.message
    shown = p.message[:left_out.start()].count("link at x8")
    assert shown >= 1 and shown + int(left_out.group(1)) == n
    assert f"{gpu(0).label()}: link at x8" in p.message
    assert gpu(n - 1).label() not in p.message


def test_compose_message_fits_exactly_when_parts_fit() -> None:
    parts = ["a" * 100, "b" * 100]
    m = compose_message(parts, "RESET_GPU")
    assert m == "a" * 100 + "; " + "b" * 100 + "." + SUFFIX["RESET_GPU"]
    assert compose_message(["ends with a period."], "IGNORE") == "ends with a period."


def test_compose_message_overlong_first_part_is_cut_and_keeps_the_action() -> None:
    m = compose_message(["x" * 5000, "y" * 10], "CONTACT_SUPPORT")
    assert len(m) <= MESSAGE_LIMIT
    assert m.endswith(SUFFIX["CONTACT_SUPPORT"])
    assert re.search(r"x… \(\+1 more\)\. Recommended action", m)      # the second finding is counted
    assert "y" not in m.replace("Recommended", "").split("(+")[0]


def test_compose_message_at_exact_budget_still_ends_with_the_action() -> None:
    budget = MESSAGE_LIMIT - len(SUFFIX["RESET_GPU"])
    m = compose_message(["a" * budget], "RESET_GPU")
    assert len(m) <= MESSAGE_LIMIT and m.endswith(SUFFIX["RESET_GPU"])


def test_single_overlong_finding_does_not_claim_more() -> None:
    m = compose_message(["z" * 3000], "RESET_GPU")
    assert len(m) <= MESSAGE_LIMIT and m.endswith(SUFFIX["RESET_GPU"])
    assert "more)" not in m


def test_problem_to_dict(engine) -> None:
    p, = engine.evaluate([pcie(2), pcie(7)])
    d = p.to_dict()
    assert {"check", "type", "reason", "message", "severity", "action", "gpus"} <= set(d)
    assert d["check"] == "pcie" and d["type"] == "GpuPcieDegraded" and d["reason"] == "PcieLinkWidthDegraded"
    assert d["severity"] == "warning" and d["action"] == "RESTART_BM" and d["message"] == p.message
    assert d["gpus"] == [2, 7]
    assert d["rule"] == "pcie-width-degraded" and d["report"] == "condition"
    assert d["gpu_details"][0] == {"index": 2, "uuid": gpu(2).uuid, "pci_bus_id": gpu(2).pci_bus_id}


def test_gpu_without_index_is_kept_but_not_in_indices(tmp_path) -> None:
    e = single_rule(tmp_path, "x{current_width}")
    ref = GpuRef(None, None, "0000:3b:00.0")
    p, = e.evaluate([Observation("pcie", {"current_width": 1, "max_width": 16}, ref), pcie(1)])
    assert p.gpus == (ref, gpu(1))
    assert p.to_dict()["gpus"] == [1]
    assert p.message.startswith("GPU (0000:3b:00.0): x1; ")


def test_builtin_rules_end_to_end() -> None:
    rs = load_rules([BUILTIN], CheckRegistry.from_entry_points().fields_by_check())
    obs = [Observation("pcie", {"current_width": 8, "max_width": 16, "current_gen": 4, "max_gen": 4,
                                "idle": False, "utilization_pct": 90, "busy": True, "check": "pcie",
                                "check_status": "ok"}, gpu(0)),
           Observation("pcie", {"current_width": 16, "max_width": 16, "current_gen": 3, "max_gen": 4,
                                "idle": False, "utilization_pct": 90, "busy": True, "check": "pcie",
                                "check_status": "ok"}, gpu(1)),
           Observation("pcie", {"current_width": 8, "max_width": 16, "current_gen": 1, "max_gen": 4,
                                "idle": True, "utilization_pct": 0, "busy": False, "check": "pcie",
                                "check_status": "ok"}, gpu(2))]
    problems = RuleEngine(rs).evaluate(obs)
    # width and generation are judged only while busy. Order is the rule file's.
    assert [(p.rule, p.gpus) for p in problems] == [("pcie-width-degraded", (gpu(0),)),
                                                    ("pcie-gen-degraded", (gpu(1),))]
    assert "x8, expected x16" in problems[0].message and "Gen3" in problems[1].message
    assert all(isinstance(p, Problem) and p.type == "GpuPcieDegraded" for p in problems)


def test_engine_keeps_its_ruleset(tmp_path) -> None:
    rs = RuleSet([], [])
    assert RuleEngine(rs).ruleset is rs and RuleEngine(rs).evaluate([pcie(0)]) == []
