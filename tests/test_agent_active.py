"""Held problems: each rule's recovery (observation, reboot, manual, ttl), persistence, condition summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detector.agent.active import ActiveProblems
from detector.rules.model import compose_message
from detector.core.types import GpuRef, Problem, Severity
from detector.rules.loader import load_rules
from detector.yamlsource import SourceError
from conftest import builtin_rules

RULES = """\
version: 1
defaults:
  recovery: reboot
rules:
  - name: lost
    check: visibility
    when: nvml_error == "GpuIsLost"
    type: GpuMissing
    reason: GpuFellOffBus
    severity: critical
    action: RESTART_BM
    message: "lost"
    recovery: observation
  - name: xid-79
    check: xid
    when: code == 79
    type: GpuXidError
    reason: Xid79
    severity: critical
    action: RESTART_BM
    message: "XID 79"
  - name: xid-48
    check: xid
    when: code == 48
    type: GpuXidError
    reason: Xid48
    severity: warning
    action: RESET_GPU
    message: "XID 48"
    ttl: 1h
  - name: xid-repeat
    check: xid
    when: code == 13
    type: GpuXidError
    reason: XidRecurring
    severity: critical
    action: CONTACT_SUPPORT
    message: "again"
    recovery: manual
  - name: failed
    check: "*"
    when: check_status == "error"
    type: GpuHealthCheckFailing
    reason: CheckFailed
    severity: warning
    action: INSPECT
    message: "failed"
    recovery: observation
  - name: app-xid
    check: xid
    when: code == 8
    type: GpuXidError
    reason: Xid8
    severity: warning
    action: RESTART_APP
    report: event
    message: "XID 8"
