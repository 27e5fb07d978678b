"""The daemon's watch on its own node (detector/kube/nodewatch.py) against the API emulator, which enforces
deploy/'s RBAC; and detector/kube/node_status.py on real node parts and ResourceSlices (tests/fixtures/
node_objects/SOURCE)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import REPO
from detector.daemon.local import SERVICE_ACCOUNT, local_daemon, publish_gpu_slice
from detector.daemon.run import DaemonSettings
from detector.kube.api import ApiError, KubeApi
from detector.kube.connection import Connection
from detector.kube.node_status import dra_devices, node_status
from detector.kube.nodewatch import NodeWatch, NodeWatchSettings, signature
from kube_emulator import Emulator

NODE = "gpu-1"
FIXTURES = REPO / "tests" / "fixtures" / "node_objects"
WAIT_S = 5.0          # how long a test waits for what it expects: never reached when the watch works
GPU = "nvidia.com/gpu"


def wait_for(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


class Running:
    """A NodeWatch on its thread, as the daemon runs it, as the daemon's service account."""

    def __init__(self, emulator: Emulator, tmp_path: Path, user: str = SERVICE_ACCOUNT, **settings):
        kubeconfig = emulator.write_kubeconfig(tmp_path / f"{abs(hash(user))}.kubeconfig", user=user)
        self.api = KubeApi.from_kubeconfig(str(kubeconfig), qps=100.0, burst=100)
        settings = {"backoff_base_s": 0.01, "backoff_cap_s": 0.1, "refused_retry_s": 0.05, "qps": 100.0,
                    "burst": 100, **settings}
        self.calls = 0
        self.watch = NodeWatch(self.api, NODE, NodeWatchSettings(**settings), self._changed)
        self.stop = threading.Event()
        self.crashed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _changed(self) -> None:
        self.calls += 1

    def _run(self) -> None:
        try:
            self.watch.run(self.stop)
        except BaseException as e:  # noqa: BLE001 - the test says so
            self.crashed = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)
        assert not self.thread.is_alive(), "the watch did not end on stop"
        assert self.crashed is None, f"the watch raised {self.crashed!r}"

    def count(self, verb: str, resource: str, code: str) -> int:
        return self.api.counts.counts[(verb, resource, code)]


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=(REPO / "deploy" / "base",), bookmark_interval_s=0.05) as emu:
        emu.create_node(NODE, capacity={GPU: "8"})
        emu.create_node("gpu-2", capacity={GPU: "8"})
        yield emu


@pytest.fixture
def running(tmp_path):
    started: list[Running] = []

    def start(emulator: Emulator, **kw) -> Running:
        r = Running(emulator, tmp_path, **kw)
        started.append(r)
        return r
    yield start
    for r in started:
        r.close()


def admin(emulator: Emulator, tmp_path: Path) -> KubeApi:
    return KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "admin.kubeconfig", user="admin")),
                                   qps=100.0, burst=100)


def gpus(r: Running) -> int | None:
    status = r.watch.current()
    return None if status is None else status.count(GPU)


# --- the watch against the emulator ----------------------------------------------------------------

def test_an_allocatable_patch_is_seen_at_once_and_calls_on_change_once(emulator, running, tmp_path):
    r = running(emulator)
    assert wait_for(lambda: gpus(r) == 8)
    assert r.calls == 1                                   # the first read
    admin(emulator, tmp_path).patch_node_status(NODE, {"status": {"allocatable": {GPU: "7"}}})
    assert wait_for(lambda: gpus(r) == 7, 2.0)
    status = r.watch.current()
    assert status is not None and status.count(GPU, allocatable=False) == 8 and status.name == NODE
    assert r.calls == 2
    assert r.count("list", "nodes", "200") == 1 and r.count("get", "nodes", "200") == 0


def test_a_heartbeat_is_not_a_change_and_another_node_is_not_ours(emulator, running, tmp_path):
    r = running(emulator)
    assert wait_for(lambda: r.watch.current() is not None)
    calls, read_at = r.calls, r.watch.current().read_at
    for _ in range(5):        # kubelet's status updates: heartbeats, the same condition again
        emulator.set_node_condition(NODE, {"type": "Ready", "status": "True", "reason": "KubeletReady",
                                           "message": "kubelet is posting ready status"})
    admin(emulator, tmp_path).patch_node_status("gpu-2", {"status": {"allocatable": {GPU: "0"}}})
    emulator.set_node_condition(NODE, {"type": "MaintenanceInProgress", "status": "True", "reason": "Drain"})
    assert wait_for(lambda: r.watch.current().maintenance() == "MaintenanceInProgress=True (Drain)")
    assert r.calls == calls + 1                            # the maintenance condition only
    assert r.watch.current().read_at >= read_at and gpus(r) == 8


