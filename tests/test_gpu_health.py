"""Per-GPU health: one state and one recommended action per GPU, from the problems naming it, in
the core and in the daemon's metrics (gpu_npd_gpu_health)."""

from __future__ import annotations

from conftest import builtin_rules, Clock, node_for
from detector.agent.agent import AgentSettings, NodeAgent
from detector.agent.metrics import AgentMetrics
from detector.rules.sources import builtin_rules_dir
from detector.config import build_checks
from detector.core.check import CheckRegistry
from detector.core.gpu_health import DEGRADED, FAILED, HEALTHY, carry_since, gpu_health, gpu_key
from detector.core.types import GpuRef, Problem, Severity
from detector.rules.loader import load_rules
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host

GPU0 = GpuRef(0, "GPU-a", "0000:18:00.0")
GPU1 = GpuRef(1, "GPU-b", "0000:2a:00.0")


def problem(reason: str, severity: Severity, action: str, *gpus: GpuRef) -> Problem:
    return Problem("r-" + reason, "c", "T", reason, reason, severity, action, "condition", gpus)


def by_bus(health):
    return {h.gpu.pci_bus_id: h for h in health}


def test_the_worst_severity_sets_the_state_and_the_most_demanding_action_leads():
    health = by_bus(gpu_health([GPU0, GPU1], [
        problem("PcieLinkWidthDegraded", Severity.WARNING, "CHECK_PCIE", GpuRef(1, None, "0000:2a:00.0")),
        problem("Xid13", Severity.WARNING, "RESTART_APP", GPU1),
        problem("Informational", Severity.INFO, "IGNORE", GPU0),
    ]))
    assert (health["0000:18:00.0"].state, health["0000:18:00.0"].action) == (HEALTHY, "NONE")
    g1 = health["0000:2a:00.0"]
    assert (g1.state, g1.action, g1.reasons) == (DEGRADED, "CHECK_PCIE", ("PcieLinkWidthDegraded",))
    assert g1.gpu == GPU1                                    # the inventory's full identity, not the problem's


def test_an_application_fault_leaves_the_gpu_healthy():
    """XID 13/31/43 from a user's kernel ask the application to restart: they are about the program, and a
    GPU is never degraded (tainted, counted towards a reboot) because one program faulted on it."""
    health = by_bus(gpu_health([GPU0, GPU1], [problem("Xid13", Severity.WARNING, "RESTART_APP", GPU1),
                                              problem("Xid31", Severity.CRITICAL, "RESTART_APP", GPU1)]))
    assert (health["0000:2a:00.0"].state, health["0000:2a:00.0"].action) == (HEALTHY, "NONE")


def test_a_critical_problem_fails_the_gpu_and_a_gpu_nvml_lost_keeps_a_row():
    lost = GpuRef(None, "GPU-c", "0000:ab:00.0")               # found on the PCI bus, not in NVML
    health = gpu_health([GPU0], [problem("GpuNotVisibleToNvml", Severity.CRITICAL, "RESTART_BM", lost),
                                 problem("Xid74", Severity.WARNING, "CHECK_NVLINK", GpuRef(0))])
    assert [(h.gpu.pci_bus_id, h.state, h.action) for h in health] == [
        ("0000:18:00.0", DEGRADED, "CHECK_NVLINK"), ("0000:ab:00.0", FAILED, "RESTART_BM")]


def test_node_wide_and_unnamed_problems_are_not_spread_over_the_gpus():
    health = gpu_health([GPU0, GPU1], [problem("NvmlDriverNotLoaded", Severity.CRITICAL, "CHECK_DRIVER"),
                                       problem("Xid79", Severity.CRITICAL, "RESTART_BM", GpuRef(None))])
    assert {h.state for h in health} == {HEALTHY} and len(health) == 2


def test_metrics_have_one_series_per_gpu_that_follows_its_state():
    registry_ = CheckRegistry.from_entry_points()
    node = node_for("h100-sxm-8")
    metrics = AgentMetrics()
    rules = load_rules([builtin_rules_dir()], registry_.fields_by_check())
    clock = Clock()
    agent = NodeAgent(fake_host(node, threaded=False), build_checks(registry_, ["visibility", "pcie", "xid"], {}),
                      rules, [metrics], AgentSettings(start_spread_s=0.0), clock=clock)

    def series() -> dict[str, tuple[dict[str, str], float]]:
        out = {}
        for family in metrics.registry.collect():
            if family.name == "gpu_npd_gpu_health":
                for sample in family.samples:
                    assert sample.labels["pci_bus_id"] not in out, "two series for one GPU"
                    out[sample.labels["pci_bus_id"]] = (sample.labels, sample.value)
        return out

    agent.run_due()
    healthy = series()
    assert len(healthy) == 8 and {v for _, v in healthy.values()} == {0.0}
    assert {l["state"] for l, _ in healthy.values()} == {"healthy"} and all(l["uuid"] for l, _ in healthy.values())

    node.inject(Fault("pcie", gpu=1, params={"width": 8}))
    node.inject(Fault("xid", gpu=3, params={"code": 79}))
    clock.now += 60
    agent.run_due()
    now = series()
    assert len(now) == 8
    bad = {labels["gpu"]: (labels["state"], labels["action"], value) for labels, value in now.values()
           if labels["state"] != "healthy"}
    assert bad["3"][0] == "failed" and bad["3"][2] == 2.0 and bad["3"][1] == "RESTART_BM"
    assert bad["1"][0] in ("degraded", "failed") and bad["1"][2] >= 1.0
    assert set(bad) == {"1", "3"}
    node.inject(Fault("recover", gpu=1))
    node.inject(Fault("reboot"))                               # XID 79 is held until a reboot, and its cure
    for _ in range(agent.settings.verify_sweeps):              # is verified by every check, round after round
        assert series()["0000:5d:00.0"][0]["state"] == "failed"
        clock.now += 60
        agent.run_due()
    assert {(l["state"], v) for l, v in series().values()} == {("healthy", 0.0)} and len(series()) == 8


