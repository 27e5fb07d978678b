"""The fleet simulator's device plugins: each KWOK node's capacity and allocatable follow its fake device
plugin; a fault annotated on the node (as `kubectl annotate` does) makes the plugin lie, the node's
GpuAllocatableMismatch turns True, and removing the annotation heals it. The node object reaches each
agent through the fleet's one watch, maintenance conditions set on the node included."""

from __future__ import annotations

import json

import pytest
from detector.cli.simulate import SIMULATOR_USER
from detector.core.check import CheckRegistry
from detector.daemon.local import REPO_DEPLOY
from detector.kube.api import KubeApi
from detector.sim.annotations import INJECT_ANNOTATION
from detector.sim.faultlog import FaultLog
from detector.sim.fleet import Fleet, FleetSettings
from detector.sim.fleetfile import fleet_from_dict
from kube_emulator import Emulator
from kube_emulator.rbac import ADMIN
from test_sim_fleet import wait_for
from conftest import builtin_rules

FLEET = {"version": 1, "seed": 7, "checks": {"allocatable": {"settle": 0}},
         "nodes": [{"scenario": "h100-sxm-8", "count": 2, "name": "dp-{index}"}]}
STALE_AND_LOST = json.dumps([{"kind": "device_plugin_stale"}, {"kind": "xid", "gpu": 3, "params": {"code": 79}}])


@pytest.fixture
def fleet(tmp_path):
    """Two simulated nodes with their shared node watch on, and an admin client playing kubectl."""
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok")) as emulator:
        sim = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "sim", user=SIMULATOR_USER)),
                                      qps=500.0, burst=500)
        admin = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "admin", user=ADMIN)))
        registry = CheckRegistry.from_entry_points()
        fleet = Fleet(fleet_from_dict(FLEET), sim, builtin_rules(),
                      registry, FleetSettings(workers=2, start_spread_s=0.0), FaultLog(tmp_path / "faults.jsonl"))
        fleet.start()
        try:
            yield fleet, emulator, admin
        finally:
            fleet.stop()


def mismatch(emulator: Emulator, name: str) -> tuple[str, str, str] | None:
    for c in emulator.node(name)["status"].get("conditions", []):
        if c["type"] == "GpuAllocatableMismatch":
            return c["status"], c.get("reason", ""), c.get("message", "")
    return None


def gpus(emulator: Emulator, name: str) -> tuple[str, str]:
    status = emulator.node(name)["status"]
    return status["capacity"]["nvidia.com/gpu"], status["allocatable"]["nvidia.com/gpu"]


def test_a_stale_device_plugin_on_a_lost_gpu_turns_the_mismatch_true_and_heals(fleet):
    fleet, emulator, admin = fleet
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert wait_for(lambda: fleet.nodes["dp-0"].reporter.settled(["GpuAllocatableMismatch"])
                    and mismatch(emulator, "dp-0") is None)
    assert gpus(emulator, "dp-0") == ("8", "8")
    admin.patch_node_annotations("dp-0", {INJECT_ANNOTATION: STALE_AND_LOST})       # kubectl annotate
    assert wait_for(lambda: (mismatch(emulator, "dp-0") or ("",))[0] == "True")
    status, reason, message = mismatch(emulator, "dp-0")
    assert reason == "AdvertisedGpusMissing" and gpus(emulator, "dp-0") == ("8", "8"), "the plugin kept its count"
    assert message.startswith("gpu-npd: nvidia.com/gpu: 8 allocatable (capacity 8) but NVML sees 7 GPUs") and "GPU 3 (" in message
    assert (mismatch(emulator, "dp-1") or ("",))[0] != "True", "only the annotated node"

    admin.patch_node_annotations("dp-0", {INJECT_ANNOTATION: None})                   # kubectl annotate ...-
    assert wait_for(lambda: (mismatch(emulator, "dp-0") or ("",))[0] == "False")
    assert [r["kind"] for r in fleet.fault_log.records()] == ["device_plugin_stale", "xid", "reboot"]


def test_a_device_plugin_advertising_seven_is_published_and_judged_then_healed(fleet):
    fleet, emulator, admin = fleet
    admin.patch_node_annotations("dp-1", {INJECT_ANNOTATION: '{"kind": "device_plugin_count", "params": {"count": 7}}'})
    assert wait_for(lambda: gpus(emulator, "dp-1") == ("7", "7"))                  # one PATCH of nodes/status
    assert wait_for(lambda: (mismatch(emulator, "dp-1") or ("",))[0] == "True")
    _, reason, message = mismatch(emulator, "dp-1")
    assert reason == "HealthyGpusNotAdvertised" and "7 allocatable (capacity 7) but 8 healthy GPUs call for 8" in message
    admin.patch_node_annotations("dp-1", {INJECT_ANNOTATION: None})
    assert wait_for(lambda: gpus(emulator, "dp-1") == ("8", "8"))
    assert wait_for(lambda: (mismatch(emulator, "dp-1") or ("",))[0] == "False")


def test_the_node_object_reaches_the_agent_maintenance_conditions_included(fleet):
    fleet, emulator, admin = fleet
    host = fleet.nodes["dp-1"].agent.host
    assert wait_for(lambda: host.node_status() is not None and host.node_status().count("nvidia.com/gpu") == 8)
    assert host.node_status().maintenance() == ""
    admin.patch_node_status("dp-1", {"status": {"conditions": [
        {"type": "MaintenanceInProgress", "status": "True", "reason": "FirmwareUpdate"}]}})
    assert wait_for(lambda: host.node_status().maintenance() == "MaintenanceInProgress=True (FirmwareUpdate)")
