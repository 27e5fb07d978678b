"""rules/xid.yaml against NVIDIA's XID catalogue: every code has an explicit, tested meaning.

The expected buckets below are written independently of the rule file (from NVIDIA's catalogue,
with the project's resolution of the workflow codes), so a typo in either shows up here.

Two groups of tests:
- "Static" tests read the YAML directly and check its structure and policy.
- "Engine" tests load the file with `load_rules` and evaluate observations. They need the rule-format
  extensions (`fallback`, `action_field`, `count`/`window`, `boots`, the DRAIN_* actions, and the
  `{matches}`/`{boots_seen}` placeholders) in the loader and the engine; until those land they fail.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from detector.core.check import COMMON_FIELDS
from detector.core.types import ACTIONS, GpuRef, Observation, Problem
from detector.rules.engine import RuleEngine
from detector.rules.loader import RuleSet, load_rules

REPO = Path(__file__).resolve().parent.parent
XID_RULES = REPO / "rules" / "xid.yaml"

XID_FIELDS = {"kind", "code", "pci_bus_id", "fatal", "recovery_action", "message", "pid", "process_name",
              "count", "source", "boot", "line", "incidents", "follows", "origin", "gpu_instance", "nvlink_unit",
              "nvlink_subcode", "link", "applications", "detail", "faults",
              # issue 31: XID counts over a window, and the driver lines without an Xid (rules/driverlines.yaml)
              "xid_in_window", "severity", "port", "reports", "reports_in_window", "driver_gpu", "minor",
              "index_from",
              # issue 32: XID 144-150 decoded against the catalogue's table
              "intrinfo", "error_status", "xid_decoded", "nvlink_layout", "nvlink_decoded_unit", "nvlink_resolution",
              "nvlink_investigation", "nvlink_severity", "nvlink_effect", "nvlink_guidance", "nvlink_note"}
KNOWN_FIELDS = {"xid": XID_FIELDS | set(COMMON_FIELDS)}

# NVIDIA's immediate-action bucket per code; workflow buckets resolved as the project decided
# (45 -> IGNORE, 48 -> RESET_GPU, 74 -> CONTACT_SUPPORT). 144-150 and 154 are tested separately.
CATALOGUE: dict[int, str] = {
    8: "RESTART_APP", 13: "RESTART_APP", 31: "RESTART_APP", 32: "RESTART_APP", 38: "IGNORE",
    43: "IGNORE", 44: "IGNORE", 45: "IGNORE", 46: "RESET_GPU", 48: "RESET_GPU",
    54: "CHECK_MECHANICALS", 62: "RESET_GPU", 63: "IGNORE", 64: "RESET_GPU", 68: "RESTART_APP",
    69: "RESTART_APP", 74: "CONTACT_SUPPORT", 79: "RESTART_BM", 80: "RESTART_APP", 92: "IGNORE",
    93: "IGNORE", 94: "RESTART_APP", 95: "RESET_GPU", 109: "RESET_GPU", 110: "RESET_GPU",
    119: "RESET_GPU", 120: "RESET_GPU", 121: "IGNORE", 136: "RESET_GPU", 137: "IGNORE",
    140: "RESET_GPU", 143: "RESET_GPU", 151: "RESTART_VM", 155: "RESET_GPU", 156: "RESET_GPU",
    157: "IGNORE", 158: "RESET_GPU", 159: "CHECK_UVM",
    # Added from NVIDIA's "Analyzing Xid Errors with the Xid Catalog" (R575/R580 editions): every code
    # it marks as applying to A100, H100, B100 or GB200.
    11: "RESTART_APP", 14: "IGNORE", 25: "RESTART_APP", 37: "IGNORE", 39: "RESTART_APP", 40: "RESTART_APP",
    41: "RESTART_APP", 60: "RESTART_APP", 66: "IGNORE", 67: "IGNORE", 70: "RESTART_APP", 71: "RESTART_APP",
    72: "RESTART_APP", 75: "RESTART_APP", 76: "RESTART_APP", 77: "RESTART_APP", 78: "UPDATE_SWFW",
    82: "RESTART_APP", 83: "RESTART_APP", 84: "RESTART_APP", 85: "RESTART_APP", 86: "RESTART_APP",
    88: "RESTART_APP", 89: "RESTART_APP", **{c: "RESTART_APP" for c in range(96, 106)}, 106: "IGNORE",
    107: "IGNORE", 108: "IGNORE", **{c: "RESTART_APP" for c in range(126, 136)}, 139: "RESTART_APP",
    141: "IGNORE", 142: "CONTACT_SUPPORT", 160: "IGNORE", 161: "IGNORE",
}
# Published without an immediate-action bucket: events, never dropped, with the project's (action, severity).
NO_BUCKET: dict[int, tuple[str, str]] = {
    162: ("IGNORE", "info"), 163: ("INSPECT", "warning"), 164: ("INSPECT", "warning"),
    165: ("INSPECT", "warning"), 166: ("INSPECT", "warning"), 167: ("INSPECT", "warning"),
    168: ("INSPECT", "warning"), 169: ("INSPECT", "warning"), 170: ("INSPECT", "warning"),
    171: ("IGNORE", "info"), 172: ("IGNORE", "info"), 173: ("INSPECT", "warning"),
}
NVLINK5 = range(144, 151)
ALL_CODES = set(CATALOGUE) | set(NVLINK5) | {154} | set(NO_BUCKET)
RECOVERY_ACTIONS = ["RESET_GPU", "RESTART_BM", "DRAIN_P2P", "DRAIN_AND_RESET"]

# The policy: (report, severity) by bucket.
POLICY: dict[str, tuple[str, str]] = {
    "RESTART_APP": ("event", "warning"),
    "IGNORE": ("event", "info"),
    **{b: ("condition", "critical") for b in
       ("RESET_GPU", "RESTART_BM", "RESTART_VM", "CHECK_MECHANICALS", "CHECK_UVM", "CONTACT_SUPPORT",
        "UPDATE_SWFW")},
}

EXTENSION_KEYS = {"fallback", "count", "window", "boots"}    # rules with these are not per-code rules
GPU = GpuRef(3, "GPU-x", "0000:5d:00.0")


# --- helpers -------------------------------------------------------------------------------------

def raw_rules() -> list[dict[str, Any]]:
    return yaml.safe_load(XID_RULES.read_text())["rules"]


def per_code_rules() -> list[dict[str, Any]]:
    """The catalogue rules: not fallbacks, not escalations (count/boots, or the applications evidence)."""
    return [r for r in raw_rules() if not EXTENSION_KEYS & set(r) and "applications" not in r["when"]]


def codes_in(when: str) -> set[int]:
    codes = {int(c) for c in re.findall(r"\bcode\s*==\s*(\d+)", when)}
    for listed in re.findall(r"\bcode\s+in\s*\[([^\]]*)\]", when):
        codes |= {int(c) for c in re.findall(r"\d+", listed)}
    return codes


def fields(code: int, kind: str = "xid", fatal: bool | None = None, recovery_action: str = "",
           count: int = 1, boot: str = "boot-1", message: str = "the rest of the line",
           incidents: int = 1, applications: int | None = None, origin: str = "kernel",
           detail: bool = False, nvlink_resolution: str = "") -> dict[str, Any]:
    nvlink = {"nvlink_unit": "", "nvlink_subcode": "", "link": None, "intrinfo": "", "error_status": "",
              "xid_decoded": "", "nvlink_layout": "", "nvlink_decoded_unit": "", "nvlink_investigation": "",
              "nvlink_severity": "", "nvlink_effect": "", "nvlink_guidance": "", "nvlink_note": "",
              "nvlink_resolution": nvlink_resolution}
    return {**nvlink, "kind": kind, "code": code, "pci_bus_id": GPU.pci_bus_id, "fatal": fatal,
            "recovery_action": recovery_action, "message": message, "pid": 4242, "process_name": "python3",
            "count": count, "incidents": incidents, "follows": None, "origin": origin, "gpu_instance": None,
            "source": "kernel", "boot": boot, "line": 17, "applications": applications, "detail": detail,
            "check": "xid", "check_status": "ok", "check_error": "", "duration_ms": 3.0}


@pytest.fixture(scope="module")
def ruleset() -> RuleSet:
    return load_rules([XID_RULES], KNOWN_FIELDS)


def evaluate(ruleset: RuleSet, *field_sets: dict[str, Any]) -> list[Problem]:
    return RuleEngine(ruleset).evaluate([Observation("xid", f, GPU) for f in field_sets])


def only(problems: list[Problem]) -> Problem:
    assert len(problems) == 1, [(p.rule, p.action) for p in problems]
    return problems[0]


# --- static: the file itself (pass without the loader extensions) --------------------------------

def test_rule_names_are_unique():
    names = [r["name"] for r in raw_rules()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_catalogue_code_has_an_explicit_rule():
    covered: set[int] = set()
    for r in per_code_rules():
        if 'kind == "xid"' in r["when"]:
            codes = codes_in(r["when"])
            assert codes, f"{r['name']}: no code in {r['when']!r}"
            assert codes <= ALL_CODES, f"{r['name']} names codes outside the catalogue: {codes - ALL_CODES}"
            covered |= codes
    assert covered == ALL_CODES, f"missing: {sorted(ALL_CODES - covered)}"


def test_each_simple_code_has_exactly_one_rule_with_its_bucket_and_policy():
    by_code: dict[int, list[dict[str, Any]]] = {}
    for r in per_code_rules():
        for code in codes_in(r["when"]):
            by_code.setdefault(code, []).append(r)
    for code, bucket in CATALOGUE.items():
        rules = by_code[code]
        assert len(rules) == 1, (code, [r["name"] for r in rules])
        r = rules[0]
        report, severity = POLICY[bucket]
        assert (r["name"], r["action"], r.get("report", "condition"), r["severity"], r["type"]) == \
               (f"xid-{code}", bucket, report, severity, "GpuXidError"), code
        # A condition needs a line the kernel provably wrote; an event rule takes any line.
        guard = 'origin == "kernel" and ' if report == "condition" else ""
        assert r["when"] == f'{guard}kind == "xid" and code == {code}'
        assert r.get("description"), f"xid-{code} has no description"


def test_actions_are_known_and_types_are_the_two_xid_conditions():
    allowed = set(ACTIONS) | {"DRAIN_P2P", "DRAIN_AND_RESET"}
    for r in raw_rules():
        assert r["action"] in allowed, r["name"]
        assert r["type"] in {"GpuXidError", "GpuNvSwitchError"}, r["name"]
        assert r["check"] == "xid", r["name"]
        assert r.get("description"), f"{r['name']} has no description"


def test_application_and_ignore_classes_are_events_in_the_file():
    for r in raw_rules():
        if r["action"] in ("RESTART_APP", "IGNORE", "NONE"):
            assert r.get("report") == "event", r["name"]


def test_fallbacks_and_escalations_are_declared():
    rules = {r["name"]: r for r in raw_rules()}
    fallbacks = {r["name"] for r in rules.values() if r.get("fallback") is True}
    assert fallbacks == {"xid-unknown", "sxid-unknown", "xid-unverified-origin"}
    app = rules["xid-application-errors-repeated"]
    assert (app["action"], app["severity"], app["report"]) == ("INSPECT", "warning", "condition")
    assert "count" not in app and "applications >= 3" in app["when"]
    assert codes_in(app["when"]) == {13, 31}
    assert rules["xid-fatal-repeated"]["count"] == 5 and rules["xid-fatal-repeated"]["window"] == "24h"
    # Every reset- or reboot-class code (and the NVLink5 family) escalates when it survives a reboot.
    reset_class = {c for c, b in CATALOGUE.items() if b in ("RESET_GPU", "RESTART_BM")} | set(NVLINK5)
    recurring = {c for r in rules.values() if r.get("boots") == 2 for c in codes_in(r["when"])}
    assert recurring == reset_class
    assert codes_in(rules["xid-fatal-repeated"]["when"]) == reset_class
    assert rules["xid-154"]["action_field"] == "recovery_action"


# --- engine: need the loader and engine extensions ----------------------------------------------

def test_rule_file_loads(ruleset):
    assert ruleset.types() == {"GpuXidError", "GpuNvSwitchError"}


def test_known_fields_match_the_registered_xid_check():
    """The field set this file is validated against is the check's own (needs the xid check registered)."""
    from detector.core.check import CheckRegistry
    assert CheckRegistry.from_entry_points().fields_by_check()["xid"] == KNOWN_FIELDS["xid"]


