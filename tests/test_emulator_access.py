"""What the emulator answers beyond plain CRUD: server-side dry run, impersonation, access reviews,
404 Status bodies, discovery, pods, server-side Tables, HTTPS, and the kubeconfig and CLI for them."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from kube_emulator import Emulator
from kube_emulator.protobuf import MAGIC, decode_access_review
from kube_emulator.rbac import ADMIN
from kube_emulator.table import human_duration

SA = "system:serviceaccount:gpu-npd:gpu-npd"
MERGE = "application/merge-patch+json"


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"]) as emu:
        emu.create_node("gpu-1")
        yield emu


def call(emu: Emulator, method: str, path: str, body: Any = None, user: str = ADMIN,
         content_type: str = "application/json", headers: dict[str, str] | None = None,
         raw: bytes | None = None, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(emu.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {emu.token_for(user)}", "Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status_is(body: dict, code: int, reason: str) -> bool:
    return (body.get("kind"), body.get("apiVersion"), body.get("status"), body.get("code"),
            body.get("reason")) == ("Status", "v1", "Failure", code, reason)


# --- Server-side dry run ------------------------------------------------------------------------------

def test_dry_run_patch_and_update_are_answered_not_stored(emulator):
    before, last_change = emulator.node("gpu-1"), emulator.store.changes.last_rv
    code, patched = call(emulator, "PATCH", "/api/v1/nodes/gpu-1?dryRun=All",
                         {"metadata": {"annotations": {"a": "b"}}}, content_type=MERGE)
    assert code == 200 and patched["metadata"]["annotations"] == {"a": "b"}
    code, updated = call(emulator, "PUT", "/api/v1/nodes/gpu-1?dryRun=All",
                         {**before, "metadata": {**before["metadata"], "labels": {"x": "y"}}})
    assert code == 200 and updated["metadata"]["labels"] == {"x": "y"}
    code, status = call(emulator, "PATCH", "/api/v1/nodes/gpu-1/status?dryRun=All",
                        {"status": {"conditions": [{"type": "GpuHealthy", "status": "Maybe"}]}}, content_type=MERGE)
    assert code == 422 and status_is(status, 422, "Invalid")             # validated all the same
    assert emulator.node("gpu-1") == before
    assert emulator.store.changes.last_rv == last_change                 # no change recorded for watches


def test_dry_run_create_and_delete(emulator):
    node = {"metadata": {"name": "gpu-9"}}
    code, created = call(emulator, "POST", "/api/v1/nodes?dryRun=All", node)
    assert code == 201 and created["metadata"]["uid"] and "resourceVersion" not in created["metadata"]
    assert call(emulator, "GET", "/api/v1/nodes/gpu-9")[0] == 404
    code, _ = call(emulator, "POST", "/api/v1/nodes?dryRun=All", {"metadata": {"name": "gpu-1"}})
    assert code == 409                                                    # still checked against what exists
    assert call(emulator, "DELETE", "/api/v1/nodes/gpu-1?dryRun=All")[0] == 200
    assert call(emulator, "DELETE", "/api/v1/nodes/gpu-1", {"dryRun": ["All"]})[0] == 200   # DeleteOptions
    assert emulator.node("gpu-1")["metadata"]["name"] == "gpu-1"


def test_unknown_dry_run_values_are_refused_never_acted_on(emulator):
    before = emulator.node("gpu-1")
    for value in ("true", "1", "None", "all"):
        code, status = call(emulator, "PATCH", f"/api/v1/nodes/gpu-1?dryRun={value}",
                            {"metadata": {"annotations": {"a": "b"}}}, content_type=MERGE)
        assert code == 400 and status_is(status, 400, "BadRequest") and "dryRun" in status["message"], value
    assert call(emulator, "DELETE", "/api/v1/nodes/gpu-1?dryRun=yes")[0] == 400
    assert emulator.node("gpu-1") == before


def test_dry_run_needs_the_same_rbac_as_the_real_thing(emulator):
    code, status = call(emulator, "DELETE", "/api/v1/nodes/gpu-1?dryRun=All", user=SA)
    assert code == 403 and status_is(status, 403, "Forbidden")
    code, _ = call(emulator, "PATCH", "/api/v1/nodes/gpu-1/status?dryRun=All",
                   {"status": {"conditions": [{"type": "GpuHealthy", "status": "True"}]}}, user=SA, content_type=MERGE)
    assert code == 200 and "GpuHealthy" not in [c["type"] for c in emulator.node("gpu-1")["status"]["conditions"]]


# --- Impersonation -------------------------------------------------------------------------------

def test_impersonation_without_the_impersonate_verb_is_403(emulator):
    code, status = call(emulator, "GET", "/api/v1/nodes", user=SA, headers={"Impersonate-User": ADMIN})
    assert code == 403 and status_is(status, 403, "Forbidden")
    assert status["message"] == (f'users "admin" is forbidden: User "{SA}" cannot impersonate resource "users" in '
                                 'API group "" at the cluster scope')
    code, status = call(emulator, "GET", "/api/v1/nodes", user=SA,
                        headers={"Impersonate-User": SA, "Impersonate-Group": "system:masters"})
    assert code == 403 and 'cannot impersonate resource "serviceaccounts"' in status["message"]
    code, status = call(emulator, "GET", "/api/v1/nodes", headers={"Impersonate-Group": "system:masters"})
    assert code == 400 and status_is(status, 400, "BadRequest")


def test_admin_impersonating_the_daemon_gets_the_daemons_rights(emulator):
    as_sa = {"Impersonate-User": SA}
    assert call(emulator, "GET", "/api/v1/nodes/gpu-1", headers=as_sa)[0] == 200
    assert call(emulator, "GET", "/api/v1/nodes", headers=as_sa)[0] == 200      # its node watch lists nodes
    code, status = call(emulator, "GET", "/api/v1/pods", headers=as_sa)
    assert code == 403 and f'User "{SA}" cannot list resource "pods"' in status["message"]
    code, review = call(emulator, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", {}, headers={
        "Impersonate-User": "jane", "Impersonate-Group": "team-a,team-b"})
    assert code == 201
    assert review["status"]["userInfo"] == {"username": "jane",
                                            "groups": ["team-a", "team-b", "system:authenticated"]}


def test_rbac_granting_impersonate_allows_it(tmp_path):
    (tmp_path / "rbac.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "support"},
         "rules": [{"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"], "resourceNames": ["jane"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "support"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "support"},
         "subjects": [{"kind": "User", "name": "helpdesk"}]}]))
    with Emulator(rbac_paths=[tmp_path / "rbac.yaml"]) as emu:
        code, status = call(emu, "GET", "/api/v1/nodes", user="helpdesk", headers={"Impersonate-User": "jane"})
        assert code == 403 and status["message"].endswith('User "jane" cannot list resource "nodes" in API group "" '
                                                          "at the cluster scope")     # acting as jane now
        code, status = call(emu, "GET", "/api/v1/nodes", user="helpdesk", headers={"Impersonate-User": "joe"})
        assert code == 403 and 'User "helpdesk" cannot impersonate' in status["message"]


# --- Access reviews -----------------------------------------------------------------------------------

def access_review(verb: str, resource: str, subresource: str = "", group: str = "") -> dict:
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "subresource": subresource,
                                            "group": group}}}


def test_self_subject_access_review_answers_for_the_caller(emulator):
    path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
    for verb, resource, sub, allowed in [("get", "nodes", "", True), ("patch", "nodes", "status", True),
                                         ("list", "nodes", "", True), ("watch", "nodes", "", True),
                                         ("patch", "nodes", "", False), ("list", "pods", "", False),
                                         ("create", "events", "", True), ("get", "leases", "", False)]:
        code, review = call(emulator, "POST", path, access_review(verb, resource, sub), user=SA)
        assert code == 201 and review["status"]["allowed"] is allowed, (verb, resource, sub)
    assert call(emulator, "POST", path, access_review("list", "nodes"))[1]["status"]["allowed"] is True
    assert call(emulator, "POST", path, {"spec": {}}, user=SA)[0] == 422


def test_protobuf_access_review_as_kubectl_sends_it():
    def field(number: int, value: bytes) -> bytes:
        return bytes([number << 3 | 2, len(value)]) + value
    attributes = field(1, b"gpu-npd") + field(2, b"patch") + field(5, b"nodes") + field(6, b"status")
    review = field(1, b"") + field(2, field(1, attributes))
    body = MAGIC + field(1, field(1, b"authorization.k8s.io/v1") + field(2, b"SelfSubjectAccessReview")) + field(
        2, review)
    assert decode_access_review(body) == {"spec": {"resourceAttributes": {
        "namespace": "gpu-npd", "verb": "patch", "resource": "nodes", "subresource": "status"}}}


def test_protobuf_bodies_for_stored_resources_are_415(emulator):
    code, status = call(emulator, "POST", "/api/v1/nodes", raw=MAGIC + b"\x0a\x00",
                        content_type="application/vnd.kubernetes.protobuf")
    assert code == 415 and status_is(status, 415, "UnsupportedMediaType")


# --- 404s and discovery --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/v1/widgets", "/api/v2/nodes", "/apis/example.com/v1/widgets",
                                  "/apis/example.com", "/apis/coordination.k8s.io/v2/leases",
                                  "/apis/coordination.k8s.io/v1/widgets", "/api/v1/namespaces/x/nodes",
                                  "/api/v1/nodes/gpu-1/proxy", "/openapi/v9", "/nothing/here"])
def test_unknown_paths_are_404_with_a_status(emulator, path):
    code, status = call(emulator, "GET", path)
    assert code == 404 and status_is(status, 404, "NotFound"), path


def test_missing_objects_are_404_with_their_group(emulator):
    code, status = call(emulator, "GET", "/apis/coordination.k8s.io/v1/namespaces/x/leases/nope")
    assert code == 404 and status_is(status, 404, "NotFound")
    assert status["message"] == 'leases.coordination.k8s.io "nope" not found'
    assert status["details"] == {"name": "nope", "group": "coordination.k8s.io", "kind": "leases"}


def test_discovery_lists_every_served_resource(emulator):
    groups = {g["name"]: g for g in call(emulator, "GET", "/apis")[1]["groups"]}
    assert groups["coordination.k8s.io"]["preferredVersion"]["groupVersion"] == "coordination.k8s.io/v1"
    assert {"authorization.k8s.io", "authentication.k8s.io"} <= set(groups)
    core = {r["name"]: r for r in call(emulator, "GET", "/api/v1")[1]["resources"]}
    assert set(core) == {"nodes", "nodes/status", "events", "pods", "pods/status"}
    assert "watch" in core["nodes"]["verbs"] and core["pods"]["namespaced"] is True
    leases = call(emulator, "GET", "/apis/coordination.k8s.io/v1")[1]
    assert leases["groupVersion"] == "coordination.k8s.io/v1"
    assert [(r["name"], r["kind"], r["namespaced"]) for r in leases["resources"]] == [("leases", "Lease", True)]
    assert call(emulator, "GET", "/apis/coordination.k8s.io")[1]["kind"] == "APIGroup"
    assert call(emulator, "GET", "/version")[1]["gitVersion"].startswith("v1.")


# --- Pods -------------------------------------------------------------------------------------------

def pod(name: str, node: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": "Running"}}


def test_pods_empty_unless_created_and_selected_by_node(emulator):
    assert call(emulator, "GET", "/api/v1/pods")[1]["items"] == []
    assert call(emulator, "POST", "/api/v1/namespaces/ml/pods", pod("train-0", "gpu-1"))[0] == 201
    assert call(emulator, "POST", "/api/v1/namespaces/ml/pods", pod("train-1", "gpu-2"))[0] == 201
    code, listed = call(emulator, "GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-1,"
                                         "status.phase!%3DSucceeded,status.phase!%3DFailed")
    assert code == 200 and [p["metadata"]["name"] for p in listed["items"]] == ["train-0"]
    assert call(emulator, "GET", "/api/v1/namespaces/ml/pods/train-1")[1]["spec"]["nodeName"] == "gpu-2"
    assert call(emulator, "GET", "/api/v1/namespaces/other/pods")[1]["items"] == []
    assert call(emulator, "DELETE", "/api/v1/namespaces/ml/pods/train-1")[0] == 200
    code, bad = call(emulator, "POST", "/api/v1/namespaces/ml/pods", {"metadata": {"name": "x"}, "spec": {}})
    assert code == 422 and bad["details"]["causes"][0]["field"] == "spec.containers"
    code, status = call(emulator, "POST", "/api/v1/namespaces/ml/pods", pod("sa", "gpu-1"), user=SA)
    assert code == 403 and 'cannot create resource "pods"' in status["message"]


# --- Tables ------------------------------------------------------------------------------------------

def test_table_when_asked_for_as_kubectl_get_does(emulator):
    emulator.create_node("gpu-2", labels={"node-role.kubernetes.io/worker": ""})
    emulator.set_node_condition("gpu-2", {"type": "Ready", "status": "False"})
    accept = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
    code, table = call(emulator, "GET", "/api/v1/nodes", headers=accept)
    assert code == 200 and (table["kind"], table["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [c["name"] for c in table["columnDefinitions"] if c["priority"] == 0] == ["Name", "Status", "Roles",
                                                                                     "Age", "Version"]
    assert [row["cells"][:3] for row in table["rows"]] == [["gpu-1", "Ready", "<none>"],
                                                          ["gpu-2", "NotReady", "worker"]]
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    code, one = call(emulator, "GET", "/api/v1/nodes/gpu-1?includeObject=Object", headers=accept)
    assert one["rows"][0]["object"]["status"]["conditions"]
    assert call(emulator, "GET", "/api/v1/nodes?includeObject=All", headers=accept)[0] == 400
    assert call(emulator, "GET", "/api/v1/nodes")[1]["kind"] == "NodeList"      # plain JSON otherwise


def test_ages_read_as_kubectl_writes_them():
    assert [human_duration(s) for s in (0, 59, 119, 125, 600, 7200, 4 * 3600 + 60, 30 * 3600, 3 * 86400 + 3600,
                                        400 * 86400, None)] == [
        "0s", "59s", "119s", "2m5s", "10m", "120m", "4h1m", "30h", "3d1h", "400d", "<unknown>"]


# --- HTTPS, kubeconfig, CLI --------------------------------------------------------------------------

def test_https_is_verified_with_the_emulators_ca(tmp_path):
    with Emulator(https=True) as emu:
        assert emu.url.startswith("https://")
        ca = ssl.create_default_context(cafile=str(emu.write_ca(tmp_path / "ca.pem")))
        assert call(emu, "GET", "/version", context=ca)[0] == 200
        with pytest.raises(urllib.error.URLError):
            call(emu, "GET", "/version", context=ssl.create_default_context())   # the system's CAs: refused
        emu.down()
        emu.up()                                                    # back up: the same CA still verifies it
        assert call(emu, "GET", "/version", context=ca)[0] == 200


def test_plain_http_kubeconfig_is_as_before(emulator, tmp_path):
    doc = yaml.safe_load(emulator.write_kubeconfig(tmp_path / "kc").read_text())
    assert doc["clusters"][0]["cluster"] == {"server": emulator.url}
    assert [c["name"] for c in doc["contexts"]] == ["gpu-npd:gpu-npd"] and doc["users"][0]["name"] == SA
    with pytest.raises(RuntimeError, match="plain HTTP"):
        emulator.write_ca(tmp_path / "ca.pem")


def test_cli_https_writes_a_kubeconfig_and_the_ca(tmp_path):
    kubeconfig, ca = tmp_path / "kc.yaml", tmp_path / "ca.pem"
    proc = subprocess.Popen([sys.executable, "-m", "kube_emulator", "--https", "--kubeconfig-out", str(kubeconfig),
                             "--ca-out", str(ca), "--node", "gpu-17"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("https://127.0.0.1:")
        doc = yaml.safe_load(kubeconfig.read_text())
        assert [c["name"] for c in doc["contexts"]] == ["gpu-npd:gpu-npd", "admin"]
        tokens = {u["name"]: u["user"]["token"] for u in doc["users"]}
        context = ssl.create_default_context(cafile=str(ca))
        for user, expected in ((SA, 403), (ADMIN, 200)):
            req = urllib.request.Request(url + "/api/v1/pods", headers={"Authorization": f"Bearer {tokens[user]}"})
            try:
                code = urllib.request.urlopen(req, timeout=5, context=context).status
            except urllib.error.HTTPError as e:
                code = e.code
            assert code == expected, user
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert proc.returncode == 0


def test_cli_help_teaches_kubectl():
    out = subprocess.run([sys.executable, "-m", "kube_emulator", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=30).stdout
    for text in ("--https", "--kubeconfig-out", "export KUBECONFIG=", "kubectl --context admin", "auth can-i"):
        assert text in out, text


def test_cli_ca_out_needs_https(tmp_path, capsys):
    from kube_emulator.cli import main
    assert main(["--ca-out", str(tmp_path / "ca.pem")]) == 2
    assert "--ca-out needs --https" in capsys.readouterr().err


def test_kubeconfig_file_is_private(emulator, tmp_path: Path):
    path = tmp_path / "kc"
    path.write_text("old")
    path.chmod(0o644)
    emulator.write_kubeconfig(path, identities=[ADMIN])
    assert path.stat().st_mode & 0o777 == 0o600


def test_openapi_v3_says_the_server_validates_fields(emulator):
    index = call(emulator, "GET", "/openapi/v3")[1]["paths"]
    assert set(index) == {"api/v1", "apis/coordination.k8s.io/v1", "apis/resource.k8s.io/v1alpha3"}
    code, doc = call(emulator, "GET", index["api/v1"]["serverRelativeURL"])
    assert code == 200
    patch = doc["paths"]["/api/v1/nodes/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "", "version": "v1", "kind": "Node"}
    assert {"dryRun", "fieldValidation"} <= {p["name"] for p in patch["parameters"]}
    assert "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}" in call(
        emulator, "GET", "/openapi/v3/apis/coordination.k8s.io/v1")[1]["paths"]
    assert call(emulator, "GET", "/openapi/v3/apis/example.com/v1")[0] == 404
