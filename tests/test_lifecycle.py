"""The node's lifecycle as the agent sees it: verified before work lands, recovery verified before it is
trusted, planned maintenance is not a fault. Fake nodes through the real checks and builtin rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detector.agent.agent import AgentSettings, AgentSink, NodeAgent
from detector.config import build_checks
from detector.core.nodestatus import NodeCondition, NodeStatus
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario
from tests.conftest import Clock
from conftest import builtin_rules

CHECKS = ["visibility", "xid", "driver", "pcie", "node", "readiness"]
HOUR = 3600.0


@pytest.fixture(scope="module")
def rules(registry):
    return builtin_rules()


class Events(AgentSink):
    def __init__(self) -> None:
        self.seen = []

    def events(self, problems) -> None:
        self.seen.extend(problems)


class Node:
    """A fake node and its agent; `status` is what the cluster says of it (None: no API server)."""

    def __init__(self, registry, rules, scenario="h100-sxm-8", state_dir=None, status: NodeStatus | None = None,
                 **settings):
        self.clock = Clock(1_764_000_000.0)
        self.fake = load_scenario(scenario).build(clock=self.clock)
        self.registry, self.rules, self.state_dir, self.settings = registry, rules, state_dir, settings
        self.status = status
        self.events = Events()
        self.agent = self._start()

    def _start(self) -> NodeAgent:
        host = fake_host(self.fake, threaded=False)
        host.node_status = lambda: self.status
        return NodeAgent(host, build_checks(self.registry, CHECKS, {}), self.rules, [self.events],
                         AgentSettings(start_spread_s=0.0, state_dir=self.state_dir, **self.settings), self.clock)

    def sweep(self, *names: str) -> dict[str, tuple[bool, str, str]]:
        self.clock.now += 60
        checks = [c for c in self.agent.checks if not names or c.name in names]
        self.agent.run(checks)
        return {s.type: (s.active, s.reason, s.message) for s in self.agent.conditions()}

    def reboot(self) -> None:
        self.clock.now += HOUR
        self.fake.inject(Fault("reboot"))
        self.agent = self._start()


def maintenance(condition: str = "MaintenanceInProgress", annotation: str = "") -> NodeStatus:
    conditions = {condition: NodeCondition(condition, "True", "FirmwareUpdate")} if condition else {}
    annotations = {"gpu-npd.io/maintenance": annotation} if annotation else {}
    return NodeStatus("node-1", 0.0, conditions=conditions, annotations=annotations)


# -- verified before work lands ------------------------------------------------------------------------

def test_a_node_is_unverified_until_every_check_ran_in_this_boot(registry, rules):
    node = Node(registry, rules)
    conditions = node.sweep("visibility", "xid")
    active, reason, message = conditions["GpuNodeUnverified"]
    assert (active, reason) == (True, "ChecksPending")
    assert "2 check(s) have not run in this boot yet" in message and "driver, pcie" in message
    assert node.sweep("driver", "pcie")["GpuNodeUnverified"][:2] == (False, "NoGpuNodeUnverified")

    node.reboot()                                       # a new boot is verified afresh
    assert node.sweep("xid")["GpuNodeUnverified"][:2] == (True, "ChecksPending")


def test_a_node_that_asks_for_remediation_is_not_verified(registry, rules):
    node = Node(registry, rules, "h100-sxm-8-modules-uvm-unloaded")
    conditions = node.sweep()
    assert conditions["GpuNodeNeedsRemediation"][0] is True
    active, reason, message = conditions["GpuNodeUnverified"]
    assert (active, reason) == (True, "RemediationRequested")
    assert "GpuNodeNeedsRemediation NodeWideProblem" in message


def test_one_failed_gpu_fenced_on_its_own_does_not_block_the_node(registry, rules):
    node = Node(registry, rules)
    node.fake.inject(Fault("xid", 3, {"code": 79}))
    conditions = node.sweep()
    assert conditions["GpuXidError"][0] and not conditions["GpuNodeNeedsRemediation"][0]
    assert conditions["GpuNodeUnverified"][0] is False


# -- maintenance is not a fault ---------------------------------------------------------------------------

@pytest.mark.parametrize("status, reason", [
    (maintenance("MaintenanceInProgress"), "MaintenanceInProgress"),
    (maintenance("DrainInProgress"), "DrainInProgress"),
    (maintenance("", annotation="bios-update CHG-1234"), "MaintenanceAnnotation"),
    (maintenance("", annotation="True"), "MaintenanceAnnotation"),
])
def test_under_maintenance_the_node_is_judged_but_no_remediation_is_asked(registry, rules, status, reason):
    node = Node(registry, rules, "h100-sxm-8-modules-uvm-unloaded", status=status)
    conditions = node.sweep()
    assert conditions["GpuDriverUnhealthy"][0] is True                      # judged as ever
    active, why, message = conditions["GpuNodeNeedsRemediation"]
    assert (active, why) == (False, reason)
    assert message.startswith("the node is under maintenance (") and "otherwise it would: NodeWideProblem" in message
    assert conditions["GpuNodeUnverified"][:2] == (True, "RemediationRequested")   # and not verified either

    node.status = None                                   # maintenance over: the ask is back at once
    node.agent.kick_node_checks()
    node.agent.run_due()
    assert {s.type: s.active for s in node.agent.conditions()}["GpuNodeNeedsRemediation"] is True


def test_a_maintenance_value_of_false_is_no_maintenance(registry, rules):
    node = Node(registry, rules, "h100-sxm-8-modules-uvm-unloaded", status=maintenance("", annotation="false"))
    assert node.sweep()["GpuNodeNeedsRemediation"][0] is True


def test_boots_that_begin_in_maintenance_count_towards_no_loop_and_no_flaky_gpu(registry, rules, tmp_path):
    node = Node(registry, rules, state_dir=tmp_path, status=maintenance())
    for _ in range(4):                                   # a firmware update that reboots four times, XID 48 each
        node.fake.inject(Fault("xid", 3, {"code": 48}))
        conditions = node.sweep()
        node.reboot()
    node.status = None                                   # back in service
    node.fake.inject(Fault("xid", 3, {"code": 48}))
    conditions = node.sweep()
    assert conditions["GpuRemediationLoop"][0] is False and conditions["GpuFlaky"][0] is False
    assert {h.gpu.index: h.incidents for h in node.agent.gpu_health()}[3] == 1     # this boot's only


# -- recovery is verified, not assumed --------------------------------------------------------------------

def test_a_failed_gpu_stays_fenced_until_every_check_passed_verify_sweeps_rounds(registry, rules, tmp_path):
    node = Node(registry, rules, state_dir=tmp_path, verify_sweeps=2)
    node.fake.inject(Fault("xid", 3, {"code": 79}))
    node.sweep()
    node.reboot()                                        # the reboot brings GPU 3 back
    node.sweep("visibility", "xid")                     # half the checks: not a round yet
    health = {h.gpu.index: h for h in node.agent.gpu_health()}
    assert health[3].state == "failed" and health[3].verifying
    assert node.sweep("driver", "pcie")["GpuXidError"][0] is True         # round 1 of 2
    assert "after a reboot; verifying: 1 of 2 rounds" in {s.type: s for s in node.agent.conditions()}[
        "GpuXidError"].message
    node.events.seen.clear()
    conditions = node.sweep()                            # round 2: verified
    assert conditions["GpuXidError"][0] is False
    assert all(h.state == "healthy" for h in node.agent.gpu_health())
    verified = [p for p in node.events.seen if p.reason == "RecoveryVerified"]
    assert verified and all(p.severity.value == "info" for p in verified)
    assert any("GPU 3" in p.message and "verified 3m00s after the reboot" in p.message for p in verified), \
        [p.message for p in verified]


def test_a_fault_back_while_verifying_starts_the_verification_again(registry, rules, tmp_path):
    node = Node(registry, rules, state_dir=tmp_path, verify_sweeps=2)
    node.fake.inject(Fault("xid", 3, {"code": 79}))
    node.sweep()
    node.reboot()
    node.sweep()                                         # round 1
    node.fake.inject(Fault("xid", 3, {"code": 79}))     # it fell off again
    node.sweep()
    latches = [l for l in node.agent.active.latches.values() if l.problem.type == "GpuXidError"]
    assert latches and all(l.verifying is None for l in latches)


def test_verify_sweeps_zero_trusts_a_cure_at_once(registry, rules, tmp_path):
    node = Node(registry, rules, state_dir=tmp_path, verify_sweeps=0)
    node.fake.inject(Fault("xid", 3, {"code": 79}))
    node.sweep()
    node.reboot()
    assert node.sweep()["GpuXidError"][0] is False


def test_what_others_hold_on_the_node_is_said_once_each_time_it_changes(registry, rules):
    node = Node(registry, rules, status=NodeStatus("node-1", 0.0))
    node.sweep()
    node.status = replace(node.status, unschedulable=True, taints=("medik8s.io/remediation:NoExecute",))
    node.sweep()
    node.sweep()
    said = [p for p in node.events.seen if p.reason == "NodeHeldByOthers"]
    assert len(said) == 1
    assert "cordoned, taint medik8s.io/remediation:NoExecute" in said[0].message