@pytest.mark.parametrize("code", sorted(CATALOGUE))
def test_catalogue_code_gives_one_problem_with_its_bucket(ruleset, code):
    p = only(evaluate(ruleset, fields(code)))
    bucket = CATALOGUE[code]
    assert (p.rule, p.action, (p.report, p.severity.value)) == (f"xid-{code}", bucket, POLICY[bucket])
    assert p.type == "GpuXidError" and p.gpus == (GPU,)
    assert f"XID {code}" in p.message and "the rest of the line" in p.message


@pytest.mark.parametrize("code", sorted(NO_BUCKET))
def test_codes_published_without_a_bucket_are_events_never_dropped(ruleset, code):
    p = only(evaluate(ruleset, fields(code)))
    assert (p.rule, p.report, (p.action, p.severity.value)) == (f"xid-{code}", "event", NO_BUCKET[code])
    assert f"XID {code}" in p.message


def test_every_code_up_to_the_newest_published_is_known_or_unused():
    """Codes 1-173 that no rule names are the ones NVIDIA lists for none of A100/H100/B100/GB200."""
    unused = {1, 2, 3, 4, 5, 6, 7, 9, 10, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 26, 27, 28, 29, 30,
              33, 34, 35, 36, 42, 47, 49, 50, 51, 52, 53, 55, 56, 57, 58, 59, 61, 65, 73, 81, 87, 90, 91,
              111, 112, 113, 114, 115, 116, 117, 118, 122, 123, 124, 125, 138, 152, 153}
    named = {c for r in per_code_rules() for c in codes_in(r["when"])}
    assert set(range(1, 174)) - named == unused


