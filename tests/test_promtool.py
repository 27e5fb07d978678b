"""The shipped alerts and recording rules run through the real promtool (Debian's `prometheus` package, which
`make test` installs): `promtool check rules` on the PrometheusRule's groups, extracted to a plain rules file,
and `promtool test rules` on the unit tests of tests/promtool/ (input series, expected alerts with their
annotations, expected recording-rule samples). The Helm chart's copy of the rules is rendered with the real
helm and run through the same tests; and the unit tests are shown to fail on rules broken on purpose (a
threshold moved, a guard dropped), so a pass means something.

promtool comes from PATH (/usr/bin/promtool from the package). Without it these tests skip and say how to
install it; `make test` installs it as root, so on CI they run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from test_deploy_render import offline_env
from test_helm import MISSING, find_helm

MONITORING_RULE = REPO / "deploy" / "monitoring" / "prometheusrule.yaml"
CHART = REPO / "deploy" / "helm" / "gpu-npd"
CHART_RULE = CHART / "files" / "prometheusrule.yaml"
UNIT_TESTS = sorted((REPO / "tests" / "promtool").glob("*.yaml"))
DEPLOY_JOB = 'job="gpu-npd/gpu-npd"'
SLOW_ALERT = "GpuSlowerThanFleetPeers"
INSTALL = ("promtool not found on PATH: it is Debian's `prometheus` package (`apt-get install "
           "--no-install-recommends prometheus`, which `make test` runs as root)")


def find_promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(INSTALL)
    return path


def groups_of(rule_text: str) -> dict[str, Any]:
    """The PrometheusRule's spec is a Prometheus rules file: {groups: [...]}."""
    [doc] = [d for d in yaml.safe_load_all(rule_text) if d is not None]
    assert doc["kind"] == "PrometheusRule" and set(doc["spec"]) == {"groups"}
    return doc["spec"]


def rule_count(spec: dict[str, Any]) -> int:
    return sum(len(g["rules"]) for g in spec["groups"])


def workdir_with(tmp_path: Path, spec: dict[str, Any]) -> Path:
    """A directory with the rules as rules.yaml and a copy of every unit test (they name rules.yaml)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    for test in UNIT_TESTS:
        shutil.copy(test, tmp_path / test.name)
    return tmp_path


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([find_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=offline_env())


def check_and_test(workdir: Path, spec: dict[str, Any], tests: list[str] | None = None) -> None:
    check = promtool("check", "rules", "rules.yaml", cwd=workdir)
    assert check.returncode == 0, f"promtool check rules:\n{check.stdout}\n{check.stderr}"
    assert f"SUCCESS: {rule_count(spec)} rules found" in check.stdout, check.stdout
    for name in tests or [t.name for t in UNIT_TESTS]:
        run = promtool("test", "rules", name, cwd=workdir)
        assert run.returncode == 0, f"promtool test rules {name}:\n{run.stdout}\n{run.stderr}"


# --- deploy/monitoring

def test_unit_tests_are_there():
    assert {"slow_gpu.yaml", "slow_gpu_quiet.yaml", "gpus_and_xids.yaml"} <= {t.name for t in UNIT_TESTS}
    for test in UNIT_TESTS:
        assert yaml.safe_load(test.read_text(encoding="utf-8"))["rule_files"] == ["rules.yaml"], test.name


def test_promtool_check_rules_on_the_shipped_rules(tmp_path):
    spec = groups_of(MONITORING_RULE.read_text(encoding="utf-8"))
    check_and_test(workdir_with(tmp_path, spec), spec, tests=[])


@pytest.mark.parametrize("test", [t.name for t in UNIT_TESTS])
def test_promtool_unit_tests_pass_on_the_shipped_rules(tmp_path, test):
    spec = groups_of(MONITORING_RULE.read_text(encoding="utf-8"))
    check_and_test(workdir_with(tmp_path, spec), spec, tests=[test])


def broken(spec: dict[str, Any], record_or_alert: str, old: str, new: str) -> dict[str, Any]:
    """The spec with one rule's expression edited (the edit must apply)."""
    spec = yaml.safe_load(yaml.safe_dump(spec))
    [rule] = [r for g in spec["groups"] for r in g["rules"] if record_or_alert in (r.get("alert"), r.get("record"))]
    assert old in rule["expr"], (record_or_alert, rule["expr"])
    rule["expr"] = rule["expr"].replace(old, new)
    return spec