"""


@pytest.fixture
def rules(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text(RULES)
    return load_rules([path]).rules


def problem(rule: str, type_: str = "GpuXidError", reason: str = "Xid79", check: str = "xid",
            severity: Severity = Severity.CRITICAL, message: str = "m", report: str = "condition") -> Problem:
    return Problem(rule, check, type_, reason, message, severity, "RESTART_BM", report, (GpuRef(3, "GPU-3", "0000:5d:00.0"),))


def test_defaults_and_own_values_are_loaded(rules):
    by = {r.name: r for r in rules}
    assert by["lost"].recovery == "observation"
    assert by["xid-79"].recovery == "reboot" and by["xid-79"].ttl_s is None
    assert by["xid-48"].recovery == "reboot" and by["xid-48"].ttl_s == 3600
    assert by["xid-repeat"].recovery == "manual"
    assert by["app-xid"].recovery == "observation"      # events take no default


@pytest.mark.parametrize("snippet, field, expected", [
    ("    recovery: sometimes\n", "rules[0].recovery", "not one of"),
    ("    ttl: soon\n", "rules[0].ttl", "expected a duration"),
    ("    ttl: 1h\n", "rules[0].ttl", "needs recovery reboot or manual"),
])
def test_bad_recovery_names_file_line_and_field(tmp_path, snippet, field, expected):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nrules:\n  - name: a\n    check: x\n    when: a == 1\n    type: GpuA\n"
                    "    reason: A\n    severity: info\n    action: NONE\n    message: m\n" + snippet)
    with pytest.raises(SourceError) as e:
        load_rules([path])
    assert e.value.file == str(path) and e.value.line == 11 and e.value.field == field
    assert expected in str(e.value)


def test_events_refuse_recovery(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nrules:\n  - name: a\n    check: x\n    when: a == 1\n    type: GpuA\n"
                    "    reason: A\n    severity: info\n    action: NONE\n    message: m\n    report: event\n"
                    "    recovery: reboot\n")
    with pytest.raises(SourceError, match="events do not recover"):
        load_rules([path])


def test_observation_recovery_clears_on_the_next_clean_run_of_its_check(rules):
    active = ActiveProblems(rules)
    lost = problem("lost", "GpuMissing", "GpuFellOffBus", "visibility")
    assert active.update("visibility", True, [lost], 1.0, "b1")
    assert active.condition("GpuMissing").active
    assert not active.update("xid", True, [], 2.0, "b1")            # another check: no effect
    assert not active.update("visibility", False, [], 3.0, "b1")    # the check failed: cannot tell
    assert active.condition("GpuMissing").active
    assert active.update("visibility", True, [], 4.0, "b1")
    status = active.condition("GpuMissing")
    assert not status.active and status.reason == "NoGpuMissing"


def test_status_rules_are_decided_even_by_failed_runs(rules):
    active = ActiveProblems(rules)
    failed = problem("failed", "GpuHealthCheckFailing", "CheckFailed", "pcie", Severity.WARNING)
    active.update("pcie", False, [failed], 1.0, "b1")
    active.update("visibility", False, [], 2.0, "b1")              # other check's failure: its own latch
    assert active.condition("GpuHealthCheckFailing").active
    active.update("pcie", False, [], 3.0, "b1")                    # timed out instead: check-failed is over
    assert not active.condition("GpuHealthCheckFailing").active


def test_reboot_recovery_holds_through_quiet_runs_until_a_new_boot(rules):
    active = ActiveProblems(rules)
    active.update("xid", True, [problem("xid-79")], 1.0, "boot-a")
    for t in range(2, 10):
        active.update("xid", True, [], float(t), "boot-a")
    assert not active.expire(10.0, "boot-a")
    assert active.condition("GpuXidError").active
    assert active.expire(11.0, "boot-b")
    assert not active.condition("GpuXidError").active


def test_ttl_and_manual_clear(rules):
    active = ActiveProblems(rules)
    active.update("xid", True, [problem("xid-48", reason="Xid48", severity=Severity.WARNING)], 100.0, "b")
    active.update("xid", True, [problem("xid-repeat", reason="XidRecurring")], 100.0, "b")
    assert not active.expire(100.0 + 3599, "b")
    assert active.expire(100.0 + 3600, "b")                         # xid-48's ttl ran out
    assert active.condition("GpuXidError").reason == "XidRecurring"
    assert not active.expire(10**9, "another-boot")                 # manual survives reboots
    assert not active.clear({"GpuMissing"}, 10**9)                  # other types untouched
    assert not active.clear(None, 50.0)                             # seen after the request: kept
    assert active.clear({"GpuXidError"}, 10**9)
    assert not active.latches


def test_condition_summary_puts_the_most_severe_first(rules):
    active = ActiveProblems(rules)
    active.update("xid", True, [problem("xid-48", reason="Xid48", severity=Severity.WARNING, message="warn"),
                                problem("xid-79", message="crit")], 5.0, "b")
    status = active.condition("GpuXidError")
    assert status.reason == "Xid79" and status.severity == Severity.CRITICAL
    assert status.message == "crit | warn." and status.since == 5.0


def test_event_problems_are_never_held(rules):
    active = ActiveProblems(rules)
    assert not active.update("xid", True, [problem("app-xid", reason="Xid8", report="event")], 1.0, "b")
    assert not active.latches


def test_state_survives_a_restart_and_a_corrupt_file_is_survived(rules, tmp_path):
    path = tmp_path / "problems.json"
    active = ActiveProblems(rules)
    active.update("xid", True, [problem("xid-79", message="XID 79 on GPU 3")], 1.0, "boot-a")
    active.save(path)
    again = ActiveProblems(rules)
    assert again.load(path) is None
    restored = again.condition("GpuXidError")
    assert restored.active and restored.message == "XID 79 on GPU 3."
    assert next(iter(again.latches.values())).problem.gpus == (GpuRef(3, "GPU-3", "0000:5d:00.0"),)
    # a rule removed since: its latch is not restored
    fewer = ActiveProblems([r for r in rules if r.name != "xid-79"])
    fewer.load(path)
    assert not fewer.latches
    path.write_text("{not json")
    warning = ActiveProblems(rules).load(path)
    assert warning and str(path) in warning
    path.write_text(json.dumps({"version": 99, "latches": [{"junk": 1}]}))
    assert "version 99" in ActiveProblems(rules).load(path)           # another version's file: kept aside too


def test_stacked_problems_show_the_most_urgent_first_each_once_ending_with_its_action(rules):
    """Three problems behind one condition: the one demanding the most (action, then severity, then
    recency) gives the reason and leads the message; the rest follow once; one recommended action."""
    active = ActiveProblems(rules)

    def held(rule, reason, action, severity, text):
        return Problem(rule, "xid", "GpuXidError", reason, compose_message([text], action), severity, action,
                       "condition", (GpuRef(3, "GPU-3", "0000:5d:00.0"),))
    newest_but_mild = held("xid-13", "Xid13", "RESTART_APP", Severity.WARNING, "GPU 3: XID 13")
    reset = held("xid-48", "Xid48", "RESET_GPU", Severity.CRITICAL, "GPU 3: XID 48")
    reboot = held("xid-79", "Xid79", "RESTART_BM", Severity.CRITICAL, "GPU 3: XID 79")
    active.update("xid", True, [reboot], 1.0, "b")
    active.update("xid", True, [reboot, reset], 2.0, "b")
    active.update("xid", True, [reboot, reset, newest_but_mild, newest_but_mild], 3.0, "b")
    status = active.condition("GpuXidError")
    assert status.reason == "Xid79"
    assert status.message.startswith("GPU 3: XID 79 | GPU 3: XID 48 | GPU 3: XID 13. Recommended action: RESTART_BM")
    assert status.message.count("Recommended action") == 1


def test_condition_message_stays_within_the_limit_and_keeps_whole_findings(rules):
    active = ActiveProblems(rules)
    findings = [compose_message([f"GPU {i}: " + "x" * 100], "RESTART_BM") for i in range(20)]
    active.update("xid", True, [problem(f"r{i}", message=m) for i, m in enumerate(findings)], 1.0, "b")
    status = active.condition("GpuXidError", limit=500)
    assert len(status.message) <= 500 and "more)." in status.message
    assert status.message.count("Recommended action") == 1
    assert status.message.endswith("power-cycle it if the GPU does not come back).")


def test_a_template_that_repeats_its_message_says_it_once():
    from detector.rules.model import _without_echo
    assert _without_echo("XID 79, GPU has fallen off the bus: GPU has fallen off the bus.") == \
        "XID 79, GPU has fallen off the bus"
    assert _without_echo("XID 46, GPU stopped processing: Ch 00000001") == "XID 46, GPU stopped processing: Ch 00000001"


def test_agent_reuses_a_recent_inventory_for_the_xid_check_only_until_it_is_old(registry):
    from detector.agent.agent import AgentSettings, NodeAgent
    from detector.config import build_checks
    from fake_nvml.host import fake_host
    from fake_nvml.scenario import load_scenario

    host = fake_host(load_scenario("h100-sxm-8").build("n"))
    calls = []
    real = host.nvml.nvmlDeviceGetCount
    host.nvml.nvmlDeviceGetCount = lambda: calls.append(1) or real()
    checks = {c.name: c for c in build_checks(registry, None, {})}
    agent = NodeAgent(host, list(checks.values()), builtin_rules(),
                      settings=AgentSettings(inventory_max_age_s=0.2))
    agent.run([checks["pcie"]])
    agent.run([checks["xid"]])
    agent.run([checks["xid"]])
    assert len(calls) == 1                      # xid reused pcie's inventory
    import time as _time
    for _ in range(5):                          # frequent xid runs do not keep an old inventory young
        _time.sleep(0.06)
        agent.run([checks["xid"]])
    assert len(calls) == 2                      # too old after 0.2 s: read once more, then reused again
    host.close()


@pytest.mark.parametrize("content", ["{not json", '{"version": 99, "latches": []}', '{"version": 1}', "[1, 2]"])
def test_unreadable_problem_state_is_moved_aside_and_reported(rules, tmp_path, content):
    """Held problems are never silently dropped: the file is kept beside, under a time-stamped name."""
    path = tmp_path / "problems.json"
    path.write_text(content)
    warning = ActiveProblems(rules).load(path)
    [kept] = list(tmp_path.glob("problems.json.unreadable-*"))
    assert warning and str(path) in warning and f"moved aside to {kept}" in warning
    assert kept.read_text() == content and not path.exists()


def test_a_missing_problem_state_is_no_warning(rules, tmp_path):
    assert ActiveProblems(rules).load(tmp_path / "problems.json") is None