def test_application_class_xids_never_set_a_condition(ruleset):
    for code, bucket in CATALOGUE.items():
        if bucket == "RESTART_APP":
            assert all(p.report == "event" for p in evaluate(ruleset, fields(code))), code


def test_unknown_code_falls_back_to_an_inspect_event(ruleset):
    p = only(evaluate(ruleset, fields(999, message="something new")))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-unknown", "event", "warning", "INSPECT")
    assert "999" in p.message and "something new" in p.message


# Beyond the newest published code, catalogue codes NVIDIA lists as unused, and a made-up one.
NOT_IN_THE_FILE = [max(ALL_CODES) + 1, 1, 87, 152, 9999]


@pytest.mark.parametrize("code", NOT_IN_THE_FILE)
def test_a_code_no_rule_names_is_reported_by_the_fallback_never_dropped(ruleset, code):
    assert code not in ALL_CODES
    p = only(evaluate(ruleset, fields(code, message="a line gpu-npd has not seen")))
    assert (p.rule, p.reason, p.action, p.report) == ("xid-unknown", "XidNotInCatalogue", "INSPECT", "event")
    assert p.message.startswith(f"{GPU.label()}: XID {code} is not in gpu-npd's catalogue: a line gpu-npd")


@pytest.fixture(scope="module")
def bundled() -> RuleSet:
    """Every bundled rule file, as `gpu-npd diagnose` loads them by default."""
    from detector.rules.sources import load_ruleset
    from detector.core.check import CheckRegistry

    return load_ruleset(None, CheckRegistry.from_entry_points())


