"""Is the API server taking our reports? Counted from every request, said in the log sparingly.

An outage (no answer, 5xx, 429) gets one warning when it starts, then at most one a `every_s` with the
count of failed requests, and one line when the API server answers again: an API server down for an hour
costs sixty log lines, not thousands. A refusal (401, 403, a missing node) is not an outage: it gets one
error line naming what was refused and how to grant it, said again only after it was cured once.
Checks never wait on any of this; `/readyz` and `gpu_npd_reporting` read `state()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

RBAC_HINT = "deploy/base/rbac.yaml does (get, list and watch nodes, patch nodes/status, create and patch events)"


def refusal_line(verb: str, resource: str, status: int, message: str = "", name: str = "",
                 rbac_hint: str = RBAC_HINT) -> str:
    """What the API server refused, in one line that says what to do about it."""
    if status == 404:
        return (f"node {name or '?'} does not exist in the cluster ({verb} {resource}: 404 Not Found): set "
                "--node-name or NODE_NAME to the node's Kubernetes name (the DaemonSet sets it from spec.nodeName)")
    if status == 401:
        return (f"the API server does not accept gpu-npd's credentials ({verb} {resource}: 401 Unauthorized"
                f"{': ' + message if message else ''}): the service-account token or the kubeconfig's "
                "credentials are invalid or expired")
    return f"the API server forbids gpu-npd to {verb} {resource} (403 Forbidden): grant it as {rbac_hint}"


@dataclass(frozen=True)
class ReportingState:
    reporting: bool
    detail: str          # "ok", or why reports are not reaching the API server


class ApiHealth:
    """Thread-safe; one per API client (a fleet's nodes share theirs, so an outage is one story, not 7,500)."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 rbac_hint: str = RBAC_HINT):
        self.log, self.every_s, self.clock, self.rbac_hint = logger, every_s, clock, rbac_hint
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._failed = 0                   # requests failed in this outage
        self._unsaid = 0                   # ... since the last line about it
        self._said_at = 0.0
        self._last_error = ""
        self._refusals: dict[tuple[str, str], str] = {}    # (verb, resource) -> the line said about it

    def record(self, verb: str, resource: str, status: int, message: str = "", name: str = "") -> None:
        """One request's outcome: `status` 0 when no answer came. `name` is the object asked about."""
        with self._lock:
            if status in (401, 403) or (status == 404 and resource.startswith("nodes")):
                self._refused(verb, resource, status, message, name)
            elif status == 0 or status in (408, 429) or status >= 500:
                self._failure(verb, resource, status, message)
            else:                                            # an answer: 2xx, or 404/409 on an event
                self._answered(verb, resource)

    def state(self) -> ReportingState:
        with self._lock:
            if self._refusals:
                return ReportingState(False, "not reporting: " + "; ".join(sorted(set(self._refusals.values()))))
            if self._down_since is not None:
                return ReportingState(False, f"not reporting: the API server has failed {self._failed} requests "
                                             f"over {self.clock() - self._down_since:.0f}s (last: {self._last_error})")
            return ReportingState(True, "ok")

    # -- under the lock ---------------------------------------------------------------------------

    def _failure(self, verb: str, resource: str, status: int, message: str) -> None:
        now = self.clock()
        self._last_error = f"{verb} {resource}: {status or 'no answer'}" + (f" {message}" if message else "")
        self._failed += 1
        self._unsaid += 1
        if self._down_since is None:
            self._down_since, self._said_at, self._unsaid = now, now, 0
            self.log.warning("API server unavailable (%s); checks go on, reports are kept and sent when it "
                             "is back", self._last_error)
        elif now - self._said_at >= self.every_s:
            self.log.warning("API server still unavailable after %.0fs: %d requests failed in the last %.0fs "
                             "(last: %s)", now - self._down_since, self._unsaid, now - self._said_at,
                             self._last_error)
            self._said_at, self._unsaid = now, 0

    def _answered(self, verb: str, resource: str) -> None:
        self._end_outage()
        if self._refusals.pop((verb, resource), None) is not None:
            self.log.info("the API server now lets gpu-npd %s %s; reporting again", verb, resource)

    def _refused(self, verb: str, resource: str, status: int, message: str, name: str) -> None:
        self._end_outage()                                   # a refusal is an answer: the server is up
        line = refusal_line(verb, resource, status, message, name, self.rbac_hint)
        if self._refusals.get((verb, resource)) != line:
            self._refusals[(verb, resource)] = line
            self.log.error("%s; checks go on and reports resume once it is fixed", line)

    def _end_outage(self) -> None:
        if self._down_since is not None:
            self.log.info("API server available again after %.0fs (%d requests failed); sending the latest state",
                          self.clock() - self._down_since, self._failed)
            self._down_since, self._failed, self._unsaid = None, 0, 0
