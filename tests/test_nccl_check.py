"""The nccl check with the fake node's probe: thresholds by model, probe failures, the idle gate,
never two probes at once, opt-in selection, the agent's probe lane, metrics and the CLI."""

from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import builtin_rules, REPO, Clock, diagnose_host, node_for
from detector.agent.agent import AgentSettings, NodeAgent
from detector.agent.metrics import AgentMetrics
from detector.checks.nccl import NcclCheck
from detector.checks.nccl.probe import ProbeRequest, ProbeResult
from detector.checks.nccl.size import parse_size, show_size
from detector.cli.main import main
from detector.config import build_checks
from detector.core.sweep import run_sweep
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.nccl import FakeNcclProbe

RESULT_KEYS = {"backend", "ranks", "size_bytes", "avg_busbw_gbps", "min_busbw_gbps", "wrong"}


def probe(registry, scenario="h100-sxm-8", faults=(), **settings):
    node = node_for(scenario)
    for fault in faults:
        node.inject(fault)
    return diagnose_host(fake_host(node), registry, checks=["nccl"], settings={"nccl": settings})


def only_run(outcome):
    (run,) = outcome.sweep.runs
    return run


# -- the fake probe through the builtin rules ---------------------------------------------------------

def test_healthy_h100_node_passes_with_its_figures(registry):
    out = probe(registry)
    run = only_run(out)
    assert run.status == "ok" and out.problems == []
    assert RESULT_KEYS <= set(run.result)
    assert run.result["backend"] == "fake" and run.result["ranks"] == 8
    assert run.result["size_bytes"] == 8 << 30 and run.result["wrong"] == 0
    assert run.result["avg_busbw_gbps"] == 480.0 and run.result["min_busbw_gbps"] <= 480.0
    assert "480.0 GB/s avg" in run.summary


def test_nvlink_down_is_a_bandwidth_problem_naming_measured_and_expected(registry):
    out = probe(registry, "h100-sxm-8-nvlink-down")
    (p,) = out.problems
    assert (p.type, p.reason, p.rule) == ("GpuNcclBandwidthDegraded", "NcclBusBandwidthLow", "nccl-busbw-h100-sxm-8")
    assert "240 GB/s" in p.message and "at least 460 GB/s" in p.message and "8 GiB" in p.message
    assert p.action == "CHECK_NVLINK"


@pytest.mark.parametrize("scenario, factor, threshold", [
    ("a100-pcie-4", 0.5, "25 GB/s"), ("h100-sxm-8", 0.95, "460 GB/s")])
def test_thresholds_follow_the_gpu_model_and_topology(registry, scenario, factor, threshold):
    assert probe(registry, scenario).problems == []
    out = probe(registry, scenario, [Fault("nccl_degraded", params={"factor": factor})])
    (p,) = out.problems
    assert p.type == "GpuNcclBandwidthDegraded" and threshold in p.message


def test_a_model_without_a_threshold_is_judged_only_for_failures(registry):
    # 8x A100 SXM has a threshold; a made-up 2-GPU slice of it has none.
    out = probe(registry, "h100-sxm-8", [Fault("nccl_degraded", params={"factor": 0.1})], ranks=2)
    assert only_run(out).result["ranks"] == 2 and out.problems == []


def test_lost_gpu_fails_the_probe_with_a_different_condition(registry):
    out = probe(registry, "h100-sxm-8-xid79")
    (p,) = [p for p in out.problems if p.check == "nccl"]
    assert (p.type, p.reason) == ("GpuNcclProbeFailed", "NcclProbeFailed")
    assert "rank 3 (GPU 3, 0000:5d:00.0)" in p.message and p.severity.value == "critical"
    assert only_run(out).result["avg_busbw_gbps"] is None