@pytest.mark.parametrize("code", [*NOT_IN_THE_FILE, *sorted(NO_BUCKET)])
def test_the_whole_bundled_rule_set_still_reports_new_and_unknown_codes(bundled, code):
    """With every bundled file loaded (rules of other files may match any check), nothing swallows them."""
    p = only(evaluate(bundled, fields(code)))
    assert p.rule == ("xid-unknown" if code in NOT_IN_THE_FILE else f"xid-{code}")


@pytest.mark.parametrize("code, unit", [(144, "SAW"), (145, "RLW"), (146, "TLW"), (147, "TREX"),
                                        (148, "NVLPW_CTRL"), (149, "NETIR"), (150, "MSE")])
def test_nvlink5_messages_name_the_unit(ruleset, code, unit):
    for fatal, rule in ((True, "xid-144-150-fatal"), (False, "xid-144-150-nonfatal")):
        p = only(evaluate(ruleset, {**fields(code, fatal=fatal), "nvlink_unit": unit}))
        assert p.rule == rule and f"XID {code}, " in p.message and f"NVLink5 {unit} unit error" in p.message


@pytest.mark.parametrize("code", list(NVLINK5))
def test_nvlink5_fatal_sets_a_condition(ruleset, code):
    p = only(evaluate(ruleset, fields(code, fatal=True)))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-144-150-fatal", "condition", "critical",
                                                              "RESET_GPU")


