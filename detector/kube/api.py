"""The API calls gpu-npd makes (the daemon: get its node, patch its status, create and patch events, and
one list-then-watch of its own node; ResourceSlices and, with --dra-taints, DeviceTaintRules of
resource.k8s.io; the fleet simulator also lists, watches and annotates its nodes), with a client-side QPS
limit.

Responses are plain JSON (no model objects): cheap in memory and CPU, which matters when one simulator
process speaks for thousands of nodes. Failures become ApiError with what a caller needs to decide:
retry (and when), or stop because a permission is missing.

Nothing the server (or a proxy in front of it) sends can hold a thread or memory without bound: every
request has an overall deadline (deadline.py), a response body and a watch line have a size cap larger
than any real object (the API server stores objects up to 1.5 MiB), a Retry-After is obeyed up to a
minute, and a watch event of the wrong shape is a failure like a broken connection, not a crash.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import quote

import urllib3

from detector.kube.connection import ConfigError, Connection, load_connection
from detector.kube.deadline import Watchdog, guard_pool, guarded
from detector.kube.health import RBAC_HINT, ApiHealth, refusal_line
from detector.kube.pacing import RETRY_AFTER_CAP_S, TokenBucket

EVENT_NAMESPACE = "default"     # where Kubernetes keeps events about cluster-scoped objects such as Nodes
REQUEST_TIMEOUT = urllib3.Timeout(connect=5.0, read=15.0)
REQUEST_DEADLINE_S = 30.0        # a whole request, connect to last byte: a trickling server cannot hold one longer
WATCH_TIMEOUT_S = 300            # a watch asks the server to end it after this long; the caller watches again
WATCH_GRACE_S = 60.0             # ... and is cut this long after that, whatever the server keeps sending
# The API server stores objects up to 1.5 MiB (etcd's request limit): one object, or one watch event (the
# object plus a line of framing), fits easily in 4 MiB; a longer line is not an object but an attack.
MAX_OBJECT_BYTES = 4 << 20
MAX_BODY_BYTES = 16 << 20        # a response other than a list page: an object, a Status, a small list
# An unpaged list of a whole fleet (the simulator's adoption and watch, `gpu-npd fleet --chunk-size
# 7500`): 15,000 nodes of 64 KiB each is under 1 GiB. Paging (gpu-npd fleet's default) keeps it far lower.
MAX_LIST_BYTES = 1 << 30
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "gpu-npd"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None,
                 verb: str = "", resource: str = "", name: str = ""):
        super().__init__(f"{status or 'no response'} {reason}: {message}")
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s
        self.verb, self.resource, self.name = verb, resource, name     # the request refused

    def explain(self, rbac_hint: str = RBAC_HINT) -> str:
        """One line for a person: what was refused and what to do, or what failed."""
        if self.verb and self.refused and (self.status != 404 or self.resource.startswith("nodes")):
            return refusal_line(self.verb, self.resource, self.status, self.message, self.name, rbac_hint)
        return f"{self.verb} {self.resource}: {self}" if self.verb else str(self)

    @property
    def refused(self) -> bool:
        """Unauthorized, forbidden, or the object (our node) is not there: retrying soon cannot cure it."""
        return self.status in (401, 403, 404)

    @property
    def retryable(self) -> bool:
        return self.status in (0, 408, 409, 429) or self.status >= 500


@dataclass
class RequestCounts:
    """Requests by (verb, resource, code): the daemon's metrics and the benchmarks read it."""

    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    listener: Callable[[str, str, str], None] | None = None

    def add(self, verb: str, resource: str, code: str) -> None:
        with self.lock:
            self.counts[(verb, resource, code)] += 1
        if self.listener:
            self.listener(verb, resource, code)


