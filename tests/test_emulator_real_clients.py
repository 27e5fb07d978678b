"""Real Kubernetes clients against the emulator over HTTPS, with the kubeconfig it writes: the kubectl
binary (`make kubectl` installs it) and the official Python client's watch. What they print and do
is what they would against a cluster given deploy/base's RBAC."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config, watch

from conftest import REPO
from kube_emulator import Emulator
from kube_emulator.rbac import ADMIN
from test_deploy_render import require_kubectl

SA = "system:serviceaccount:gpu-npd:gpu-npd"
WAIT_S = 10.0    # the longest a test waits for output it expects: never reached when things work


@pytest.fixture(scope="module")
def kubectl_path() -> str:
    return require_kubectl()


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], https=True) as emu:
        emu.create_node("gpu-1", labels={"pool": "h100"})
        emu.create_node("gpu-2", labels={"pool": "h100"})
        yield emu


@pytest.fixture
def kubeconfig(emulator, tmp_path) -> Path:
    return emulator.write_kubeconfig(tmp_path / "kubeconfig", identities=[ADMIN])


@pytest.fixture
def kubectl_env(kubeconfig, tmp_path) -> dict[str, str]:
    home = tmp_path / "home"     # kubectl's discovery cache goes here, not to the user's ~/.kube
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(HOME=str(home), KUBECONFIG=str(kubeconfig), NO_PROXY="127.0.0.1,localhost")
    return env


@pytest.fixture
def kubectl(kubectl_path, kubectl_env):
    def run(*args: str, context: str = "admin", ok: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([kubectl_path, "--context", context, *args], capture_output=True, text=True,
                              env=kubectl_env, timeout=60)
        if ok:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
            assert done.stderr == "", f"kubectl {' '.join(args)} warned: {done.stderr}"
        return done
    return run


@pytest.fixture
def admin_api(kubeconfig) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig), context="admin"))


def node_event(api: client.CoreV1Api, name: str, reason: str, message: str, uid: str | None = None) -> None:
    """An Event about a node as gpu-npd writes one (involvedObject.uid the node's name, as the kubelet's)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    api.create_namespaced_event("default", {
        "metadata": {"name": f"{name}.{reason.lower()}"}, "reason": reason, "message": message, "type": "Warning",
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid or name},
        "source": {"component": "gpu-npd", "host": name}, "count": 1, "firstTimestamp": now, "lastTimestamp": now})


# --- The kubeconfig ---------------------------------------------------------------------------------

def test_kubeconfig_has_a_context_per_identity_and_the_ca(emulator, kubeconfig):
    doc = yaml.safe_load(kubeconfig.read_text())
    assert emulator.url.startswith("https://127.0.0.1:")
    assert doc["clusters"][0]["cluster"]["server"] == emulator.url
    assert doc["clusters"][0]["cluster"]["certificate-authority-data"]
    assert [c["name"] for c in doc["contexts"]] == ["gpu-npd:gpu-npd", "admin"]
    assert doc["current-context"] == "gpu-npd:gpu-npd"
    assert {u["name"] for u in doc["users"]} == {SA, ADMIN} and all(u["user"]["token"] for u in doc["users"])
    assert kubeconfig.stat().st_mode & 0o777 == 0o600


# --- kubectl ------------------------------------------------------------------------------------------

def test_kubectl_get_nodes_prints_the_servers_columns(emulator, kubectl):
    emulator.set_node_condition("gpu-2", {"type": "Ready", "status": "False", "reason": "KubeletNotReady"})
    lines = kubectl("get", "nodes").stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["gpu-1"][1:3] == ["Ready", "<none>"] and rows["gpu-2"][1] == "NotReady"
    wide = kubectl("get", "nodes", "-o", "wide", "-l", "pool=h100").stdout
    assert "INTERNAL-IP" in wide and "Ubuntu 24.04.1 LTS" in wide


def test_kubectl_custom_columns_show_a_condition(emulator, kubectl):
    emulator.set_node_condition("gpu-1", {"type": "GpuHealthy", "status": "False", "reason": "XidFatal",
                                          "message": "GPU 3 fell off the bus"})
    out = kubectl("get", "nodes", "-o",
                  'custom-columns=NAME:.metadata.name,GPU:.status.conditions[?(@.type=="GpuHealthy")].reason').stdout
    assert [line.split() for line in out.splitlines()] == [["NAME", "GPU"], ["gpu-1", "XidFatal"],
                                                          ["gpu-2", "<none>"]]