def test_the_server_ending_the_watch_is_followed_by_a_new_one(emulator, running, tmp_path):
    r = running(emulator, timeout_s=1)
    assert wait_for(lambda: r.watch.nodes.watches >= 3, 10.0)
    admin(emulator, tmp_path).patch_node_status(NODE, {"status": {"allocatable": {GPU: "6"}}})
    assert wait_for(lambda: gpus(r) == 6)
    assert r.watch.nodes.lists == 1                      # each new watch starts where the last one ended


def test_the_api_server_going_away_and_a_410_recover_without_raising(tmp_path, running, caplog):
    with Emulator(rbac_paths=(REPO / "deploy" / "base",), bookmark_interval_s=0.05, watch_history=3) as emulator:
        emulator.create_node(NODE, capacity={GPU: "8"})
        r = running(emulator, timeout_s=1)              # a watch that lives 0.5 s is a working one
        assert wait_for(lambda: gpus(r) == 8)
        caplog.set_level(logging.INFO, "gpu_npd.kube")
        emulator.down()
        emulator.store.update(*_status_patch(emulator, {GPU: "5"}), subresource="status")
        for i in range(6):                               # more changes than the history keeps
            emulator.create_node(f"other-{i}")
        time.sleep(0.3)                                # the watch retries against a closed port meanwhile
        assert r.thread.is_alive() and r.count("list", "nodes", "error") + r.count("watch", "nodes", "error") > 0
        emulator.up()
        assert wait_for(lambda: gpus(r) == 5)
        said = lambda: [rec.getMessage() for rec in caplog.records]   # noqa: E731
        assert wait_for(lambda: any("working again" in line for line in said()))
        assert r.watch.nodes.lists >= 2                   # the old resourceVersion was gone: read again
        assert sum("node watch failing" in line for line in said()) == 1    # one outage, one line


def _status_patch(emulator: Emulator, allocatable: dict[str, str]):
    from kube_emulator.kinds import NODES  # noqa: PLC0415 - only this helper reaches into the store

    def build(current: dict) -> dict:
        node = json.loads(json.dumps(current))
        node["status"]["allocatable"].update(allocatable)
        return node
    return NODES, None, NODE, build


def refusing_rbac(tmp_path: Path, verbs: str, slices: bool = True) -> Path:
    """deploy/base's RBAC with the nodes rule's verbs replaced (and the ResourceSlice rule dropped)."""
    text = (REPO / "deploy" / "base" / "rbac.yaml").read_text()
    text = text.replace('verbs: ["get", "list", "watch"]', f"verbs: {verbs}", 1)
    if not slices:
        text = text.replace('  - apiGroups: ["resource.k8s.io"]\n    resources: ["resourceslices"]\n'
                            '    verbs: ["get", "list", "watch"]\n', "")
    path = tmp_path / "rbac.yaml"
    path.write_text(text)
    return path


def test_a_refused_watch_is_said_once_with_the_rbac_and_asked_again_rarely(tmp_path, running, caplog):
    with Emulator(rbac_paths=(refusing_rbac(tmp_path, '["get"]'),)) as emulator:
        emulator.create_node(NODE)
        with caplog.at_level(logging.ERROR, "gpu_npd.kube"):
            r = running(emulator)
            assert wait_for(lambda: r.count("list", "nodes", "403") >= 4)
        assert r.watch.current() is None and r.calls == 0 and r.thread.is_alive()
        errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "forbids gpu-npd to list nodes (403 Forbidden)" in errors[0]
        assert "get, list and watch nodes" in errors[0] and "--no-node-watch" in errors[0]


def test_only_this_nodes_slices_of_the_nvidia_driver_are_read(emulator, running, tmp_path):
    from fake_nvml.scenario import load_scenario  # noqa: PLC0415

    publish_gpu_slice(emulator, load_scenario("h100-sxm-8").build(NODE))
    publish_gpu_slice(emulator, load_scenario("h100-sxm-8").build("gpu-2"))
    emulator.create_resource_slice({"metadata": {"name": f"{NODE}-compute-domain"}, "spec": {
        "driver": "compute-domain.nvidia.com", "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                                          "resourceSliceCount": 1},
        "devices": [{"name": "channel-0", "basic": {"attributes": {"type": {"string": "channel"}}}}]}})
    r = running(emulator, read_slices=True)
    assert wait_for(lambda: r.watch.current() is not None and r.watch.current().dra_devices is not None)
    devices = r.watch.current().dra_devices
    assert sorted(d.name for d in devices) == [f"gpu-{i}" for i in range(8)]
    assert {d.pool for d in devices} == {NODE} and all(d.uuid and d.pci_bus_id for d in devices)
    assert r.watch.current().dra_error == ""
    calls = r.calls
    emulator.store.delete(*_slice_key(emulator, f"{NODE}-gpu.nvidia.com-abcde"))     # the driver withdrew it
    assert wait_for(lambda: r.watch.current().dra_devices == ())
    assert r.calls == calls + 1