@pytest.mark.parametrize("fatal", [False, None])
def test_nvlink5_nonfatal_is_an_event(ruleset, fatal):
    p = only(evaluate(ruleset, fields(144, fatal=fatal)))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-144-150-nonfatal", "event", "warning",
                                                              "IGNORE")


@pytest.mark.parametrize("code", list(NVLINK5))
@pytest.mark.parametrize("fatal", [True, False, None])
def test_nvlink5_decoded_row_decides_not_the_fatal_word(ruleset, code, fatal):
    """The catalogue's resolution for the decoded row picks the rule, whatever the line's Fatal word says."""
    want = {"RESET_GPU": ("xid-144-150-reset", "condition", "critical", "RESET_GPU"),
            "IGNORE": ("xid-144-150-ignore", "event", "warning", "IGNORE"),
            "XID_154_EVAL": ("xid-144-150-xid154-eval", "event", "warning", "RESTART_APP")}
    for resolution, expected in want.items():
        p = only(evaluate(ruleset, fields(code, fatal=fatal, nvlink_resolution=resolution)))
        assert (p.rule, p.report, p.severity.value, p.action) == expected


def test_nvlink5_decoded_message_names_subcode_unit_link_and_resolution(ruleset):
    obs = {**fields(149, fatal=True, nvlink_resolution="RESET_GPU"), "xid_decoded": "149.37",
           "nvlink_decoded_unit": "NETIR_LINK_DOWN", "link": 14, "nvlink_severity": "Link Fatal",
           "nvlink_guidance": "investigate the peer device (the other end of the link is the source)"}
    assert (
        "XID 149.37 NETIR_LINK_DOWN on link 14: Link Fatal; catalogue resolution RESET_GPU, investigate the "
        "peer device (the other end of the link is the source)") in only(evaluate(ruleset, obs)).message


def test_nvlink5_unverified_reset_row_sets_no_condition(ruleset):
    p = only(evaluate(ruleset, fields(149, fatal=True, origin="unverified", nvlink_resolution="RESET_GPU")))
    assert (p.rule, p.report) == ("xid-unverified-origin", "event")