def test_kubectl_describe_node_shows_conditions_lease_and_events(emulator, kubectl, admin_api):
    emulator.set_node_condition("gpu-1", {"type": "GpuHealthy", "status": "False", "reason": "XidFatal",
                                          "message": "GPU 3 fell off the bus"})
    node_event(admin_api, "gpu-1", "GpuXidError", "XID 79 on GPU 3")
    node_event(admin_api, "gpu-1", "NodeDrainAdvised", "drain it", uid=emulator.node("gpu-1")["metadata"]["uid"])
    node_event(admin_api, "gpu-2", "SomethingElse", "not about gpu-1")
    out = kubectl("describe", "node", "gpu-1").stdout
    conditions = out.split("Conditions:", 1)[1].split("Addresses:", 1)[0]
    assert "GpuHealthy" in conditions and "XidFatal" in conditions and "GPU 3 fell off the bus" in conditions
    assert "KubeletReady" in conditions
    assert "HolderIdentity:  gpu-1" in out
    events = out.split("\nEvents:", 1)[1]
    assert "GpuXidError" in events and "XID 79 on GPU 3" in events and "gpu-npd" in events
    assert "NodeDrainAdvised" in events and "SomethingElse" not in events
    assert "Non-terminated Pods:          (0 in total)" in out


def test_kubectl_annotate_adds_and_removes(emulator, kubectl):
    assert "node/gpu-1 annotated" in kubectl("annotate", "node", "gpu-1", "gpu-npd.io/drill=xid-79").stdout
    assert emulator.node("gpu-1")["metadata"]["annotations"] == {"gpu-npd.io/drill": "xid-79"}
    kubectl("annotate", "node", "gpu-1", "gpu-npd.io/drill-")
    assert "gpu-npd.io/drill" not in (emulator.node("gpu-1")["metadata"].get("annotations") or {})


def test_kubectl_server_dry_run_changes_nothing(emulator, kubectl):
    before = emulator.node("gpu-1")
    out = kubectl("annotate", "--dry-run=server", "node", "gpu-1", "gpu-npd.io/drill=xid-79").stdout
    assert "(server dry run)" in out
    assert emulator.node("gpu-1") == before
    out = kubectl("delete", "--dry-run=server", "node", "gpu-2").stdout
    assert "(server dry run)" in out and emulator.node("gpu-2")["metadata"]["name"] == "gpu-2"


