"""gpu-npd.io/unhealthy-gpus: the node annotation listing the node's unhealthy GPUs. Its value, how it
rides in the conditions' status PATCH (scripted API), the emulator taking annotations through the status
subresource, and the real Daemon on a fake 8-GPU node against the emulator."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Clock
from detector.core.gpu_health import DEGRADED, FAILED, HEALTHY, GpuHealth
from detector.core.types import GpuRef
from detector.daemon.local import SERVICE_ACCOUNT, LocalDaemon
from detector.kube.annotations import UNHEALTHY_GPUS, read_unhealthy_gpus, unhealthy_gpus_annotation
from detector.kube.api import ApiError, KubeApi
from detector.kube.stamps import parse_rfc3339
from fake_nvml.faults import Fault
from kube_emulator import Emulator
from test_daemon_e2e import emulator, fast_settings, running, settled, status  # noqa: F401 - fixtures
from test_emulator_api import api as core_api
from test_kube_reporters import ScriptedApi, kube_reporter, reporter, xid

KUBELET_ANNOTATIONS = {"node.alpha.kubernetes.io/ttl": "0",
                       "volumes.kubernetes.io/controller-managed-attach-detach": "true"}
OTHER_ANNOTATIONS = {**KUBELET_ANNOTATIONS, "example.com/owner": "team-a"}


def gpu(index: int | None, state: str, action: str = "NONE", bus: str | None = None, uuid: str | None = None):
    bus = bus if bus is not None or index is None else f"0000:{index + 16:02x}:00.0"
    return GpuHealth(GpuRef(index, uuid if uuid is not None else f"GPU-{index}", bus), state, action)


# -- the value --------------------------------------------------------------------------------------

def test_value_lists_only_unhealthy_gpus_sorted_compact():
    assert UNHEALTHY_GPUS == "gpu-npd.io/unhealthy-gpus"
    health = [gpu(5, DEGRADED, "RESET_GPU"), gpu(0, HEALTHY), gpu(3, FAILED, "RESTART_BM"), gpu(7, HEALTHY),
              gpu(None, FAILED, "RESTART_BM", bus="0000:01:00.0", uuid=""),
              gpu(3, DEGRADED, "RESET_GPU", bus="0000:0a:00.0", uuid="GPU-3b")]
    value = unhealthy_gpus_annotation(health)
    assert value is not None and " " not in value
    assert json.loads(value) == [
        {"index": 3, "pciBusId": "0000:0a:00.0", "uuid": "GPU-3b", "state": "degraded", "action": "RESET_GPU"},
        {"index": 3, "pciBusId": "0000:13:00.0", "uuid": "GPU-3", "state": "failed", "action": "RESTART_BM"},
        {"index": 5, "pciBusId": "0000:15:00.0", "uuid": "GPU-5", "state": "degraded", "action": "RESET_GPU"},
        {"pciBusId": "0000:01:00.0", "state": "failed", "action": "RESTART_BM"},     # no index: last; no uuid
    ]
    assert value.startswith('[{"index":3,"pciBusId":"0000:0a:00.0","uuid":"GPU-3b","state":"degraded",')
    only_index = GpuHealth(GpuRef(2), FAILED, "RESTART_BM")
    assert unhealthy_gpus_annotation([only_index]) == '[{"index":2,"state":"failed","action":"RESTART_BM"}]'


def test_no_unhealthy_gpu_no_value():
    assert unhealthy_gpus_annotation([]) is None
    assert unhealthy_gpus_annotation([gpu(0, HEALTHY), gpu(1, HEALTHY)]) is None


def test_serial_and_since_are_written_and_a_restart_keeps_the_serial_the_node_remembers():
    known = GpuHealth(GpuRef(3, "GPU-3", "0000:5d:00.0"), FAILED, "RESTART_BM", serial="1650566906417",
                      since=1_700_000_000.4)
    value = unhealthy_gpus_annotation([known])
    assert value == ('[{"index":3,"pciBusId":"0000:5d:00.0","uuid":"GPU-3","serial":"1650566906417",'
                     '"state":"failed","action":"RESTART_BM","since":"2023-11-14T22:13:20Z"}]')
    lost = GpuHealth(GpuRef(3, "GPU-3", "0000:5d:00.0"), FAILED, "RESTART_BM", since=1_700_000_000.0)
    assert unhealthy_gpus_annotation([lost], value) == value                  # NVML cannot read it any more
    other_board = GpuHealth(GpuRef(3, "GPU-new", "0000:5d:00.0"), FAILED, "RESTART_BM")
    assert "serial" not in unhealthy_gpus_annotation([other_board], value)    # a swapped board is not the same
    assert unhealthy_gpus_annotation([lost], "not json") == unhealthy_gpus_annotation([lost])


def test_old_and_new_values_read_back():
    old = read_unhealthy_gpus('[{"index":2,"pciBusId":"0000:3a:00.0","state":"degraded","action":"RESET_GPU"}]')
    assert [g.to_dict() for g in old] == [{"index": 2, "pciBusId": "0000:3a:00.0", "uuid": None, "serial": None,
                                           "state": "degraded", "action": "RESET_GPU", "since": None}]
    assert read_unhealthy_gpus(None) == [] and read_unhealthy_gpus("") == []
    for junk in ("{", '{"index": 1}', "[1, 2]"):
        with pytest.raises(ValueError, match="unhealthy-gpus"):
            read_unhealthy_gpus(junk)


# -- in the status PATCH (scripted API) ---------------------------------------------------------------

VALUE = '[{"index":3,"state":"failed","action":"RESTART_BM"}]'


def patches(api: ScriptedApi) -> list[dict[str, Any]]:
    return [body for verb, body in api.calls if verb == "patch-status"]


def test_annotation_rides_with_condition_changes_and_never_with_a_heartbeat():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock, heartbeat_s=300.0)
    r.adopt({"metadata": {"annotations": dict(OTHER_ANNOTATIONS)}, "status": {"conditions": []}})
    r.update([xid(True)])
    assert r.annotate(VALUE) and not r.annotate(VALUE)
    assert r.flush()
    [body] = patches(api)                                           # one request for both
    assert body["metadata"] == {"annotations": {UNHEALTHY_GPUS: VALUE}}
    assert [c["type"] for c in body["status"]["conditions"]] == ["GpuXidError"]
    assert r.due_at() is not None and r.due_at() > clock.now        # only the heartbeat is left
    clock.now = r.due_at() + 1
    r.annotate(VALUE)                                               # every sweep gives it again
    r.flush()
    assert len(patches(api)) == 2 and "metadata" not in patches(api)[-1]

    clock.now += 1
    r.annotate(None)                                                # the GPU recovered
    r.update([xid(False)])
    r.flush()
    assert len(patches(api)) == 3
    assert patches(api)[-1]["metadata"] == {"annotations": {UNHEALTHY_GPUS: None}}
    clock.now += 1
    r.annotate(None)
    r.flush()
    assert len(patches(api)) == 3                                   # nothing due: no request


def test_annotation_alone_is_sent_even_before_any_condition_was_judged():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock)
    r.adopt({"status": {"conditions": []}})
    r.annotate(VALUE)
    assert r.due_at() == 0.0 and r.flush()
    assert patches(api) == [{"metadata": {"annotations": {UNHEALTHY_GPUS: VALUE}}}]
    clock.now += 1000                                               # no conditions: no heartbeat either
    assert r.due_at() is None and r.flush() and len(patches(api)) == 1


def test_removal_only_when_the_node_has_it_and_an_unchanged_value_is_not_resent():
    api, clock = ScriptedApi(), Clock()
    never = reporter(api, clock)
    never.adopt({"metadata": {"annotations": dict(OTHER_ANNOTATIONS)}, "status": {"conditions": []}})
    never.annotate(None)                                            # all healthy, never had it
    assert never.due_at() is None and never.flush() and patches(api) == []

    on_node = {"metadata": {"annotations": {**OTHER_ANNOTATIONS, UNHEALTHY_GPUS: VALUE}},
               "status": {"conditions": []}}
    restarted = reporter(api, clock)
    restarted.adopt(on_node)
    restarted.annotate(VALUE)                                       # a restart, still broken
    assert restarted.due_at() is None and restarted.flush() and patches(api) == []
    restarted.annotate(None)                                        # then it recovers
    restarted.flush()
    assert patches(api) == [{"metadata": {"annotations": {UNHEALTHY_GPUS: None}}}]


def test_a_failed_patch_keeps_the_annotation_due_and_the_latest_value_goes():
    api, clock = ScriptedApi(errors=[ApiError(503, "ServiceUnavailable", "later")]), Clock()
    r = reporter(api, clock)
    r.adopt({"status": {"conditions": []}})
    r.annotate(VALUE)
    assert not r.flush()
    newer = VALUE.replace("]", ',{"index":4,"state":"degraded","action":"RESET_GPU"}]')
    r.annotate(newer)
    clock.now = r.due_at()
    assert r.flush()
    assert [b["metadata"]["annotations"][UNHEALTHY_GPUS] for b in patches(api)] == [VALUE, newer]


def test_kube_reporter_waits_for_the_node_and_wakes_only_on_a_change():
    clock = Clock(1000.0)
    api = ScriptedApi(errors=[ApiError(503, "ServiceUnavailable", "later")])
    out = kube_reporter(api, clock)
    health = [gpu(3, FAILED, "RESTART_BM"), gpu(4, HEALTHY)]
    out.gpus(health)
    assert out.wake.is_set()
    out.wake.clear()
    out.gpus(health)
    assert not out.wake.is_set()                                    # same value: nothing to wake for
    out.flush()                                                     # the node could not be read
    assert patches(api) == []                                       # so nothing is written yet
    clock.now = out.due_at() or clock.now
    out.flush()
    assert [verb for verb, _ in api.calls] == ["get", "get", "patch-status"]
    assert json.loads(patches(api)[0]["metadata"]["annotations"][UNHEALTHY_GPUS]) == [
        {"index": 3, "pciBusId": "0000:13:00.0", "uuid": "GPU-3", "state": "failed", "action": "RESTART_BM"}]
    out.gpus([gpu(3, HEALTHY), gpu(4, HEALTHY)])
    assert out.wake.is_set()


# -- the emulator: annotations through nodes/<name>/status ----------------------------------------------

def api_as(emu: Emulator, tmp_path: Path, user: str) -> KubeApi:
    path = emu.write_kubeconfig(tmp_path / f"{user.replace(':', '_')}.kubeconfig", user=user)
    return KubeApi.from_kubeconfig(str(path))


def test_emulator_status_patch_sets_and_removes_annotations_and_keeps_the_rest(emulator, tmp_path):
    emulator.create_node("n1", labels={"pool": "h100"})
    api_as(emulator, tmp_path, "admin").patch_node_annotations("n1", dict(OTHER_ANNOTATIONS))
    sa = api_as(emulator, tmp_path, SERVICE_ACCOUNT)               # deploy/base: patch nodes/status only
    with pytest.raises(ApiError) as denied:
        sa.patch_node_annotations("n1", {UNHEALTHY_GPUS: VALUE})
    assert denied.value.status == 403

    got = sa.patch_node_status("n1", {"metadata": {"annotations": {UNHEALTHY_GPUS: VALUE}},
                                      "spec": {"unschedulable": True}})
    assert got["metadata"]["annotations"] == {**OTHER_ANNOTATIONS, UNHEALTHY_GPUS: VALUE}
    node = emulator.node("n1")
    assert node["metadata"]["annotations"] == {**OTHER_ANNOTATIONS, UNHEALTHY_GPUS: VALUE}
    assert node["metadata"]["labels"]["pool"] == "h100" and "unschedulable" not in node["spec"]  # spec: reset

    sa.patch_node_status("n1", {"metadata": {"annotations": {UNHEALTHY_GPUS: None}}})
    node = emulator.node("n1")
    assert node["metadata"]["annotations"] == OTHER_ANNOTATIONS and node["metadata"]["labels"]["pool"] == "h100"

    with pytest.raises(ApiError) as invalid:                        # still validated: a map of strings
        sa.patch_node_status("n1", {"metadata": {"annotations": {UNHEALTHY_GPUS: 3}}})
    assert invalid.value.status == 422
    body = emulator.node("n1")                                      # an update (PUT) of status too
    body["metadata"]["annotations"]["example.com/owner"] = "team-b"
    core_api(emulator, tmp_path).replace_node_status("n1", body)
    assert emulator.node("n1")["metadata"]["annotations"]["example.com/owner"] == "team-b"


# -- the real Daemon against the emulator ---------------------------------------------------------------

@pytest.fixture
def bodies(monkeypatch) -> list[dict[str, Any]]:
    """Every status PATCH body the daemon sends."""
    sent: list[dict[str, Any]] = []
    original = KubeApi.patch_node_status

    def record(self: KubeApi, name: str, body: dict[str, Any]) -> dict[str, Any]:
        sent.append(copy.deepcopy(body))
        return original(self, name, body)

    monkeypatch.setattr(KubeApi, "patch_node_status", record)
    return sent


def annotations(emu: Emulator, name: str = "gpu-1") -> dict[str, str]:
    return dict(emu.node(name)["metadata"].get("annotations") or {})


def unhealthy(emu: Emulator) -> list[dict[str, Any]] | None:
    value = annotations(emu).get(UNHEALTHY_GPUS)
    return None if value is None else json.loads(value)


def annotation_values(sent: list[dict[str, Any]]) -> list[str | None]:
    return [b["metadata"]["annotations"][UNHEALTHY_GPUS] for b in sent if "metadata" in b]


def quiet(sent: list[dict[str, Any]], for_s: float = 1.0, timeout_s: float = 10.0) -> None:
    """Wait until no annotation change was sent for `for_s`."""
    deadline = time.monotonic() + timeout_s
    seen, since = len(annotation_values(sent)), time.monotonic()
    while time.monotonic() - since < for_s:
        assert time.monotonic() < deadline, annotation_values(sent)
        time.sleep(0.05)
        if len(annotation_values(sent)) != seen:
            seen, since = len(annotation_values(sent)), time.monotonic()


def a_node_with_other_annotations(emu: Emulator, tmp_path: Path) -> None:
    emu.create_node("gpu-1", labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "8"})
    api_as(emu, tmp_path, "admin").patch_node_annotations("gpu-1", dict(OTHER_ANNOTATIONS))


def test_a_failed_gpu_is_annotated_and_the_annotation_goes_when_it_recovers(emulator, running, bodies, tmp_path):
    a_node_with_other_annotations(emulator, tmp_path)
    local: LocalDaemon = running(settings=fast_settings(heartbeat_s=0.3))
    settled(local)
    time.sleep(0.5)
    assert UNHEALTHY_GPUS not in annotations(emulator) and annotation_values(bodies) == []   # never had it

    gpu3 = local.node.snapshot().gpus[3]
    injected = time.time()
    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert local.wait_for(lambda: unhealthy(emulator) is not None), annotations(emulator)
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True")
    first = json.loads(annotation_values(bodies)[0])
    since = first[0].pop("since")
    assert first == [{"index": 3, "pciBusId": "0000:5d:00.0", "uuid": gpu3.uuid, "serial": gpu3.serial,
                      "state": "failed", "action": "RESTART_BM"}]
    assert int(injected) <= parse_rfc3339(since) <= time.time()      # when it failed, to the second
    assert {k: v for k, v in annotations(emulator).items() if k != UNHEALTHY_GPUS} == OTHER_ANNOTATIONS

    quiet(bodies)                                                   # the value settled: heartbeats only now
    before, value = len(bodies), annotations(emulator)[UNHEALTHY_GPUS]
    assert [{k: v for k, v in g.items() if k != "uuid"} for g in json.loads(value)] == [
        {"index": 3, "pciBusId": "0000:5d:00.0", "serial": gpu3.serial, "state": "failed", "action": "RESTART_BM",
         "since": since}]                                           # the same since: the state did not change
    time.sleep(1.5)
    heartbeats = bodies[before:]
    assert len(heartbeats) >= 3 and all("metadata" not in b for b in heartbeats), annotation_values(bodies)
    assert annotations(emulator)[UNHEALTHY_GPUS] == value

    local.node.inject(Fault("reboot"))                              # XID 79 holds until a reboot
    assert local.wait_for(lambda: UNHEALTHY_GPUS not in annotations(emulator)), annotations(emulator)
    assert annotations(emulator) == OTHER_ANNOTATIONS
    assert local.wait_for(lambda: status(local, "GpuXidError") == "False")
    values = annotation_values(bodies)
    assert values[-1] is None and values.count(None) == 1
    assert all(a != b for a, b in zip(values, values[1:]))          # never the same value twice in a row
    assert emulator.request_count(code=403) == 0 and emulator.request_count(code=422) == 0


def test_a_restart_with_the_annotation_on_the_node_sends_nothing_for_it(emulator, running, bodies, tmp_path):
    a_node_with_other_annotations(emulator, tmp_path)
    state = tmp_path / "state"
    first = running(state_dir=state)
    settled(first)
    first.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert first.wait_for(lambda: unhealthy(emulator) is not None and status(first, "GpuXidError") == "True")
    quiet(bodies)
    on_node = annotations(emulator)
    first.daemon.stop.set()
    assert first.thread is not None
    first.thread.join(10)

    sent_before = len(bodies)
    second = running(state_dir=state, node=first.node)              # XID 79 is held across the restart
    time.sleep(2.0)                                                 # several sweeps of every check
    assert annotations(emulator) == on_node
    assert annotation_values(bodies[sent_before:]) == []            # already there: not written again
    assert second.daemon.reporter is not None and second.daemon.reporter.started

    second.node.inject(Fault("reboot"))                             # the adopted annotation is removed
    assert second.wait_for(lambda: UNHEALTHY_GPUS not in annotations(emulator)), annotations(emulator)
    assert annotations(emulator) == OTHER_ANNOTATIONS
    assert annotation_values(bodies[sent_before:]) == [None]