def _slice_key(emulator: Emulator, name: str):
    return emulator._dra_kind("resourceslices"), None, name


def test_no_dra_api_served_is_no_devices_and_no_error(tmp_path, running):
    with Emulator(rbac_paths=(REPO / "deploy" / "base",), dra_version=None) as emulator:
        emulator.create_node(NODE)
        r = running(emulator, read_slices=True)
        assert wait_for(lambda: r.watch.current() is not None and r.watch.current().dra_error == "")
        assert r.watch.current().dra_devices is None
        assert r.count("list", "resourceslices", "200") == 0


def test_refused_slices_say_which_permission_is_missing(tmp_path, running, caplog):
    with Emulator(rbac_paths=(refusing_rbac(tmp_path, '["get", "list", "watch"]', slices=False),)) as emulator:
        emulator.create_node(NODE)
        with caplog.at_level(logging.ERROR, "gpu_npd.kube"):
            r = running(emulator, read_slices=True)
            assert wait_for(lambda: r.watch.current() is not None and "list resourceslices" in r.watch.current().dra_error)
            assert wait_for(lambda: r.count("list", "resourceslices", "403") >= 3)
        status = r.watch.current()
        assert status.dra_devices is None and status.count(GPU) is None and "403" in status.dra_error
        assert len([rec for rec in caplog.records if "resourceslices" in rec.getMessage()]) == 1


def test_the_daemons_account_may_watch_its_node_and_write_nothing_it_should_not(emulator, tmp_path):
    """deploy/base: list and watch nodes, read ResourceSlices; no write but its node's status and events."""
    sa = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(tmp_path / "sa.kubeconfig", user=SERVICE_ACCOUNT)))
    listed = sa.list_node_collection(field_selector=f"metadata.name={NODE}")
    assert [n["metadata"]["name"] for n in listed["items"]] == [NODE]
    event = next(iter(sa.watch_nodes("", listed["metadata"]["resourceVersion"], 1,
                                     field_selector=f"metadata.name={NODE}")), None)
    assert event is None or event["type"] in ("BOOKMARK", "MODIFIED")
    assert sa.list_resource_slices("v1alpha3", f"spec.nodeName={NODE}") == []
    refused = [
        lambda: sa.patch_node_annotations(NODE, {"a": "b"}),
        lambda: sa.create_node({"metadata": {"name": "intruder"}}),
        lambda: sa._call("delete", "nodes", "DELETE", f"/api/v1/nodes/{NODE}"),
        lambda: sa._call("create", "resourceslices", "POST", "/apis/resource.k8s.io/v1alpha3/resourceslices",
                         {"metadata": {"name": "x"}, "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE,
                                                              "pool": {"name": NODE, "generation": 1,
                                                                       "resourceSliceCount": 1}}}),
        lambda: sa.create_device_taint_rule("v1alpha3", {"metadata": {"name": "x"}}),
        lambda: sa._call("list", "pods", "GET", "/api/v1/pods"),
    ]
    for call in refused:
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 403, e.value
    assert [n["metadata"]["name"] for n in emulator.nodes()] == [NODE, "gpu-2"]


# --- the daemon's wiring ---------------------------------------------------------------------------

def test_the_daemon_reads_its_node_from_the_watch_and_judges_it_again_on_a_change(tmp_path):
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    local = local_daemon("h100-sxm-8", NODE, settings=settings, workdir=tmp_path,
                         check_settings={"visibility": {"interval": 60}}, checks=["visibility"]).start()
    try:
        watch = local.daemon.node_watch
        assert watch is not None and not watch.settings.read_slices
        assert local.wait_for(lambda: local.daemon.host.node_status() is not None)
        admin(local.emulator, tmp_path).patch_node_status(NODE, {"status": {"allocatable": {GPU: "7"}}})
        assert local.wait_for(lambda: local.daemon.host.node_status().count(GPU) == 7, 2.0)
        assert watch.changes >= 2
    finally:
        local.stop()


