"""The agent's Kubernetes sink: conditions, events and the unhealthy-GPUs annotation for one node, sent
when due.

`conditions`/`events` only record the latest state and return at once; `flush` (called by the
daemon's sender thread, or by the fleet's shared scheduler) does the talking, reading the node first. So a
slow, absent or refusing API server delays reports but never stalls the checks.
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
from detector.core.gpu_health import GpuHealth
from detector.core.types import Problem, Severity
from detector.kube.annotations import unhealthy_gpus_annotation
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import KEEP_CLEARED_S, ConditionReporter
from detector.kube.events import EventReporter, EventSettings
from detector.kube.pacing import Backoff

log = logging.getLogger("gpu_npd.kube")


# Written from their first judgement, False included: a node remediator keys on the first (medik8s
# NodeHealthCheck, draino), the Node Readiness Controller on the second, which it reads as not verified while
# it is missing. Every other type is written only once its problem was seen on the node.
ALWAYS_WRITTEN = ("GpuNodeNeedsRemediation", "GpuNodeUnverified")


@dataclass
class ReporterSettings:
    # node-problem-detector's --k8s-exporter-heartbeat-period. What acts on the conditions does not read
    # lastHeartbeatTime (a NodeHealthCheck times a condition from its lastTransitionTime, the Node Readiness
    # Controller reads its status); `gpu-npd fleet` says a node is not reporting after three missed.
    heartbeat_s: float = 300.0
    heartbeat_jitter: float = 0.1
    always_written: tuple[str, ...] = ALWAYS_WRITTEN
    keep_cleared_s: float = KEEP_CLEARED_S   # a condition whose problem is over stays False this long, then goes
    start_wait_s: float = 300.0         # conditions wait this long for the node to be read, then go without
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    refused_retry_s: float = 300.0      # after a 401/403/404: ask again this rarely
    outage_log_every_s: float = 60.0    # while the API server is away, one warning this often at most
    events: EventSettings = field(default_factory=EventSettings)


class KubeReporter(AgentSink):
    def __init__(self, api: KubeApi, node: str, owned_types: list[str], settings: ReporterSettings | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.api, self.node, self.clock = api, node, clock
        self.settings = settings or ReporterSettings()
        rng = rng or random.Random()
        s = self.settings
        self.condition_out = ConditionReporter(api, node, owned_types, clock, s.heartbeat_s, s.heartbeat_jitter,
                                               rng, self._backoff(rng), always=s.always_written,
                                               keep_cleared_s=s.keep_cleared_s)
        self.event_out = EventReporter(api, node, clock, s.events, rng, self._backoff(rng))
        self.wake = threading.Event()       # set whenever something is waiting to be sent
        self.on_pending: Callable[[], None] | None = None
        self.started = False                # the node's conditions were read (or given up on)
        self._first_try: float | None = None
        self._adopt_at = 0.0
        # Flip events compare a judgement with the last one, starting from what the node said: None until
        # the node was read. Judgements that come earlier wait (latest per type), so a restarted daemon
        # does not announce again a condition the node already shows.
        self._flip_lock = threading.Lock()
        self._judged: dict[str, tuple[str, str]] | None = None
        self._early: dict[str, ConditionStatus] = {}
        self._adopt_backoff = self._backoff(rng)
        self._health: list[GpuHealth] | None = None      # the GPUs as last judged

    def _backoff(self, rng: random.Random) -> Backoff:
        s = self.settings
        return Backoff(s.backoff_base_s, s.backoff_cap_s, rng, refused_s=s.refused_retry_s)

    # -- reading the node first ------------------------------------------------------------------

    def _adopt(self) -> bool:
        """Read the node's conditions before writing any (so ours keep their transition times and stale
        ones are pruned). Retried with backoff; after `start_wait_s` of failures, carry on without them."""
        now = self.clock()
        if self._first_try is None:
            self._first_try = now
        if now < self._adopt_at:
            return False
        try:
            self.condition_out.adopt(self.api.get_node(self.node))
        except ApiError as e:
            if not e.refused and now - self._first_try >= self.settings.start_wait_s:
                log.warning("could not read node %s for %.0fs (%s); writing conditions without its current ones",
                            self.node, now - self._first_try, e)
                self._start({})
                return True
            self._adopt_at = now + self._adopt_backoff.after(e.status, e.retry_after_s)
            return False
        self._start(self.condition_out.snapshot())
        return True

    def _start(self, on_node: dict[str, tuple[str, str]]) -> None:
        """The node was read (or given up on): judge the flips that waited for it, and the annotation
        again with the serials the node's own value remembers."""
        if self._health is not None:
            before = self.condition_out.annotation_on_node()
            self.condition_out.annotate(unhealthy_gpus_annotation(self._health, before))
        with self._flip_lock:
            self._judged = dict(on_node)
            early, self._early = list(self._early.values()), {}
            for s in early:
                self._record_flip(s)
        self.started = True

    # -- the sink -------------------------------------------------------------------------------

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        owned = [s for s in statuses if s.type in self.condition_out.owned]
        flipped = False
        with self._flip_lock:
            for s in owned:
                if self._judged is None:
                    self._early[s.type] = s
                else:
                    flipped |= self._record_flip(s)
        if self.condition_out.update(statuses) or flipped:
            self._pending()

    def _record_flip(self, s: ConditionStatus) -> bool:
        """An event when a condition turns true or clears, so `kubectl describe node` tells the story.
        Called with _flip_lock held, once the node's own conditions are known; True when one was recorded."""
        assert self._judged is not None
        status = "True" if s.active else "False"
        before = self._judged.get(s.type)
        self._judged[s.type] = (status, s.reason)
        if before == (status, s.reason) or (before is None and not s.active):
            return False
        if s.active:
            self.event_out.record(_event_type(s.severity), s.reason, s.message)
        elif before is not None and before[0] == "True":
            self.event_out.record("Normal", s.reason, f"{s.type} cleared: {s.message}")
        else:
            return False
        return True

    def events(self, problems: list[Problem]) -> None:
        for p in problems:
            self.event_out.record(_event_type(p.severity), p.reason, p.message, p.occurrences)
        self._pending()

    def gpus(self, health: list[GpuHealth]) -> None:
        """The node's unhealthy GPUs as an annotation, written with the next status PATCH if it changed."""
        self._health = health
        changed = self.condition_out.annotate(unhealthy_gpus_annotation(health, self.condition_out.annotation_on_node()))
        cliques = {h.clique for h in health if h.clique}
        if self.condition_out.clique(next(iter(cliques)) if len(cliques) == 1 else "") or changed:
            self._pending()

    def note_gpus(self, note: str) -> None:
        """Why unhealthy GPUs are not fenced ("" once they are), said in the conditions that name GPUs."""
        if self.condition_out.note_gpus(note):
            self._pending()

    def _pending(self) -> None:
        self.wake.set()
        if self.on_pending:
            self.on_pending()

    def settled(self, types: list[str]) -> bool:
        """The node was read, and shows what was decided for these types (True, False, or nothing for a
        problem never seen on it)."""
        return self.started and self.condition_out.settled(types)

    # -- sending --------------------------------------------------------------------------------

    def due_at(self) -> float | None:
        if not self.started:
            return self._adopt_at
        times = [t for t in (self.condition_out.due_at(), self.event_out.due_at()) if t is not None]
        return min(times) if times else None

    def flush(self) -> None:
        """Send what is due; never raises for the API server's sake. Failures are retried later (the
        client's ApiHealth says them in the log)."""
        if not self.started and not self._adopt():
            return
        for out in (self.condition_out, self.event_out):
            out.flush()


def _event_type(severity: Severity | None) -> str:
    return "Normal" if severity in (None, Severity.INFO) else "Warning"