class KubeApi:
    def __init__(self, connection: Connection, qps: float = 5.0, burst: int = 10,
                 counts: RequestCounts | None = None, sleep: Callable[[float], None] = time.sleep,
                 pool: urllib3.PoolManager | None = None, pool_size: int = 4, health: ApiHealth | None = None,
                 watchdog: Watchdog | None = None):
        """`pool_size`: connections kept open; the fleet simulator shares one client among its workers.
        `health` hears every request's outcome (the daemon's outage log and readiness). `watchdog` ends
        requests at their deadline: clients of one process share one (a thread, started on first use)."""
        self.connection = connection
        self.health = health
        self.http = pool or connection.pool(pool_size)
        self.limiter = TokenBucket(qps, burst)
        self.counts = counts or RequestCounts()
        self._limiter_lock = threading.Lock()
        self._sleep = sleep
        self.watchdog = watchdog or Watchdog()
        guard_pool(self.http)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None, context: str | None = None, **kwargs: Any) -> "KubeApi":
        """Raises ConfigError with a clear message when there is no usable configuration."""
        return cls(load_connection(kubeconfig, context), **kwargs)

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call("get", "nodes", "GET", f"/api/v1/nodes/{quote(name)}", name=name)

    def list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        """The fleet simulator's adoption of existing (KWOK) nodes (the daemon lists only its own node)."""
        items = self.list_node_collection(label_selector, max_bytes=MAX_LIST_BYTES).get("items")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def list_node_page(self, label_selector: str = "", limit: int = 500, continue_token: str = "",
                       max_bytes: int | None = None) -> dict[str, Any]:
        """One page of a chunked LIST (`gpu-npd fleet`): at most `limit` nodes, and metadata.continue when
        more follow (a 410 Gone when that token's snapshot has expired: list again). A page larger than
        `max_bytes` (by default room for `limit` objects of the largest size the API server stores) is an
        ApiError TooLarge."""
        params = [("labelSelector", label_selector), ("limit", str(limit)), ("continue", continue_token)]
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params if v)
        if max_bytes is None:
            largest_page = limit * (3 << 19) if limit > 0 else MAX_LIST_BYTES     # limit x 1.5 MiB objects
            max_bytes = min(MAX_LIST_BYTES, max(MAX_BODY_BYTES, largest_page))
        return self._call("list", "nodes", "GET", f"/api/v1/nodes?{query}", max_bytes=max_bytes)

    def watch_nodes(self, label_selector: str, resource_version: str, timeout_s: int = WATCH_TIMEOUT_S,
                    on_open: Callable[[urllib3.BaseHTTPResponse], None] | None = None,
                    field_selector: str = "") -> Iterator[dict[str, Any]]:
        """Watch events ({"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": ...}) of the nodes matching
        `label_selector` and `field_selector` (`metadata.name=<node>`: the daemon's one node), from
        `resource_version` on, with bookmarks, until the server ends the watch (after about `timeout_s`).
        An ERROR event raises ApiError with its Status (410: start again from a fresh list); a broken
        connection raises ApiError(0). `on_open` gets the open response, so another thread can end the
        watch at once (its shutdown())."""
        return self._watch("nodes", "/api/v1/nodes", resource_version, timeout_s, on_open,
                           label_selector, field_selector)

    def list_node_collection(self, label_selector: str = "", field_selector: str = "",
                             max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
        """The NodeList itself: its metadata.resourceVersion is where a watch of the same nodes starts.
        The daemon lists its one node (16 MiB is room for any); a fleet's list passes MAX_LIST_BYTES."""
        return self._call("list", "nodes", "GET", "/api/v1/nodes" + _query(labelSelector=label_selector,
                                                                           fieldSelector=field_selector),
                          max_bytes=max_bytes)

    def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
        """Set (or, with None, remove) annotations on a node: a merge patch of its metadata only."""
        return self._call("patch", "nodes", "PATCH", f"/api/v1/nodes/{quote(name)}",
                          {"metadata": {"annotations": annotations}}, MERGE_PATCH, name)

    def create_node(self, body: dict[str, Any]) -> dict[str, Any]:
        """The fleet simulator's own (KWOK) nodes; the daemon never creates one."""
        return self._call("create", "nodes", "POST", "/api/v1/nodes", body)

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("patch", "nodes/status", "PATCH", f"/api/v1/nodes/{quote(name)}/status", body,
                          STRATEGIC_MERGE, name)

    def create_event(self, body: dict[str, Any], namespace: str = EVENT_NAMESPACE) -> dict[str, Any]:
        return self._call("create", "events", "POST", f"/api/v1/namespaces/{quote(namespace)}/events", body)

    def patch_event(self, name: str, body: dict[str, Any], namespace: str = EVENT_NAMESPACE) -> dict[str, Any]:
        return self._call("patch", "events", "PATCH", f"/api/v1/namespaces/{quote(namespace)}/events/{quote(name)}",
                          body, MERGE_PATCH)

    # -- resource.k8s.io (DRA device taints, opt-in: detector/kube/device_taints.py) ------------------

    def get_api_group(self, group: str) -> dict[str, Any]:
        """The APIGroup discovery document of /apis/<group>: its versions, preferred first. 404 when the
        cluster does not serve the group."""
        return self._call("get", "discovery", "GET", f"/apis/{quote(group)}")

    def get_api_resources(self, group: str, version: str) -> dict[str, Any]:
        """The APIResourceList of /apis/<group>/<version>: which resources that version serves."""
        return self._call("get", "discovery", "GET", f"/apis/{quote(group)}/{quote(version)}")

    def list_resource_slices(self, version: str, field_selector: str = "") -> list[dict[str, Any]]:
        return self.list_resource_slice_collection(version, field_selector).get("items", [])

    def list_resource_slice_collection(self, version: str, field_selector: str = "") -> dict[str, Any]:
        """The ResourceSliceList itself: its metadata.resourceVersion is where a watch of the same slices
        starts."""
        return self._call("list", "resourceslices", "GET", f"/apis/resource.k8s.io/{quote(version)}/resourceslices"
                          + _query(fieldSelector=field_selector))

    def watch_resource_slices(self, version: str, field_selector: str, resource_version: str,
                              timeout_s: int = WATCH_TIMEOUT_S,
                              on_open: Callable[[urllib3.BaseHTTPResponse], None] | None = None
                              ) -> Iterator[dict[str, Any]]:
        """As watch_nodes, for ResourceSlices (`spec.nodeName=<node>,spec.driver=<driver>`: one node's)."""
        return self._watch("resourceslices", f"/apis/resource.k8s.io/{quote(version)}/resourceslices",
                           resource_version, timeout_s, on_open, "", field_selector)

    def list_device_taint_rules(self, version: str, label_selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={quote(label_selector)}" if label_selector else ""
        return self._call("list", "devicetaintrules", "GET",
                          f"/apis/resource.k8s.io/{quote(version)}/devicetaintrules{query}").get("items", [])

    def get_device_taint_rule(self, version: str, name: str) -> dict[str, Any]:
        return self._call("get", "devicetaintrules", "GET",
                          f"/apis/resource.k8s.io/{quote(version)}/devicetaintrules/{quote(name)}", name=name)

    def create_device_taint_rule(self, version: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("create", "devicetaintrules", "POST",
                          f"/apis/resource.k8s.io/{quote(version)}/devicetaintrules", body)

    def update_device_taint_rule(self, version: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A PUT: `body` carries the metadata.resourceVersion it replaces (409 Conflict if it moved on)."""
        return self._call("update", "devicetaintrules", "PUT",
                          f"/apis/resource.k8s.io/{quote(version)}/devicetaintrules/{quote(name)}", body, name=name)

    def delete_device_taint_rule(self, version: str, name: str) -> dict[str, Any]:
        return self._call("delete", "devicetaintrules", "DELETE",
                          f"/apis/resource.k8s.io/{quote(version)}/devicetaintrules/{quote(name)}", name=name)

    def _watch(self, resource: str, path: str, resource_version: str, timeout_s: int,
               on_open: Callable[[urllib3.BaseHTTPResponse], None] | None, label_selector: str = "",
               field_selector: str = "") -> Iterator[dict[str, Any]]:
        query = _query(watch="1", allowWatchBookmarks="true", resourceVersion=resource_version,
                       timeoutSeconds=str(int(timeout_s)), labelSelector=label_selector, fieldSelector=field_selector)
        read_timeout = urllib3.Timeout(connect=5.0, read=timeout_s + 30.0)
        self._pace()
        with guarded(self.watchdog, timeout_s + WATCH_GRACE_S) as guard:
            response = self._send("watch", resource, "GET", path + query, timeout=read_timeout, stream=True,
                                  guard_fired=lambda: guard.fired)
            if on_open is not None:
                on_open(response)
            try:
                for line in _lines(response, MAX_OBJECT_BYTES):
                    yield watch_event(json.loads(line), resource)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                if guard.fired:
                    raise ApiError(0, "Timeout", f"watch still open {timeout_s + WATCH_GRACE_S:.0f}s after "
                                   f"asking for {timeout_s}s: cut", None, "watch", resource) from None
                raise ApiError(0, "ConnectionFailed", f"watch ended: {type(e).__name__}: {e}", None,
                               "watch", resource) from None
            except (ValueError, RecursionError):
                raise ApiError(0, "BadResponse", "a watch event is not JSON", None, "watch", resource) from None
            finally:
                response.release_conn()

    def _pace(self) -> None:
        with self._limiter_lock:
            while (wait := self.limiter.wait_s()) > 0:
                self._sleep(wait)
            self.limiter.try_take()

    def _call(self, verb: str, resource: str, method: str, path: str, body: Any = None,
              content_type: str = "application/json", name: str = "", max_bytes: int = MAX_BODY_BYTES
              ) -> dict[str, Any]:
        """One request and its JSON object, within REQUEST_DEADLINE_S (from when the client-side rate limit
        lets it go: a queue behind the limiter is our own doing, not the server's) and `max_bytes`."""
        self._pace()
        with guarded(self.watchdog, REQUEST_DEADLINE_S) as guard:
            response = self._send(verb, resource, method, path, body, content_type, name, stream=True,
                                  guard_fired=lambda: guard.fired)
            try:
                data = _read_capped(response, max_bytes)
                if guard.fired:                  # cut mid-answer: what was read may parse, but is not whole
                    raise urllib3.exceptions.ProtocolError("cut at the deadline")
            except (urllib3.exceptions.HTTPError, OSError) as e:
                error = _failed(verb, resource, name, e, guard.fired)
                self._heard(error)
                raise error from None
            except ValueError as e:             # over max_bytes
                error = ApiError(0, "TooLarge", str(e), None, verb, resource, name)
                self._heard(error)
                raise error from None
            finally:
                response.release_conn()
        try:
            value = json.loads(data) if data else {}
        except ValueError:
            raise ApiError(response.status, "BadResponse", "the API server's answer is not JSON", None,
                           verb, resource, name) from None
        except RecursionError:
            raise ApiError(response.status, "BadResponse", "the API server's answer is JSON nested too deeply",
                           None, verb, resource, name) from None
        if not isinstance(value, dict):
            raise ApiError(response.status, "BadResponse", f"the API server's answer is a JSON "
                           f"{type(value).__name__}, not an object", None, verb, resource, name)
        return value

    def _send(self, verb: str, resource: str, method: str, path: str, body: Any = None,
              content_type: str = "application/json", name: str = "", timeout: urllib3.Timeout = REQUEST_TIMEOUT,
              stream: bool = False, guard_fired: Callable[[], bool] = lambda: False) -> urllib3.BaseHTTPResponse:
        """One request (already paced), counted; a 2xx response (its body unread when `stream`), else
        ApiError. `guard_fired` says whether a failure is the request's deadline passing."""
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        token = self.connection.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        payload = None
        if body is not None:
            payload, headers["Content-Type"] = json.dumps(body).encode(), content_type
        try:
            response = self.http.request(method, self.connection.server + path, body=payload, headers=headers,
                                         timeout=timeout, retries=False, redirect=False, preload_content=not stream)
            if guard_fired():                    # the head was cut short: http.client took the rest as empty
                response.release_conn()
                raise urllib3.exceptions.ProtocolError("cut at the deadline")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self.counts.add(verb, resource, "error")
            error = _failed(verb, resource, name, e, guard_fired())
            self._heard(error)
            raise error from None
        self.counts.add(verb, resource, str(response.status))
        if 200 <= response.status < 300:
            if self.health is not None:
                self.health.record(verb, resource, response.status)
        else:
            try:
                status_body = _read_capped(response, MAX_BODY_BYTES) if stream else response.data
            except (urllib3.exceptions.HTTPError, OSError, ValueError):
                status_body = b""                     # a Status cut short or too long: the code says enough
            finally:
                response.release_conn()
            error = _api_error(response, status_body, verb, resource, name)
            self._heard(error)
            raise error
        return response

    def _heard(self, error: ApiError) -> None:
        if self.health is not None:
            self.health.record(error.verb, error.resource, error.status, error.message, error.name)


def _query(**params: str) -> str:
    """`?a=1&b=2` of the parameters that are set (in the order given), each value quoted."""
    text = "&".join(f"{k}={quote(v)}" for k, v in params.items() if v)
    return f"?{text}" if text else ""


def end_watch(response: urllib3.BaseHTTPResponse) -> None:
    """End a watch's read blocked on a quiet stream, from another thread (the daemon stopping). The watch may
    have ended and given its socket back in the meantime: ending it again is nothing, never an error."""
    try:
        response.shutdown()
    except OSError:
        pass


def _lines(response: urllib3.BaseHTTPResponse, limit: int) -> Iterator[bytes]:
    """The newline-delimited JSON of a watch, as chunks arrive (a line may span chunks). A line longer
    than `limit` raises ApiError TooLarge: its bytes are never all kept. Each byte is
    looked at once (a line arriving in many small chunks costs no more than one arriving whole)."""
    pending = bytearray()
    for chunk in response.stream(64 * 1024, decode_content=True):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            _check_line(pending, limit)
            if pending.strip():
                yield bytes(pending)
            pending.clear()
            start = end + 1
        pending += chunk[start:]
        _check_line(pending, limit)
    if pending.strip():
        yield bytes(pending)


def _check_line(line: bytearray, limit: int) -> None:
    if len(line) > limit:
        raise ApiError(0, "TooLarge", f"a watch event over {limit:,} bytes (larger than any object the API "
                       "server stores)", None, "watch")


def watch_event(event: Any, resource: str) -> dict[str, Any]:
    """A watch line's JSON as {"type": str, "object": dict}; ApiError BadResponse for any other shape, and
    the ERROR event's Status as ApiError (410: the caller lists again)."""
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ApiError(0, "BadResponse", f"a watch event that is a JSON {_shape(event)}, not an object with a "
                       "type", None, "watch", resource)
    obj = event.get("object")
    if event["type"] == "ERROR":
        status = obj if isinstance(obj, dict) else {}
        code = status.get("code")
        return_code = code if isinstance(code, int) and 100 <= code < 600 else 500
        raise ApiError(return_code, str(status.get("reason") or "Error")[:200],
                       str(status.get("message") or obj or "watch error")[:500], None, "watch", resource)
    if not isinstance(obj, dict):
        raise ApiError(0, "BadResponse", f"a {event['type'][:40]} watch event whose object is a JSON "
                       f"{_shape(obj)}", None, "watch", resource)
    return event


def _shape(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _read_capped(response: urllib3.BaseHTTPResponse, limit: int) -> bytes:
    """The whole body, refused (ValueError) once it passes `limit` bytes: a declared Content-Length over
    the limit is refused before reading, a body without one as soon as it passes."""
    declared = response.headers.get("Content-Length") if response.headers else None
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ValueError(f"an answer of {int(declared):,} bytes, over the {limit:,}-byte limit")
    body = bytearray()
    for chunk in response.stream(64 * 1024, decode_content=True):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"an answer over the {limit:,}-byte limit")
    return bytes(body)


def _failed(verb: str, resource: str, name: str, e: Exception, deadline_passed: bool) -> ApiError:
    if deadline_passed:
        return ApiError(0, "Timeout", f"no complete answer within {REQUEST_DEADLINE_S:.0f}s", None, verb,
                        resource, name)
    return ApiError(0, "ConnectionFailed", f"{type(e).__name__}: {e}", None, verb, resource, name)


def _api_error(response: urllib3.BaseHTTPResponse, body: bytes, verb: str, resource: str, name: str) -> ApiError:
    message, reason = response.reason or "", "Error"
    try:
        status = json.loads(body or b"{}")
        message, reason = str(status.get("message", message))[:1000], str(status.get("reason", reason) or reason)[:200]
    except (ValueError, AttributeError, RecursionError):
        pass
    return ApiError(response.status, reason, message, retry_after(response.headers), verb, resource, name)


def retry_after(headers: Any) -> float | None:
    """The server's Retry-After in seconds, at most RETRY_AFTER_CAP_S; None when absent or not a finite
    number of seconds (an HTTP date, "inf", "nan": our own backoff decides)."""
    value = (headers or {}).get("Retry-After")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(0.0, seconds), RETRY_AFTER_CAP_S)


__all__ = ["ApiError", "ConfigError", "KubeApi", "RequestCounts"]
