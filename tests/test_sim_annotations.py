"""Faults by node annotation: the value's reading (and its errors), the plan from one set of faults to
the next, and a fleet acting on annotated nodes against the emulator: inject, write back, report a bad
value without touching the node, heal by a GPU reset or (XIDs) a reboot."""

from __future__ import annotations

import json

import pytest
from detector.cli.simulate import SIMULATOR_USER
from detector.core.check import CheckRegistry
from detector.daemon.local import REPO_DEPLOY
from detector.kube.api import KubeApi
from detector.sim.annotations import (INJECT_ANNOTATION, STATUS_ANNOTATION, AnnotationError, parse_faults, plan)
from detector.sim.faultlog import FaultLog
from detector.agent.agent import AgentSettings
from detector.sim.fleet import Fleet, FleetSettings
from detector.sim.fleetfile import fleet_from_dict
from fake_nvml.faults import Fault
from kube_emulator import Emulator
from test_sim_fleet import wait_for
from conftest import builtin_rules

XID79 = '{"kind": "xid", "gpu": 3, "params": {"code": 79}}'

# A cure is trusted after one round of every check (a reboot makes every check due at once), not the
# daemon's three: these tests are about the drill, not the verification (tests/test_lifecycle.py).
QUICK_CURES = AgentSettings(start_spread_s=0.0, verify_sweeps=1)


# -- reading the value ----------------------------------------------------------------------------

def test_one_fault_or_a_list():
    assert parse_faults(XID79) == (Fault("xid", 3, {"code": 79}),)
    assert parse_faults(f'[{XID79}, {{"kind": "pcie", "gpu": 1, "params": {{"width": 8}}}}]') == (
        Fault("xid", 3, {"code": 79}), Fault("pcie", 1, {"width": 8}))
    assert parse_faults("") == () and parse_faults("  ") == () and parse_faults("[]") == ()
    assert parse_faults('{"kind": "driver_unloaded"}') == (Fault("driver_unloaded"),)


@pytest.mark.parametrize("value,says", [
    ("{kind: xid}", "gpu-npd.io/inject-fault: not JSON"),
    ('{"kind": "xid", "gpu": 3}', "gpu-npd.io/inject-fault: fault 'xid' needs parameter 'code'"),
    ('{"kind": "xid", "params": {"code": 79}}', "fault 'xid' needs a 'gpu'"),
    ('{"kind": "fell_off", "gpu": 3}', "unknown fault kind 'fell_off' (known: "),
    ('{"kind": "xid", "gpu": 3, "params": {"code": "79"}}', "code must be int, got '79'"),
    ('{"kind": "xid", "gpu": -1, "params": {"code": 79}}', "gpu-npd.io/inject-fault.gpu: expected a GPU index"),
    ('{"kind": "xid", "gpu": true, "params": {"code": 79}}', ".gpu: expected a GPU index"),
    ('{"kind": "xid", "gpu": 3, "code": 79}', "unknown field 'code' (a fault has: kind, gpu, params)"),
    ('[{"kind": "pcie", "gpu": 1, "params": {"width": 8}}, 7]', "gpu-npd.io/inject-fault[1]: expected an object"),
    ('{"kind": "reboot"}', "'reboot' is how faults heal; remove the annotation instead"),
    (f"[{XID79}, {XID79}]", "the same fault is listed twice"),
    ('"xid"', "expected an object with kind, gpu and params"),
])
def test_a_bad_value_says_what_is_wrong(value, says):
    with pytest.raises(AnnotationError) as e:
        parse_faults(value)
    assert says in str(e.value)


# -- from the faults applied to the ones wanted ---------------------------------------------------

PCIE1, PCIE2 = Fault("pcie", 1, {"width": 8}), Fault("pcie", 2, {"width": 4})
XID = Fault("xid", 3, {"code": 79})