def test_nvlink5_decoded_ignore_row_does_not_escalate_even_when_the_line_says_fatal(ruleset):
    """149.38 (a link taken down by software or a user) says Fatal, the catalogue says IGNORE."""
    ignore = [fields(149, fatal=True, boot=f"boot-{i}", nvlink_resolution="IGNORE") for i in range(5)]
    assert rules_of(evaluate(ruleset, *ignore)) == {"xid-144-150-ignore"}
    reset = [fields(149, fatal=False, boot=f"boot-{i}", nvlink_resolution="RESET_GPU") for i in range(2)]
    assert "xid-149-recurring-after-reboot" in rules_of(evaluate(ruleset, *reset))
    assert "xid-fatal-repeated" in rules_of(evaluate(ruleset, *[fields(149, nvlink_resolution="RESET_GPU")] * 5))


@pytest.mark.parametrize("action", RECOVERY_ACTIONS)
def test_xid_154_takes_the_action_from_the_line(ruleset, action):
    p = only(evaluate(ruleset, fields(154, recovery_action=action)))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-154", "condition", "critical", action)


def test_xid_154_unknown_action_defaults_to_reset(ruleset):
    p = only(evaluate(ruleset, fields(154, recovery_action="SOMETHING_NEW")))
    assert (p.rule, p.action) == ("xid-154", "RESET_GPU")


def test_xid_154_none_is_an_info_event(ruleset):
    p = only(evaluate(ruleset, fields(154, recovery_action="NONE")))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-154-none", "event", "info", "NONE")


def test_xid_154_unreadable_action_is_an_inspect_event(ruleset):
    p = only(evaluate(ruleset, fields(154, recovery_action="")))
    assert (p.rule, p.report, p.action) == ("xid-154-unreadable", "event", "INSPECT")


def test_sxid_fatal_sets_the_nvswitch_condition(ruleset):
    p = only(evaluate(ruleset, fields(12028, kind="sxid", fatal=True)))
    assert (p.rule, p.type, p.report, p.severity.value, p.action) == \
           ("sxid-fatal", "GpuNvSwitchError", "condition", "critical", "RESTART_BM")


@pytest.mark.parametrize("fatal", [False, None])
def test_sxid_nonfatal_is_an_event(ruleset, fatal):
    p = only(evaluate(ruleset, fields(11012, kind="sxid", fatal=fatal)))
    assert (p.rule, p.type, p.report, p.severity.value, p.action) == \
           ("sxid-nonfatal", "GpuNvSwitchError", "event", "warning", "IGNORE")


def test_sxid_without_fatality_field_falls_back(ruleset):
    f = fields(20034, kind="sxid")
    del f["fatal"]                       # a missing field never matches, so neither SXid rule does
    p = only(evaluate(ruleset, f))
    assert (p.rule, p.action) == ("sxid-unknown", "INSPECT")


# --- engine: escalations (need count/window and boots) -------------------------------------------

def rules_of(problems: list[Problem]) -> set[str]:
    return {p.rule for p in problems}


def test_one_application_faulting_again_and_again_never_escalates(ruleset):
    """Faults of one program (one process name, however many pids) are its bug, not the GPU's."""
    problems = evaluate(ruleset, *[fields(13, applications=1)] * 5, *[fields(31, applications=1)] * 5)
    assert rules_of(problems) == {"xid-13", "xid-31"}
    assert all(p.report == "event" for p in problems)
    assert "xid-application-errors-repeated" not in rules_of(evaluate(ruleset, fields(13, applications=2)))
    # A fault whose process is unknown is no evidence (the check gives it the count it has: here none).
    assert rules_of(evaluate(ruleset, fields(13))) == {"xid-13"}


def test_13_or_31_from_three_different_applications_asks_for_diagnostics(ruleset):
    problems = evaluate(ruleset, fields(13, applications=1), fields(31, applications=2), fields(13, applications=3))
    esc = next(p for p in problems if p.rule == "xid-application-errors-repeated")
    assert (esc.report, esc.severity.value, esc.action, esc.type) == ("condition", "warning", "INSPECT",
                                                                      "GpuXidError")
    assert "3 different applications" in esc.message and "dcgmi diag" in esc.message
    # Never a reset, whatever the count.
    assert all(p.action != "RESET_GPU" for p in evaluate(ruleset, *[fields(13, applications=9)] * 9))
    # A continuation (incidents 0) is not a new fault.
    assert "xid-application-errors-repeated" not in rules_of(evaluate(ruleset, fields(13, applications=3,
                                                                                          incidents=0)))


