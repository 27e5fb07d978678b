"""Every mistake at once (issue 34, item 2): each YAML file gpu-npd reads (rules, the daemon's config file,
fleet files, scenario files) reports all of its mistakes in one run, each with file, line and field, and a
misspelt name that is close to a known one says which it likely means."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from detector.cli.main import main
from detector.config import load_check_settings, load_selected_checks
from detector.core.check import CheckRegistry
from detector.rules.loader import RuleErrors, load_rules
from detector.sim.fleetfile import load_fleet
from detector.yamlsource import MappingReader, SourceError, SourceErrors, collecting, did_you_mean, parse_yaml
from fake_nvml.scenario import load_scenario

THREE_MISTAKES = """\
version: 1
rules:
  - name: hot-gpu
    check: thermal
    whn: gpu_temp > 90
    type: GpuHot
    reason: TooHot
    severity: urgent
    action: CHECK_COOLING
    message: "GPU at {gpu_temp} C"
"""


@pytest.fixture(scope="module")
def registry() -> CheckRegistry:
    return CheckRegistry.from_entry_points()


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def line_of(path: Path, needle: str) -> int:
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    assert len(lines) == 1, (needle, lines)
    return lines[0]


def mistakes(fn, *args) -> list[SourceError]:
    with pytest.raises(SourceErrors) as e:
        fn(*args)
    return e.value.errors


def located(errors: list[SourceError]) -> list[tuple[int | None, str | None]]:
    return [(e.line, e.field) for e in errors]


# --- rules --------------------------------------------------------------------------------------------------

def test_validate_rules_prints_all_three_mistakes_of_one_rule_and_the_near_miss(tmp_path, capsys) -> None:
    path = write(tmp_path, "mine.yaml", THREE_MISTAKES)
    assert main(["validate-rules", str(path)]) == 2
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and len(lines) == 4, out.err
    assert lines[0] == f"{path}:5: field 'rules[0].whn': unknown field; did you mean `when`?"
    assert lines[1] == f"{path}:8: field 'rules[0].severity': 'urgent' is not one of: critical, info, warning"
    assert lines[2].startswith(f"{path}:10: field 'rules[0].message': unknown field 'gpu_temp' at column 8 in "
                               "'GPU at {gpu_temp} C' for check 'thermal' (known: ")
    assert "temperature_c" in lines[2]                   # no near miss: the thermal check's fields are listed
    assert lines[3] == "gpu-npd: 3 error(s) in 1 file(s)"
    # the misspelt `when` is one mistake, not two: it is not also reported as a missing required field
    assert "missing required field" not in out.err


def test_a_rule_missing_five_required_fields_names_each(tmp_path, registry) -> None:
    path = write(tmp_path, "bare.yaml", """\
        version: 1
        rules:
          - name: bare
            check: pcie
            action: NONE
        """)
    with pytest.raises(RuleErrors) as raised:
        load_rules([path], registry.fields_by_check())
    errors = raised.value.errors
    assert sorted(e.field for e in errors) == [f"rules[0].{f}" for f in ("message", "reason", "severity", "type",
                                                                          "when")]
    for e in errors:
        assert e.file == str(path) and e.line == line_of(path, "name: bare")
        assert e.problem == f"missing required field '{e.field.split('.')[1]}'"


def test_every_file_and_every_rule_is_checked_in_one_run(tmp_path, capsys) -> None:
    a = write(tmp_path, "a.yaml", THREE_MISTAKES)
    b = write(tmp_path, "b.yaml", """\
        version: 1
        rules:
          - {name: ok, check: pcie, when: current_width < 16, type: GpuNarrow, reason: Narrow, severity: info,
             action: NONE, message: narrow}
          - {name: two, check: pcei, when: current_width < 16, type: gpu-narrow, reason: Narrow,
             severity: critcal, action: NONE, message: narrow, count: 0}
        """)
    assert main(["validate-rules", str(a), str(b)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "gpu-npd: 7 error(s) in 2 file(s)"
    assert [line for line in lines if line.startswith(f"{b}:")] == [
        f"{b}:5: field 'rules[1].check': no check named 'pcei' (did you mean `pcie`?)",
        f"{b}:5: field 'rules[1].type': 'gpu-narrow': expected CamelCase, like GpuPcieDegraded",
        f"{b}:6: field 'rules[1].severity': 'critcal': did you mean `critical`?",
        f"{b}:6: field 'rules[1].count': must be at least 1",
    ]


def test_a_rule_with_a_mistake_is_left_out_but_the_others_are_still_judged(tmp_path, registry) -> None:
    path = write(tmp_path, "r.yaml", """\
        version: 1
        rules:
          - {name: one, check: pcie, when: widht < 16, type: GpuA, reason: A, severity: info, action: NONE,
             message: "x{widht} {max_widht}"}
          - {name: one, check: pcie, when: current_width < 16, type: GpuA, reason: A, severity: info,
             action: NONE, message: a}
        """)
    errors = mistakes(load_rules, [path], registry.fields_by_check())
    problems = [e.problem for e in errors]
    # each unknown name is its own mistake; the rule with them is left out, so the second `one` is no duplicate
    assert len(problems) == 3 and not any("already defined" in p for p in problems), problems
    assert problems[0].startswith("unknown field 'widht' at column 1 in 'widht < 16'")
    assert problems[1].startswith("unknown field 'widht' at column 2 in 'x{widht} {max_widht}'")
    assert problems[2] == ("unknown field 'max_widht' at column 10 in 'x{widht} {max_widht}' for check 'pcie' "
                           "(did you mean `max_width`?)")


def test_duplicate_keys_are_reported_beside_the_other_mistakes(tmp_path) -> None:
    path = write(tmp_path, "dup.yaml", """\
        version: 1
        rules:
          - name: dup
            check: pcie
            when: current_width < 16
            type: GpuA
            type: GpuB
            reason: A
            severity: loud
            action: NONE
            message: m
        """)
    errors = mistakes(load_rules, [path])
    assert located(errors) == [(7, "type"), (9, "rules[0].severity")]
    assert errors[0].problem == "duplicate key"


# --- the daemon's config file -----------------------------------------------------------------------------

def test_a_config_file_reports_all_of_its_mistakes(tmp_path, registry) -> None:
    config = write(tmp_path, "config.yaml", """\
        checks:
          visibilty: {expected_gpus: 8}
          pcie:
            interval: -5
            colour: red
          thermal: {window: soon}
        chekcs: {}
        """)
    errors = mistakes(load_selected_checks, registry, None, config, {"visibility": {"expected_gpus": 8}})
    assert [e.file for e in errors] == [str(config)] * 5
    assert located(errors) == [(2, "checks.visibilty"), (4, "checks.pcie.interval"), (5, "checks.pcie.colour"),
                               (6, "checks.thermal.window"), (7, "chekcs")]
    assert errors[0].problem == "no check named 'visibilty' (did you mean `visibility`?)"
    assert errors[1].problem == "must be a positive number of seconds"
    assert errors[2].problem.startswith("unknown field; expected one of: ")   # nothing close: the list
    assert errors[3].problem == "expected a number, got a string 'soon'"
    assert errors[4].problem == "unknown field; did you mean `checks`?"


def test_the_config_files_own_shape_is_checked_whole_too(tmp_path) -> None:
    config = write(tmp_path, "config.yaml", "checks: [pcie]\ncolour: blue\n")
    errors = mistakes(load_check_settings, config)
    assert located(errors) == [(1, "checks"), (2, "colour")]


# --- fleet files --------------------------------------------------------------------------------------------

def test_a_fleet_file_reports_all_of_its_mistakes(tmp_path) -> None:
    fleet = write(tmp_path, "fleet.yaml", """\
        version: 1
        nodes:
          - scenario: h100-sxm-8
            cuont: 4
            racks: 3
          - {scenario: a100-pcie-4, count: 2, labels: {team: "a b"}}
        checks:
          pcie: {interval: -1}
        faults:
          - {at: 5 minutes, node: gpu-h100-0001, kind: xidd, gpu: 3}
          - {random: {rate: 0}, kind: lost, gpu: any}
        """)
    errors = mistakes(load_fleet, fleet)
    assert {e.file for e in errors} == {str(fleet)}
    assert located(errors) == [(4, "nodes[0].cuont"), (6, "nodes[1].labels.team"), (8, "checks.pcie.interval"),
                               (10, "faults[0].at"), (10, "faults[0].kind"), (11, "faults[1].random.rate"),
                               (11, "faults[1].gpu")]
    assert errors[0].problem == "unknown field; did you mean `count`?"
    assert errors[4].problem == "unknown fault kind 'xidd' (did you mean `xid`?)"
    # `racks: 3` is not judged against the default count of 1: the count it goes with is misspelt


def test_a_fault_naming_a_node_of_a_broken_group_is_not_blamed_for_it(tmp_path) -> None:
    fleet = write(tmp_path, "fleet.yaml", """\
        version: 1
        nodes:
          - {scenario: h100-sxm-8, count: 0, name: "gpu-{index}"}
        faults:
          - {at: 60, node: gpu-1, kind: xid, gpu: 3, code: 79, colour: red}
        """)
    errors = mistakes(load_fleet, fleet)
    assert located(errors) == [(3, "nodes[0].count"), (5, "faults[0].colour")]
    assert errors[1].problem.startswith("fault 'xid' takes no parameter 'colour' (it takes: code, ")
    assert errors[1].problem.endswith("; a fault entry also takes: at, fraction, gpu, kind, labels, node, rack, "
                                      "random)")


def test_a_fleets_scenario_file_mistakes_are_named_in_that_file(tmp_path) -> None:
    write(tmp_path, "custom.yaml", "gpu_model: h100-sxm\ngpus: 99\n")
    fleet = write(tmp_path, "fleet.yaml", """\
        version: 1
        nodes:
          - {scenario: custom.yaml, count: 1}
          - {scenario: custom.yaml, count: 1, name: "other-{index}"}
        """)
    errors = mistakes(load_fleet, fleet)
    scenario = str(tmp_path / "custom.yaml")
    assert [(e.file, e.line, e.field) for e in errors] == [
        (str(fleet), 3, "nodes[0].scenario"), (str(fleet), 4, "nodes[1].scenario"),
        (scenario, 1, "gpu_model"), (scenario, 2, "gpus")]
    assert errors[0].problem.startswith(f"cannot load scenario file: 2 mistakes in {scenario}")
    assert "did you mean `h100-sxm5-80gb`?" in errors[2].problem


# --- scenario files -----------------------------------------------------------------------------------------

def test_a_scenario_file_reports_all_of_its_mistakes(tmp_path) -> None:
    path = write(tmp_path, "node.yaml", """\
        gpu_model: h100-sxm5-80gb
        gpus: 8
        imex: {peers: 5000, managed_by: hosts}
        faults:
          - {at: -1, kind: xid, gpu: 9, code: 79}
        drivr_version: 550
        """)
    errors = mistakes(load_scenario, str(path))
    assert {e.file for e in errors} == {str(path)}
    assert located(errors) == [(3, "imex.peers"), (3, "imex.managed_by"), (5, "faults[0].at"),
                               (5, "faults[0].gpu"), (6, "drivr_version")]
    assert errors[1].problem == "'hosts': did you mean `host`?"
    assert errors[4].problem == "unknown field; did you mean `driver_version`?"


def test_a_scenario_extending_a_broken_one_names_both_files(tmp_path) -> None:
    base = write(tmp_path, "base.yaml", "gpu_model: h100-sxm5-80gb\ngpus: 0\n")
    child = write(tmp_path, "child.yaml", f"extends: {base}\ncolour: red\n")
    errors = mistakes(load_scenario, str(child))
    assert [(e.file, e.line, e.field) for e in errors] == [(str(child), 2, "colour"), (str(base), 2, "gpus")]


# --- the shared mechanism -------------------------------------------------------------------------------------

def test_a_reader_that_collects_reads_on_and_one_that_does_not_raises_the_first() -> None:
    data = parse_yaml("a: 1\nb: x\nc: y\n", "f.yaml").data
    with pytest.raises(SourceErrors) as e, collecting() as found:
        r = MappingReader("f.yaml", data, "", mistakes=found)
        r.attempt(r.reject_unknown, {"a", "b"})
        assert r.attempt(r.get, "b", int) is None
        assert r.attempt(r.get, "a", int) == 1
    assert located(e.value.errors) == [(2, "b"), (3, "c")]         # in line order, not the order found
    alone = MappingReader("f.yaml", data, "")
    with pytest.raises(SourceError) as first:
        alone.attempt(alone.get, "b", int)
    assert not isinstance(first.value, SourceErrors) and first.value.field == "b"


def test_did_you_mean_names_only_a_close_name() -> None:
    assert did_you_mean("whn", ["when", "name", "message"]) == "when"
    assert did_you_mean("colour", ["version", "rules", "defaults"]) is None