def test_new_faults_are_injected_and_kept_ones_left_alone():
    step = plan((PCIE1,), (PCIE1, PCIE2))
    assert step.heal == [] and step.inject == [PCIE2]


def test_a_gpu_fault_removed_is_healed_by_that_gpus_reset_and_its_other_faults_come_back():
    busy = Fault("busy", 1, {"utilization": 90})
    step = plan((PCIE1, busy, PCIE2), (busy, PCIE2))
    assert step.heal == [Fault("recover", 1)] and step.inject == [busy]


def test_a_node_fault_removed_is_healed_by_a_node_repair_and_everything_still_wanted_returns():
    step = plan((Fault("driver_unloaded"), PCIE1), (PCIE1,))
    assert step.heal == [Fault("recover")] and step.inject == [PCIE1]


def test_an_xid_removed_needs_a_reboot():
    step = plan((XID, PCIE1), (PCIE1,))
    assert step.heal == [Fault("reboot")] and step.inject == [PCIE1]
    assert plan((XID,), ()).heal == [Fault("reboot")]


# -- a fleet acting on its nodes' annotations -----------------------------------------------------

FLEET = {"version": 1, "seed": 3,
         "nodes": [{"scenario": "h100-sxm-8", "count": 3, "name": "drill-{index:02d}"}]}


@pytest.fixture
def drill(tmp_path):
    """A 3-node fleet on the emulator, its node watch off: the tests hand it node objects themselves."""
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok")) as emulator:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
        api = KubeApi.from_kubeconfig(str(kubeconfig), qps=500.0, burst=500)
        registry = CheckRegistry.from_entry_points()
        ruleset = builtin_rules()
        fleet = Fleet(fleet_from_dict(FLEET), api, ruleset, registry,
                      FleetSettings(workers=2, start_spread_s=0.0, watch_annotations=False,
                                    agent=QUICK_CURES),
                      FaultLog(tmp_path / "faults.jsonl"))
        fleet.start()
        try:
            yield fleet, emulator
        finally:
            fleet.stop()


def status_of(emulator: Emulator, name: str) -> str | None:
    return (emulator.node(name)["metadata"].get("annotations") or {}).get(STATUS_ANNOTATION)


def annotate(fleet: Fleet, emulator: Emulator, name: str, value: str | None) -> dict:
    """As `kubectl annotate` would leave the node, then as the watch would hand it over; the fault-status
    annotation the fleet then writes (on its scheduler)."""
    before = status_of(emulator, name)
    node = emulator.node(name)
    annotations = node["metadata"].setdefault("annotations", {})
    if value is None:
        annotations.pop(INJECT_ANNOTATION, None)
    else:
        annotations[INJECT_ANNOTATION] = value
    fleet.on_node_seen(node)
    assert wait_for(lambda: status_of(emulator, name) not in (None, before), 10.0)
    return json.loads(status_of(emulator, name))


def condition(emulator: Emulator, name: str, type_: str) -> str | None:
    return next((c["status"] for c in emulator.node(name)["status"].get("conditions", []) if c["type"] == type_), None)


def test_an_annotated_xid_79_breaks_the_node_and_removing_it_reboots_it_healthy(drill):
    fleet, emulator = drill
    status = annotate(fleet, emulator, "drill-01", XID79)
    assert status["applied"] == ["xid on GPU 3 (code=79)"] and "error" not in status and status["time"]
    assert wait_for(lambda: condition(emulator, "drill-01", "GpuXidError") == "True")
    assert condition(emulator, "drill-00", "GpuXidError") != "True", "only the annotated node"
    assert [(r["node"], r["kind"], r["source"]) for r in fleet.fault_log.records()] == [("drill-01", "xid", "annotation")]
    resync = emulator.node("drill-01")
    resync["metadata"]["annotations"][INJECT_ANNOTATION] = XID79
    fleet.on_node_seen(resync)                                     # seen again (a resync): nothing new
    assert len(fleet.fault_log.records()) == 1

    status = annotate(fleet, emulator, "drill-01", None)
    assert status["applied"] == []
    assert [r["kind"] for r in fleet.fault_log.records()] == ["xid", "reboot"]
    assert wait_for(lambda: condition(emulator, "drill-01", "GpuXidError") == "False")
    assert condition(emulator, "drill-01", "GpuMissing") == "False"


