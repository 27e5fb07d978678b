"""The API calls gpu-npd makes (the daemon: get its node, patch its status, create and patch events, and
one list-then-watch of its own node; ResourceSlices and, with --dra-taints, DeviceTaintRules of
resource.k8s.io; the fleet simulator also lists, watches and annotates its nodes), with a client-side QPS
limit.

Responses are plain JSON (no model objects): cheap in memory and CPU, which matters when one simulator
process speaks for thousands of nodes. Failures become ApiError with what a caller needs to decide:
retry (and when), or stop because a permission is missing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import quote

import urllib3

from detector.kube.connection import ConfigError, Connection, load_connection
from detector.kube.health import RBAC_HINT, ApiHealth, refusal_line
from detector.kube.pacing import TokenBucket

EVENT_NAMESPACE = "default"     # where Kubernetes keeps events about cluster-scoped objects such as Nodes
REQUEST_TIMEOUT = urllib3.Timeout(connect=5.0, read=15.0)
WATCH_TIMEOUT_S = 300            # a watch asks the server to end it after this long; the caller watches again
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
                 pool: urllib3.PoolManager | None = None, pool_size: int = 4, health: ApiHealth | None = None):
        """`pool_size`: connections kept open; the fleet simulator shares one client among its workers.
        `health` hears every request's outcome (the daemon's outage log and readiness)."""
        self.connection = connection
        self.health = health
        self.http = pool or connection.pool(pool_size)
        self.limiter = TokenBucket(qps, burst)
        self.counts = counts or RequestCounts()
        self._limiter_lock = threading.Lock()
        self._sleep = sleep

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None, context: str | None = None, **kwargs: Any) -> "KubeApi":
        """Raises ConfigError with a clear message when there is no usable configuration."""
        return cls(load_connection(kubeconfig, context), **kwargs)

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call("get", "nodes", "GET", f"/api/v1/nodes/{quote(name)}", name=name)

    def list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        """The fleet simulator's adoption of existing (KWOK) nodes; the daemon never lists."""
        return self.list_node_collection(label_selector).get("items", [])

    def list_node_page(self, label_selector: str = "", limit: int = 500, continue_token: str = "") -> dict[str, Any]:
        """One page of a chunked LIST (`gpu-npd fleet`): at most `limit` nodes, and metadata.continue when
        more follow (a 410 Gone when that token's snapshot has expired: list again)."""
        params = [("labelSelector", label_selector), ("limit", str(limit)), ("continue", continue_token)]
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params if v)
        return self._call("list", "nodes", "GET", f"/api/v1/nodes?{query}")

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

    def list_node_collection(self, label_selector: str = "", field_selector: str = "") -> dict[str, Any]:
        """The NodeList itself: its metadata.resourceVersion is where a watch of the same nodes starts."""
        return self._call("list", "nodes", "GET", "/api/v1/nodes" + _query(labelSelector=label_selector,
                                                                           fieldSelector=field_selector))

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
        response = self._send("watch", resource, "GET", path + query, timeout=read_timeout, stream=True)
        if on_open is not None:
            on_open(response)
        try:
            for line in _lines(response):
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(int(status.get("code") or 500), status.get("reason") or "Error",
                                   status.get("message") or "watch error", None, "watch", resource)
                yield event
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ApiError(0, "ConnectionFailed", f"watch ended: {type(e).__name__}: {e}", None,
                           "watch", resource) from None
        except ValueError:
            raise ApiError(0, "BadResponse", "a watch event is not JSON", None, "watch", resource) from None
        finally:
            response.release_conn()

    def _pace(self) -> None:
        with self._limiter_lock:
            while (wait := self.limiter.wait_s()) > 0:
                self._sleep(wait)
            self.limiter.try_take()

    def _call(self, verb: str, resource: str, method: str, path: str, body: Any = None,
              content_type: str = "application/json", name: str = "") -> dict[str, Any]:
        response = self._send(verb, resource, method, path, body, content_type, name)
        try:
            return json.loads(response.data) if response.data else {}
        except ValueError:
            raise ApiError(response.status, "BadResponse", "the API server's answer is not JSON") from None

    def _send(self, verb: str, resource: str, method: str, path: str, body: Any = None,
              content_type: str = "application/json", name: str = "", timeout: urllib3.Timeout = REQUEST_TIMEOUT,
              stream: bool = False) -> urllib3.BaseHTTPResponse:
        """One request, paced and counted; a 2xx response (its body unread when `stream`), else ApiError."""
        self._pace()
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
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self.counts.add(verb, resource, "error")
            error = ApiError(0, "ConnectionFailed", f"{type(e).__name__}: {e}", None, verb, resource, name)
            self._heard(error)
            raise error from None
        self.counts.add(verb, resource, str(response.status))
        if 200 <= response.status < 300:
            if self.health is not None:
                self.health.record(verb, resource, response.status)
        else:
            if stream:
                response.read(cache_content=True)     # the Status body, kept for _api_error
                response.release_conn()
            error = _api_error(response, verb, resource, name)
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


def _lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """The newline-delimited JSON of a watch, as chunks arrive (a line may span chunks)."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def _api_error(response: urllib3.BaseHTTPResponse, verb: str, resource: str, name: str) -> ApiError:
    message, reason = response.reason or "", "Error"
    try:
        status = json.loads(response.data or b"{}")
        message, reason = status.get("message", message), status.get("reason", reason) or reason
    except (ValueError, AttributeError):
        pass
    return ApiError(response.status, reason, message, _retry_after(response.headers), verb, resource, name)


def _retry_after(headers: Any) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None           # an HTTP date: rare from the API server; fall back to our own backoff


__all__ = ["ApiError", "ConfigError", "KubeApi", "RequestCounts"]
