"""Authorization: the project's own RBAC manifest over HTTP with Kubernetes' exact 403 messages,
and the RBAC rules (bindings, namespaces, wildcards, resourceNames) on small policies."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
from kubernetes import client, config

from conftest import REPO
from kube_emulator import Emulator
from kube_emulator.rbac import Attributes, Authorizer, User, default_groups, forbidden_message, load_policy

SA = "system:serviceaccount:gpu-npd:gpu-npd"
DENIED = f'User "{SA}" cannot'


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"]) as emu:
        emu.create_node("n1")
        yield emu


@pytest.fixture
def sa(emulator, tmp_path) -> client.CoreV1Api:
    path = emulator.write_kubeconfig(tmp_path / "sa.kubeconfig")
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


def forbidden(call) -> str:
    with pytest.raises(client.ApiException) as err:
        call()
    assert err.value.status == 403
    status = json.loads(err.value.body)
    assert status["reason"] == "Forbidden" and status["code"] == 403
    return status["message"]


def event(name: str) -> dict:
    now = datetime.now(timezone.utc).isoformat()
    return {"metadata": {"name": name}, "involvedObject": {"kind": "Node", "name": "n1"}, "reason": "XidFatal",
            "message": "GPU 3 fell off the bus", "type": "Warning", "count": 1, "firstTimestamp": now,
            "lastTimestamp": now}


def test_service_account_can_do_what_deploy_base_grants(emulator, sa):
    assert sa.read_node("n1").metadata.name == "n1"
    node = sa.patch_node_status("n1", {"status": {"conditions": [{"type": "GpuHealthy", "status": "True"}]}})
    assert "GpuHealthy" in [c.type for c in node.status.conditions]
    sa.create_namespaced_event("default", event("n1.a"))
    assert sa.patch_namespaced_event("n1.a", "default", {"count": 2}).count == 2


def test_service_account_gets_kubernetes_exact_403_for_the_rest(emulator, sa):
    sa.create_namespaced_event("default", event("n1.a"))
    assert forbidden(lambda: sa.create_node({"metadata": {"name": "n2"}})) == (
        f'nodes is forbidden: {DENIED} create resource "nodes" in API group "" at the cluster scope')
    assert forbidden(lambda: sa.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})) == (
        f'nodes "n1" is forbidden: {DENIED} patch resource "nodes" in API group "" at the cluster scope')
    assert forbidden(lambda: sa.replace_node_status("n1", emulator.node("n1"))) == (
        f'nodes "n1" is forbidden: {DENIED} update resource "nodes/status" in API group "" at the cluster scope')
    assert forbidden(lambda: sa.delete_namespaced_event("n1.a", "default")) == (
        f'events "n1.a" is forbidden: {DENIED} delete resource "events" in API group "" in the namespace "default"')
    assert forbidden(lambda: sa.list_namespaced_event("default")) == (
        f'events is forbidden: {DENIED} list resource "events" in API group "" in the namespace "default"')
    assert forbidden(lambda: sa.delete_node("n1")).startswith('nodes "n1" is forbidden')
    assert len(emulator.nodes()) == 1 and len(emulator.events()) == 1


def test_forbidden_details_name_the_object(emulator, sa):
    with pytest.raises(client.ApiException) as err:
        sa.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    assert json.loads(err.value.body)["details"] == {"name": "n1", "kind": "nodes"}


def test_admin_may_do_everything_and_other_users_nothing(emulator, tmp_path):
    admin = client.CoreV1Api(config.new_client_from_config(
        config_file=str(emulator.write_kubeconfig(tmp_path / "admin", user="admin"))))
    assert admin.delete_node("n1")["status"] == "Success"
    nobody = client.CoreV1Api(config.new_client_from_config(
        config_file=str(emulator.write_kubeconfig(tmp_path / "nobody", user="jane"))))
    assert forbidden(lambda: nobody.read_node("n1")) == (
        'nodes "n1" is forbidden: User "jane" cannot get resource "nodes" in API group "" at the cluster scope')
    assert client.VersionApi(nobody.api_client).get_code().major == "1"


def test_control_endpoints_need_the_admin(emulator):
    req = urllib.request.Request(emulator.url + "/emulator/stats",
                                 headers={"Authorization": f"Bearer {emulator.token_for(SA)}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 403


# --- Rules on small policies ----------------------------------------------------------------------

POLICY = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: status-writer}
rules:
  - apiGroups: [""]
    resources: ["*/status"]
    verbs: ["patch", "update"]
  - apiGroups: [""]
    resources: ["nodes"]
    resourceNames: ["gpu-1"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: status-writer}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: status-writer}
subjects:
  - {kind: User, name: alice}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: event-reader, namespace: team-a}
rules:
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["get", "list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: event-reader, namespace: team-a}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: event-reader}
subjects:
  - {kind: Group, name: "system:serviceaccounts:team-a"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: everything}
rules:
  - apiGroups: ["*"]
    resources: ["*"]
    verbs: ["*"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: everything-in-b, namespace: team-b}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: everything}
subjects:
  - {kind: ServiceAccount, name: bot}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: dangling}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: missing}
subjects:
  - {kind: User, name: bob}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
"""