def test_kubectl_get_watch_prints_a_change(emulator, kubectl_path, kubectl_env):
    proc = subprocess.Popen([kubectl_path, "--context", "admin", "get", "nodes", "-w"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=kubectl_env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def next_line() -> str:
        try:
            return lines.get(timeout=WAIT_S)
        except queue.Empty:
            proc.kill()
            pytest.fail(f"kubectl get nodes -w printed nothing more; stderr: {proc.communicate()[1]}")

    try:
        assert next_line().split()[:2] == ["NAME", "STATUS"]
        assert {next_line().split()[0] for _ in range(2)} == {"gpu-1", "gpu-2"}
        emulator.set_node_condition("gpu-2", {"type": "Ready", "status": "False", "reason": "KubeletNotReady"})
        assert next_line().split()[:2] == ["gpu-2", "NotReady"]
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=WAIT_S)
    assert err == ""


def test_kubectl_auth_can_i_as_the_daemon(kubectl):
    # -A: no namespace for a cluster-scoped resource (else kubectl warns, as against any cluster)
    assert kubectl("auth", "can-i", "get", "nodes", "-A", context="gpu-npd:gpu-npd").stdout.strip() == "yes"
    assert kubectl("auth", "can-i", "patch", "nodes", "--subresource=status", "-A",
                   context="gpu-npd:gpu-npd").stdout.strip() == "yes"
    assert kubectl("auth", "can-i", "watch", "nodes", "-A", "--as", SA).stdout.strip() == "yes"   # its node watch
    denied = kubectl("auth", "can-i", "list", "pods", "-A", context="gpu-npd:gpu-npd", ok=False)
    assert (denied.returncode, denied.stdout.strip()) == (1, "no")
    assert kubectl("auth", "can-i", "patch", "nodes", "-A", "--as", SA, ok=False).stdout.strip() == "no"
    assert kubectl("auth", "whoami", context="gpu-npd:gpu-npd").stdout.split("\n")[1].split() == ["Username", SA]


def test_kubectl_as_the_daemon_gets_kubernetes_errors(kubectl):
    assert kubectl("get", "node", "gpu-1", context="gpu-npd:gpu-npd").stdout.split()[5:7] == ["gpu-1", "Ready"]
    denied = kubectl("get", "pods", "-A", context="gpu-npd:gpu-npd", ok=False)
    assert denied.returncode == 1
    assert (f'pods is forbidden: User "{SA}" cannot list resource "pods" in API group "" at the cluster scope'
            in denied.stderr)
    escalate = kubectl("get", "nodes", "--as", ADMIN, context="gpu-npd:gpu-npd", ok=False)
    assert escalate.returncode == 1 and f'User "{SA}" cannot impersonate resource "users"' in escalate.stderr
    missing = kubectl("get", "node", "gpu-404", ok=False)
    assert missing.returncode == 1 and 'nodes "gpu-404" not found' in missing.stderr


def test_kubectl_leases_and_pods(emulator, kubectl):
    lines = kubectl("get", "leases", "-n", "kube-node-lease").stdout.splitlines()
    assert lines[0].split() == ["NAME", "HOLDER", "AGE"] and lines[1].split()[:2] == ["gpu-1", "gpu-1"]
    out = kubectl("get", "leases", "-n", "kube-node-lease", "-o", "name").stdout.split()
    assert out == ["lease.coordination.k8s.io/gpu-1", "lease.coordination.k8s.io/gpu-2"]
    none = kubectl("get", "pods", "-A", ok=False)
    assert (none.returncode, none.stdout, none.stderr) == (0, "", "No resources found\n")


# --- The Python client's watch --------------------------------------------------------------------

def test_python_client_watch_over_https_and_resume(emulator, kubeconfig):
    config.load_kube_config(config_file=str(kubeconfig), context="admin")    # as a script would
    api = client.CoreV1Api()
    w = watch.Watch()
    seen = []
    changed = False
    for event in w.stream(api.list_node, timeout_seconds=10):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 2 and not changed:
            changed = True
            emulator.set_node_condition("gpu-1", {"type": "GpuHealthy", "status": "False", "reason": "XidFatal"})
        if event["type"] == "MODIFIED":
            w.stop()
    assert sorted(seen[:2]) == [("ADDED", "gpu-1"), ("ADDED", "gpu-2")] and seen[2:] == [("MODIFIED", "gpu-1")]
    resume_from = w.resource_version
    emulator.create_node("gpu-3")                          # while nobody watches
    again = watch.Watch()
    for event in again.stream(api.list_node, resource_version=resume_from, timeout_seconds=10):
        assert (event["type"], event["object"].metadata.name) == ("ADDED", "gpu-3")   # only what came after
        again.stop()
    assert int(again.resource_version) > int(resume_from)


def test_python_client_sees_410_for_a_compacted_resource_version(tmp_path):
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], https=True, watch_history=2) as emu:
        emu.create_node("a")
        old = emu.node("a")["metadata"]["resourceVersion"]
        for i in range(3):
            emu.set_node_condition("a", {"type": "GpuHealthy", "status": "True" if i % 2 else "False"})
        api = client.CoreV1Api(config.new_client_from_config(
            config_file=str(emu.write_kubeconfig(tmp_path / "kc", user=ADMIN))))
        with pytest.raises(client.ApiException) as err:
            api.list_node(watch=True, resource_version=old, _preload_content=False)
        assert err.value.status == 410 and '"reason":"Expired"' in str(err.value.body).replace(" ", "")


def test_kubectl_create_apply_and_delete_a_lease(kubectl, tmp_path):
    """kubectl validates through the server (it finds fieldValidation in /openapi/v3), so -f works as is."""
    manifest = tmp_path / "lease.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                        "metadata": {"name": "leader", "namespace": "gpu-npd"},
                                        "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15}}))
    assert kubectl("create", "--save-config", "-f", str(manifest)).stdout.strip() == (
        "lease.coordination.k8s.io/leader created")
    manifest.write_text(manifest.read_text().replace("pod-a", "pod-b"))
    assert kubectl("apply", "-f", str(manifest)).stdout.strip() == "lease.coordination.k8s.io/leader configured"
    holder = kubectl("get", "lease", "leader", "-n", "gpu-npd", "-o", "jsonpath={.spec.holderIdentity}").stdout
    assert holder == "pod-b"
    assert "deleted" in kubectl("delete", "-f", str(manifest)).stdout
