"""Injected faults as a client meets them (429 with Retry-After, 503, latency, dropped connections,
a server that goes away and comes back) and the request statistics a benchmark reads."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import urllib3
from kubernetes import client, config

from conftest import REPO, Clock
from kube_emulator import Emulator
from kube_emulator.faults import Faults
from kube_emulator.stats import Stats

SA = "system:serviceaccount:gpu-npd:gpu-npd"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def emulator(clock):
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], clock=clock) as emu:
        emu.create_node("n1")
        yield emu


def api(emu: Emulator, tmp_path: Path, user: str = SA) -> client.CoreV1Api:
    path = emu.write_kubeconfig(tmp_path / f"{user.replace(':', '_')}.kubeconfig", user=user)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


@pytest.fixture
def sa(emulator, tmp_path) -> client.CoreV1Api:
    return api(emulator, tmp_path)


def control(emu: Emulator, action: str, body: dict | None = None) -> dict:
    reading = action in ("stats", "faults")
    req = urllib.request.Request(
        f"{emu.url}/emulator/{action}", method="GET" if reading else "POST",
        data=None if reading else json.dumps(body or {}).encode(),
        headers={"Authorization": f"Bearer {emu.token_for('admin')}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def condition_patch(status: str = "True") -> dict:
    return {"status": {"conditions": [{"type": "GpuHealthy", "status": status}]}}


def test_429_carries_retry_after_to_the_client(emulator, sa):
    emulator.fail(429, count=1, retry_after=7)
    with pytest.raises(client.ApiException) as err:
        sa.patch_node_status("n1", condition_patch())
    assert err.value.status == 429
    assert err.value.headers["Retry-After"] == "7"
    body = json.loads(err.value.body)
    assert body["reason"] == "TooManyRequests" and body["details"] == {"retryAfterSeconds": 7}
    sa.patch_node_status("n1", condition_patch())
    assert emulator.request_count(code=429) == 1 and emulator.request_count(code=200) == 1


def test_urllib3_retries_a_get_that_carries_retry_after(emulator, sa):
    # The client's default urllib3 Retry honours Retry-After on 429/503 for idempotent methods,
    # so a GET is retried without the caller seeing the 429; a PATCH is not (see the test above).
    emulator.fail(429, count=1, retry_after=0)
    assert sa.read_node("n1").metadata.name == "n1"
    assert emulator.request_count(verb="get", code=429) == 1 and emulator.request_count(verb="get", code=200) == 1


def test_503_for_a_duration_of_the_emulator_clock(emulator, sa, clock):
    emulator.fail(503, duration_s=30)
    for _ in range(3):
        with pytest.raises(client.ApiException) as err:
            sa.read_node("n1")
        assert err.value.status == 503 and json.loads(err.value.body)["reason"] == "ServiceUnavailable"
    clock.now += 31
    assert sa.read_node("n1").metadata.name == "n1"


def test_match_restricts_failures_to_a_verb_or_path(emulator, sa):
    emulator.fail(500, match="patch")
    assert sa.read_node("n1").metadata.name == "n1"
    with pytest.raises(client.ApiException) as err:
        sa.patch_node_status("n1", condition_patch())
    assert err.value.status == 500
    emulator.clear()
    emulator.fail(504, match="/events")
    sa.patch_node_status("n1", condition_patch())
    with pytest.raises(client.ApiException) as err:
        sa.create_namespaced_event("default", {"metadata": {"name": "e"}, "involvedObject": {"name": "n1"},
                                               "reason": "R"})
    assert err.value.status == 504


def test_latency_delays_every_answer(emulator, sa):
    emulator.latency(0.2)
    start = time.monotonic()
    sa.read_node("n1")
    assert time.monotonic() - start >= 0.2
    emulator.latency(0)
    start = time.monotonic()
    sa.read_node("n1")
    assert time.monotonic() - start < 0.2


def test_dropped_connection_is_a_connection_error(emulator, sa):
    sa.read_node("n1")   # a pooled keep-alive connection now exists
    emulator.drop(1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        sa.patch_node_status("n1", condition_patch())
    sa.patch_node_status("n1", condition_patch("False"))
    # urllib3 retries an idempotent GET on a dropped connection by itself.
    emulator.drop(1)
    assert sa.read_node("n1").metadata.name == "n1"
    assert emulator.request_count(code=0) == 2


def test_down_refuses_connections_then_up_listens_on_the_same_port(emulator, sa):
    url = emulator.url
    sa.read_node("n1")
    emulator.down()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        sa.read_node("n1")
    assert isinstance(err.value.reason, urllib3.exceptions.NewConnectionError)
    emulator.up()
    assert emulator.url == url
    assert sa.read_node("n1").metadata.name == "n1"

    emulator.down(duration_s=0.2)
    assert not emulator.is_up
    deadline = time.monotonic() + 5
    while not emulator.is_up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sa.read_node("n1").metadata.name == "n1"


def test_faults_over_http(emulator, sa):
    control(emulator, "fail", {"status": 429, "count": 2, "retry_after": 1, "match": "patch"})
    assert [r["status"] for r in control(emulator, "faults")["rules"]] == [429]
    with pytest.raises(client.ApiException) as err:
        sa.patch_node_status("n1", condition_patch())
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    control(emulator, "clear")
    sa.patch_node_status("n1", condition_patch())
    control(emulator, "drop", {"count": 1})
    with pytest.raises(urllib3.exceptions.ProtocolError):
        sa.patch_node_status("n1", condition_patch())
    with pytest.raises(urllib.error.HTTPError) as bad:
        control(emulator, "fail", {"status": 404})
    assert bad.value.code == 400
    control(emulator, "down", {"duration_s": 0.2})
    deadline = time.monotonic() + 5
    while not emulator.is_up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert control(emulator, "faults")["up"] is True


# --- Stats --------------------------------------------------------------------------------------

def test_stats_by_user_verb_resource_code_and_second(emulator, sa, clock):
    emulator.reset_stats()
    sa.read_node("n1")
    sa.patch_node_status("n1", condition_patch())
    sa.patch_node_status("n1", condition_patch("False"))
    clock.now += 1
    with pytest.raises(client.ApiException):
        sa.list_pod_for_all_namespaces()
    sa.create_namespaced_event("default", {"metadata": {"name": "e"}, "involvedObject": {"name": "n1"},
                                           "reason": "R"})
    control(emulator, "stats")   # control requests are not counted

    stats = emulator.stats()
    assert stats["total"] == 5
    assert stats["by_verb_resource_code"] == [
        {"user": SA, "verb": "create", "resource": "events", "code": 201, "count": 1},
        {"user": SA, "verb": "get", "resource": "nodes", "code": 200, "count": 1},
        {"user": SA, "verb": "list", "resource": "pods", "code": 403, "count": 1},
        {"user": SA, "verb": "patch", "resource": "nodes/status", "code": 200, "count": 2},
    ]
    assert stats["per_second"] == {"1700000000": 3, "1700000001": 2}
    assert stats["peak_per_second"] == 3
    assert control(emulator, "stats") == json.loads(json.dumps(stats))
    control(emulator, "stats/reset", {})
    assert emulator.stats()["total"] == 0 and emulator.stats()["per_second"] == {}


def test_stats_keep_a_bounded_number_of_seconds():
    stats = Stats(keep_seconds=3)
    for second in range(10):
        stats.record("u", "get", "nodes", 200, second + 0.5)
    assert list(stats.snapshot()["per_second"]) == ["7", "8", "9"]
    assert stats.snapshot()["total"] == 10


def test_fault_rules_count_down_expire_and_validate():
    clock = Clock(100.0)
    faults = Faults(clock)
    faults.fail(503, count=2, match="PATCH")
    faults.drop(1, match="/events")
    assert faults.decide("get", "GET", "/api/v1/nodes/n1").status is None
    assert faults.decide("patch", "PATCH", "/api/v1/nodes/n1").status == 503
    assert faults.decide("create", "POST", "/api/v1/namespaces/default/events").drop
    assert faults.decide("patch", "PATCH", "/api/v1/namespaces/default/events/e").status == 503
    assert faults.decide("patch", "PATCH", "/api/v1/nodes/n1") == faults.decide("get", "GET", "/")
    faults.fail(429, duration_s=5, retry_after=0.5)
    assert faults.decide("get", "GET", "/").retry_after == 1
    clock.now += 5
    assert faults.decide("get", "GET", "/").status is None
    assert faults.describe() == {"latency_s": 0.0, "rules": []}
    for bad in (lambda: faults.fail(404), lambda: faults.fail(500, count=0), lambda: faults.latency(-1),
                lambda: faults.fail(500, duration_s=0)):
        with pytest.raises(ValueError):
            bad()
