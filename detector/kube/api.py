"""The four API calls gpu-npd makes, through the official client, with a client-side QPS limit.

Responses are read as plain JSON (no model objects): cheaper in memory and CPU, which matters when one
simulator process speaks for thousands of nodes. Failures become ApiError with what a caller needs to
decide: retry (and when), or stop because a permission is missing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from detector.kube.pacing import TokenBucket

EVENT_NAMESPACE = "default"     # where Kubernetes keeps events about cluster-scoped objects such as Nodes
REQUEST_TIMEOUT = (5.0, 15.0)   # connect, read (seconds)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"{status or 'no response'} {reason}: {message}")
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s

    @property
    def forbidden(self) -> bool:
        return self.status in (401, 403)

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

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """A kubeconfig file, else the in-cluster service account. Retries are ours, not urllib3's."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as e:
            raise ApiError(0, "NoConfig", f"not in a cluster and no --kubeconfig given ({e})") from None
    configuration.retries = False
    return client.ApiClient(configuration)


class KubeApi:
    def __init__(self, api_client: client.ApiClient, qps: float = 5.0, burst: int = 10,
                 counts: RequestCounts | None = None, sleep: Callable[[float], None] = time.sleep):
        self.core = client.CoreV1Api(api_client)
        self.limiter = TokenBucket(qps, burst)
        self.counts = counts or RequestCounts()
        self._limiter_lock = threading.Lock()
        self._sleep = sleep

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call("get", "nodes", self.core.read_node, name)

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("patch", "nodes/status", self.core.patch_node_status, name, body)

    def create_event(self, body: dict[str, Any], namespace: str = EVENT_NAMESPACE) -> dict[str, Any]:
        return self._call("create", "events", self.core.create_namespaced_event, namespace, body)

    def patch_event(self, name: str, body: dict[str, Any], namespace: str = EVENT_NAMESPACE) -> dict[str, Any]:
        return self._call("patch", "events", self.core.patch_namespaced_event, name, namespace, body)

    def _pace(self) -> None:
        with self._limiter_lock:
            while (wait := self.limiter.wait_s()) > 0:
                self._sleep(wait)
            self.limiter.try_take()

    def _call(self, verb: str, resource: str, method: Callable[..., Any], *args: Any) -> dict[str, Any]:
        self._pace()
        try:
            response = method(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            data = response.read()
        except ApiException as e:
            self.counts.add(verb, resource, str(e.status))
            raise _api_error(e) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self.counts.add(verb, resource, "error")
            raise ApiError(0, "ConnectionFailed", f"{type(e).__name__}: {e}") from None
        self.counts.add(verb, resource, str(response.status))
        try:
            return json.loads(data) if data else {}
        except ValueError:
            raise ApiError(response.status, "BadResponse", "the API server's answer is not JSON") from None


def _api_error(e: ApiException) -> ApiError:
    message, reason = str(e.reason or ""), "Error"
    try:
        status = json.loads(e.body or b"{}")
        message, reason = status.get("message", message), status.get("reason", reason) or reason
    except (ValueError, AttributeError):
        pass
    return ApiError(int(e.status or 0), reason, message, _retry_after(e.headers))


def _retry_after(headers: Any) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None           # an HTTP date: rare from the API server; fall back to our own backoff
