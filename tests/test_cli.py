"""`gpu-npd` as a user runs it: a separate process, exit codes, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from conftest import REPO


def gpu_npd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GPU_NPD_NVML", None) if env is None or "GPU_NPD_NVML" not in env else None
    return subprocess.run([sys.executable, "-m", "detector.cli.main", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


def diagnose_json(scenario: str, *extra: str) -> tuple[int, dict]:
    proc = gpu_npd("diagnose", "--nvml", f"fake:{scenario}", "--output", "json", *extra)
    assert proc.stderr.startswith("gpu-npd: rules: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_healthy_node_json_exit_0_with_eight_gpus_and_bus_ids(registry):
    code, report = diagnose_json("h100-sxm-8")
    assert code == 0
    assert report["node"] == "h100-sxm-8" and report["problems"] == [] and report["healthy"] is True
    assert len(report["gpus"]) == 8
    assert [g["pci_bus_id"] for g in report["gpus"]] == [
        "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
        "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
    gpu = report["gpus"][0]
    assert set(gpu) >= {"index", "uuid", "name", "pci_bus_id", "pcie"}
    assert gpu["pcie"] == {"current_width": 16, "max_width": 16, "current_gen": 5, "max_gen": 5}
    assert gpu["uuid"].startswith("GPU-") and gpu["name"] == "NVIDIA H100 80GB HBM3"
    default_checks = {n for n in registry.names() if registry.get(n).enabled_by_default}
    assert {"visibility", "pcie", "xid"} <= default_checks
    assert {c["name"] for c in report["checks"]} == default_checks
    assert all(c["status"] == "ok" and isinstance(c["duration_ms"], float) for c in report["checks"])


def test_pcie_x8_exit_1_with_pcie_problem_on_gpu_5():
    code, report = diagnose_json("h100-sxm-8-pcie-x8")
    assert code == 1
    [problem] = report["problems"]
    assert problem["check"] == "pcie" and problem["gpus"] == [5]
    assert set(problem) >= {"check", "type", "reason", "message", "severity", "action", "gpus"}
    assert problem["severity"] == "warning" and problem["type"] == "GpuPcieDegraded"


def test_missing_gpu_exit_1_with_visibility_problem_naming_its_bus_id():
    code, report = diagnose_json("h100-sxm-8-gpu-missing")
    assert code == 1
    [problem] = report["problems"]
    assert problem["check"] == "visibility"
    assert "0000:ba:00.0" in problem["message"]
    assert problem["gpu_details"] == [{"index": None, "uuid": None, "pci_bus_id": "0000:ba:00.0"}]


def test_xid79_exit_1_names_gpu_3():
    code, report = diagnose_json("h100-sxm-8-xid79")
    assert code == 1
    assert {p["reason"]: p["gpus"] for p in report["problems"]} == {"GpuFellOffBus": [3], "Xid79GpuFellOffBus": [3]}
    assert report["gpus"][3]["error"] == "GpuIsLost"


def test_table_output_shows_the_problem_and_the_gpu_state():
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8-pcie-x8")
    assert proc.returncode == 1
    assert "PcieLinkWidthDegraded" in proc.stdout
    row5 = next(line for line in proc.stdout.splitlines() if line.startswith("5 "))
    assert "x8/x16" in row5 and "PcieLinkWidthDegraded" in row5


def test_backend_comes_from_environment_when_not_given():
    proc = gpu_npd("diagnose", "-o", "json", env={"GPU_NPD_NVML": "fake:h100-sxm-8-xid79"})
    assert proc.returncode == 1 and json.loads(proc.stdout)["problems"][0]["gpus"] == [3]


def test_checks_option_runs_only_those():
    code, report = diagnose_json("h100-sxm-8-gpu-missing", "--checks", "pcie")
    assert code == 0 and [c["name"] for c in report["checks"]] == ["pcie"]


def test_expect_gpus_option():
    code, report = diagnose_json("h100-sxm-8", "--expect-gpus", "16")
    assert code == 1 and report["problems"][0]["reason"] == "GpuCountBelowExpected"


def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver; the no-driver path needs one without")
def test_real_backend_without_driver_exit_2_one_line_no_traceback():
    proc = gpu_npd("diagnose", "--nvml", "real")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "libnvidia-ml.so.1 not found" in lines[0] and "fake:" in lines[0]


def test_bad_rule_file_exit_2_names_file_line_and_field(tmp_path):
    rules = tmp_path / "mine.yaml"
    rules.write_text("version: 1\nrules:\n  - name: slow-link\n    check: pcie\n    when: current_width < 16\n"
                     "    type: GpuPcieDegraded\n    reason: Slow\n    severity: dire\n    action: NONE\n"
                     "    message: slow\n")
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8", "--rules", str(rules))
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{rules}:8: field 'rules[0].severity'" in proc.stderr
    assert "'dire' is not one of: critical, info, warning" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_rule_referring_to_an_unknown_field_is_refused_at_load(tmp_path):
    rules = tmp_path / "typo.yaml"
    rules.write_text("version: 1\nrules:\n  - {name: x, check: pcie, when: curent_width < 16, type: GpuX,"
                     " reason: X, severity: info, action: NONE, message: m}\n")
    proc = gpu_npd("validate-rules", str(rules))
    assert proc.returncode == 2
    assert f"{rules}:3: field 'rules[0].when': unknown field 'curent_width'" in proc.stderr


def test_user_rules_can_extend_the_builtin_ones(tmp_path):
    rules = tmp_path / "strict.yaml"
    rules.write_text("version: 1\nrules:\n  - {name: any-gen5, check: pcie, when: max_gen >= 5, type: GpuGen5,"
                     " reason: Gen5Present, severity: info, action: NONE, message: 'Gen{max_gen} capable',"
                     " report: event}\n")
    code, report = diagnose_json("h100-sxm-8-pcie-x8", "--rules", "builtin", "--rules", str(rules))
    assert code == 1
    assert {p["rule"] for p in report["problems"]} == {"pcie-width-degraded", "any-gen5"}
    assert next(p for p in report["problems"] if p["rule"] == "any-gen5")["report"] == "event"


def test_unknown_check_exit_2_lists_available():
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "pcie,fans")
    assert proc.returncode == 2
    assert "no check named 'fans'" in proc.stderr and "pcie" in proc.stderr


def test_unknown_scenario_exit_2_lists_bundled():
    proc = gpu_npd("diagnose", "--nvml", "fake:tpu-v5")
    assert proc.returncode == 2
    assert "no bundled scenario" in proc.stderr and "h100-sxm-8-xid79" in proc.stderr
    near = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-99")          # a near miss is named instead
    assert near.returncode == 2 and "no bundled scenario of that name (did you mean `h100-sxm-8`?)" in near.stderr


@pytest.mark.parametrize("spec", ["fake", "fake:", "nvml", "real:x"])
def test_malformed_backend_spec_exit_2(spec):
    proc = gpu_npd("diagnose", "--nvml", spec)
    assert proc.returncode == 2 and "expected 'real', 'fake:SCENARIO'" in proc.stderr


def test_config_file_with_unknown_setting_names_its_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("checks:\n  visibility:\n    expected_gpus: 8\n    expcted: 1\n")
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8", "--config", str(config))
    assert proc.returncode == 2
    assert f"{config}:4: field 'checks.visibility.expcted': unknown field" in proc.stderr


def test_config_file_settings_apply(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("checks:\n  visibility: {expected_gpus: 10, timeout: 5}\n  pcie: {}\n")
    code, report = diagnose_json("h100-sxm-8", "--config", str(config))
    assert code == 1 and "only 8 of 10 expected GPUs" in report["problems"][0]["message"]


def test_bad_usage_is_exit_2():
    assert gpu_npd("diagnose", "--output", "xml").returncode == 2
    assert gpu_npd().returncode == 2


def test_help_teaches_with_examples():
    proc = gpu_npd("diagnose", "--help")
    assert proc.returncode == 0
    assert "fake:h100-sxm-8-xid79" in proc.stdout and "Exit code" in proc.stdout


def test_listing_commands():
    checks = gpu_npd("checks")
    assert checks.returncode == 0 and "current_width" in checks.stdout and "expected_gpus" in checks.stdout
    assert "  metric gpu_npd_pcie_link_width{gpu,pci_bus_id}: " in checks.stdout
    scenarios = gpu_npd("scenarios")
    assert scenarios.returncode == 0 and "h100-sxm-8-pcie-x8" in scenarios.stdout
    valid = gpu_npd("validate-rules")
    assert valid.returncode == 0 and valid.stdout.startswith("OK: ")


def test_console_scripts_are_installed():
    bin_dir = Path(sys.executable).parent
    for script in ("gpu-npd", "fake-nvidia-smi"):
        assert (bin_dir / script).exists(), f"{script} not installed next to {sys.executable}"
    proc = subprocess.run([str(bin_dir / "gpu-npd"), "diagnose", "--nvml", "fake:a100-pcie-4", "-o", "json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["gpus"]) == 4