def test_a_bad_value_changes_nothing_and_says_so_on_the_node(drill):
    fleet, emulator = drill
    annotate(fleet, emulator, "drill-02", '{"kind": "pcie", "gpu": 1, "params": {"width": 8}}')
    assert wait_for(lambda: condition(emulator, "drill-02", "GpuPcieDegraded") == "True")
    status = annotate(fleet, emulator, "drill-02", '{"kind": "pcie", "gpu": 9, "params": {"width": 8}}')
    assert status["applied"] == ["pcie on GPU 1 (width=8)"], "the fault already applied stays"
    assert "node drill-02 has GPUs 0 to 7, not 9" in status["error"]
    assert wait_for(lambda: any(e["reason"] == "InvalidFaultAnnotation" and e["involvedObject"]["name"] == "drill-02"
                                for e in emulator.events()))
    [event] = [e for e in emulator.events() if e["reason"] == "InvalidFaultAnnotation"]
    assert event["type"] == "Warning" and "nothing was changed" in event["message"]
    assert [r["kind"] for r in fleet.fault_log.records()] == ["pcie"]
    assert condition(emulator, "drill-02", "GpuPcieDegraded") == "True"


def test_a_gpu_fault_removed_heals_by_a_gpu_reset_without_a_reboot(drill):
    fleet, emulator = drill
    boot = fleet.nodes["drill-00"].fake.boot_id
    annotate(fleet, emulator, "drill-00", '{"kind": "pcie", "gpu": 5, "params": {"width": 4}}')
    assert wait_for(lambda: condition(emulator, "drill-00", "GpuPcieDegraded") == "True")
    annotate(fleet, emulator, "drill-00", "")
    assert [(r["kind"], r["gpu"]) for r in fleet.fault_log.records()] == [("pcie", 5), ("recover", 5)]
    assert wait_for(lambda: condition(emulator, "drill-00", "GpuPcieDegraded") == "False")
    assert fleet.nodes["drill-00"].fake.boot_id == boot, "a GPU reset, not a reboot"


def test_nodes_that_are_not_the_fleets_are_left_alone(drill):
    fleet, emulator = drill
    emulator.create_node("someone-elses")
    fleet.on_node_seen({"metadata": {"name": "someone-elses", "annotations": {INJECT_ANNOTATION: XID79}}})
    assert fleet.fault_log.records() == []
    assert STATUS_ANNOTATION not in (emulator.node("someone-elses")["metadata"].get("annotations") or {})


# -- shards: several simulators, one fleet --------------------------------------------------------

def test_shards_are_disjoint_contiguous_blocks_that_cover_the_fleet():
    from detector.sim.fleet import shard_of
    nodes = fleet_from_dict({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 30, "name": "n-{index:02d}"}]}).nodes
    blocks = [shard_of(nodes, k, 4) for k in range(4)]
    assert [len(b) for b in blocks] == [7, 8, 7, 8]
    assert [n for b in blocks for n in b] == nodes
    assert shard_of(nodes, 0, 1) == nodes
    with pytest.raises(ValueError, match="shard 4 of 4: expected 0 to 3"):
        shard_of(nodes, 4, 4)


