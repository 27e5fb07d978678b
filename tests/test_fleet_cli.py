"""`gpu-npd fleet` and the kubectl plugin `kubectl gpu-npd`, against the emulator: the real daemon's
annotation and conditions read back (GPU 3 fell off the bus), a healthy fleet, a daemon that stopped
reporting, the JSON, the chunked LIST, the read-only RBAC of deploy/fleet-viewer, and the real kubectl
running the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from detector.cli.main import main
from detector.daemon.local import REPO_DEPLOY
from detector.kube.annotations import UNHEALTHY_GPUS
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import MARKER
from detector.kube.connection import user_kubeconfig
from detector.kube.fleet_view import GPU_NODE_LABELS, read_fleet
from detector.kube.stamps import parse_rfc3339, rfc3339
from fake_nvml.faults import Fault
from kube_emulator import Emulator
from kube_emulator.kinds import NODES
from test_daemon_e2e import FAST_CHECKS, fast_settings, running, settled  # noqa: F401 - fixtures
from test_deploy_render import require_kubectl

REPO = Path(__file__).resolve().parent.parent
FLEET_VIEWER = REPO / "deploy" / "fleet-viewer"
VIEWER, VIEWERS = "jane", "gpu-npd:fleet-viewers"        # binding.yaml's example group
GPU_LABELS = {"nvidia.com/gpu.present": "true"}
OLD_VALUE = '[{"index":2,"pciBusId":"0000:3a:00.0","uuid":"GPU-2","state":"degraded","action":"RESET_GPU"}]'


@pytest.fixture
def emulator():
    """deploy/base's RBAC (the daemons) and deploy/fleet-viewer's (the person running gpu-npd fleet)."""
    with Emulator(rbac_paths=(REPO_DEPLOY, FLEET_VIEWER)) as emu:
        yield emu


@pytest.fixture
def viewer(emulator, tmp_path) -> Path:
    """A kubeconfig for a member of the fleet-viewers group: the read-only RBAC, nothing else."""
    path = emulator.write_kubeconfig(tmp_path / "viewer.kubeconfig", user=VIEWER)
    emulator.token_for(VIEWER, groups=[VIEWERS, "system:authenticated"])     # the same token, in the group
    return path


def fleet(kubeconfig: Path, *args: str, capsys) -> tuple[int, str]:
    code = main(["fleet", "--kubeconfig", str(kubeconfig), *args])
    out, err = capsys.readouterr()
    assert err == "" or code != 0, err
    return code, out + err


def rows(out: str) -> list[list[str]]:
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["NODE", "GPU", "BUS"]
    return [line.split() for line in lines[1:-1]]


def own_condition(type_: str, status: str, heartbeat: float, reason: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason or f"No{type_}", "message": MARKER + "as written",
            "lastHeartbeatTime": rfc3339(heartbeat), "lastTransitionTime": rfc3339(heartbeat - 3600)}


# -- the real daemon's annotation and conditions ----------------------------------------------------------

def test_a_healthy_node_then_gpu_3_off_the_bus_as_the_daemon_writes_it(emulator, running, viewer, capsys):
    # A healthy node's gpu-npd conditions are the always-written ones (issue 34): the readiness check's
    # GpuNodeUnverified carries the heartbeat that says the daemon reports.
    local = running(settings=fast_settings(heartbeat_s=0.5), checks=[*FAST_CHECKS, "readiness"])
    settled(local)
    assert local.wait_for(lambda: local.conditions().get("GpuNodeUnverified", {}).get("status") == "False")
    emulator.create_node("cpu-1")                                    # not a GPU node: never counted
    code, out = fleet(viewer, capsys=capsys)
    assert code == 0 and out.strip().splitlines() == [
        "nothing is wrong: 1 GPU node, 8 GPUs, 0 failed, 0 degraded, 0 not reporting"]

    gpu3 = local.node.snapshot().gpus[3]
    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert local.wait_for(lambda: UNHEALTHY_GPUS in (emulator.node("gpu-1")["metadata"].get("annotations") or {}))
    assert local.wait_for(lambda: local.conditions().get("GpuXidError", {}).get("status") == "True")   # absent before
    code, out = fleet(viewer, capsys=capsys)
    assert code == 1, out
    [gpu_row, *condition_rows] = rows(out)
    assert gpu_row[:7] == ["gpu-1", "3", "0000:5d:00.0", gpu3.uuid, gpu3.serial, "failed", "RESTART_BM"]
    assert abs(parse_rfc3339(gpu_row[7]) - time.time()) < 30 and gpu_row[8:] == ["Ready", "-"]
    assert {r[5]: r[6] for r in condition_rows}["GpuXidError"] == "Xid79GpuFellOffBus"
    assert out.strip().splitlines()[-1] == "1 node to look at: 1 GPU node, 8 GPUs, 1 failed, 0 degraded, 0 not reporting"

    code, out = fleet(viewer, "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 1 and doc["nothingWrong"] is False
    assert doc["summary"] == {"nodes": 1, "gpus": 8, "nodesWithoutGpuCount": 0, "failed": 1, "degraded": 0,
                              "notReporting": 0, "nodesWithProblems": 1, "listed": 2, "pages": 1}
    [node] = doc["nodes"]
    assert node["unhealthyGpus"] == [{"index": 3, "pciBusId": "0000:5d:00.0", "uuid": gpu3.uuid,
                                      "serial": gpu3.serial, "state": "failed", "action": "RESTART_BM",
                                      "since": gpu_row[7]}]
    assert node["reporting"] is True and node["status"] == "Ready" and node["ready"] == "True"
    assert "GpuXidError" in {c["type"] for c in node["conditions"]}


def test_a_node_that_started_with_gpu_3_off_the_bus(emulator, running, viewer, capsys):
    """fake:h100-sxm-8-xid79: the daemon never saw GPU 3 work, so it knows no serial, but GPU 3 is listed
    failed with its bus id and the action its rule says."""
    local = running(scenario="h100-sxm-8-xid79", settings=fast_settings(heartbeat_s=0.5))
    assert local.wait_for(lambda: UNHEALTHY_GPUS in (emulator.node("gpu-1")["metadata"].get("annotations") or {}))
    code, out = fleet(viewer, capsys=capsys)
    gpu_rows = [r for r in rows(out) if r[1] != "-"]
    assert code == 1 and [r[:3] + r[5:7] for r in gpu_rows] == [["gpu-1", "3", "0000:5d:00.0", "failed",
                                                                 "RESTART_BM"]]


# -- not reporting, readiness, old annotations ------------------------------------------------------------

def test_stale_or_missing_heartbeats_are_not_reporting_and_readiness_is_shown(emulator, viewer, capsys):
    now = time.time()
    emulator.create_node("gpu-fresh", labels=GPU_LABELS, capacity={"nvidia.com/gpu": "8"},
                         conditions=[own_condition("GpuXidError", "False", now - 60)])
    emulator.create_node("gpu-stale", labels=GPU_LABELS, capacity={"nvidia.com/gpu": "8"}, conditions=[
        {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "down"},
        own_condition("GpuXidError", "False", now - 1200), own_condition("GpuMissing", "False", now - 1000)])
    emulator.create_node("gpu-never", labels={"feature.node.kubernetes.io/pci-10de.present": "true"})
    emulator.create_node("cpu-1")
    admin = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(Path(viewer).parent / "admin.kc", user="admin")))
    admin.patch_node_annotations("gpu-fresh", {UNHEALTHY_GPUS: OLD_VALUE})       # an older gpu-npd's value
    emulator.store.update(NODES, None, "gpu-never", lambda n: {     # cordoned, a readiness taint and another
            **n, "spec": {"unschedulable": True, "taints": [
                {"key": "readiness.k8s.io/gpu-npd-verified", "effect": "NoSchedule"},
                {"key": "example.com/team", "value": "a", "effect": "NoExecute"}]}})

    code, out = fleet(viewer, capsys=capsys)
    assert code == 1
    table = {(r[0], r[5]): r for r in rows(out)}
    assert set(table) == {("gpu-fresh", "degraded"), ("gpu-stale", "not-reporting"), ("gpu-never", "not-reporting")}
    assert table["gpu-fresh", "degraded"][1:8] == ["2", "0000:3a:00.0", "GPU-2", "-", "degraded", "RESET_GPU", "-"]
    stale = table["gpu-stale", "not-reporting"]
    assert stale[6:9] == ["NoHeartbeat", rfc3339(now - 1000), "NotReady"]
    never = table["gpu-never", "not-reporting"]
    assert never[6:] == ["NeverReported", "-", "Ready,SchedulingDisabled",
                         "readiness.k8s.io/gpu-npd-verified:NoSchedule,example.com/team=a:NoExecute"]
    assert out.strip().splitlines()[-1] == ("3 nodes to look at: 3 GPU nodes, 16+ GPUs (1 node without a GPU "
                                            "count), 0 failed, 1 degraded, 2 not reporting")   # gpu-never's unsaid

    doc = json.loads(fleet(viewer, "-o", "json", "--stale-after", "1500", capsys=capsys)[1])
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert set(by_name) == {"gpu-fresh", "gpu-never"}                   # 1,000 s is not stale after 1,500
    assert by_name["gpu-never"]["readinessTaints"] == ["readiness.k8s.io/gpu-npd-verified:NoSchedule"]
    assert by_name["gpu-never"]["unschedulable"] is True and by_name["gpu-never"]["lastHeartbeat"] is None
    assert by_name["gpu-fresh"]["unhealthyGpus"][0] == {"index": 2, "pciBusId": "0000:3a:00.0", "uuid": "GPU-2",
                                                        "serial": None, "state": "degraded", "action": "RESET_GPU",
                                                        "since": None}

    code, out = fleet(viewer, "--all", capsys=capsys)
    assert ("cpu-1" not in out) and any(r[0] == "gpu-stale" for r in rows(out))


def test_a_selector_lists_only_its_nodes_and_takes_them_as_gpu_nodes(emulator, viewer, capsys):
    emulator.create_node("gpu-a", labels={"example.com/gpu-node": "true"})     # a site's own label only
    emulator.create_node("gpu-b", labels=GPU_LABELS)
    code, out = fleet(viewer, "-l", "example.com/gpu-node=true", "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 1 and [n["name"] for n in doc["nodes"]] == ["gpu-a"] and doc["summary"]["listed"] == 1


# -- the LIST: pages, and the RBAC it needs ---------------------------------------------------------------

def test_a_large_fleet_is_read_in_pages_with_list_alone(emulator, viewer, capsys):
    for i in range(25):
        emulator.create_node(f"gpu-{i:02d}", labels=GPU_LABELS, conditions=[own_condition("GpuXidError", "False",
                                                                                           time.time())])
    emulator.reset_stats()
    code, out = fleet(viewer, "--chunk-size", "10", "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["nothingWrong"] is True and doc["nodes"] == []
    assert doc["summary"]["pages"] == 3 and doc["summary"]["listed"] == 25 and doc["summary"]["nodes"] == 25
    assert emulator.request_count(user=VIEWER) == emulator.request_count(verb="list", resource="nodes", code=200) == 3


def test_an_expired_continue_token_lists_again_from_the_start():
    class Expiring:
        def __init__(self):
            self.calls: list[str] = []

        def list_node_page(self, selector: str, limit: int, token: str) -> dict:
            self.calls.append(token)
            if token and len(self.calls) == 2:
                raise ApiError(410, "Expired", "The provided continue parameter is too old")
            name = f"gpu-{len(self.calls)}"
            node = {"metadata": {"name": name, "labels": GPU_LABELS}, "status": {"conditions": []}}
            return {"items": [node], "metadata": {"continue": "" if token else "next"}}

    api = Expiring()
    view = read_fleet(api)                                      # type: ignore[arg-type] - the one call it makes
    assert api.calls == ["", "next", "", "next"] and view.listed == 2 and view.pages == 2


def test_the_fleet_viewer_may_list_nodes_and_nothing_else(emulator, viewer, capsys):
    emulator.create_node("gpu-1", labels=GPU_LABELS)
    as_viewer = KubeApi.from_kubeconfig(str(viewer))
    assert as_viewer.list_node_page(limit=1)["items"][0]["metadata"]["name"] == "gpu-1"
    assert as_viewer.get_node("gpu-1")["metadata"]["name"] == "gpu-1"
    for write in (lambda: as_viewer.patch_node_annotations("gpu-1", {"a": "b"}),
                  lambda: as_viewer.patch_node_status("gpu-1", {"status": {"conditions": []}}),
                  lambda: as_viewer.watch_nodes("", "0").__next__()):
        with pytest.raises(ApiError) as refused:
            write()
        assert refused.value.status == 403

    nobody = emulator.write_kubeconfig(Path(viewer).parent / "nobody.kubeconfig", user="jane")   # no binding
    code, out = fleet(nobody, capsys=capsys)
    assert code == 3 and "forbids gpu-npd to list nodes (403 Forbidden)" in out and "deploy/fleet-viewer" in out


def test_fleet_viewer_rbac_is_get_and_list_nodes_only():
    docs = {d["kind"]: d for f in FLEET_VIEWER.glob("*.yaml") if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text())}
    assert docs["ClusterRole"]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]
    assert docs["ClusterRoleBinding"]["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]


def test_gpu_node_labels_are_the_daemonsets():
    daemonset = yaml.safe_load((REPO / "deploy" / "base" / "daemonset.yaml").read_text())
    terms = daemonset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    selected = [(e["key"], e["values"][0]) for t in terms for e in t["matchExpressions"] if e["operator"] == "In"]
    assert tuple(selected) == GPU_NODE_LABELS


# -- usage and the kubeconfig -----------------------------------------------------------------------------

def test_the_kubeconfig_is_found_as_kubectl_finds_it(tmp_path):
    home = tmp_path / "home"
    assert user_kubeconfig(None, {}, home) is None                                  # in-cluster
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("{}")
    assert user_kubeconfig(None, {}, home) == str(home / ".kube" / "config")
    listed = tmp_path / "b.yaml"
    listed.write_text("{}")
    assert user_kubeconfig(None, {"KUBECONFIG": f"{tmp_path / 'missing.yaml'}{os.pathsep}{listed}"}, home) == str(listed)
    assert user_kubeconfig("given.yaml", {"KUBECONFIG": str(listed)}, home) == "given.yaml"


def test_a_context_that_is_not_there_is_a_usage_error(emulator, viewer, capsys):
    code, out = fleet(viewer, "--context", "nope", capsys=capsys)
    assert code == 2 and "no context named 'nope'" in out and f"contexts: {VIEWER}" in out


# -- the kubectl plugin -----------------------------------------------------------------------------------

def test_pyproject_installs_the_kubectl_plugin():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-gpu_npd"] == "detector.cli.fleet:kubectl_plugin"


def test_kubectl_runs_the_plugin_with_or_without_fleet(emulator, viewer, tmp_path):
    kubectl = require_kubectl()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plugin = bin_dir / "kubectl-gpu_npd"            # what the console script installs, run from this checkout
    plugin.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from detector.cli.fleet import kubectl_plugin\nsys.exit(kubectl_plugin())\n")
    plugin.chmod(0o755)
    emulator.create_node("gpu-1", labels=GPU_LABELS)
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", KUBECONFIG=str(viewer), HOME=str(tmp_path),
               NO_PROXY="127.0.0.1,localhost")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([kubectl, *args], capture_output=True, text=True, env=env, timeout=60)

    listed = run("plugin", "list")
    assert str(plugin) in listed.stdout, listed.stdout + listed.stderr
    alone = run("gpu-npd")
    assert alone.returncode == 1 and alone.stdout.strip().splitlines()[-1] == (
        "1 node to look at: 1 GPU node, GPU count unknown, 0 failed, 0 degraded, 1 not reporting"), alone.stderr
    as_json = run("gpu-npd", "fleet", "-o", "json", "--stale-after", "60")
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["nodes"][0]["name"] == "gpu-1", as_json.stderr
    usage = run("gpu-npd", "fleet", "--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: kubectl gpu-npd [fleet]")
    assert "exit code: 0 nothing is wrong" in " ".join(usage.stdout.split())


def test_a_node_still_being_verified_after_its_boot_is_shown_as_verifying_not_as_wrong():
    from detector.kube.conditions import MARKER
    from detector.kube.fleet_view import fleet_node

    now = "2026-11-26T10:00:00Z"
    node = {"metadata": {"name": "gpu-v", "labels": {"nvidia.com/gpu.present": "true"}},
            "status": {"conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "GpuNodeUnverified", "status": "True", "reason": "ChecksPending", "lastHeartbeatTime": now,
                 "message": f"{MARKER}2 check(s) have not run in this boot yet (up 1m): xid, pcie"},
                {"type": "GpuXidError", "status": "False", "reason": "NoGpuXidError", "lastHeartbeatTime": now,
                 "message": f"{MARKER}no GpuXidError problem found"}]}}
    from detector.kube.stamps import parse_rfc3339
    seen = fleet_node(node, frozenset({"GpuNodeUnverified", "GpuXidError"}), parse_rfc3339(now) + 10, 900)
    assert seen is not None and not seen.has_problems
    assert seen.status == "Ready,Verifying" and "have not run in this boot yet" in seen.verifying
    node["status"]["conditions"][1]["reason"] = "RemediationRequested"          # that one is a problem
    assert fleet_node(node, frozenset({"GpuNodeUnverified"}), parse_rfc3339(now) + 10, 900).has_problems
