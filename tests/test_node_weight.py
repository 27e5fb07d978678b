"""Light on the Node (issue 34): gpu-npd writes a condition only once its problem was seen on the node, keeps
GpuNodeNeedsRemediation and GpuNodeUnverified always, keeps a cleared one False for a while, cleans an older
gpu-npd's never-seen False conditions, and never touches a condition it does not own. The byte bound is a
behaviour (what is written); the figures and the requests per node-hour are bench/node_weight.py's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import Clock
from detector.agent.active import ConditionStatus
from detector.core.types import Severity
from detector.daemon.local import REPO_DEPLOY, local_daemon
from detector.daemon.run import DaemonSettings
from detector.kube.api import KubeApi
from detector.kube.conditions import KEEP_CLEARED_S, MARKER, legacy_false
from detector.kube.reporter import ALWAYS_WRITTEN, KubeReporter, ReporterSettings
from detector.kube.stamps import rfc3339
from kube_emulator import Emulator
from test_kube_reporters import ScriptedApi, reporter, xid

TODAY_BYTES = 5167                 # gpu-npd's conditions on a healthy fake:h100-sxm-8 before issue 34
KUBELET = {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure"}
NODE = "gpu-w"


def compact(conditions: list[dict]) -> int:
    return len(json.dumps(conditions, separators=(",", ":")).encode())


def ours(node: dict, owned: set[str]) -> list[dict]:
    return [c for c in node["status"].get("conditions", []) if c["type"] in owned]


def test_a_healthy_eight_gpu_node_carries_at_most_half_of_todays_bytes(tmp_path):
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        settings = DaemonSettings(listen="127.0.0.1:0")
        settings.agent.start_spread_s = 0.0
        local = local_daemon("h100-sxm-8", NODE, settings=settings, emulator=emulator, workdir=tmp_path)
        kubelet_before = {c["type"]: c for c in emulator.node(NODE)["status"]["conditions"] if c["type"] in KUBELET}
        owned = set(local.daemon.agent.owned_types)
        local.start()
        try:
            assert local.wait_for(lambda: local.conditions().get("GpuNodeUnverified", {}).get("status") == "False"
                                  and local.settled(*(s.type for s in local.daemon.agent.conditions())), 60), \
                local.conditions()
            node = emulator.node(NODE)
        finally:
            local.stop()
    conditions = ours(node, owned)
    assert compact(conditions) <= TODAY_BYTES // 2, conditions
    assert {c["type"]: (c["status"], c["reason"]) for c in conditions} == {
        "GpuNodeNeedsRemediation": ("False", "NoGpuNodeNeedsRemediation"),
        "GpuNodeUnverified": ("False", "NoGpuNodeUnverified")}
    assert all(c["message"] == MARKER + "no problem found" for c in conditions)
    assert {c["type"]: c for c in node["status"]["conditions"] if c["type"] in KUBELET} == kubelet_before


# -- the reporter against the emulator: what the Node shows over time -------------------------------------

OWNED = ["GpuXidError", "GpuMissing", *ALWAYS_WRITTEN]


@pytest.fixture
def emulator():
    with Emulator() as emu:
        yield emu


def admin_api(emulator: Emulator, tmp_path: Path) -> KubeApi:
    return KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "admin.kubeconfig", user="admin")))


def healthy(type_: str) -> ConditionStatus:
    return ConditionStatus(type_, False, f"No{type_}", "no problem found")


def xid79() -> ConditionStatus:
    return ConditionStatus("GpuXidError", True, "Xid79GpuFellOffBus", "GPU 3 (0000:5d:00.0): XID 79",
                           Severity.CRITICAL, names_gpu=True)


def shown(emulator: Emulator, name: str = NODE) -> dict[str, dict]:
    return {c["type"]: c for c in emulator.node(name)["status"].get("conditions", [])}


def test_a_problem_once_seen_stays_false_after_its_cure_across_a_restart_then_goes(emulator, tmp_path):
    emulator.create_node(NODE)
    clock = Clock(emulator.clock())
    out = KubeReporter(admin_api(emulator, tmp_path), NODE, OWNED, clock=clock, rng=random.Random(1))
    out.conditions([xid79(), *map(healthy, ["GpuMissing", *ALWAYS_WRITTEN])])
    out.flush()
    out.flush()
    assert {t: c["status"] for t, c in shown(emulator).items() if t in OWNED} == {
        "GpuXidError": "True", "GpuNodeNeedsRemediation": "False", "GpuNodeUnverified": "False"}

    clock.now += 600
    out.conditions([healthy("GpuXidError")])                          # cured
    out.flush()
    cleared = shown(emulator)["GpuXidError"]
    assert (cleared["status"], cleared["reason"]) == ("False", "NoGpuXidError")
    assert cleared["lastTransitionTime"] == rfc3339(clock.now) and "GpuMissing" not in shown(emulator)

    clock.now += 3600                                                 # a new daemon: it reads the node first
    again = KubeReporter(admin_api(emulator, tmp_path), NODE, OWNED, clock=clock, rng=random.Random(2))
    again.conditions([*map(healthy, ["GpuXidError", "GpuMissing", *ALWAYS_WRITTEN])])
    again.flush()
    assert again.settled(OWNED)
    assert shown(emulator)["GpuXidError"]["lastTransitionTime"] == cleared["lastTransitionTime"]   # kept as it was

    clock.now += KEEP_CLEARED_S - 3600 - 1
    again.flush()                                                     # a heartbeat: still kept
    assert shown(emulator)["GpuXidError"]["status"] == "False"
    clock.now += 1
    assert again.due_at() <= clock.now                                # its time is up: due at once
    again.flush()
    assert "GpuXidError" not in shown(emulator)
    assert {t for t in shown(emulator) if t in OWNED} == set(ALWAYS_WRITTEN)


def test_an_upgrade_removes_only_an_older_gpu_npds_never_seen_false_conditions(emulator, tmp_path):
    """What an older gpu-npd wrote for every type is removed at the first write, judged or not; a True one,
    the always-written ones, kubelet's and anything not of gpu-npd's types (by its rules) stay."""
    old = [{"type": t, "status": "False", "reason": f"No{t}", "message": legacy_false(t)}
           for t in ["GpuMissing", "GpuNcclProbeFailed", *ALWAYS_WRITTEN]]
    emulator.create_node(NODE)                                             # kubelet's conditions
    for condition in [
        {"type": "GpuXidError", "status": "True", "reason": "Xid79GpuFellOffBus", "message": MARKER + "earlier"},
        *old,
        {"type": "VendorGpuCheck", "status": "False", "reason": "NoVendorGpuCheck",
         "message": "no VendorGpuCheck problem found"},                   # not gpu-npd's type, not its marker
        {"type": "GpuLookalike", "status": "False", "reason": "NoGpuLookalike",
         "message": "gpu-npd-like: no GpuLookalike problem found"},
    ]:
        emulator.set_node_condition(NODE, condition)
    before = shown(emulator)
    assert KUBELET <= set(before)
    owned = [*OWNED, "GpuNcclProbeFailed"]                                # nccl: a type whose check is off
    out = KubeReporter(admin_api(emulator, tmp_path), NODE, owned, clock=Clock(emulator.clock()),
                       rng=random.Random(1))
    out.flush()                                                            # reads the node, cleans it
    after = shown(emulator)
    assert set(before) - set(after) == {"GpuMissing", "GpuNcclProbeFailed"}
    assert {t: after[t] for t in after} == {t: before[t] for t in after}  # the rest untouched, kubelet's too

    out.conditions([*map(healthy, ["GpuXidError", "GpuMissing", *ALWAYS_WRITTEN])])
    out.flush()
    after = shown(emulator)
    assert {t: after[t]["status"] for t in after if t in owned} == {
        "GpuXidError": "False", "GpuNodeNeedsRemediation": "False", "GpuNodeUnverified": "False"}
    assert after["GpuNodeUnverified"]["message"] == MARKER + "no problem found"
    assert {t: after[t] for t in ("VendorGpuCheck", "GpuLookalike", *KUBELET)} == \
        {t: before[t] for t in ("VendorGpuCheck", "GpuLookalike", *KUBELET)}


def test_a_type_never_true_costs_no_request_and_one_seen_only_by_the_agent_is_still_written():
    api, clock = ScriptedApi(), Clock()
    out = reporter(api, clock)
    out.adopt(api.node)
    assert not out.update([xid(False)])                  # judged healthy, never seen: nothing to write
    assert out.flush() and api.calls == []
    clock.now += 3600
    assert out.flush() and api.calls == []               # no heartbeat without a condition to refresh
    assert out.settled(["GpuXidError"])

    out.update([xid(True)])                              # seen by the agent; the API server is away
    out.update([xid(False)])                             # ... cured before anything reached it
    assert out.flush()
    [[cleared]] = [body["status"]["conditions"] for verb, body in api.calls if verb == "patch-status"]
    assert (cleared["type"], cleared["status"]) == ("GpuXidError", "False")   # the node hears it was seen


def test_kubelets_and_the_maintenance_conditions_are_never_written_or_deleted(emulator, tmp_path):
    """Even were a type of theirs handed over as gpu-npd's (the rule loader refuses one), or a message of
    theirs to start like gpu-npd's."""
    emulator.create_node(NODE)
    emulator.set_node_condition(NODE, {"type": "MemoryPressure", "status": "False", "reason": "X",
                                       "message": MARKER + "planted"})
    emulator.set_node_condition(NODE, {"type": "MaintenanceInProgress", "status": "False", "reason": "Done",
                                       "message": "no MaintenanceInProgress problem found"})
    before = shown(emulator)
    out = KubeReporter(admin_api(emulator, tmp_path), NODE, ["Ready", "MaintenanceInProgress", *OWNED],
                       clock=Clock(emulator.clock()), rng=random.Random(1))
    out.conditions([healthy("Ready"), healthy("MaintenanceInProgress"), xid79()])
    out.flush()
    out.flush()
    after = shown(emulator)
    assert after["GpuXidError"]["status"] == "True"
    assert {t: after[t] for t in (*KUBELET, "MaintenanceInProgress")} == \
        {t: before[t] for t in (*KUBELET, "MaintenanceInProgress")}
