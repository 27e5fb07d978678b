"""Rule files: the builtin set loads, and every mistake is reported with file, line and field."""

from __future__ import annotations

import ast
from pathlib import Path

import textwrap

import pytest

from detector.core.check import CheckRegistry
from detector.rules.loader import RuleErrors, RuleSet, load_rules, rule_files
from detector.yamlsource import SourceError

REPO = Path(__file__).resolve().parent.parent
BUILTIN = REPO / "rules"

GOOD_RULE = """\
  - name: pcie-width-degraded
    check: pcie
    when: current_width < max_width
    type: GpuPcieDegraded
    reason: PcieLinkWidthDegraded
    severity: warning
    action: RESTART_BM
    message: "link at x{current_width}, expected x{max_width}"
"""

# The rule under test is always rules[1], after a valid one, so line numbers and indices are not trivial.
BAD_RULE = {
    "name": "second-rule",
    "check": "pcie",
    "when": "idle == false and current_gen < max_gen",
    "type": "GpuPcieSlow",
    "reason": "PcieLinkGenDegraded",
    "severity": "warning",
    "action": "RESTART_BM",
    "message": '"Gen{current_gen}, expected Gen{max_gen}"',
}


@pytest.fixture(scope="module")
def known_fields() -> dict[str, set[str]]:
    return CheckRegistry.from_entry_points().fields_by_check()


def rule_text(drop: tuple[str, ...] = (), **fields: str) -> str:
    """rules[1] as YAML: BAD_RULE with `fields` changed/added (in order) and `drop` removed."""
    merged = {k: v for k, v in {**BAD_RULE, **fields}.items() if k not in drop}
    lines = [f"{k}: {v}" for k, v in merged.items()]
    return "  - " + "\n    ".join(lines) + "\n"


def rule_file(tmp_path: Path, second: str, name: str = "rules.yaml") -> tuple[Path, str]:
    text = "# test rules\nversion: 1\nrules:\n" + GOOD_RULE + "\n" + second
    path = tmp_path / name
    path.write_text(text)
    return path, text


def line_no(text: str, needle: str, nth: int = 1) -> int:
    """The 1-based line of the nth line containing `needle`."""
    found = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return found[nth - 1]


def load_error(paths, known=None) -> SourceError:
    with pytest.raises(SourceError) as e:
        load_rules(paths if isinstance(paths, list) else [paths], known)
    return e.value


def assert_located(err: SourceError, path: Path, line: int, field: str | None) -> None:
    assert err.file == str(path)
    assert err.line == line, str(err)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{path}:{line}: ")
    if field:
        assert f"field '{field}'" in str(err)


# --- the builtin rules ---------------------------------------------------------------------------------

def test_builtin_rules_load_with_known_fields(known_fields) -> None:
    rs = load_rules([BUILTIN], known_fields)
    assert isinstance(rs, RuleSet)
    assert rs.files == sorted(str(p) for p in BUILTIN.glob("*.yaml"))
    assert len({r.name for r in rs.rules}) == len(rs.rules)
    by_check: dict[str, list[str]] = {}
    for r in rs.rules:
        for c in (r.checks or {"*"}):
            by_check.setdefault(c, []).append(r.name)
    assert "pcie-width-degraded" in by_check["pcie"]
    assert "pcie-gen-degraded" in by_check["pcie"]
    assert "gpu-fell-off-bus" in by_check["visibility"]
    assert "gpu-not-visible-to-nvml" in by_check["visibility"]
    assert {"GpuPcieDegraded", "GpuMissing", "GpuDriverUnhealthy"} <= rs.types()


