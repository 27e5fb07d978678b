"""DRA device taints (--dra-taints): the real Daemon on a fake 8-GPU node against the API emulator, which
serves ResourceSlices and DeviceTaintRules at one resource.k8s.io version and enforces deploy/'s RBAC."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from conftest import REPO, node_for
from detector.core.domain import key
from detector.daemon.local import REPO_DEPLOY, LocalDaemon, local_daemon, publish_gpu_slice
from detector.daemon.run import DaemonSettings
from detector.kube.device_taints import (
    MANAGED_BY,
    NODE_LABEL,
    TAINT_KEY,
    DeviceTaintSettings,
    dns_name,
    rule_name,
)
from fake_nvml.faults import Fault
from fake_nvml.node import FakeNode
from kube_emulator import Emulator

DRA_RBAC = REPO / "deploy" / "overlays" / "dra-taints" / "rbac.yaml"
FAST_CHECKS = {"visibility": {"interval": 0.5}, "pcie": {"interval": 0.5}, "xid": {"interval": 0.5}}
NODE = "gpu-1"


def settings(**dra: object) -> DaemonSettings:
    s = DaemonSettings(listen="127.0.0.1:0")
    s.agent.start_spread_s = 0.0
    s.reporter.backoff_base_s, s.reporter.backoff_cap_s = 0.01, 0.5
    s.dra_taints = DeviceTaintSettings(**{"backoff_base_s": 0.01, "backoff_cap_s": 0.5, "start_grace_s": 0.0,
                                          "qps": 50.0, "burst": 100, **dra})  # type: ignore[arg-type]
    return s


def rules(emulator: Emulator) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in emulator.device_taint_rules()}


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=(REPO_DEPLOY, DRA_RBAC)) as emu:
        yield emu


@pytest.fixture
def start(tmp_path):
    started: list[LocalDaemon] = []

    def go(emulator: Emulator, node: FakeNode | None = None, **kw) -> LocalDaemon:
        kw.setdefault("settings", settings())
        local = local_daemon("h100-sxm-8", NODE, emulator=emulator, workdir=tmp_path, check_settings=FAST_CHECKS,
                             checks=list(FAST_CHECKS), node=node, **kw).start()
        started.append(local)
        return local

    yield go
    for local in started:
        local.stop()


def healthy(local: LocalDaemon) -> bool:
    return all(c["status"] == "False" for t, c in local.conditions().items() if t.startswith("Gpu"))


def test_failed_gpu_noexecute_degraded_noschedule_recovery_deletes(emulator, start):
    node = node_for("h100-sxm-8", NODE)
    publish_gpu_slice(emulator, node)
    local = start(emulator, node)
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuXidError") and "GpuXidError" not in local.conditions())
    assert rules(emulator) == {}

    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    failed = rule_name(NODE, "gpu-3")
    assert failed == "gpu-npd-gpu-1-gpu-3"
    assert local.wait_for(lambda: failed in rules(emulator)), rules(emulator)
    rule = rules(emulator)[failed]
    assert rule["apiVersion"] == "resource.k8s.io/v1alpha3" and rule["kind"] == "DeviceTaintRule"
    assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}
    assert rule["spec"]["taint"] == {"key": "gpu-npd.io/gpu-unhealthy", "value": "failed", "effect": "NoExecute"}
    assert TAINT_KEY == key("gpu-unhealthy")
    assert rule["metadata"]["labels"] == {MANAGED_BY: "gpu-npd", NODE_LABEL: NODE}
    assert rule["metadata"]["annotations"][key("gpu")] == "0000:5d:00.0"

    local.node.inject(Fault("pcie", gpu=5, params={"width": 8}))
    degraded = rule_name(NODE, "gpu-5")
    assert local.wait_for(lambda: degraded in rules(emulator)), rules(emulator)
    assert rules(emulator)[degraded]["spec"]["taint"] == {"key": TAINT_KEY, "value": "degraded",
                                                          "effect": "NoSchedule"}
    assert set(rules(emulator)) == {failed, degraded}            # one rule per unhealthy GPU, no more

    local.node.inject(Fault("recover", gpu=5))
    assert local.wait_for(lambda: set(rules(emulator)) == {failed}), rules(emulator)
    local.node.inject(Fault("reboot"))                          # XID 79 is held until a reboot
    assert local.wait_for(lambda: rules(emulator) == {}), rules(emulator)
    assert local.daemon.device_taints is not None and local.daemon.device_taints.note == ""
    assert emulator.request_count(code=403) == 0 and emulator.request_count(code=422) == 0


def test_effects_are_configurable_and_none_means_no_taint(emulator, start):
    node = node_for("h100-sxm-8", NODE)
    publish_gpu_slice(emulator, node, bus_id_only=frozenset({2}))          # GPU 2 is found by its PCI bus id
    local = start(emulator, node, settings=settings(failed_effect="NoSchedule", degraded_effect=None))
    local.node.inject(Fault("pcie", gpu=1, params={"width": 8}))
    local.node.inject(Fault("xid", gpu=2, params={"code": 79}))
    name = rule_name(NODE, "gpu-2")
    assert local.wait_for(lambda: name in rules(emulator)), rules(emulator)
    assert rules(emulator)[name]["spec"]["taint"]["effect"] == "NoSchedule"
    assert local.wait_for(lambda: local.conditions().get("GpuPcieDegraded", {}).get("status") == "True")
    time.sleep(0.5)
    assert set(rules(emulator)) == {name}                              # degraded: None, no taint


def test_restart_neither_duplicates_nor_orphans(emulator, start, tmp_path):
    node = node_for("h100-sxm-8", NODE)
    publish_gpu_slice(emulator, node)
    state = tmp_path / "state"
    first = start(emulator, node, state_dir=state)
    first.node.inject(Fault("xid", gpu=2, params={"code": 79}))
    name = rule_name(NODE, "gpu-2")
    assert first.wait_for(lambda: name in rules(emulator))
    uid = rules(emulator)[name]["metadata"]["uid"]
    first.daemon.stop.set()
    assert first.thread is not None
    first.thread.join(10)

    # A stale rule of this node (a GPU that recovered while gpu-npd was down), one of another node, and
    # one this gpu-npd does not own: only the first goes.
    labels = {MANAGED_BY: "gpu-npd", NODE_LABEL: NODE}
    spec = {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-6"},
            "taint": {"key": TAINT_KEY, "value": "degraded", "effect": "NoSchedule"}}
    emulator.create_device_taint_rule({"metadata": {"name": rule_name(NODE, "gpu-6"), "labels": labels}, "spec": spec})
    emulator.create_device_taint_rule({"metadata": {"name": rule_name("gpu-2", "gpu-6"),
                                                    "labels": {**labels, NODE_LABEL: "gpu-2"}}, "spec": spec})
    emulator.create_device_taint_rule({"metadata": {"name": "someone-elses"}, "spec": spec})

    second = start(emulator, first.node, state_dir=state)       # XID 79 is held across the restart
    assert second.wait_for(lambda: rule_name(NODE, "gpu-6") not in rules(emulator)), rules(emulator)
    time.sleep(0.5)
    assert set(rules(emulator)) == {name, rule_name("gpu-2", "gpu-6"), "someone-elses"}
    assert rules(emulator)[name]["metadata"]["uid"] == uid       # the same object: not deleted, not duplicated
    assert emulator.request_count(verb="create", resource="devicetaintrules.resource.k8s.io") == 1   # the first run's only


def message(local: LocalDaemon, type_: str) -> str:
    return local.conditions().get(type_, {}).get("message", "")


def test_no_resource_slice_no_rule_one_message(emulator, start, caplog):
    caplog.set_level(logging.INFO, logger="gpu_npd.dra")
    local = start(emulator, settings=settings(slice_relist_s=0.2))
    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    sink = local.daemon.device_taints
    assert sink is not None
    assert local.wait_for(lambda: "no ResourceSlice" in sink.note), sink.note
    local.node.inject(Fault("pcie", gpu=5, params={"width": 8}))
    assert local.wait_for(lambda: local.conditions().get("GpuPcieDegraded", {}).get("status") == "True")
    time.sleep(0.5)
    assert rules(emulator) == {}
    text = (f"DRA device taints: node {NODE} has no ResourceSlice of driver gpu.nvidia.com (is the NVIDIA DRA "
            "driver running here?): no GPU is tainted")
    said = [r.getMessage() for r in caplog.records if "no ResourceSlice" in r.getMessage()]
    assert said == [text]                                               # once in the log, though retried
    # ... and in the message of each condition naming an unhealthy GPU, while it holds
    assert local.wait_for(lambda: message(local, "GpuXidError").endswith(" | " + text)), message(local, "GpuXidError")
    assert local.wait_for(lambda: message(local, "GpuPcieDegraded").endswith(" | " + text))
    false = [c["message"] for c in local.conditions().values() if c["status"] == "False"]
    assert false and not any(text in m for m in false)                  # a false condition says nothing of it

    publish_gpu_slice(emulator, local.node)                             # the DRA driver starts on the node
    assert local.wait_for(lambda: set(rules(emulator)) == {rule_name(NODE, "gpu-3"), rule_name(NODE, "gpu-5")})
    assert local.wait_for(lambda: "ResourceSlice" not in message(local, "GpuXidError")), message(local, "GpuXidError")
    assert "ResourceSlice" not in message(local, "GpuPcieDegraded") and sink.note == ""


def test_base_rbac_only_one_error_and_conditions_still_reported(start, caplog):
    caplog.set_level(logging.INFO)
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        node = node_for("h100-sxm-8", NODE)
        publish_gpu_slice(emulator, node)
        local = start(emulator, node, settings=settings(refused_retry_s=0.2))
        local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
        assert local.wait_for(lambda: local.conditions().get("GpuXidError", {}).get("status") == "True")
        assert local.wait_for(lambda: any(e["reason"].startswith("Xid79") for e in local.events()))
        assert local.wait_for(lambda: emulator.request_count(code=403) >= 3)      # retried, rarely
        assert rules(emulator) == {}
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors
        assert "forbids gpu-npd to list devicetaintrules" in errors[0] and "deploy/overlays/dra-taints" in errors[0]
        assert local.wait_for(lambda: local.conditions()["GpuXidError"]["message"].endswith(
            " | DRA device taints: not permitted to list devicetaintrules (403)"))
        assert local.daemon.readiness() == (True, "ok")           # reports reach the API server
        local.stop()


def test_version_discovery_picks_v1beta2(start):
    with Emulator(rbac_paths=(REPO_DEPLOY, DRA_RBAC), dra_version="v1beta2") as emulator:
        node = node_for("h100-sxm-8", NODE)
        publish_gpu_slice(emulator, node)
        local = start(emulator, node)
        local.node.inject(Fault("xid", gpu=0, params={"code": 79}))
        name = rule_name(NODE, "gpu-0")
        assert local.wait_for(lambda: name in rules(emulator)), rules(emulator)
        assert rules(emulator)[name]["apiVersion"] == "resource.k8s.io/v1beta2"
        assert local.daemon.device_taints is not None and local.daemon.device_taints.rule_version == "v1beta2"
        assert emulator.request_count(resource="devicetaintrules.resource.k8s.io", code=404) == 0
        local.stop()


def test_no_device_taint_rules_served_said_once_and_nothing_done(start, caplog):
    caplog.set_level(logging.INFO, logger="gpu_npd.dra")
    with Emulator(rbac_paths=(REPO_DEPLOY, DRA_RBAC), dra_version=None) as emulator:
        local = start(emulator)
        local.node.inject(Fault("xid", gpu=0, params={"code": 79}))
        sink = local.daemon.device_taints
        assert sink is not None
        assert local.wait_for(lambda: sink.off)
        assert local.wait_for(lambda: local.conditions().get("GpuXidError", {}).get("status") == "True")
        time.sleep(0.3)
        said = [r.getMessage() for r in caplog.records if "serves no DeviceTaintRule" in r.getMessage()]
        assert len(said) == 1 and "versions: none" in said[0]
        assert emulator.request_count(resource="devicetaintrules.resource.k8s.io") == 0
        local.stop()


def test_names_are_dns_safe_and_short():
    assert rule_name("gpu-1", "gpu-3") == "gpu-npd-gpu-1-gpu-3"
    long = rule_name("a-very-long-node-name.with.dots.example.com-" + "x" * 60, "gpu-7")
    assert len(long) <= 63 and long == dns_name("gpu-npd-a-very-long-node-name.with.dots.example.com-" + "x" * 60
                                                + "-gpu-7")
    assert long != rule_name("a-very-long-node-name.with.dots.example.com-" + "x" * 60, "gpu-6")
    assert dns_name("Node_1.Example") == "node-1-example"


def test_emulator_resource_kinds_validate_and_enforce_rbac(emulator):
    import json
    import urllib.error
    import urllib.request

    def call(method: str, path: str, body: dict | None = None, user: str = "admin") -> tuple[int, dict]:
        request = urllib.request.Request(emulator.url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {emulator.token_for(user)}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    base = "/apis/resource.k8s.io/v1alpha3/devicetaintrules"
    bad = {"metadata": {"name": "x"}, "spec": {"taint": {"key": "k", "effect": "PreferNoSchedule"}}}
    code, status = call("POST", base, bad)
    assert code == 422 and "spec.taint.effect" in status["message"]
    good = {"metadata": {"name": "x"}, "spec": {"taint": {"key": "example.com/k", "effect": "NoSchedule"}}}
    assert call("POST", base, good)[0] == 201
    sa = "system:serviceaccount:gpu-npd:gpu-npd"
    assert call("GET", base, user=sa)[0] == 200
    assert call("PATCH", f"{base}/x", {}, user=sa)[0] == 403                 # the overlay grants no patch
    assert call("GET", "/apis/resource.k8s.io/v1alpha3/resourceslices", user=sa)[0] == 200
    assert call("DELETE", f"{base}/x", user=sa)[0] == 200
    assert call("GET", "/apis/resource.k8s.io/v1beta2")[0] == 404             # one version per emulator
    groups = {g["name"] for g in call("GET", "/apis")[1]["groups"]}
    assert "resource.k8s.io" in groups
    assert Path(DRA_RBAC).is_file()