@pytest.fixture
def authorizer(tmp_path) -> Authorizer:
    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "kustomization.yaml").write_text("resources: [not-rbac-at-all]\n")
    return Authorizer(load_policy([tmp_path]))


def user(name: str) -> User:
    return User(name, default_groups(name))


def allowed(authorizer: Authorizer, who: str, verb: str, resource: str, subresource: str = "",
            namespace: str = "", name: str = "") -> bool:
    return authorizer.authorize(Attributes(user(who), verb, resource, subresource, namespace, name))[0]


def test_wildcard_subresource_and_resource_names(authorizer):
    assert allowed(authorizer, "alice", "patch", "nodes", "status", name="gpu-9")
    assert allowed(authorizer, "alice", "update", "nodes", "status", name="gpu-9")
    assert not allowed(authorizer, "alice", "patch", "nodes", name="gpu-9")
    assert allowed(authorizer, "alice", "get", "nodes", name="gpu-1")
    assert not allowed(authorizer, "alice", "get", "nodes", name="gpu-2")
    assert not allowed(authorizer, "alice", "list", "nodes")


def test_roles_and_role_bindings_only_reach_their_namespace(authorizer):
    reader = "system:serviceaccount:team-a:any"
    assert allowed(authorizer, reader, "list", "events", namespace="team-a")
    assert not allowed(authorizer, reader, "list", "events", namespace="team-b")
    assert not allowed(authorizer, reader, "list", "events")
    assert not allowed(authorizer, "system:serviceaccount:team-c:any", "list", "events", namespace="team-a")
    bot = "system:serviceaccount:team-b:bot"
    assert allowed(authorizer, bot, "delete", "events", namespace="team-b", name="e")
    assert not allowed(authorizer, bot, "delete", "events", namespace="team-a", name="e")
    assert not allowed(authorizer, bot, "get", "nodes", name="n1")


def test_binding_to_missing_role_names_it_in_the_message(authorizer):
    ok, reason = authorizer.authorize(Attributes(user("bob"), "get", "nodes", name="n1"))
    assert not ok
    assert forbidden_message(Attributes(user("bob"), "get", "nodes", name="n1"), reason) == (
        'nodes "n1" is forbidden: User "bob" cannot get resource "nodes" in API group "" at the cluster scope: '
        'RBAC: clusterrole.rbac.authorization.k8s.io "missing" not found')


def test_masters_bypass_and_default_groups():
    empty = Authorizer(load_policy([]))
    assert empty.authorize(Attributes(user("admin"), "deletecollection", "nodes"))[0]
    assert default_groups("system:serviceaccount:ns:sa") == (
        "system:serviceaccounts", "system:serviceaccounts:ns", "system:authenticated")


def test_missing_rbac_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="RBAC path not found"):
        load_policy([tmp_path / "absent"])
    with pytest.raises(FileNotFoundError):
        Emulator(rbac_paths=[Path(tmp_path / "absent.yaml")])