def test_builtin_rules_use_only_their_checks_fields(known_fields) -> None:
    """Independent of the loader: every name a builtin `when:`/message uses is a field of its check."""
    rs = load_rules([BUILTIN], known_fields)
    common = set.intersection(*known_fields.values())
    for r in rs.rules:
        allowed = common if r.checks is None else set().union(*(known_fields[c] for c in r.checks))
        used = {n.id for n in ast.walk(ast.parse(r.when.source, mode="eval")) if isinstance(n, ast.Name)}
        used -= {"true", "false", "null"}
        assert used <= allowed, (r.name, used - allowed)
        assert r.when.names == frozenset(used), r.name


def test_a_valid_file_loads_every_field(tmp_path, known_fields) -> None:
    path, _ = rule_file(tmp_path, rule_text(report="event", description="free text here",
                                             check="[pcie, visibility]", when="on_pci and idle == false"))
    rs = load_rules([path], known_fields)
    first, second = rs.rules
    assert first.name == "pcie-width-degraded" and first.checks == frozenset({"pcie"})
    assert first.report == "condition" and first.description == ""
    assert first.line == 4 and first.file == str(path)
    assert second.checks == frozenset({"pcie", "visibility"})
    assert second.report == "event" and second.description == "free text here"
    assert second.severity.value == "warning" and second.action == "RESTART_BM"
    assert rs.types() == {"GpuPcieDegraded"}          # events set no condition


# --- file-level errors -----------------------------------------------------------------------------------

def test_invalid_yaml_syntax_names_the_line(tmp_path) -> None:
    path = tmp_path / "broken.yaml"
    text = "version: 1\nrules:\n  - name: a\n    when: [unclosed\n    type: X\n"
    path.write_text(text)
    err = load_error(path)
    assert err.file == str(path)
    assert err.line is not None and 4 <= err.line <= 6
    assert "invalid YAML" in err.problem
    assert str(err).startswith(f"{path}:{err.line}: ")


def test_duplicate_key(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text() + "    severity: critical\n")
    err = load_error(path)
    assert err.line == line_no(text, "severity: critical")
    # the YAML layer knows only the key, not its path (see report)
    assert err.field in ("severity", "rules[1].severity")
    assert "duplicate key" in err.problem
    assert str(err).startswith(f"{path}:{err.line}: ")