def test_diagnose_shows_each_gpus_health_in_json_and_table_as_the_metric_does():
    import json
    import subprocess
    import sys

    from conftest import REPO

    def diagnose(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml",
                               "fake:h100-sxm-8-xid79", *args], capture_output=True, text=True, cwd=REPO,
                              timeout=60).stdout

    report = json.loads(diagnose("-o", "json"))
    health = {g["pci_bus_id"]: g["health"] for g in report["gpus"]}
    assert health["0000:5d:00.0"] == {"state": "failed", "action": "RESTART_BM",
                                      "reasons": ["GpuFellOffBus", "Xid79GpuFellOffBus"],
                                      "incidents": 0}          # diagnose keeps no history across boots
    assert all(h == {"state": "healthy", "action": "NONE", "reasons": [], "incidents": 0}
               for bus, h in health.items() if bus != "0000:5d:00.0")
    table = diagnose()
    header = next(line for line in table.splitlines() if line.startswith("GPU "))
    assert "HEALTH" in header.split()
    [lost] = [line for line in table.splitlines() if "0000:5d:00.0" in line and not line.startswith(" ")]
    assert "failed RESTART_BM" in lost
    assert sum("healthy" in line.split() for line in table.splitlines()) == 7


def test_a_lost_gpu_keeps_the_uuid_a_held_problem_knows():
    """NVML forgets a GPU that fell off the bus (no UUID any more); a held XID problem still names it by
    UUID, and the GPU's health (and so the annotation and the device taint) keeps that identity."""
    lost = GpuRef(1, None, "0000:2a:00.0")
    [h0, h1] = gpu_health([GPU0, lost], [problem("Xid79GpuFellOffBus", Severity.CRITICAL, "RESTART_BM", GPU1)])
    assert h1.gpu == GPU1 and h1.state == FAILED and h0.gpu == GPU0


def test_since_is_the_first_match_of_the_problems_of_its_state_and_holds_while_the_state_does():
    warning = problem("PcieLinkWidthDegraded", Severity.WARNING, "CHECK_PCIE", GPU0)
    xid = problem("Xid79", Severity.CRITICAL, "RESTART_BM", GPU0)
    missing = problem("GpuFellOffBus", Severity.CRITICAL, "RESTART_BM", GPU0)
    first = {warning: 100.0, xid: 200.0, missing: 250.0}
    [degraded] = gpu_health([GPU0], [warning], first)
    assert (degraded.state, degraded.since) == (DEGRADED, 100.0)
    [failed] = gpu_health([GPU0], [warning, xid, missing], first)
    assert (failed.state, failed.since) == (FAILED, 200.0)          # failed since its first critical problem
    assert gpu_health([GPU0], [xid])[0].since is None                # no start known: none said

    before = {gpu_key(failed.gpu): failed}
    [still] = carry_since(gpu_health([GPU0], [warning, missing], first), before)
    assert (still.state, still.since) == (FAILED, 200.0)             # the XID ended, the outage did not
    [better] = carry_since(gpu_health([GPU0], [warning], first), before)
    assert (better.state, better.since) == (DEGRADED, 100.0)         # a new state: its own since


def test_the_agent_gives_each_unhealthy_gpu_its_serial_and_a_since_that_does_not_move(registry):
    clock = Clock(1000.0)
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    ruleset = builtin_rules()
    agent = NodeAgent(host, build_checks(registry, ["visibility", "xid"], {}), ruleset, clock=clock,
                      settings=AgentSettings(start_spread_s=0.0))
    agent.run(agent.checks)
    gpu3 = node.snapshot().gpus[3]
    node.inject(Fault("xid", gpu=3, params={"code": 79}))
    clock.now = 1010.0
    agent.run(agent.checks)
    [failed] = [h for h in agent.gpu_health() if h.state != HEALTHY]
    assert (failed.gpu.index, failed.serial, failed.since) == (3, gpu3.serial, 1010.0)
    clock.now = 1100.0
    agent.run(agent.checks)
    [again] = [h for h in agent.gpu_health() if h.state != HEALTHY]
    assert again.since == 1010.0
