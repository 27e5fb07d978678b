"""The emulator's watch and list semantics over HTTP, as the Kubernetes watch protocol defines them:
events, resourceVersions, selectors, bookmarks, timeouts, 410 Gone, leases, and watches that end
when the server goes down and never hold up other requests."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from conftest import REPO
from kube_emulator import Emulator
from kube_emulator.changes import Change, ChangeLog, Expired

SA = "system:serviceaccount:gpu-npd:gpu-npd"
WAIT_S = 5.0    # how long a test waits for an event it expects: never reached when the emulator works


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], bookmark_interval_s=0.05) as emu:
        yield emu


class Watch:
    """A watch request held open: next() returns the next event, parsed."""

    def __init__(self, emu: Emulator, path: str, user: str = "admin"):
        host, port = emu.url.rsplit("//", 1)[1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        self.conn.request("GET", path, headers={"Authorization": f"Bearer {emu.token_for(user)}"})
        self.response = self.conn.getresponse()
        self.status = self.response.status

    def next(self) -> dict[str, Any] | None:
        """The next event; None when the server ended the stream."""
        line = self.response.readline()
        return json.loads(line) if line else None

    def body(self) -> dict[str, Any]:
        return json.loads(self.response.read())

    def events(self, count: int) -> list[dict[str, Any]]:
        return [e for e in (self.next() for _ in range(count))]

    def until(self, predicate) -> dict[str, Any]:
        while True:
            event = self.next()
            assert event is not None, "the stream ended before the event expected"
            if predicate(event):
                return event

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def watches():
    opened: list[Watch] = []

    def open_(emu: Emulator, path: str, user: str = "admin") -> Watch:
        w = Watch(emu, path, user)
        opened.append(w)
        return w

    yield open_
    for w in opened:
        w.close()


def call(emu: Emulator, method: str, path: str, body: Any = None, user: str = "admin",
         content_type: str = "application/json") -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(emu.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {emu.token_for(user)}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def names(events: list[dict]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def annotate(emu: Emulator, node: str, **annotations: str | None) -> dict:
    code, body = call(emu, "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"annotations": annotations}},
                      content_type="application/merge-patch+json")
    assert code == 200, body
    return body


def no_bookmarks(w: Watch) -> dict:
    return w.until(lambda e: e["type"] != "BOOKMARK")


# --- Events and resourceVersions ---------------------------------------------------------------------

def test_watch_without_resource_version_starts_with_what_exists(emulator, watches):
    emulator.create_node("a")
    emulator.create_node("b")
    w = watches(emulator, "/api/v1/nodes?watch=1")
    assert w.status == 200 and w.response.getheader("Transfer-Encoding") == "chunked"
    assert names(w.events(2)) == [("ADDED", "a"), ("ADDED", "b")]
    annotate(emulator, "a", team="ml")
    event = w.next()
    assert (event["type"], event["object"]["metadata"]["annotations"]) == ("MODIFIED", {"team": "ml"})
    assert event["object"]["kind"] == "Node" and event["object"]["apiVersion"] == "v1"
    code, _ = call(emulator, "DELETE", "/api/v1/nodes/b")
    assert code == 200
    deleted = w.next()
    assert (deleted["type"], deleted["object"]["metadata"]["name"]) == ("DELETED", "b")
    assert int(deleted["object"]["metadata"]["resourceVersion"]) > int(event["object"]["metadata"]["resourceVersion"])


def test_watch_from_a_lists_resource_version_gets_every_later_change_and_nothing_before(emulator, watches):
    emulator.create_node("a")
    code, listed = call(emulator, "GET", "/api/v1/nodes")
    rv = listed["metadata"]["resourceVersion"]
    annotate(emulator, "a", step="1")
    emulator.create_node("b")
    annotate(emulator, "a", step="2")
    w = watches(emulator, f"/api/v1/nodes?watch=true&resourceVersion={rv}")
    events = w.events(3)
    assert names(events) == [("MODIFIED", "a"), ("ADDED", "b"), ("MODIFIED", "a")]
    assert [e["object"]["metadata"].get("annotations", {}).get("step") for e in events] == ["1", None, "2"]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)


def test_resuming_from_the_last_event_misses_nothing(emulator, watches):
    emulator.create_node("a")
    w = watches(emulator, "/api/v1/nodes?watch=1")
    last = w.next()["object"]["metadata"]["resourceVersion"]
    w.close()
    annotate(emulator, "a", missed="no")
    again = watches(emulator, f"/api/v1/nodes?watch=1&resourceVersion={last}")
    event = again.next()
    assert event["type"] == "MODIFIED" and event["object"]["metadata"]["annotations"] == {"missed": "no"}


def test_a_resource_version_older_than_the_history_is_410_expired():
    with Emulator(rbac_paths=[REPO / "deploy" / "base"], watch_history=3) as emu:
        emu.create_node("a")       # a node and its kubelet lease: two changes
        first = emu.node("a")["metadata"]["resourceVersion"]
        for i in range(4):
            annotate(emu, "a", i=str(i))
        code, status = call(emu, "GET", f"/api/v1/nodes?watch=1&resourceVersion={first}")
        assert code == 410
        assert (status["kind"], status["status"], status["reason"], status["code"]) == ("Status", "Failure",
                                                                                       "Expired", 410)
        assert "too old resource version" in status["message"]
        code, listed = call(emu, "GET", "/api/v1/nodes")        # the client lists again ...
        w = Watch(emu, f"/api/v1/nodes?watch=1&resourceVersion={listed['metadata']['resourceVersion']}")
        try:                                                     # ... and watches from there
            assert w.status == 200
            annotate(emu, "a", i="after")
            assert w.next()["object"]["metadata"]["annotations"] == {"i": "after"}
        finally:
            w.close()


def test_a_watcher_left_behind_by_the_history_gets_an_error_event():
    log = ChangeLog(capacity=2)
    for rv in range(1, 6):
        log.record(Change(rv, "nodes", "ADDED", None, {"metadata": {"name": str(rv)}}))
    assert [c.rv for c in log.after(3, 0)] == [4, 5]
    with pytest.raises(Expired):
        log.after(2, 0)
    assert log.oldest_rv == 3 and log.last_rv == 5


def test_bad_watch_parameters_are_400(emulator):
    for query in ("resourceVersion=abc", "timeoutSeconds=soon", "sendInitialEvents=maybe",
                  "labelSelector=a%20b%20c", "fieldSelector=spec.podCIDR%3Dx"):
        code, status = call(emulator, "GET", f"/api/v1/nodes?watch=1&{query}")
        assert (code, status["reason"]) == (400, "BadRequest"), query


# --- Selectors -----------------------------------------------------------------------------------

def test_list_label_and_field_selectors(emulator):
    emulator.create_node("gpu-1", labels={"pool": "h100"})
    emulator.create_node("gpu-2", labels={"pool": "a100"})
    emulator.create_node("cpu-1")
    for selector, expected in [("labelSelector=pool%3Dh100", ["gpu-1"]), ("labelSelector=pool", ["gpu-1", "gpu-2"]),
                               ("labelSelector=!pool", ["cpu-1"]), ("labelSelector=pool%20in%20(a100,v100)", ["gpu-2"]),
                               ("fieldSelector=metadata.name%3Dgpu-2", ["gpu-2"]),
                               ("fieldSelector=metadata.name!%3Dgpu-2&labelSelector=pool", ["gpu-1"])]:
        code, listed = call(emulator, "GET", f"/api/v1/nodes?{selector}")
        assert code == 200
        assert [n["metadata"]["name"] for n in listed["items"]] == expected, selector
        assert listed["metadata"]["resourceVersion"].isdigit()


def test_watch_selectors_turn_entering_and_leaving_into_added_and_deleted(emulator, watches):
    emulator.create_node("gpu-1", labels={"pool": "h100"})
    emulator.create_node("gpu-2")
    w = watches(emulator, "/api/v1/nodes?watch=1&labelSelector=pool%3Dh100")
    assert names(w.events(1)) == [("ADDED", "gpu-1")]
    annotate(emulator, "gpu-2", ignored="yes")                          # not selected: no event
    call(emulator, "PATCH", "/api/v1/nodes/gpu-2", {"metadata": {"labels": {"pool": "h100"}}},
         content_type="application/merge-patch+json")                    # enters the selection
    call(emulator, "PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {"pool": None}}},
         content_type="application/merge-patch+json")                    # leaves it
    entered, left = w.events(2)
    assert (entered["type"], entered["object"]["metadata"]["name"]) == ("ADDED", "gpu-2")
    assert (left["type"], left["object"]["metadata"]["name"]) == ("DELETED", "gpu-1")
    assert left["object"]["metadata"]["labels"]["pool"] == "h100"       # its last state that matched


def test_watch_by_field_selector_and_by_name(emulator, watches):
    emulator.create_node("a")
    emulator.create_node("b")
    by_field = watches(emulator, "/api/v1/nodes?watch=1&fieldSelector=metadata.name%3Db")
    by_name = watches(emulator, "/api/v1/nodes/b?watch=1")
    assert names(by_field.events(1)) == names(by_name.events(1)) == [("ADDED", "b")]
    annotate(emulator, "a", x="1")
    annotate(emulator, "b", x="2")
    assert names(by_field.events(1)) == names(by_name.events(1)) == [("MODIFIED", "b")]


# --- Bookmarks, timeouts, initial events ------------------------------------------------------------

def test_bookmarks_carry_only_the_resource_version(emulator, watches):
    emulator.create_node("a")
    w = watches(emulator, "/api/v1/nodes?watch=1&allowWatchBookmarks=true")
    assert w.next()["type"] == "ADDED"
    bookmark = w.until(lambda e: e["type"] == "BOOKMARK")
    assert bookmark["object"] == {"kind": "Node", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": emulator.store.resource_version}}
    annotate(emulator, "a", x="1")
    assert no_bookmarks(w)["type"] == "MODIFIED"
    later = w.until(lambda e: e["type"] == "BOOKMARK")
    assert later["object"]["metadata"]["resourceVersion"] == emulator.node("a")["metadata"]["resourceVersion"]


def test_no_bookmarks_unless_asked(emulator, watches):
    emulator.create_node("a")
    w = watches(emulator, "/api/v1/nodes?watch=1&timeoutSeconds=1")
    assert [e["type"] for e in iter(w.next, None)] == ["ADDED"]


def test_timeout_seconds_ends_the_stream_cleanly(emulator, watches):
    w = watches(emulator, "/api/v1/nodes?watch=1&timeoutSeconds=1")
    assert w.next() is None          # the chunked body ended (a zero-length chunk), no error
    assert w.response.isclosed()


def test_send_initial_events_ends_with_an_annotated_bookmark(emulator, watches):
    emulator.create_node("a")
    rv = emulator.store.resource_version
    w = watches(emulator, "/api/v1/nodes?watch=1&sendInitialEvents=true&allowWatchBookmarks=true"
                          "&resourceVersionMatch=NotOlderThan&resourceVersion=" + rv)
    added, bookmark = w.events(2)
    assert (added["type"], bookmark["type"]) == ("ADDED", "BOOKMARK")
    assert bookmark["object"]["metadata"] == {"resourceVersion": rv,
                                              "annotations": {"k8s.io/initial-events-end": "true"}}


# --- Leases ---------------------------------------------------------------------------------------

def lease(name: str, holder: str) -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "renewTime": "2024-01-01T00:00:00.000000Z"}}


def test_leases_crud_and_watch(emulator, watches):
    base = "/apis/coordination.k8s.io/v1/namespaces/gpu-npd/leases"
    w = watches(emulator, f"{base}?watch=1")
    code, created = call(emulator, "POST", base, lease("leader", "pod-a"))
    assert code == 201 and created["apiVersion"] == "coordination.k8s.io/v1" and created["metadata"]["uid"]
    assert call(emulator, "GET", f"{base}/leader")[1]["spec"]["holderIdentity"] == "pod-a"
    code, updated = call(emulator, "PUT", f"{base}/leader", {**created, "spec": {**created["spec"],
                                                                                "holderIdentity": "pod-b"}})
    assert code == 200 and updated["spec"]["holderIdentity"] == "pod-b"
    code, stale = call(emulator, "PUT", f"{base}/leader", created)          # the old resourceVersion
    assert code == 409 and stale["reason"] == "Conflict"
    assert 'leases.coordination.k8s.io "leader"' in stale["message"]
    code, patched = call(emulator, "PATCH", f"{base}/leader", {"spec": {"leaseTransitions": 1}},
                         content_type="application/merge-patch+json")
    assert code == 200 and patched["spec"]["leaseTransitions"] == 1
    code, bad = call(emulator, "POST", base, {**lease("bad", "x"), "spec": {"leaseDurationSeconds": 0}})
    assert code == 422 and bad["details"]["causes"][0]["field"] == "spec.leaseDurationSeconds"
    assert call(emulator, "DELETE", f"{base}/leader")[0] == 200
    assert call(emulator, "GET", f"{base}/leader")[0] == 404
    assert [e["type"] for e in w.events(4)] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]


def test_nodes_get_their_kubelet_lease(emulator):
    emulator.create_node("gpu-1")
    code, listed = call(emulator, "GET", "/apis/coordination.k8s.io/v1/leases")
    assert code == 200 and listed["kind"] == "LeaseList"
    [node_lease] = listed["items"]
    assert node_lease["metadata"]["namespace"] == "kube-node-lease"
    assert node_lease["spec"]["holderIdentity"] == "gpu-1"


# --- RBAC, concurrency, shutdown ---------------------------------------------------------------------

def test_watch_is_authorized_as_its_own_verb(emulator):
    emulator.create_node("a")
    code, status = call(emulator, "GET", "/api/v1/namespaces/default/events?watch=1", user=SA)   # create, patch only
    assert code == 403
    assert status["message"] == (f'events is forbidden: User "{SA}" cannot watch resource "events" in API group "" '
                                 'in the namespace "default"')
    code, status = call(emulator, "GET", "/apis/coordination.k8s.io/v1/namespaces/gpu-npd/leases?watch=1", user=SA)
    assert code == 403 and 'cannot watch resource "leases" in API group "coordination.k8s.io"' in status["message"]
    code, status = call(emulator, "GET", "/api/v1/pods", user=SA)
    assert code == 403 and 'cannot list resource "pods"' in status["message"]


def test_open_watches_hold_up_no_other_request(emulator, watches):
    emulator.create_node("a")
    open_watches = [watches(emulator, "/api/v1/nodes?watch=1") for _ in range(8)]
    for w in open_watches:
        assert w.next()["type"] == "ADDED"
    for i in range(20):
        annotate(emulator, "a", i=str(i))
        assert call(emulator, "GET", "/api/v1/nodes/a")[0] == 200
    for w in open_watches:
        assert w.events(20)[-1]["object"]["metadata"]["annotations"] == {"i": "19"}


def test_stop_ends_open_watches(watches):
    emu = Emulator(rbac_paths=[REPO / "deploy" / "base"])
    emu.start()
    emu.create_node("a")
    w = watches(emu, "/api/v1/nodes?watch=1")
    assert w.next()["type"] == "ADDED"
    ended = threading.Event()

    def read_to_end() -> None:
        try:
            while w.next() is not None:
                pass
        except (OSError, http.client.HTTPException):
            pass    # the connection closed under the reader: also an end
        ended.set()

    threading.Thread(target=read_to_end, daemon=True).start()
    emu.stop()
    assert ended.wait(WAIT_S), "the watch outlived the server"