@pytest.mark.parametrize("rule, old, new, fails", [
    # 40% below the median instead of 20%: the GPU 30% below no longer fires.
    (SLOW_ALERT, "< 0.8", "< 0.6", "slow_gpu.yaml"),
    # Without the model's busy-GPU count: one slow GPU among three fires on a median of three.
    (SLOW_ALERT, "\n  and on (model)\n(model:gpu_npd_gpus_busy:count >= 4)", "", "slow_gpu_quiet.yaml"),
    # Idle GPUs (NaN) counted as busy.
    ("model:gpu_npd_gpus_busy:count", "gpu_npd_gpu_busy_sm_clock_mhz > 0", "gpu_npd_gpu_busy_sm_clock_mhz",
     "slow_gpu_quiet.yaml"),
    # One fleet median for every model: the A100s are held against the H100s.
    ("model:gpu_npd_gpu_busy_sm_clock_mhz:median", "quantile by (model)", "quantile by (node)",
     "slow_gpu_quiet.yaml"),
    # SW power cap counted as a HW slowdown.
    ("gpu:gpu_npd_gpu_hw_throttle_ratio:max", "|sw_thermal_slowdown", "|sw_thermal_slowdown|sw_power_cap",
     "slow_gpu.yaml"),
], ids=["threshold", "busy-count-guard", "idle-counted", "models-mixed", "sw-power-cap"])
def test_the_unit_tests_fail_on_broken_rules(tmp_path, rule, old, new, fails):
    spec = broken(groups_of(MONITORING_RULE.read_text(encoding="utf-8")), rule, old, new)
    workdir = workdir_with(tmp_path, spec)
    check = promtool("check", "rules", "rules.yaml", cwd=workdir)
    assert check.returncode == 0, check.stdout + check.stderr       # still valid rules, wrong ones
    run = promtool("test", "rules", fails, cwd=workdir)
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr, run.stdout


# --- The Helm chart's copy

def test_the_chart_carries_deploy_monitoring_s_rules_unchanged():
    assert CHART_RULE.read_bytes() == MONITORING_RULE.read_bytes(), \
        "deploy/helm/gpu-npd/files/prometheusrule.yaml differs from deploy/monitoring/prometheusrule.yaml: " \
        "cp deploy/monitoring/prometheusrule.yaml deploy/helm/gpu-npd/files/"


def helm_rules(tmp_path: Path, release: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = offline_env()
    for key in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[key] = str(tmp_path / key.lower())
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    helm = find_helm()
    assert helm, MISSING
    proc = subprocess.run([helm, "template", release, str(CHART), "--namespace", "gpu-npd", "-f", str(values_file)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "PrometheusRule"]


def test_the_chart_renders_no_prometheus_rule_unless_asked(tmp_path):
    assert helm_rules(tmp_path, "gpu-npd", {"podMonitor": {"enabled": True}}) == []


@pytest.mark.parametrize("release, values, job", [
    ("gpu-npd", {"podMonitor": {"enabled": True}}, "gpu-npd/gpu-npd"),
    ("dev", {"podMonitor": {"enabled": True}}, "gpu-npd/dev-gpu-npd"),
    ("gpu-npd", {"serviceMonitor": {"enabled": True}}, "gpu-npd-metrics"),
], ids=["podmonitor", "other-release", "servicemonitor"])
def test_the_chart_s_rules_are_deploy_s_with_its_own_job_and_pass_promtool(tmp_path, release, values, job):
    [rule] = helm_rules(tmp_path / "helm", release, {**values, "prometheusRule": {"enabled": True,
                                                                                 "labels": {"release": "kps"}}})
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "gpu-npd" and rule["metadata"]["labels"]["release"] == "kps"
    deploy_spec = groups_of(MONITORING_RULE.read_text(encoding="utf-8"))
    expected = yaml.safe_load(yaml.safe_dump(deploy_spec).replace(DEPLOY_JOB, f'job="{job}"'))
    assert rule["spec"] == expected
    assert (job == "gpu-npd/gpu-npd") == (rule["spec"] == deploy_spec)
    check_and_test(workdir_with(tmp_path / "rules", rule["spec"]), rule["spec"])
