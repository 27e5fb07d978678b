"""The fabric check: each GPU's NVLink fabric registration and the fabric manager on NVSwitch nodes, on
scenarios that trip it and normal ones that must not, the rules' thresholds, the older NVML call, diagnose
JSON and the daemon."""

from __future__ import annotations

from dataclasses import dataclass

import pynvml
import pytest

from conftest import builtin_rules, Clock, diagnose_host, diagnose_scenario, node_for
from test_cli import diagnose_json
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.backends.system import SystemInfo
from detector.checks.fabric import FabricCheck
from detector.core.sweep import run_sweep
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.pci import write_sysfs
from fake_nvml.scenario import load_scenario
from fake_nvml.system import fake_system


@dataclass
class StubSystem:
    """A driver-plumbing reader that reports what the test says about the fabric manager."""

    running: bool | None

    def read(self) -> SystemInfo:
        return SystemInfo(fabric_manager_running=self.running)


def fabric(scenario: str, registry, system=None):
    host = fake_host(node_for(scenario))
    if system is not None:
        host.system = system
    return diagnose_host(host, registry, checks=["fabric"])


def fields_of(outcome, scope: str, index: int | None = None) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations
                if o.fields["scope"] == scope and (index is None or o.gpu.index == index))


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


# ---- scenarios ------------------------------------------------------------------------------


def test_a_healthy_nvswitch_node_has_every_gpu_registered(registry):
    out = fabric("h100-sxm-8", registry, StubSystem(True))
    assert out.problems == [] and out.sweep.runs[0].status == "ok"
    for i in range(8):
        f = fields_of(out, "gpu", i)
        assert (f["fabric_state"], f["fabric_status"], f["registered"], f["degraded_bandwidth"]) == \
            ("completed", "SUCCESS", True, False)
    assert fields_of(out, "node") == {"scope": "node", "nvswitches": 4, "fabric_manager": "running",
                                      "fabric_manager_required": True}


@pytest.mark.parametrize("scenario", ["a100-pcie-4", "rtx-4090-1", "v100-sxm-8"])
def test_nodes_without_a_fabric_are_not_applicable(scenario, registry):
    out = fabric(scenario, registry, StubSystem(False))        # no fabric manager, and none needed
    assert out.problems == []
    assert {fields_of(out, "gpu", 0)["fabric_state"], fields_of(out, "gpu", 0)["registered"]} == {"not_supported", None}
    assert fields_of(out, "node")["fabric_manager_required"] is False
    assert "not supported" in out.sweep.runs[0].summary


def test_a_failed_registration_is_critical_until_the_gpu_is_reset(registry):
    node = node_for("h100-sxm-8-fabric-failed")
    out = diagnose_host(fake_host(node), registry, checks=["fabric"])
    assert out.rules() == {"fabric-registration-failed"}
    problem = out.by_rule()["fabric-registration-failed"]
    assert (problem.type, problem.reason, problem.severity, problem.action) == \
        ("GpuFabricUnhealthy", "FabricRegistrationFailed", Severity.CRITICAL, "CHECK_NVLINK")
    assert [g.index for g in problem.gpus] == [1] and "ERROR_UNKNOWN" in problem.message
    node.inject(Fault("recover", 1))
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).problems == []


def test_an_unfinished_registration_counts_only_after_its_grace(engine):
    clock = Clock(0.0)
    node = load_scenario("h100-sxm-8").build(clock=clock)
    host = fake_host(node, threaded=False)
    check = FabricCheck(clock=clock)

    def at(t: float) -> set[str]:
        clock.now = t
        return {p.rule for p in engine.evaluate(run_sweep(host, [check]).observations)}
    assert at(0.0) == set()
    node.inject(Fault("fabric_not_started", 4))
    assert at(10.0) == set()                                  # first seen unfinished now
    assert at(309.0) == set()
    assert at(310.0) == {"fabric-registration-stuck"}
    node.inject(Fault("recover", 4))
    assert at(320.0) == set()
    node.inject(Fault("fabric_not_started", 4))               # a new spell starts its own grace
    assert at(330.0) == set()


def test_fabric_manager_stopped_on_an_nvswitch_node_is_critical(registry):
    out = fabric("h100-sxm-8", registry, StubSystem(False))
    assert out.rules() == {"fabric-manager-not-running"}
    problem = out.by_rule()["fabric-manager-not-running"]
    assert problem.severity == Severity.CRITICAL and not problem.gpus and "4 NVSwitches" in problem.message


@pytest.mark.parametrize("system", [None, StubSystem(None)])
def test_a_fabric_manager_state_that_cannot_be_read_is_unknown_never_down(system, registry):
    host = fake_host(node_for("h100-sxm-8-fabric-manager-down"))
    host.system = system
    out = diagnose_host(host, registry, checks=["fabric"])
    assert fields_of(out, "node")["fabric_manager"] == "unknown" and out.problems == []


def test_an_unreadable_plumbing_reader_is_unknown_too(registry):
    class Broken:
        def read(self) -> SystemInfo:
            raise PermissionError("/proc is not mounted")
    out = fabric("h100-sxm-8", registry, Broken())
    assert fields_of(out, "node")["fabric_manager"] == "unknown" and out.problems == []
    assert "PermissionError" in out.sweep.runs[0].result["node"]["note"]


