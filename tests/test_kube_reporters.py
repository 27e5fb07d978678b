"""Condition and event reporters against a scripted API: what they send, when, and how they back off."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import Clock
from detector.agent.active import ConditionStatus
from detector.core.types import Severity
from detector.kube.api import ApiError
from detector.kube.conditions import MARKER, ConditionReporter
from detector.kube.events import COMBINED, EventReporter, EventSettings
from detector.kube.pacing import Backoff, TokenBucket


@dataclass
class ScriptedApi:
    """Records every call; raises the next scripted error, if any."""

    node: dict[str, Any] = field(default_factory=lambda: {"status": {"conditions": []}})
    errors: list[ApiError] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def _call(self, verb: str, body: Any) -> dict[str, Any]:
        self.calls.append((verb, body))
        if self.errors:
            raise self.errors.pop(0)
        return {}

    def get_node(self, name: str) -> dict[str, Any]:
        self._call("get", name)
        return self.node

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("patch-status", body)

    def create_event(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("create-event", body)

    def patch_event(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("patch-event", (name, body))


def xid(active: bool, reason: str = "Xid79", message: str = "GPU 3 (GPU-3, 0000:5d:00.0): XID 79") -> ConditionStatus:
    return ConditionStatus("GpuXidError", active, reason if active else "NoGpuXidError",
                           message if active else "no GpuXidError problem found", Severity.CRITICAL if active else None)


def reporter(api: ScriptedApi, clock: Clock, **kw: Any) -> ConditionReporter:
    return ConditionReporter(api, "n1", {"GpuXidError", "GpuMissing"}, clock, rng=random.Random(1),
                             backoff=Backoff(1.0, 8.0, random.Random(1)), **kw)


def sent_conditions(api: ScriptedApi) -> list[list[dict[str, Any]]]:
    return [body["status"]["conditions"] for verb, body in api.calls if verb == "patch-status"]


def test_sends_only_owned_types_with_marker_and_times():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock)
    assert r.update([xid(True), ConditionStatus("Ready", True, "x", "y")])
    assert r.due_at() == 0.0
    assert r.flush()
    [conditions] = sent_conditions(api)
    assert [c["type"] for c in conditions] == ["GpuXidError"]              # never kubelet's
    c = conditions[0]
    assert c["status"] == "True" and c["reason"] == "Xid79" and c["message"].startswith(MARKER)
    assert c["lastTransitionTime"] == c["lastHeartbeatTime"] == "2023-11-14T22:13:20Z"
    assert not r.update([xid(True)])                                        # nothing new: nothing to send


def test_transition_time_kept_until_the_status_flips_and_heartbeat_refreshes():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock, heartbeat_s=300.0, jitter=0.1)
    r.update([xid(True)])
    r.flush()
    first = sent_conditions(api)[0][0]["lastTransitionTime"]
    assert 300 <= r.due_at() - clock.now <= 330                              # heartbeat, jittered, never sooner
    clock.now += 60
    r.update([xid(True, message="GPU 3: XID 79 | GPU 4: XID 79")])           # same status, new message
    r.flush()
    second = sent_conditions(api)[-1][0]
    assert second["lastTransitionTime"] == first and second["lastHeartbeatTime"] != first
    clock.now = r.due_at() + 1
    r.flush()                                                                # the heartbeat
    assert len(sent_conditions(api)) == 3
    assert sent_conditions(api)[-1][0]["lastTransitionTime"] == first
    clock.now += 10
    r.update([xid(False)])
    r.flush()
    cleared = sent_conditions(api)[-1][0]
    assert cleared["status"] == "False" and cleared["lastTransitionTime"] != first


def test_adopt_keeps_transition_times_and_deletes_stale_owned_types():
    api, clock = ScriptedApi(), Clock()
    node = {"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"},
        {"type": "GpuXidError", "status": "True", "reason": "Xid79", "message": MARKER + "old",
         "lastTransitionTime": "2020-01-01T00:00:00Z"},
        {"type": "GpuOldCheck", "status": "False", "reason": "NoGpuOldCheck", "message": MARKER + "none"},
        {"type": "SomeoneElses", "status": "True", "reason": "X", "message": "not ours"},
    ]}}
    r = reporter(api, clock)
    r.adopt(node)
    assert r.due_at() == 0.0                                  # the stale type must go even before checks ran
    r.flush()
    assert sent_conditions(api)[-1] == [{"type": "GpuOldCheck", "$patch": "delete"}]
    r.update([xid(True, message="new")])
    r.flush()
    c = sent_conditions(api)[-1][0]
    assert c["lastTransitionTime"] == "2020-01-01T00:00:00Z"  # a restart does not reset it


def test_failures_back_off_honour_retry_after_and_coalesce_to_the_latest_state():
    api, clock = ScriptedApi(errors=[ApiError(429, "TooManyRequests", "slow down", retry_after_s=20.0),
                                     ApiError(0, "ConnectionFailed", "refused")]), Clock()
    r = reporter(api, clock)
    r.update([xid(True)])
    assert not r.flush()
    assert r.due_at() - clock.now >= 20.0                     # Retry-After is a floor
    r.update([xid(True, message="second")])
    r.update([xid(False)])                                    # latest state wins
    assert r.flush()                                          # not yet due: nothing sent
    assert len(api.calls) == 1
    clock.now = r.due_at()
    assert not r.flush()                                      # connection refused
    delay = r.due_at() - clock.now
    assert 1.0 <= delay <= 2.0                                # second failure: base * 2, jittered
    clock.now += delay
    assert r.flush()
    final = sent_conditions(api)[-1][0]
    assert final["status"] == "False" and len(api.calls) == 3


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_is_asked_again_rarely_and_the_latest_state_then_goes(status):
    api, clock = ScriptedApi(errors=[ApiError(status, "Refused", "no")]), Clock()
    r = reporter(api, clock)
    r.backoff.refused_s = 300.0
    r.update([xid(True)])
    assert not r.flush()                                      # no exception: the daemon goes on
    assert r.due_at() - clock.now == 300.0                    # not the 1-8 s backoff of an outage
    clock.now += 299.0
    r.update([xid(False)])
    assert r.flush() and len(api.calls) == 1                  # still waiting
    clock.now += 1.0
    assert r.flush() and sent_conditions(api)[-1][0]["status"] == "False"


def test_a_refused_event_waits_as_long_and_keeps_its_count():
    api, clock = ScriptedApi(errors=[ApiError(403, "Forbidden", "no")]), Clock()
    events = EventReporter(api, "n1", clock, EventSettings(), random.Random(1),
                           Backoff(1.0, 8.0, random.Random(1), refused_s=300.0))
    events.record("Warning", "Xid79", "XID 79", 2)
    assert not events.flush() and events.due_at() == clock.now + 300.0
    events.record("Warning", "Xid79", "XID 79", 1)
    clock.now += 300.0
    assert events.flush()
    assert [body["count"] for verb, body in api.calls if verb == "create-event"] == [2, 3]   # refused, then sent


def test_condition_message_is_bounded():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock)
    r.update([xid(True, message="x" * 5000)])
    r.flush()
    assert len(sent_conditions(api)[0][0]["message"]) == 1024


def test_a_gpu_note_ends_the_messages_of_true_conditions_naming_a_gpu_only():
    api, clock = ScriptedApi(), Clock()
    r = reporter(api, clock)
    gpu = ConditionStatus("GpuXidError", True, "Xid79", "x" * 5000, Severity.CRITICAL, names_gpu=True)
    node_wide = ConditionStatus("GpuMissing", True, "NvmlHung", "NVML hung", Severity.CRITICAL)
    r.update([gpu, node_wide])
    r.flush()
    assert not r.note_gpus("")                                               # no note, nothing new to send
    note = "DRA device taints: node n1 has no ResourceSlice of driver gpu.nvidia.com: no GPU is tainted"
    assert r.note_gpus(note)
    assert r.flush()
    by_type = {c["type"]: c["message"] for c in sent_conditions(api)[-1]}
    assert by_type["GpuXidError"].endswith("… | " + note) and len(by_type["GpuXidError"]) == 1024   # kept whole
    assert by_type["GpuMissing"] == MARKER + "NVML hung"                     # the node's own: no GPU to fence
    assert not r.note_gpus(note)                                             # the same note: nothing to send
    r.update([xid(False)])
    r.flush()
    assert {c["type"]: c["message"] for c in sent_conditions(api)[-1]}["GpuXidError"] == (
        MARKER + "no GpuXidError problem found")                             # a false condition: no note
    r.update([gpu])
    assert r.note_gpus("")                                                   # fenced after all: the note goes
    r.flush()
    assert " | DRA" not in {c["type"]: c["message"] for c in sent_conditions(api)[-1]}["GpuXidError"]


# -- events --------------------------------------------------------------------------------------

def events(api: ScriptedApi, clock: Clock, **settings: Any) -> EventReporter:
    return EventReporter(api, "n1", clock, EventSettings(**settings), random.Random(2),
                         Backoff(1.0, 8.0, random.Random(2)))


def test_identical_repeats_become_one_event_with_a_growing_count():
    api, clock = ScriptedApi(), Clock()
    ev = events(api, clock)
    ev.record("Warning", "Xid13", "GPU 1: XID 13")
    ev.flush()
    (verb, body), = api.calls
    assert verb == "create-event" and body["count"] == 1
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "n1"}
    assert body["source"] == {"component": "gpu-npd", "host": "n1"} and body["type"] == "Warning"
    for _ in range(3):
        clock.now += 10
        ev.record("Warning", "Xid13", "GPU 1: XID 13")
    ev.flush()
    verb, (name, patch) = api.calls[-1]
    assert verb == "patch-event" and name == body["metadata"]["name"] and patch["count"] == 4
    assert len(api.calls) == 2                                 # three repeats, one PATCH


def test_after_the_window_a_repeat_starts_a_new_event():
    api, clock = ScriptedApi(), Clock()
    ev = events(api, clock, window_s=600)
    ev.record("Warning", "Xid13", "m")
    ev.flush()
    clock.now += 601
    ev.record("Warning", "Xid13", "m")
    ev.flush()
    assert [v for v, _ in api.calls] == ["create-event", "create-event"]


def test_many_similar_messages_are_combined():
    api, clock = ScriptedApi(), Clock()
    ev = events(api, clock, similar_limit=3, burst=100)
    for i in range(8):
        ev.record("Warning", "Xid13", f"GPU {i}: XID 13")
    ev.flush()
    creates = [b for v, b in api.calls if v == "create-event"]
    assert len(creates) == 4                                   # 3 distinct, then one combined series
    assert creates[-1]["message"].startswith(COMBINED) and creates[-1]["count"] == 5


def test_token_bucket_limits_writes_but_keeps_counts():
    api, clock = ScriptedApi(), Clock()
    ev = events(api, clock, burst=2, refill_per_s=1 / 300)
    for i in range(4):
        ev.record("Warning", f"R{i}", "m")
    ev.flush()
    assert len(api.calls) == 2
    ev.record("Warning", "R3", "m")                            # a pending repeat adds to the count
    assert 299 <= ev.due_at() - clock.now <= 301
    clock.now += 300
    ev.flush()
    assert len(api.calls) == 3
    clock.now += 300
    ev.flush()
    assert api.calls[-1][1]["reason"] == "R3" and api.calls[-1][1]["count"] == 2


def test_pending_series_are_bounded():
    api, clock = ScriptedApi(errors=[ApiError(503, "ServiceUnavailable", "down")] * 100), Clock()
    ev = events(api, clock, max_series=5, burst=1000)
    for i in range(50):
        ev.record("Warning", f"R{i}", "m")
    assert len(ev._series) == 5 and ev.stats.dropped == 45


def test_an_expired_event_is_created_again_and_a_lost_create_answer_becomes_a_patch():
    api, clock = ScriptedApi(), Clock()
    ev = events(api, clock)
    ev.record("Warning", "Xid13", "m")
    ev.flush()
    api.errors = [ApiError(404, "NotFound", "gone")]
    ev.record("Warning", "Xid13", "m")
    ev.flush()
    assert [v for v, _ in api.calls] == ["create-event", "patch-event", "create-event"]
    assert api.calls[-1][1]["count"] == 2
    api.errors = [ApiError(409, "AlreadyExists", "exists")]
    clock.now += 1000
    ev.record("Warning", "Other", "m")
    ev.flush()
    assert [v for v, _ in api.calls][-2:] == ["create-event", "patch-event"]


def test_token_bucket_and_backoff():
    clock = Clock()
    bucket = TokenBucket(2.0, 3, clock)
    assert [bucket.try_take() for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.try_take()
    b = Backoff(1.0, 4.0, random.Random(0))
    delays = [b.next_delay() for _ in range(5)]
    assert 0.5 <= delays[0] <= 1.0 and all(2.0 <= d <= 4.0 for d in delays[2:])
    assert b.next_delay(retry_after_s=30.0) == 30.0


# -- flip events (KubeReporter) ---------------------------------------------------------------------

def kube_reporter(api: ScriptedApi, clock: Clock):
    from detector.kube.reporter import KubeReporter
    return KubeReporter(api, "n1", ["GpuXidError", "GpuMissing"], clock=clock, rng=random.Random(1))


def created_events(api: ScriptedApi) -> list[tuple[str, str]]:
    return [(body["reason"], body["message"]) for verb, body in api.calls if verb == "create-event"]


def test_a_restarted_daemon_judging_before_the_node_was_read_does_not_announce_again():
    """The agent's first sweep may finish before the sender thread has read the node: flips wait for it,
    so a condition the node already shows True (a restart) is not announced a second time."""
    clock = Clock(1000.0)
    api = ScriptedApi(node={"status": {"conditions": [
        {"type": "GpuXidError", "status": "True", "reason": "Xid79", "message": MARKER + "GPU 3: XID 79",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
    out = kube_reporter(api, clock)
    out.conditions([xid(True), ConditionStatus("GpuMissing", False, "NoGpuMissing", "none", None)])
    assert created_events(api) == []
    out.flush()                                   # reads the node, then sends
    assert created_events(api) == []
    out.conditions([xid(False)])
    clock.now += 1
    out.flush()
    assert [reason for reason, _ in created_events(api)] == ["NoGpuXidError"]


def test_a_condition_new_to_the_node_is_announced_once_even_if_judged_twice_before_sending():
    clock = Clock(1000.0)
    api = ScriptedApi()
    out = kube_reporter(api, clock)
    out.conditions([xid(True)])
    out.conditions([xid(True)])                   # before the node was read
    out.flush()
    out.conditions([xid(True)])                   # after: unchanged
    clock.now += 1
    out.flush()
    assert [reason for reason, _ in created_events(api)] == ["Xid79"]