def test_missing_version(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("# header\nrules: []\n")
    err = load_error(path)
    assert err.file == str(path) and err.line == 2       # where the top mapping starts
    assert "missing required field 'version'" in err.problem
    assert str(err).startswith(f"{path}:2: ")


@pytest.mark.parametrize("value, problem", [
    ("2", "unsupported version 2; this gpu-npd reads version 1"),
    ('"1"', "expected an integer, got a string '1'"),
    ("true", "expected an integer, got true or false True"),
])
def test_unsupported_version(tmp_path, value: str, problem: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(f"# header\n\nversion: {value}\nrules: []\n")
    err = load_error(path)
    assert_located(err, path, 3, "version")
    assert problem in err.problem


def test_unknown_top_level_field(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nrule:\n  - name: x\n")
    err = load_error(path)
    assert_located(err, path, 2, "rule")
    assert "unknown field" in err.problem and "rules" in err.problem


def test_rules_not_a_list(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\n\nrules:\n  name: x\n")
    err = load_error(path)
    assert_located(err, path, 3, "rules")
    assert "expected a list, got a mapping" in err.problem


def test_rule_not_a_mapping(tmp_path) -> None:
    path, text = rule_file(tmp_path, "  - just-a-name\n")
    err = load_error(path)
    assert_located(err, path, line_no(text, "just-a-name"), "rules[1]")
    assert "expected a mapping, got a string" in err.problem


def test_top_level_not_a_mapping(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("\n- version: 1\n")
    err = load_error(path)
    assert err.file == str(path) and err.line == 2
    assert "expected a mapping, got a list" in err.problem


def test_empty_file(tmp_path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here yet\n")
    err = load_error(path)
    assert err.file == str(path) and err.line is None and err.field is None
    assert "empty rule file" in err.problem
    assert str(err).startswith(f"{path}: ")


def test_nonexistent_path(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    err = load_error(missing)
    assert err.file == str(missing) and err.line is None
    assert "no such rule file or directory" in str(err)


# --- rule-level errors -----------------------------------------------------------------------------------

def test_unknown_rule_field_typo(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(drop=("severity",), sevrity="warning"))
    err = load_error(path)
    assert_located(err, path, line_no(text, "sevrity:"), "rules[1].sevrity")
    assert "unknown field" in err.problem and "severity" in err.problem


def test_missing_required_field(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(drop=("when",)))
    err = load_error(path)
    # there is no line for what is absent: the rule's own line is named, and the field that is missing
    assert_located(err, path, line_no(text, "name: second-rule"), "rules[1].when")
    assert err.problem == "missing required field 'when'"


@pytest.mark.parametrize("key, value, problem", [
    ("severity", "fatal", "'fatal' is not one of: critical, info, warning"),
    ("action", "REBOOT", "'REBOOT' is not one of:"),
    ("report", "alert", "'alert' is not one of: condition, event"),
    ("name", "PCIe_Width", "'PCIe_Width': use lower-case letters, digits and dashes"),
    ("type", "gpu-pcie-slow", "expected CamelCase"),
    ("reason", "slow_link", "expected CamelCase"),
    ("type", "Ready", "'Ready' belongs to the kubelet"),
    ("type", "MemoryPressure", "belongs to the kubelet"),
    ("when", "5", "expected a string, got an integer 5"),
    ("check", "7", "expected a string or a list, got an integer 7"),
])
def test_bad_field_value_names_its_line(tmp_path, key: str, value: str, problem: str) -> None:
    path, text = rule_file(tmp_path, rule_text(**{key: value}))
    err = load_error(path)
    assert_located(err, path, line_no(text, f"{key}: {value}"), f"rules[1].{key}")
    assert problem in err.problem


def test_unknown_check_name(tmp_path, known_fields) -> None:
    path, text = rule_file(tmp_path, rule_text(check="[pcie, pcei]"))
    err = load_error(path, known_fields)
    assert_located(err, path, line_no(text, "check: [pcie, pcei]"), "rules[1].check")
    assert err.problem == "no check named 'pcei' (did you mean `pcie`?)"      # a near miss is named
    far, _ = rule_file(tmp_path, rule_text(check="fans"), "far.yaml")
    err = load_error(far, known_fields)
    assert "no check named 'fans' (available: " in err.problem and "visibility" in err.problem  # else all
    # without known fields, check names cannot be checked
    assert load_rules([path]).rules[1].checks == frozenset({"pcie", "pcei"})


def test_unknown_field_in_when(tmp_path, known_fields) -> None:
    path, text = rule_file(tmp_path, rule_text(when="curent_width < max_width"))
    err = load_error(path, known_fields)
    assert_located(err, path, line_no(text, "when: curent_width"), "rules[1].when")
    assert ("unknown field 'curent_width' at column 1 in 'curent_width < max_width' for check 'pcie'"
            in err.problem)
    assert "current_width" in err.problem                  # the known fields are listed


def test_unknown_field_column_is_the_names_not_a_string_that_spells_it(tmp_path, known_fields) -> None:
    path, _ = rule_file(tmp_path, rule_text(when="""'idle == false and "widht" != "" and widht < 16'"""))
    err = load_error(path, known_fields)
    assert ("""unknown field 'widht' at column 37 in 'idle == false and "widht" != "" and widht < 16'"""
            in err.problem)


def test_unknown_field_in_message(tmp_path, known_fields) -> None:
    path, text = rule_file(tmp_path, rule_text(message='"curent_width x{curent_width} of x{max_width}"'))
    err = load_error(path, known_fields)
    assert_located(err, path, line_no(text, "message: \"curent_width x{"), "rules[1].message")
    assert ("unknown field 'curent_width' at column 15 in 'curent_width x{curent_width} of x{max_width}'"
            in err.problem)                                # the placeholder, not the plain word before it


def test_star_check_allows_only_common_fields(tmp_path, known_fields) -> None:
    ok, _ = rule_file(tmp_path, rule_text(check='"*"', when='check_status == "timeout"',
                                          message='"{check}: {check_error}"'), "ok.yaml")
    assert load_rules([ok], known_fields).rules[1].checks is None
    bad, text = rule_file(tmp_path, rule_text(check='"*"', when="current_width < 4"), "bad.yaml")
    err = load_error(bad, known_fields)
    assert_located(err, bad, line_no(text, "when: current_width < 4"), "rules[1].when")
    assert "for check '*'" in err.problem


def test_bad_expression(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(when="current_width ==== 1"))
    err = load_error(path)
    assert_located(err, path, line_no(text, "when: current_width ===="), "rules[1].when")
    assert err.problem == "not a valid expression: invalid syntax at column 17 in 'current_width ==== 1'"


def test_disallowed_expression(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(when="__import__('os').system('id')"))
    err = load_error(path)
    assert_located(err, path, line_no(text, "when: __import__"), "rules[1].when")
    assert err.problem.startswith("'__import__('os').system('id')' is not allowed here at column 1 in "
                                  "\"__import__('os').system('id')\": use field names")


def test_duplicate_rule_name_across_files_names_both(tmp_path) -> None:
    first, _ = rule_file(tmp_path, rule_text(), "a.yaml")
    second = tmp_path / "b.yaml"
    second.write_text("version: 1\nrules:\n" + GOOD_RULE)
    err = load_error([first, second])
    assert err.file == str(second) and err.line == 3
    assert str(err).startswith(f"{second}:3: ")
    assert f"rule 'pcie-width-degraded' is already defined at {first}:4" in err.problem


def test_duplicate_rule_name_error_names_field_path_and_name_line(tmp_path) -> None:
    first, _ = rule_file(tmp_path, rule_text(), "a.yaml")
    second = tmp_path / "b.yaml"
    text = "version: 1\nrules:\n" + GOOD_RULE.replace("pcie-width-degraded", "unique-rule") + \
        "  - check: pcie\n    name: second-rule\n" + \
        "".join(f"    {k}: {v}\n" for k, v in BAD_RULE.items() if k not in ("name", "check"))
    second.write_text(text)
    err = load_error([first, second])
    assert (err.line, err.field) == (line_no(text, "name: second-rule"), "rules[1].name")


def test_directory_expansion_only_yaml_sorted(tmp_path) -> None:
    d = tmp_path / "rules.d"
    d.mkdir()
    for name in ("b.yml", "a.yaml", "c.yaml"):
        (d / name).write_text("version: 1\nrules:\n" + GOOD_RULE.replace("pcie-width-degraded",
                                                                           f"rule-{name[0]}"))
    (d / "README.md").write_text("not rules")
    (d / "c.yaml~").write_text("{{{ not yaml")
    (d / "old.yaml.bak").write_text("{{{ not yaml")
    (d / "notes.txt").write_text("{{{ not yaml")
    assert [p.name for p in rule_files([d])] == ["a.yaml", "b.yml", "c.yaml"]
    rs = load_rules([d])
    assert [r.name for r in rs.rules] == ["rule-a", "rule-b", "rule-c"]
    assert rs.files == [str(d / "a.yaml"), str(d / "b.yml"), str(d / "c.yaml")]


def test_files_and_directories_mix_in_given_order(tmp_path) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    (d / "z.yaml").write_text("version: 1\nrules:\n" + GOOD_RULE.replace("pcie-width-degraded", "in-dir"))
    single = tmp_path / "a.yaml"
    single.write_text("version: 1\nrules:\n" + GOOD_RULE)
    rs = load_rules([d, single])
    assert [r.name for r in rs.rules] == ["in-dir", "pcie-width-degraded"]


def test_a_rule_set_without_rules_is_refused(tmp_path) -> None:
    """A rule set that checks nothing would call every node healthy: refuse it, loudly."""
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nrules: []\n")
    err = load_error(path)
    assert err.file == str(path) and "no rules" in str(err)


def test_one_empty_file_among_others_counts_zero_rules(tmp_path) -> None:
    """A site file kept empty for later is fine beside real rules, and shows as 0 rules."""
    empty = tmp_path / "site.yaml"
    empty.write_text("version: 1\nrules: []\n")
    ruleset = load_rules([REPO / "rules" / "pcie.yaml", empty])
    assert ruleset.counts_by_file()[str(empty)] == 0 and ruleset.rules


def test_a_directory_without_rule_files_is_refused(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not rules")
    err = load_error(tmp_path)
    assert err.file == str(tmp_path) and "no rule files" in str(err)


def test_no_paths_at_all_is_refused() -> None:
    assert "no rules" in str(load_error([]))


def write(tmp_path: Path, name: str, text: str) -> tuple[Path, str]:
    text = textwrap.dedent(text).lstrip()
    path = tmp_path / name
    path.write_text(text)
    return path, text


def test_every_error_in_every_file_is_reported(tmp_path) -> None:
    """validate-rules shows them all: two bad rules in one file, a broken second file, a duplicate."""
    a, a_text = write(tmp_path, "a.yaml", """
        version: 1
        rules:
          - name: one
            check: pcie
            when: widht < 16
            type: GpuPcieDegraded
            reason: Narrow
            severity: warning
            action: RESET_GPU
            message: narrow
          - name: two
            check: pcie
            when: current_width < max_width
            type: GpuPcieDegraded
            reason: Narrow
            severity: loud
            action: RESET_GPU
            message: narrow
          - name: three
            check: pcie
            when: current_width < max_width
            type: GpuPcieDegraded
            reason: Narrow
            severity: warning
            action: RESET_GPU
            message: narrow
        """)
    b = tmp_path / "b.yaml"
    b.write_text("version: 1\nrules: [\n")
    c, _ = write(tmp_path, "c.yaml", """
        version: 1
        rules:
          - name: three
            check: pcie
            when: idle
            type: GpuPcieDegraded
            reason: Idle
            severity: info
            action: IGNORE
            message: idle
        """)
    with pytest.raises(RuleErrors) as e:
        load_rules([a, b, c], {"pcie": {"current_width", "max_width", "idle"}})
    lines = str(e.value).splitlines()
    assert len(e.value.errors) == len(lines) == 4, lines
    assert lines[0].startswith(f"{a}:{line_no(a_text, 'widht')}: field 'rules[0].when': unknown field 'widht' "
                               "at column 1 in 'widht < 16'")
    assert lines[1].startswith(f"{a}:{line_no(a_text, 'loud')}: field 'rules[1].severity'")
    assert lines[2].startswith(f"{b}")
    assert lines[3].startswith(f"{c}:") and "already defined at" in lines[3]


# --- bugs found -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["name", "type"])
def test_trailing_newline_in_name_or_type_is_rejected(tmp_path, key: str) -> None:
    path, text = rule_file(tmp_path, rule_text(**{key: "|\n      GpuSlow" if key == "type" else "|\n      slow"}))
    err = load_error(path)
    assert err.field == f"rules[1].{key}"


def test_empty_check_list_is_rejected(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(check="[]"))
    err = load_error(path)
    assert_located(err, path, line_no(text, "check: []"), "rules[1].check")


def test_unknown_non_string_key_names_its_own_line(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text(on="pcie"))
    err = load_error(path)
    assert err.line == line_no(text, "on: pcie")


def test_unhashable_key_is_a_source_error(tmp_path) -> None:
    path, text = rule_file(tmp_path, rule_text() + "    ? [a, b]\n    : 1\n")
    err = load_error(path)
    assert err.line == line_no(text, "? [a, b]")
