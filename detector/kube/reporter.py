"""The agent's Kubernetes sink: conditions and events for one node, sent when due.

`conditions`/`events` only record the latest state and return at once; `flush` (called by the
daemon's sender thread, or by the fleet's shared scheduler) does the talking. So a slow or absent API
server delays reports but never stalls the checks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from detector.agent.active import ConditionStatus
from detector.agent.agent import AgentSink
from detector.core.types import Problem, Severity
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import ConditionReporter
from detector.kube.events import EventReporter, EventSettings
from detector.kube.pacing import Backoff

log = logging.getLogger("gpu_npd.kube")


@dataclass
class ReporterSettings:
    heartbeat_s: float = 300.0          # node-problem-detector's --k8s-exporter-heartbeat-period
    heartbeat_jitter: float = 0.1
    start_wait_s: float = 300.0         # wait this long for the API server at start, then carry on
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    events: EventSettings = field(default_factory=EventSettings)


class KubeReporter(AgentSink):
    def __init__(self, api: KubeApi, node: str, owned_types: list[str], settings: ReporterSettings | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.api, self.node, self.clock = api, node, clock
        self.settings = settings or ReporterSettings()
        rng = rng or random.Random()
        s = self.settings
        self.condition_out = ConditionReporter(api, node, owned_types, clock, s.heartbeat_s, s.heartbeat_jitter,
                                               rng, Backoff(s.backoff_base_s, s.backoff_cap_s, rng))
        self.event_out = EventReporter(api, node, clock, s.events, rng, Backoff(s.backoff_base_s, s.backoff_cap_s, rng))
        self.wake = threading.Event()       # set whenever something is waiting to be sent
        self.on_pending: Callable[[], None] | None = None
        self.started = False

    # -- start ----------------------------------------------------------------------------------

    def start(self, sleep: Callable[[float], None] = time.sleep, stopping: Callable[[], bool] = lambda: False) -> None:
        """Read the node's conditions before writing any. Retries for `start_wait_s`, then carries on
        without them; raises ApiError when a permission is missing or the node does not exist."""
        deadline = self.clock() + self.settings.start_wait_s
        backoff = Backoff(self.settings.backoff_base_s, self.settings.backoff_cap_s)
        while not stopping():
            try:
                self.condition_out.adopt(self.api.get_node(self.node))
                self.started = True
                return
            except ApiError as e:
                if e.forbidden or e.status == 404:
                    raise
                delay = backoff.next_delay(e.retry_after_s)
                if self.clock() + delay > deadline:
                    log.warning("API server unreachable for %.0fs (%s); carrying on without the node's "
                                "current conditions", self.settings.start_wait_s, e)
                    return
                log.warning("cannot read node %s yet (%s); retrying in %.1fs", self.node, e, delay)
                sleep(delay)

    # -- the sink -------------------------------------------------------------------------------

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        before = self.condition_out.snapshot()
        if self.condition_out.update(statuses):
            for s in statuses:
                self._record_flip(s, before.get(s.type))
            self._pending()

    def _record_flip(self, s: ConditionStatus, before: tuple[str, str] | None) -> None:
        """An event when a condition turns true or clears, so `kubectl describe node` tells the story."""
        status = "True" if s.active else "False"
        if before == (status, s.reason) or (before is None and not s.active):
            return
        if s.active:
            self.event_out.record(_event_type(s.severity), s.reason, s.message)
        elif before and before[0] == "True":
            self.event_out.record("Normal", s.reason, f"{s.type} cleared: {s.message}")

    def events(self, problems: list[Problem]) -> None:
        for p in problems:
            self.event_out.record(_event_type(p.severity), p.reason, p.message, p.occurrences)
        self._pending()

    def _pending(self) -> None:
        self.wake.set()
        if self.on_pending:
            self.on_pending()

    # -- sending --------------------------------------------------------------------------------

    def due_at(self) -> float | None:
        times = [t for t in (self.condition_out.due_at(), self.event_out.due_at()) if t is not None]
        return min(times) if times else None

    def flush(self) -> None:
        """Send what is due. Raises ApiError only for a missing permission."""
        for out in (self.condition_out, self.event_out):
            try:
                out.flush()
            except ApiError as e:
                raise ApiError(e.status, e.reason, f"{e.message} (gpu-npd needs exactly the permissions in "
                               "deploy/base/rbac.yaml: get nodes, patch nodes/status, create and patch events)",
                               ) from None
            if out.last_error is not None:
                log.warning("API request failed, will retry: %s", out.last_error)


def _event_type(severity: Severity | None) -> str:
    return "Normal" if severity in (None, Severity.INFO) else "Warning"