def test_a_hung_probe_is_killed_at_its_timeout_and_reported(registry):
    started = time.monotonic()
    out = probe(registry, faults=[Fault("nccl_hang", params={"seconds": 60.0})], timeout=1.0)
    assert time.monotonic() - started < 5
    (p,) = out.problems
    assert (p.type, p.reason) == ("GpuNcclProbeFailed", "NcclProbeTimedOut")
    assert only_run(out).result["status"] == "timeout"


def test_wrong_values_are_silent_data_corruption(registry):
    out = probe(registry, faults=[Fault("nccl_wrong", params={"count": 12})])
    (p,) = out.problems
    assert (p.reason, p.action) == ("NcclWrongResults", "CONTACT_SUPPORT") and "12 wrong values" in p.message


# -- when it runs ----------------------------------------------------------------------------------------

class CountingProbe(FakeNcclProbe):
    """The fake probe, counting runs and optionally taking its time."""

    def __init__(self, node, seconds: float = 0.0, name: str = "fake"):
        super().__init__(node)
        self.name, self.seconds, self.runs = name, seconds, 0

    def run(self, request: ProbeRequest) -> ProbeResult:
        self.runs += 1
        time.sleep(self.seconds)
        return super().run(request)


def host_with(node, probe_backend):
    host = fake_host(node)
    host.nccl_probe = probe_backend
    return host


def test_busy_gpus_skip_the_probe_and_ask_for_a_retry(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("busy", gpu=6, params={"pid": 4242}))
    counting = CountingProbe(node)
    out = diagnose_host(host_with(node, counting), registry, checks=["nccl"], settings={"nccl": {"busy_retry": 120}})
    run = only_run(out)
    assert run.status == "skipped" and run.retry_after_s == 120
    assert "GPU 6 runs 1 compute process (pid 4242)" in run.error and "idle" in run.error
    assert counting.runs == 0 and out.problems == []


def test_require_idle_false_probes_busy_gpus(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("busy", gpu=6))
    out = diagnose_host(fake_host(node), registry, checks=["nccl"], settings={"nccl": {"require_idle": False}})
    assert only_run(out).status == "ok"


def test_never_two_probes_at_once(registry):
    node = node_for("h100-sxm-8")
    slow = CountingProbe(node, seconds=0.5)
    host = host_with(node, slow)
    check = NcclCheck()
    runs = []

    def sweep():
        runs.append(run_sweep(host, [check]).runs[0])
    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in runs) == ["ok", "skipped"]
    assert "still running" in next(r.error for r in runs if r.status == "skipped")
    assert slow.runs == 1


def test_real_probes_hold_a_node_wide_file_lock(registry, tmp_path):
    node = node_for("h100-sxm-8")
    lock = tmp_path / "nccl.lock"
    slow = CountingProbe(node, seconds=0.5, name="stand-in-for-nccl-tests")
    first, second = NcclCheck({"lock_file": str(lock)}), NcclCheck({"lock_file": str(lock)})
    runs = {}

    def sweep(name, check):
        runs[name] = run_sweep(host_with(node, slow), [check]).runs[0]
    t = threading.Thread(target=sweep, args=("first", first))
    t.start()
    time.sleep(0.2)
    sweep("second", second)          # another gpu-npd process would open the same file
    t.join()
    assert runs["first"].status == "ok"
    assert runs["second"].status == "skipped" and str(lock) in runs["second"].error


def test_nccl_is_opt_in(registry):
    assert "nccl" not in [c.name for c in build_checks(registry, None, {})]
    assert "nccl" in [c.name for c in build_checks(registry, None, {"nccl": {"enabled": True}})]
    assert [c.name for c in build_checks(registry, ["nccl"], {})] == ["nccl"]


@pytest.mark.parametrize("settings, message", [
    ({"backend": "mpi"}, "backend 'mpi' is not one of"),
    ({"size": "8X"}, "setting size"),
    ({"iterations": 0}, "iterations must be at least 1"),
])
def test_bad_settings_are_refused_clearly(registry, settings, message):
    with pytest.raises(ValueError, match=message):
        NcclCheck(settings)