def test_the_fake_plumbing_reader_reports_a_stopped_fabric_manager_until_recovery(registry):
    node = node_for("h100-sxm-8-fabric-manager-down")
    assert fake_system(node).read().fabric_manager_running is False
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).rules() == {"fabric-manager-not-running"}
    node.inject(Fault("recover"))
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).problems == []


def test_the_real_pci_reader_finds_the_nvswitches_in_a_sysfs_tree(tmp_path, registry):
    node = node_for("h100-sxm-8")
    write_sysfs(node.snapshot(), tmp_path)
    host = fake_host(node, sysfs_root=tmp_path)
    host.system = StubSystem(False)
    out = diagnose_host(host, registry, checks=["fabric"])
    assert fields_of(out, "node")["nvswitches"] == 4 and out.rules() == {"fabric-manager-not-running"}


def test_an_unreadable_pci_bus_leaves_the_switch_count_unknown(tmp_path, registry):
    host = fake_host(node_for("h100-sxm-8"), sysfs_root=tmp_path / "missing")
    host.system = StubSystem(False)
    out = diagnose_host(host, registry, checks=["fabric"])
    assert fields_of(out, "node")["nvswitches"] is None and out.problems == []
    assert "PCI bus unreadable" in out.sweep.runs[0].result["node"]["note"]


def test_drivers_before_550_use_the_unversioned_call(registry):
    host = fake_host(node_for("h100-sxm-8-fabric-failed"))

    def missing(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    host.nvml.nvmlDeviceGetGpuFabricInfoV = missing
    out = diagnose_host(host, registry, checks=["fabric"])
    assert out.rules() == {"fabric-registration-failed"}
    assert fields_of(out, "gpu", 0)["health_mask"] is None and fields_of(out, "gpu", 0)["registered"] is True


# ---- the rules, at and around their thresholds -----------------------------------------------------


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(FabricCheck.fields)
    base.update(scope="gpu", fabric_state="completed", fabric_status="SUCCESS", registered=True)
    return {p.rule for p in engine.evaluate([Observation("fabric", {**base, **fields})])}


@pytest.mark.parametrize("state,status,seconds,expected", [
    ("completed", "SUCCESS", 0.0, set()), ("completed", "ERROR_UNKNOWN", 0.0, {"fabric-registration-failed"}),
    ("not_started", None, 299.9, set()), ("not_started", None, 300.0, {"fabric-registration-stuck"}),
    ("in_progress", None, 300.0, {"fabric-registration-stuck"}), ("not_supported", None, None, set()),
])
def test_registration_thresholds(engine, state, status, seconds, expected):
    assert judge(engine, fabric_state=state, fabric_status=status, not_completed_s=seconds) == expected


@pytest.mark.parametrize("degraded,expected", [(True, {"fabric-bandwidth-degraded"}), (False, set()), (None, set())])
def test_degraded_bandwidth_is_a_warning(engine, degraded, expected):
    assert judge(engine, degraded_bandwidth=degraded) == expected


@pytest.mark.parametrize("switches,manager,fires", [(4, "stopped", True), (0, "stopped", False),
                                                    (None, "stopped", False), (4, "unknown", False),
                                                    (4, "running", False)])
def test_fabric_manager_rule(engine, switches, manager, fires):
    obs = Observation("fabric", {**dict.fromkeys(FabricCheck.fields), "scope": "node", "nvswitches": switches,
                                 "fabric_manager": manager})
    assert {p.rule for p in engine.evaluate([obs])} == ({"fabric-manager-not-running"} if fires else set())


# ---- end to end ------------------------------------------------------------------------------------


def test_diagnose_json_end_to_end():
    code, report = diagnose_json("h100-sxm-8-fabric-failed", "--checks", "fabric")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["fabric-registration-failed"]
    result = report["checks"][0]["result"]
    assert result["gpus"][1]["fabric_status"] == "ERROR_UNKNOWN" and result["gpus"][0]["registered"] is True
    assert result["node"]["nvswitches"] == 4
    code, report = diagnose_json("a100-pcie-4", "--checks", "fabric")
    assert code == 0 and report["checks"][0]["result"]["gpus"][0]["fabric_state"] == "not_supported"


def test_daemon_sets_and_clears_the_fabric_condition(running):
    local = running(name="gpu-fab", checks=["fabric"], check_settings={"fabric": {"interval": 0.3}})

    def status() -> str | None:
        return local.conditions().get("GpuFabricUnhealthy", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuFabricUnhealthy") and status() is None, 10), local.conditions()
    local.node.inject(Fault("fabric_failed", 3, {"status": pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES}))
    assert local.wait_for(lambda: status() == "True", 10)
    condition = local.conditions()["GpuFabricUnhealthy"]
    assert condition["reason"] == "FabricRegistrationFailed" and "GPU 3" in condition["message"]
    assert "ERROR_INSUFFICIENT_RESOURCES" in condition["message"]
    local.node.inject(Fault("recover", 3))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()