def test_two_shards_create_their_own_nodes_and_act_only_on_their_own_annotations(tmp_path):
    data = {"version": 1, "seed": 5, "nodes": [{"scenario": "h100-sxm-8", "count": 4, "name": "sh-{index}"}],
            "faults": [{"at": 0.2, "node": "sh-3", "kind": "pcie", "gpu": 0, "width": 8}]}
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok")) as emulator:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
        registry = CheckRegistry.from_entry_points()
        ruleset = builtin_rules()
        fleets = [Fleet(fleet_from_dict(data), KubeApi.from_kubeconfig(str(kubeconfig), qps=500.0, burst=500),
                        ruleset, registry, FleetSettings(workers=2, start_spread_s=0.0, watch_annotations=False,
                                                         shard=k, shards=2),
                        FaultLog(tmp_path / f"faults-{k}.jsonl")) for k in range(2)]
        for fleet in fleets:
            fleet.start()
        try:
            assert [sorted(f.nodes) for f in fleets] == [["sh-0", "sh-1"], ["sh-2", "sh-3"]]
            assert sorted(n["metadata"]["name"] for n in emulator.nodes()) == ["sh-0", "sh-1", "sh-2", "sh-3"]
            assert wait_for(lambda: [(r["node"], r["source"]) for r in fleets[1].fault_log.records()]
                            == [("sh-3", "scripted")]), "the timeline's fault reaches the shard owning its node"
            annotate(fleets[0], emulator, "sh-1", XID79)            # shard 0 sees the change...
            fleets[1].on_node_seen(emulator.node("sh-1"))          # ...and so does shard 1: not its node
            assert [r["node"] for r in fleets[0].fault_log.records()] == ["sh-1"]
            assert [r["node"] for r in fleets[1].fault_log.records()] == ["sh-3"]
            assert wait_for(lambda: condition(emulator, "sh-1", "GpuXidError") == "True")
        finally:
            for fleet in fleets:
                fleet.stop()


def test_scenarios_faults_lists_every_kind_an_annotation_may_name(capsys):
    from detector.cli.main import main
    from fake_nvml.faults import FAULT_KINDS

    assert main(["scenarios", "--faults"]) == 0
    out = capsys.readouterr().out
    kinds = [line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert kinds == sorted(FAULT_KINDS)
    assert any(line.startswith("xid ") and "gpu, code: int" in line for line in out.splitlines())


def test_the_fleets_own_watch_delivers_the_annotation_and_its_removal(tmp_path):
    """No hand-off here: the fleet's list-and-watch sees an admin annotate a node, and the removal."""
    data = {"version": 1, "seed": 5, "nodes": [{"scenario": "h100-sxm-8", "count": 2, "name": "w-{index}"}]}
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok")) as emulator:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
        admin = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "admin.kubeconfig", user="admin")))
        registry = CheckRegistry.from_entry_points()
        fleet = Fleet(fleet_from_dict(data), KubeApi.from_kubeconfig(str(kubeconfig), qps=500.0, burst=500),
                      builtin_rules(), registry,
                      FleetSettings(workers=2, start_spread_s=0.0, watch_timeout_s=5, agent=QUICK_CURES),
                      FaultLog(None))
        fleet.start()
        try:
            assert wait_for(lambda: fleet.watch is not None and fleet.watch.watches >= 1)
            admin.patch_node_annotations("w-1", {INJECT_ANNOTATION: XID79})
            assert wait_for(lambda: condition(emulator, "w-1", "GpuXidError") == "True")
            status = json.loads(emulator.node("w-1")["metadata"]["annotations"][STATUS_ANNOTATION])
            assert status["applied"] == ["xid on GPU 3 (code=79)"]
            admin.patch_node_annotations("w-1", {INJECT_ANNOTATION: None})
            assert wait_for(lambda: condition(emulator, "w-1", "GpuXidError") == "False")
            assert [(r["node"], r["kind"], r["source"]) for r in fleet.fault_log.records()] == [
                ("w-1", "xid", "annotation"), ("w-1", "reboot", "annotation")]
            assert fleet.watch.lists == 1, "one list, then the watch: no polling"
        finally:
            fleet.stop()
        assert not fleet.watch._thread.is_alive(), "stopping ends a watch blocked on a quiet stream"