def test_sizes_read_and_print_like_nccl_tests():
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1024") == 1024
    assert show_size(16 << 30) == "16 GiB" and show_size(6) == "6 B"
    with pytest.raises(ValueError, match="multiple of 4"):
        parse_size("6")


# -- in a node agent: its own lane, skipped runs judge nothing, metrics ------------------------------

def agent_for(registry, node, sinks=(), **nccl):
    rules = builtin_rules()
    checks = build_checks(registry, ["xid", "nccl"], {"nccl": nccl})
    return NodeAgent(fake_host(node, threaded=False), checks, rules, sinks,
                     AgentSettings(start_spread_s=0.0), clock=Clock())


def test_the_probe_has_its_own_lane(registry):
    node = node_for("h100-sxm-8")
    agent = agent_for(registry, node)
    agent.run_due(long_running=False)
    assert agent.next_due(long_running=True) <= agent.clock()       # nccl still due: the xid lane ran alone
    assert agent.next_due(long_running=False) > agent.clock()
    agent.run_due(long_running=True)
    assert agent.next_due(long_running=True) == agent.clock() + NcclCheck.default_interval_s


def test_a_skipped_probe_judges_nothing_and_keeps_what_it_found(registry):
    node = node_for("h100-sxm-8")
    agent = agent_for(registry, node, busy_retry=300)
    node.inject(Fault("busy", gpu=0))
    agent.run_due(long_running=True)
    assert "GpuNcclBandwidthDegraded" not in {s.type for s in agent.conditions()}   # never measured: not judged
    assert agent.next_due(long_running=True) == agent.clock() + 300                # retried soon, not in 6 h

    node.inject(Fault("idle", gpu=0))
    node.inject(Fault("nvlink_down", gpu=2, params={"link": 1}))
    agent.clock.now += 300
    agent.run_due(long_running=True)
    degraded = {s.type: s for s in agent.conditions()}["GpuNcclBandwidthDegraded"]
    assert degraded.active and "240 GB/s" in degraded.message

    node.inject(Fault("busy", gpu=0))
    agent.clock.now += NcclCheck.default_interval_s
    agent.run_due(long_running=True)                                             # skipped: the finding holds
    assert {s.type: s for s in agent.conditions()}["GpuNcclBandwidthDegraded"].active

    node.inject(Fault("recover"))
    node.inject(Fault("idle", gpu=0))
    agent.clock.now += 300
    agent.run_due(long_running=True)
    assert not {s.type: s for s in agent.conditions()}["GpuNcclBandwidthDegraded"].active


def test_metrics_show_the_last_probe(registry):
    node = node_for("h100-sxm-8-nvlink-down")
    metrics = AgentMetrics()
    agent = agent_for(registry, node, sinks=[metrics])
    value = metrics.registry.get_sample_value
    assert value("gpu_npd_nccl_probe_success") is None            # no probe yet: absent, not 0
    agent.run_due(long_running=True)
    assert value("gpu_npd_nccl_bus_bandwidth_gbps", {"stat": "avg"}) == 240.0
    assert value("gpu_npd_nccl_probe_success") == 1.0 and value("gpu_npd_nccl_wrong_values") == 0.0
    node.inject(Fault("nccl_wrong", params={"count": 3}))
    agent.clock.now += NcclCheck.default_interval_s
    agent.run_due(long_running=True)
    assert value("gpu_npd_nccl_probe_success") == 0.0 and value("gpu_npd_nccl_wrong_values") == 3.0
    assert value("gpu_npd_nccl_probe_timestamp_seconds") > 0


# -- the CLI -----------------------------------------------------------------------------------------------