def test_no_node_watch_leaves_the_node_unknown(tmp_path):
    settings = DaemonSettings(listen="127.0.0.1:0", node_watch=None)
    local = local_daemon("h100-sxm-8", NODE, settings=settings, workdir=tmp_path, checks=["visibility"])
    try:
        assert local.daemon.node_watch is None and local.daemon.host.node_status() is None
    finally:
        local.stop()


# --- node_status.py on real objects ----------------------------------------------------------------

def real_slices() -> list[dict]:
    return yaml.safe_load((FIXTURES / "resourceslices-vks-a100-vgpu.yaml").read_text())["items"]


def test_real_slices_give_the_nodes_gpu_and_not_the_compute_domain_or_another_nodes():
    node = "test-ai-0-node-pool-40c-kn48j-7n6h9-gvhpn"
    [device] = dra_devices(real_slices(), node)
    assert (device.name, device.pool, device.kind) == ("gpu-0", node, "gpu")
    assert device.uuid == "GPU-b65409f1-9131-4932-bbf9-065400000000"
    assert device.pci_bus_id == "0000:03:00.0" and device.index is None    # the 25.12 driver has no index
    assert dra_devices(real_slices(), "some-other-node") == ()
    assert [d.name for d in dra_devices(real_slices(), node, "compute-domain.nvidia.com")] == ["channel-0", "daemon-0"]


def test_a_pool_being_republished_counts_its_newest_generation_only():
    old = real_slices()[1]
    new = json.loads(json.dumps(old))
    new["metadata"]["name"] += "-2"
    new["spec"]["pool"]["generation"] = 2
    new["spec"]["devices"][0]["attributes"]["uuid"]["string"] = "GPU-00000000-0000-0000-0000-000000000002"
    devices = dra_devices([old, new], old["spec"]["nodeName"])
    assert [d.uuid for d in devices] == ["GPU-00000000-0000-0000-0000-000000000002"]


def test_the_drivers_older_pcie_bus_id_attribute_is_read():
    """Before the driver's 25.12 releases the bus id was `pcieBusID` (dra-driver-nvidia-gpu issue 719)."""
    s = real_slices()[1]
    attributes = s["spec"]["devices"][0]["attributes"]
    attributes["pcieBusID"] = attributes.pop("resource.kubernetes.io/pciBusID")
    [device] = dra_devices([s], s["spec"]["nodeName"])
    assert device.pci_bus_id == "0000:03:00.0"


def test_a_node_of_real_parts_reads_its_gpus_labels_and_conditions():
    labels = json.loads((FIXTURES / "node-labels-vks-a100-vgpu.json").read_text())
    status = yaml.safe_load((FIXTURES / "node-status-podman-desktop-7778.yaml").read_text())["status"]
    status["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                             "lastTransitionTime": "2024-06-21T10:00:00Z"}]
    parsed = node_status({"metadata": {"name": "nvidia1", "labels": labels}, "status": status}, 1.0)
    assert parsed.count(GPU) == 1 and parsed.count(GPU, allocatable=False) == 1
    assert parsed.count("cpu") == 16                                          # read as Kubernetes quantities
    assert parsed.count("memory") == int(parsed.capacity["memory"].removesuffix("Ki")) * 1024
    assert parsed.labels["nvidia.com/gpu.product"] == "GRID-A100-40C"
    assert parsed.labels["nvidia.com/gpu.deploy.nvsm"] == ""
    assert parsed.conditions["Ready"].since == 1718964000.0 and parsed.maintenance() == ""
    assert parsed.dra_devices is None and signature(parsed) == signature(node_status(
        {"metadata": {"name": "nvidia1", "labels": labels}, "status": status}, 2.0))


class _GoneStream:
    """A watch response whose socket the pool already closed: shutting it down raises, as urllib3's does."""

    def __init__(self):
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1
        raise OSError(9, "Bad file descriptor")


def test_ending_a_watch_whose_socket_is_already_gone_is_no_error():
    """The daemon stopping as a watch ends on its own: the stream's socket is closed twice, and the watch
    thread must still end quietly (it raised OSError from its last line once, in a test run)."""
    follow = NodeWatch(KubeApi(Connection("http://127.0.0.1:1")), NODE).nodes
    gone = _GoneStream()
    follow._opened(gone)
    follow.close()
    follow._opened(gone)          # a watch opened as the stop came: ended at once, quietly too
    assert gone.shutdowns == 2
