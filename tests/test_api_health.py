"""ApiHealth: how an outage and a refusal are said in the log, and what /readyz reads."""

from __future__ import annotations

import logging

import pytest

from conftest import Clock
from detector.kube.api import ApiError
from detector.kube.health import ApiHealth


@pytest.fixture
def said(caplog):
    caplog.set_level(logging.INFO, logger="test.health")
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "test.health"]


def test_an_hour_long_outage_is_a_line_a_minute_with_counts_and_one_line_when_it_ends(said):
    clock = Clock()
    health = ApiHealth(logging.getLogger("test.health"), every_s=60.0, clock=clock)
    for _ in range(3600):                                    # a failed request every second
        health.record("patch", "nodes/status", 0, "Connection refused")
        clock.now += 1.0
    assert health.state().reporting is False and "3600 requests over 3600s" in health.state().detail
    health.record("patch", "nodes/status", 200)
    lines = said()
    assert 55 <= len(lines) <= 62
    assert lines[0][0] == "WARNING" and "API server unavailable (patch nodes/status: no answer Connection refused)" \
        in lines[0][1]
    assert "60 requests failed in the last 60s" in lines[1][1]
    assert lines[-1] == ("INFO", "API server available again after 3600s (3600 requests failed); "
                                 "sending the latest state")
    assert health.state().reporting is True


def test_throttling_and_server_errors_are_an_outage_but_event_404_and_409_are_answers(said):
    health = ApiHealth(logging.getLogger("test.health"), clock=Clock())
    health.record("patch", "events", 404, "not found")         # an expired event: the reporter re-creates it
    health.record("create", "events", 409, "exists")
    assert health.state().reporting and said() == []
    health.record("patch", "nodes/status", 429, "slow down")
    health.record("patch", "nodes/status", 503, "unavailable")
    assert not health.state().reporting and len(said()) == 1


def test_a_refusal_is_one_error_naming_verb_resource_and_the_fix_until_it_is_cured(said):
    health = ApiHealth(logging.getLogger("test.health"), clock=Clock())
    for _ in range(50):
        health.record("patch", "nodes/status", 403, "forbidden")
    health.record("create", "events", 403, "forbidden")
    lines = said()
    assert [level for level, _ in lines] == ["ERROR", "ERROR"]
    assert lines[0][1].startswith("the API server forbids gpu-npd to patch nodes/status (403 Forbidden): grant it "
                                  "as deploy/base/rbac.yaml does (get, list and watch nodes, patch nodes/status, create and patch "
                                  "events)")
    state = health.state()
    assert not state.reporting and "patch nodes/status" in state.detail and "create events" in state.detail
    health.record("patch", "nodes/status", 200)
    health.record("create", "events", 201)
    assert health.state().reporting
    assert said()[-1] == ("INFO", "the API server now lets gpu-npd create events; reporting again")


def test_a_missing_node_and_bad_credentials_say_what_to_fix(said):
    health = ApiHealth(logging.getLogger("test.health"), clock=Clock())
    health.record("get", "nodes", 404, 'nodes "gpu-7" not found', "gpu-7")
    health.record("patch", "nodes/status", 401, "Unauthorized", "gpu-7")
    first, second = (m for _, m in said())
    assert first.startswith("node gpu-7 does not exist in the cluster (get nodes: 404 Not Found): set --node-name "
                            "or NODE_NAME")
    assert "401 Unauthorized" in second and "token" in second


def test_api_error_explains_itself_for_the_command_line():
    e = ApiError(403, "Forbidden", 'nodes is forbidden: User "x" cannot create resource "nodes"', None,
                 "create", "nodes")
    assert e.explain("deploy/kwok/rbac.yaml does (...)") == (
        "the API server forbids gpu-npd to create nodes (403 Forbidden): grant it as deploy/kwok/rbac.yaml does (...)")
    assert ApiError(0, "ConnectionFailed", "refused", None, "list", "nodes").explain() == \
        "list nodes: no response ConnectionFailed: refused"
