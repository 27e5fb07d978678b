"""The emulator's core/v1 API as the official Kubernetes client sees it: nodes, the status
subresource, patches, optimistic concurrency, validation, events, discovery and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
from kubernetes import client, config

from conftest import REPO, Clock
from kube_emulator import Emulator
from kube_emulator.cli import main as cli_main

SA = "system:serviceaccount:gpu-npd:gpu-npd"
KUBELET_TYPES = ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"]) as emu:
        yield emu


def api(emu: Emulator, tmp_path: Path, user: str = "admin") -> client.CoreV1Api:
    path = emu.write_kubeconfig(tmp_path / f"{user.replace(':', '_')}.kubeconfig", user=user)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


@pytest.fixture
def admin(emulator, tmp_path) -> client.CoreV1Api:
    return api(emulator, tmp_path)


@pytest.fixture
def sa(emulator, tmp_path) -> client.CoreV1Api:
    return api(emulator, tmp_path, SA)


def status_of(e: client.ApiException) -> dict:
    return json.loads(e.body)


def raw(emu: Emulator, method: str, path: str, body: bytes | None = None, user: str = "admin",
        content_type: str = "application/json") -> tuple[int, dict | str]:
    req = urllib.request.Request(emu.url + path, data=body, method=method, headers={
        "Authorization": f"Bearer {emu.token_for(user)}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            code, text, ctype = resp.status, resp.read().decode(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        code, text, ctype = e.code, e.read().decode(), e.headers["Content-Type"]
    return code, json.loads(text) if ctype.startswith("application/json") else text


def conditions(node: client.V1Node) -> dict[str, client.V1NodeCondition]:
    return {c.type: c for c in node.status.conditions}


# --- Nodes ----------------------------------------------------------------------------------------

def test_create_get_list_nodes_through_the_client(emulator, admin):
    created = admin.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="gpu-1", labels={"pool": "h100"})))
    assert created.metadata.uid and created.metadata.resource_version.isdigit()
    assert created.metadata.creation_timestamp.tzinfo is not None
    emulator.create_node("gpu-2", labels={"pool": "a100"})
    emulator.create_node("cpu-1")

    got = admin.read_node("gpu-2")
    assert [c.type for c in got.status.conditions] == KUBELET_TYPES
    assert conditions(got)["Ready"].reason == "KubeletReady"
    assert conditions(got)["MemoryPressure"].reason == "KubeletHasSufficientMemory"

    listed = admin.list_node()
    assert [n.metadata.name for n in listed.items] == ["cpu-1", "gpu-1", "gpu-2"]
    assert int(listed.metadata.resource_version) >= int(got.metadata.resource_version)
    assert [n.metadata.name for n in admin.list_node(label_selector="pool=h100").items] == ["gpu-1"]
    assert [n.metadata.name for n in admin.list_node(label_selector="pool").items] == ["gpu-1", "gpu-2"]
    assert [n.metadata.name for n in admin.list_node(label_selector="!pool").items] == ["cpu-1"]
    assert [n.metadata.name for n in admin.list_node(label_selector="pool!=h100,pool").items] == ["gpu-2"]
    assert [n.metadata.name for n in admin.list_node(label_selector="pool in (a100, v100)").items] == ["gpu-2"]


def test_list_pages_with_limit_and_continue(emulator, admin):
    for i in range(5):
        emulator.create_node(f"n{i}")
    first = admin.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"]
    assert first.metadata.remaining_item_count == 3
    second = admin.list_node(limit=2, _continue=first.metadata._continue)
    third = admin.list_node(limit=2, _continue=second.metadata._continue)
    assert [n.metadata.name for n in second.items + third.items] == ["n2", "n3", "n4"]
    assert third.metadata._continue is None


def test_strategic_merge_of_one_condition_keeps_kubelet_conditions(emulator, sa):
    before = emulator.create_node("n1")
    now = datetime.now(timezone.utc).replace(microsecond=0)
    patch = {"status": {"conditions": [{"type": "GpuHealthy", "status": "False", "reason": "XidFatal",
                                        "message": "XID 79 on GPU 3", "lastHeartbeatTime": now,
                                        "lastTransitionTime": now}]}}
    node = sa.patch_node_status("n1", patch)
    assert [c.type for c in node.status.conditions] == KUBELET_TYPES + ["GpuHealthy"]
    kubelet_before = [c for c in before["status"]["conditions"]]
    assert emulator.node("n1")["status"]["conditions"][:4] == kubelet_before
    assert int(node.metadata.resource_version) > int(before["metadata"]["resourceVersion"])

    patch["status"]["conditions"][0].update(status="True", reason="GpuOk", message="all good")
    node = sa.patch_node_status("n1", patch)
    assert [c.type for c in node.status.conditions] == KUBELET_TYPES + ["GpuHealthy"]
    assert (conditions(node)["GpuHealthy"].status, conditions(node)["GpuHealthy"].reason) == ("True", "GpuOk")
    assert conditions(node)["GpuHealthy"].last_heartbeat_time == now


def test_patch_delete_directive_removes_one_condition(emulator, sa):
    emulator.create_node("n1")
    sa.patch_node_status("n1", {"status": {"conditions": [{"type": "GpuHealthy", "status": "True"}]}})
    node = sa.patch_node_status("n1", {"status": {"conditions": [{"type": "GpuHealthy", "$patch": "delete"}]}})
    assert [c.type for c in node.status.conditions] == KUBELET_TYPES


def test_merge_patch_replaces_lists_and_json_patch_edits_them(emulator, admin):
    emulator.create_node("n1")
    node = admin.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                                   _content_type="application/merge-patch+json")
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "False")]

    node = admin.patch_node_status("n1", [
        {"op": "test", "path": "/status/conditions/0/type", "value": "Ready"},
        {"op": "add", "path": "/status/conditions/-", "value": {"type": "GpuHealthy", "status": "True"}},
        {"op": "replace", "path": "/status/conditions/0/status", "value": "Unknown"}])
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "Unknown"), ("GpuHealthy", "True")]

    with pytest.raises(client.ApiException) as err:
        admin.patch_node_status("n1", [{"op": "test", "path": "/status/conditions/0/type", "value": "Nope"}])
    assert err.value.status == 422 and status_of(err.value)["reason"] == "Invalid"

    node = admin.patch_node("n1", {"metadata": {"labels": {"kubernetes.io/os": None, "gpu": "yes"}}},
                            _content_type="application/merge-patch+json")
    assert "kubernetes.io/os" not in node.metadata.labels and node.metadata.labels["gpu"] == "yes"


def test_status_changes_through_the_main_resource_are_ignored(emulator, admin):
    emulator.create_node("n1")
    node = admin.patch_node("n1", {"metadata": {"labels": {"a": "b"}}, "spec": {"unschedulable": True},
                                   "status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert node.metadata.labels["a"] == "b" and node.spec.unschedulable is True
    assert conditions(node)["Ready"].status == "True"

    body = emulator.node("n1")
    body["status"]["conditions"] = []
    body["metadata"]["labels"]["c"] = "d"
    node = admin.replace_node("n1", body)
    assert node.metadata.labels["c"] == "d" and len(node.status.conditions) == 4

    body = emulator.node("n1")
    body["spec"]["unschedulable"] = False
    body["status"]["conditions"] = body["status"]["conditions"][:1]
    node = admin.replace_node_status("n1", body)
    assert len(node.status.conditions) == 1 and node.spec.unschedulable is True


def test_stale_resource_version_is_a_conflict(emulator, admin):
    stale = emulator.create_node("n1")["metadata"]["resourceVersion"]
    admin.patch_node("n1", {"metadata": {"labels": {"x": "1"}}})
    for call in (lambda: admin.patch_node("n1", {"metadata": {"resourceVersion": stale, "labels": {"x": "2"}}}),
                 lambda: admin.replace_node("n1", {**emulator.node("n1"), "metadata": {
                     **emulator.node("n1")["metadata"], "resourceVersion": stale}})):
        with pytest.raises(client.ApiException) as err:
            call()
        assert err.value.status == 409
        status = status_of(err.value)
        assert status["reason"] == "Conflict"
        assert status["message"] == ('Operation cannot be fulfilled on nodes "n1": the object has been modified; '
                                     'please apply your changes to the latest version and try again')
    current = emulator.node("n1")["metadata"]["resourceVersion"]
    node = admin.patch_node("n1", {"metadata": {"resourceVersion": current, "labels": {"x": "3"}}})
    assert node.metadata.labels["x"] == "3"


def test_noop_patch_keeps_resource_version_and_every_change_bumps_it(emulator, admin):
    rv = emulator.create_node("n1")["metadata"]["resourceVersion"]
    assert admin.patch_node("n1", {"metadata": {"labels": {"kubernetes.io/os": "linux"}}}).metadata.resource_version == rv
    rv2 = admin.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}).metadata.resource_version
    assert int(rv2) > int(rv)


def test_create_conflicts_and_generate_name(emulator, admin):
    emulator.create_node("n1")
    with pytest.raises(client.ApiException) as err:
        admin.create_node({"metadata": {"name": "n1"}})
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
    assert status_of(err.value)["message"] == 'nodes "n1" already exists'
    made = admin.create_node({"metadata": {"generateName": "gpu-"}})
    assert made.metadata.name.startswith("gpu-") and len(made.metadata.name) == len("gpu-") + 5


def test_validation_fails_with_422_and_causes(emulator, admin):
    with pytest.raises(client.ApiException) as err:
        admin.create_node({"metadata": {"name": "Bad_Name"}})
    status = status_of(err.value)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"].startswith('Node "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": '
                                        'a lowercase RFC 1123 subdomain')
    assert [c["field"] for c in status["details"]["causes"]] == ["metadata.name"]

    emulator.create_node("n1")
    bad = {"status": {"conditions": [{"type": "GpuHealthy", "status": "Maybe"},
                                     {"type": "Other", "status": "True", "lastHeartbeatTime": "yesterday"}]}}
    with pytest.raises(client.ApiException) as err:
        admin.patch_node_status("n1", bad)
    fields = {c["field"]: c["message"] for c in status_of(err.value)["details"]["causes"]}
    assert set(fields) == {"status.conditions[4].status", "status.conditions[5].lastHeartbeatTime"}
    assert fields["status.conditions[4].status"].startswith('Unsupported value: "Maybe"')

    with pytest.raises(client.ApiException) as err:
        admin.patch_node_status("n1", {"status": {"conditions": [{"status": "True"}]}},
                                _content_type="application/merge-patch+json")
    assert status_of(err.value)["details"]["causes"][0]["field"] == "status.conditions[0].type"

    with pytest.raises(client.ApiException) as err:
        admin.patch_node_status("n1", [{"op": "add", "path": "/status/conditions/-",
                                        "value": {"type": "Ready", "status": "True"}}])
    assert status_of(err.value)["details"]["causes"][0]["field"] == "status.conditions[4].type"
    assert emulator.node("n1")["status"]["conditions"] == emulator.node("n1")["status"]["conditions"][:4]


def test_unknown_token_is_401(emulator, tmp_path):
    path = emulator.write_kubeconfig(tmp_path / "kc", user="admin")
    path.write_text(path.read_text().replace(emulator.token_for("admin"), "not-a-token"))
    bad = client.CoreV1Api(config.new_client_from_config(config_file=str(path)))
    with pytest.raises(client.ApiException) as err:
        bad.read_node("n1")
    assert err.value.status == 401
    assert status_of(err.value)["reason"] == "Unauthorized"


def test_not_found_delete_and_unknown_paths(emulator, admin):
    with pytest.raises(client.ApiException) as err:
        admin.read_node("ghost")
    assert err.value.status == 404 and status_of(err.value)["message"] == 'nodes "ghost" not found'
    emulator.create_node("n1")
    assert admin.delete_node("n1")["status"] == "Success"
    assert emulator.nodes() == []
    code, body = raw(emulator, "GET", "/apis/apps/v1/deployments")
    assert code == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
    code, body = raw(emulator, "POST", "/api/v1/nodes/n1", b"{}")
    assert code == 405 and body["reason"] == "MethodNotAllowed"


def test_unsupported_patch_type_is_415(emulator):
    emulator.create_node("n1")
    code, body = raw(emulator, "PATCH", "/api/v1/nodes/n1", b"{}", content_type="application/json")
    assert code == 415 and body["reason"] == "UnsupportedMediaType"


def test_discovery_and_health(emulator, admin):
    assert client.VersionApi(admin.api_client).get_code().git_version.startswith("v1.")
    resources = {r.name for r in admin.get_api_resources().resources}
    assert {"nodes", "nodes/status", "events"} <= resources
    assert client.CoreApi(admin.api_client).get_api_versions().versions == ["v1"]
    with urllib.request.urlopen(emulator.url + "/healthz", timeout=5) as resp:
        assert resp.read() == b"ok"


# --- Events ---------------------------------------------------------------------------------------

def node_event(name: str, node: str, reason: str, namespace: str = "default") -> client.CoreV1Event:
    now = datetime.now(timezone.utc)
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        involved_object=client.V1ObjectReference(kind="Node", name=node, uid=node),
        reason=reason, message=f"{reason} on {node}", type="Warning", count=1,
        first_timestamp=now, last_timestamp=now, source=client.V1EventSource(component="gpu-npd", host=node))


def test_events_create_patch_and_list_with_field_selector(emulator, sa, admin):
    sa.create_namespaced_event("default", node_event("n1.xid", "n1", "XidFatal"))
    sa.create_namespaced_event("default", node_event("n2.xid", "n2", "XidFatal"))
    sa.create_namespaced_event("default", node_event("n1.pcie", "n1", "PcieDegraded"))
    patched = sa.patch_namespaced_event("n1.xid", "default", {"count": 2, "message": "again"})
    assert patched.count == 2 and patched.reason == "XidFatal"

    on_n1 = admin.list_namespaced_event("default", field_selector="involvedObject.name=n1")
    assert sorted(e.metadata.name for e in on_n1.items) == ["n1.pcie", "n1.xid"]
    xid_on_n1 = admin.list_namespaced_event("default", field_selector="involvedObject.name=n1,reason=XidFatal")
    assert [(e.metadata.name, e.count) for e in xid_on_n1.items] == [("n1.xid", 2)]
    assert len(admin.list_event_for_all_namespaces(field_selector="reason!=XidFatal").items) == 1
    assert [e["metadata"]["name"] for e in emulator.events("default")] == ["n1.pcie", "n1.xid", "n2.xid"]
    assert emulator.events("elsewhere") == []

    with pytest.raises(client.ApiException) as err:
        admin.list_namespaced_event("default", field_selector="color=blue")
    assert err.value.status == 400

    replaced = admin.replace_namespaced_event("n3.xid", "default", node_event("n3.xid", "n3", "XidFatal"))
    assert replaced.metadata.uid and admin.read_namespaced_event("n3.xid", "default").reason == "XidFatal"
    assert admin.delete_namespaced_event("n3.xid", "default")["status"] == "Success"
    assert [e["metadata"]["name"] for e in emulator.events()] == ["n1.pcie", "n1.xid", "n2.xid"]


def test_event_validation(emulator, admin):
    with pytest.raises(client.ApiException) as err:
        admin.create_namespaced_event("default", {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Node"},
                                                  "count": -1})
    fields = {c["field"] for c in status_of(err.value)["details"]["causes"]}
    assert fields == {"reason", "count"}
    # A node is cluster-scoped: Kubernetes only accepts its (legacy) events in "default".
    with pytest.raises(client.ApiException) as err:
        admin.create_namespaced_event("gpu-npd", node_event("e2", "n1", "XidFatal", namespace="gpu-npd"))
    assert status_of(err.value)["details"]["causes"][0]["field"] == "involvedObject.namespace"


# --- Convenience API, isolation, concurrency, CLI --------------------------------------------------

def test_set_node_condition_moves_transition_time_only_on_change():
    clock = Clock()
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], clock=clock) as emu:
        emu.create_node("n1")
        clock.now += 60
        ready = {c["type"]: c for c in emu.set_node_condition("n1", {"type": "Ready", "status": "True"})
                 ["status"]["conditions"]}["Ready"]
        assert ready["lastHeartbeatTime"] == "2023-11-14T22:14:20Z"
        assert ready["lastTransitionTime"] == "2023-11-14T22:13:20Z"
        assert ready["reason"] == "KubeletReady"
        clock.now += 60
        node = emu.set_node_condition("n1", {"type": "Ready", "status": "False", "reason": "KubeletNotReady"})
        ready = {c["type"]: c for c in node["status"]["conditions"]}["Ready"]
        assert ready["lastTransitionTime"] == "2023-11-14T22:15:20Z" and ready["reason"] == "KubeletNotReady"


def test_two_emulators_in_one_process_are_independent(emulator):
    with Emulator(rbac_paths=[REPO / "deploy" / "base"]) as other:
        emulator.create_node("only-here")
        assert other.nodes() == [] and other.url != emulator.url
        assert other.token_for("admin") != emulator.token_for("admin")


def test_concurrent_status_patches_lose_no_update(emulator):
    emulator.create_node("n1")
    token = emulator.token_for(SA)

    def patch(i: int) -> None:
        req = urllib.request.Request(
            f"{emulator.url}/api/v1/nodes/n1/status", method="PATCH",
            data=json.dumps({"status": {"conditions": [{"type": f"Gpu{i}", "status": "True"}]}}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/strategic-merge-patch+json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200

    threads = [threading.Thread(target=patch, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    types = [c["type"] for c in emulator.node("n1")["status"]["conditions"]]
    assert len(types) == 44 and set(types) >= {f"Gpu{i}" for i in range(40)}
    assert emulator.request_count(verb="patch", resource="nodes/status", code=200) == 40


def test_cli_serves_until_sigterm(tmp_path):
    kubeconfig, admin_kubeconfig = tmp_path / "sa.yaml", tmp_path / "admin.yaml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kube_emulator", "--listen", "127.0.0.1:0", "--kubeconfig-out", str(kubeconfig),
         "--admin-kubeconfig-out", str(admin_kubeconfig), "--node", "n1", "--node", "n2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        sa = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        assert sa.read_node("n2").metadata.name == "n2"
        assert [n.metadata.name for n in sa.list_node().items] == ["n1", "n2"]      # its node watch lists
        with pytest.raises(client.ApiException) as err:
            sa.list_pod_for_all_namespaces()
        assert err.value.status == 403
        admin = client.CoreV1Api(config.new_client_from_config(config_file=str(admin_kubeconfig)))
        assert [n.metadata.name for n in admin.list_node().items] == ["n1", "n2"]
        assert admin.api_client.configuration.host == url
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert stderr.count("listening on") == 1


def test_cli_missing_rbac_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["--rbac", str(tmp_path / "nope")]) == 2
    assert "RBAC path not found" in capsys.readouterr().err


def test_set_node_resources_changes_what_the_node_advertises_as_a_device_plugin_would():
    with Emulator() as emu:
        emu.create_node("gpu-r", capacity={"nvidia.com/gpu": "8"})
        node = emu.set_node_resources("gpu-r", {"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "7"})
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "7"
        stored = emu.node("gpu-r")["status"]
        assert stored["allocatable"]["nvidia.com/gpu"] == "7" and stored["capacity"]["nvidia.com/gpu"] == "8"
        assert stored["allocatable"]["cpu"] == "8"                    # the other resources are left as they are