@pytest.mark.parametrize("code", sorted(c for c, b in CATALOGUE.items() if POLICY[b][0] == "condition"))
def test_an_unverified_line_never_sets_a_condition(ruleset, code):
    """Plain dmesg cannot tell the kernel's lines from user space's: reported for a person, not acted on."""
    p = only(evaluate(ruleset, fields(code, origin="unverified")))
    assert (p.rule, p.report, p.severity.value, p.action) == ("xid-unverified-origin", "event", "warning", "INSPECT")
    assert f"xid {code} in a line whose origin" in p.message


def test_an_unverified_application_fault_is_still_its_event(ruleset):
    p = only(evaluate(ruleset, fields(13, origin="unverified", applications=5)))
    assert (p.rule, p.report) == ("xid-13", "event")
    assert only(evaluate(ruleset, fields(20034, kind="sxid", fatal=True, origin="unverified"))).rule == \
        "xid-unverified-origin"


def test_an_orphan_sxid_detail_line_is_its_own_event(ruleset):
    p = only(evaluate(ruleset, fields(20034, kind="sxid", detail=True,
                                      message="Severity 1 Engine instance 60 Sub-engine instance 00")))
    assert (p.rule, p.report, p.action) == ("sxid-detail-without-headline", "event", "INSPECT")
    assert "Severity 1 Engine instance 60" in p.message


def test_reset_class_xid_in_two_boots_escalates_to_support(ruleset):
    problems = evaluate(ruleset, fields(79, boot="boot-1"), fields(79, boot="boot-2"))
    esc = next(p for p in problems if p.rule == "xid-79-recurring-after-reboot")
    assert (esc.reason, esc.report, esc.severity.value, esc.action) == \
           ("XidRecurringAfterReboot", "condition", "critical", "CONTACT_SUPPORT")
    assert "xid-79-recurring-after-reboot" not in rules_of(evaluate(ruleset, fields(79, count=3)))
    # Different codes in different boots are not "the same XID".
    assert not {r for r in rules_of(evaluate(ruleset, fields(79, boot="boot-1"), fields(48, boot="boot-2")))
                if r.endswith("-recurring-after-reboot")}


def test_nonfatal_nvlink5_does_not_escalate_across_boots(ruleset):
    problems = evaluate(ruleset, fields(149, fatal=False, boot="boot-1"), fields(149, fatal=False, boot="boot-2"))
    assert rules_of(problems) == {"xid-144-150-nonfatal"}


def test_five_fatal_xids_in_a_day_escalate_to_support(ruleset):
    esc = next(p for p in evaluate(ruleset, *[fields(48)] * 5) if p.rule == "xid-fatal-repeated")
    assert (esc.report, esc.severity.value, esc.action) == ("condition", "critical", "CONTACT_SUPPORT")
    mixed = evaluate(ruleset, fields(48), fields(48), fields(95), fields(95), fields(144, fatal=True))
    assert "xid-fatal-repeated" in rules_of(mixed)
    assert "xid-fatal-repeated" not in rules_of(evaluate(ruleset, *[fields(48)] * 4))
    assert "xid-fatal-repeated" not in rules_of(evaluate(ruleset, *[fields(13)] * 5))
    # A flood is one incident however many lines it printed; a companion line (incidents 0) adds none.
    assert "xid-fatal-repeated" not in rules_of(evaluate(ruleset, fields(48, count=800_000)))
    assert "xid-fatal-repeated" not in rules_of(evaluate(ruleset, *[fields(48)] * 4, fields(95, incidents=0)))
