"""How rule sets combine on the command line, and that none can silently vanish: the bundled rules by
default, `+PATH` to add to them, a plain PATH to replace them (said aloud), an empty set refused, and
`validate-rules` reporting every mistake."""

from __future__ import annotations

import json
import logging

import pytest

from detector.cli.main import main

from detector.rules.sources import load_ruleset
from detector.core.check import CheckRegistry

MINE = """version: 1
rules:
  - name: my-narrow-link
    check: pcie
    when: current_width < 16
    type: GpuPcieNarrow
    reason: Narrow
    severity: warning
    action: INSPECT
    message: "x{current_width}"
"""


def _diagnose(capsys, *rules: str) -> tuple[int, dict, str]:
    args = ["diagnose", "--nvml", "fake:h100-sxm-8-pcie-x8", "-o", "json"]
    for r in rules:
        args += ["--rules", r]
    code = main(args)
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else {}), out.err


def test_default_is_the_bundled_rules_and_says_so(capsys):
    code, report, err = _diagnose(capsys)
    assert code == 1 and [s["source"] for s in report["rules"]] == ["builtin"]
    assert report["rules"][0]["rules"] > 50
    assert "gpu-npd: rules: builtin (" in err


def test_plus_adds_to_the_bundled_rules(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    _, report, err = _diagnose(capsys, f"+{mine}")
    assert [s["source"] for s in report["rules"]] == ["builtin", str(mine)]
    assert {"pcie-width-degraded", "my-narrow-link"} <= {p["rule"] for p in report["problems"]}
    assert f"+ {mine} (1 rule)" in err and "NOT loaded" not in err


def test_a_plain_path_replaces_them_and_the_output_says_so(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    _, report, err = _diagnose(capsys, str(mine))
    assert [p["rule"] for p in report["problems"]] == ["my-narrow-link"]
    assert "the built-in rules are NOT loaded" in err


def test_builtin_and_a_path_extend_as_before(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    _, report, _ = _diagnose(capsys, "builtin", str(mine))
    assert [s["source"] for s in report["rules"]] == ["builtin", str(mine)]


def test_quiet_leaves_stderr_clean(capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_an_empty_rule_set_is_refused_with_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\nrules: []\n")
    code, _, err = _diagnose(capsys, str(empty))
    assert code == 2 and f"{empty}: no rules" in err
    code, _, err = _diagnose(capsys, f"+{empty}")                   # beside the bundled ones: said aloud
    assert code == 1 and f"+ {empty} (0 rules)" in err
    empty_dir = tmp_path / "rules.d"
    empty_dir.mkdir()
    code, _, err = _diagnose(capsys, str(empty_dir))
    assert code == 2 and "no rule files" in err
    code, _, err = _diagnose(capsys, "+")
    assert code == 2 and "name a rule file" in err


def test_validate_rules_reports_every_error_in_every_file(tmp_path, capsys):
    bad1 = tmp_path / "a.yaml"
    second = MINE.split("rules:\n")[1].replace("my-narrow-link", "second").replace("warning", "loud")
    bad1.write_text(MINE.replace("current_width < 16", "widht < 16") + second)
    bad2 = tmp_path / "b.yaml"
    bad2.write_text("version: 2\nrules: []\n")
    assert main(["validate-rules", str(bad1), str(bad2)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "gpu-npd: 3 error(s) in 2 file(s)"
    assert err[0].startswith(f"{bad1}:5: field 'rules[0].when': unknown field 'widht' at column 1 in 'widht < 16'")
    assert err[1].startswith(f"{bad1}:16: field 'rules[1].severity'")
    assert err[2].startswith(f"{bad2}:1: field 'version': unsupported version 2")
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    assert main(["validate-rules", f"+{mine}"]) == 0
    assert f"+ {mine} (1 rule)" in capsys.readouterr().out


def test_a_rule_named_like_a_bundled_one_is_an_error_naming_both_places(tmp_path, capsys):
    """No silent override: the user renames the rule, or replaces the bundled set on purpose."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE.replace("my-narrow-link", "pcie-width-degraded"))
    code, _, err = _diagnose(capsys, f"+{mine}")
    assert code == 2
    assert err.startswith(f"gpu-npd: error: {mine}:3: field 'rules[0].name': rule 'pcie-width-degraded' is "
                          "already defined at ")
    assert "pcie.yaml:" in err.splitlines()[0]
    code, report, _ = _diagnose(capsys, str(mine))                     # replacing: no clash
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["pcie-width-degraded"]


def test_an_empty_rules_argument_is_not_the_current_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "stray.yaml").write_text(MINE)
    monkeypatch.chdir(tmp_path)
    for value in ("", "+", "+ "):
        code, _, err = _diagnose(capsys, value)
        assert code == 2 and f"--rules {value!r}: name a rule file or directory" in err, value
    assert main(["validate-rules", ""]) == 2
    assert "name a rule file or directory" in capsys.readouterr().err


def test_errors_stop_diagnose_with_the_validate_rules_shape(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINE.replace("current_width < 16", "current_width < len(x)"))
    code, _, err = _diagnose(capsys, f"+{bad}")
    assert code == 2
    assert err == (f"gpu-npd: error: {bad}:5: field 'rules[0].when': 'len(x)' is not allowed here at column 17 in "
                   "'current_width < len(x)': use field names, literals, comparisons (== != < <= > >= in), "
                   "and/or/not and + - * / %\n")


class _Daemon:
    """Stands in for the daemon: `run` is judged here only by what it logs about its rules at start."""

    def __init__(self, host, *args, **kwargs):
        self.stop, self.host = None, host

    def run(self) -> int:
        self.host.close()
        return 0


@pytest.mark.parametrize("given, level, text", [
    (None, logging.INFO, "rules: builtin ("),
    ("+{mine}", logging.INFO, "rules: builtin ({n} rules) + {mine} (1 rule)"),
    ("{mine}", logging.WARNING, "rules: {mine} (1 rule); the built-in rules are NOT loaded"),
])
def test_run_logs_the_active_rule_sets_and_warns_when_they_replace_the_bundled_ones(
        tmp_path, monkeypatch, caplog, given, level, text):
    import detector.cli.daemon as daemon

    monkeypatch.setattr(daemon, "Daemon", _Daemon)
    monkeypatch.setattr(daemon, "setup_logging", lambda *args: None)
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    n = len(load_ruleset(None, CheckRegistry.from_entry_points()).rules)
    args = ["run", "--nvml", "fake:h100-sxm-8", "--no-kube", "--node-name", "n1", "--listen", "127.0.0.1:0"]
    args += ["--rules", given.format(mine=mine)] if given else []
    with caplog.at_level(logging.INFO, logger="gpu_npd"):
        assert main(args) == 0
    record = next(r for r in caplog.records if r.name == "gpu_npd" and r.getMessage().startswith("rules: "))
    assert record.levelno == level and record.getMessage().startswith(text.format(mine=mine, n=n))