def test_diagnose_checks_nccl_passes_on_a_healthy_fake_node(capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "nccl", "-o", "json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    (entry,) = report["checks"]
    assert entry["name"] == "nccl" and entry["status"] == "ok" and RESULT_KEYS <= set(entry["result"])
    assert "gpu-npd: nccl: all-reduce of 8 GiB across 8 GPUs with fake" in captured.err      # progress


def test_diagnose_nvlink_down_fails_with_the_figures(capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8-nvlink-down", "--checks", "nccl", "-q"]) == 1
    captured = capsys.readouterr()
    assert "GpuNcclBandwidthDegraded/NcclBusBandwidthLow" in captured.out
    assert "240 GB/s" in captured.out and "460 GB/s" in captured.out
    assert "nccl: fake, 8 ranks, 8 GiB: bus bandwidth 240.0 GB/s avg" in captured.out
    assert captured.err == ""                                                                 # --quiet


@pytest.mark.parametrize("argv, message", [
    (["--nccl-tests", "/no/such/all_reduce_perf"], "not an executable file"),
    (["--checks", "xid", "--nccl-size", "8G"], "which --checks leaves out"),
    (["--checks", "nccl", "--nccl-size", "7"], "multiple of 4"),
])
def test_diagnose_refuses_bad_nccl_options(capsys, argv, message):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_broken_progress_display_does_not_fail_the_probe(registry):
    def broken(check: str, message: str) -> None:
        raise BrokenPipeError("stderr closed")
    run = run_sweep(fake_host(node_for("h100-sxm-8")), [NcclCheck()], progress=broken).runs[0]
    assert run.status == "ok" and run.result["avg_busbw_gbps"] == 480.0


FAKE_ALL_REDUCE_PERF = REPO / "tests" / "fixtures" / "nccl" / "fake_all_reduce_perf.py"


@pytest.mark.parametrize("fixture, exit_code, expected", [
    ("h100x8-pass.txt", 0, None),
    ("h100x8-degraded.txt", 0, ("GpuNcclBandwidthDegraded", "NcclBusBandwidthLow")),
    ("h100x8-wrong.txt", 1, ("GpuNcclProbeFailed", "NcclWrongResults")),
    ("h100x8-aborted.txt", 1, ("GpuNcclProbeFailed", "NcclProbeFailed")),
])
def test_diagnose_with_nccl_tests_end_to_end(capsys, monkeypatch, tmp_path, fixture, exit_code, expected):
    """`--nccl-tests PATH` through the CLI, the check and the builtin rules, on a stand-in binary."""
    monkeypatch.setenv("FAKE_ALL_REDUCE_PERF_FIXTURE", fixture)
    monkeypatch.setenv("FAKE_ALL_REDUCE_PERF_EXIT", str(exit_code))
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_ALL_REDUCE_PERF_ARGV", str(argv_file))
    rc = main(["diagnose", "--nvml", "fake:h100-sxm-8", "--nccl-tests", str(FAKE_ALL_REDUCE_PERF), "-o", "json",
               "--config", str(_lock_config(tmp_path))])
    report = json.loads(capsys.readouterr().out)
    (entry,) = report["checks"]
    assert entry["result"]["backend"] == "nccl-tests"
    assert json.loads(argv_file.read_text())[:6] == ["-b", "8589934592", "-e", "8589934592", "-g", "8"]
    if expected is None:
        assert rc == 0 and report["problems"] == [] and entry["result"]["avg_busbw_gbps"] > 460
    else:
        assert rc == 1 and {(p["type"], p["reason"]) for p in report["problems"]} == {expected}


def _lock_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"checks:\n  nccl:\n    lock_file: {tmp_path / 'nccl.lock'}\n")
    return config


def test_a_node_with_the_probe_off_exports_no_nccl_metrics(registry):
    from prometheus_client import generate_latest

    metrics = AgentMetrics()
    rules = builtin_rules()
    checks = build_checks(registry, None, {})                     # every enabled check: the probe is opt-in
    assert "nccl" not in {c.name for c in checks}
    agent = NodeAgent(fake_host(node_for("h100-sxm-8"), threaded=False), checks, rules, [metrics],
                      AgentSettings(start_spread_s=0.0), clock=Clock())
    agent.run_due(long_running=True)
    assert b"gpu_npd_nccl" not in generate_latest(metrics.registry)
