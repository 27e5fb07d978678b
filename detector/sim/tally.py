"""What a simulated fleet showed, as its nodes' agents judged it: the figures of `gpu-npd simulate`'s progress
lines and of its summary at the end (nodes reporting, conditions True, nodes asking for remediation).

Each node's agent gets one more sink beside its Kubernetes reporter, so the figures are the judgements the
reporters send, counted as they happen, without a request to the API server. The readiness countdown
(GpuNodeUnverified with reason ChecksPending, True on every node after every boot until its checks have
run) is not counted: it says a node is starting, not that it found something.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from detector.agent.active import ConditionStatus
from detector.agent.agent import AgentSink

COUNTDOWN_REASON = "ChecksPending"          # rules/readiness.yaml: a node whose checks have not all run yet


@dataclass(frozen=True)
class TallySnapshot:
    nodes_reporting: int                                  # nodes whose agent judged its conditions at least once
    true_now: Counter[str] = field(default_factory=Counter)      # condition type -> nodes where it is True now
    turned_true: Counter[str] = field(default_factory=Counter)   # condition type -> times it turned True
    asking_now: tuple[str, ...] = ()                      # nodes asking for remediation now, by name
    ever_asked: int = 0                                   # nodes that asked for remediation at some point


class FleetTally:
    """Counts, across threads, what every node's conditions said; `sink(node)` is that node's agent sink."""

    def __init__(self, remediation_types: Sequence[str] = ("GpuNodeNeedsRemediation",)):
        self.remediation_types = frozenset(remediation_types)
        self._lock = threading.Lock()
        self._true: dict[str, set[str]] = {}             # node -> its condition types True now
        self._turned_true: Counter[str] = Counter()
        self._ever_asked: set[str] = set()

    def sink(self, node: str) -> AgentSink:
        return _NodeTally(self, node)

    def conditions(self, node: str, statuses: Sequence[ConditionStatus]) -> None:
        true = {s.type for s in statuses if s.active and s.reason != COUNTDOWN_REASON}
        with self._lock:
            before = self._true.get(node, set())
            self._turned_true.update(true - before)
            self._true[node] = true
            if true & self.remediation_types:
                self._ever_asked.add(node)

    def snapshot(self) -> TallySnapshot:
        with self._lock:
            true_now = Counter(t for types in self._true.values() for t in types)
            asking = tuple(sorted(n for n, types in self._true.items() if types & self.remediation_types))
            return TallySnapshot(len(self._true), true_now, Counter(self._turned_true), asking,
                                 len(self._ever_asked))


class _NodeTally(AgentSink):
    def __init__(self, tally: FleetTally, node: str):
        self.tally, self.node = tally, node

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        self.tally.conditions(self.node, statuses)


def counted(counts: Counter[str], limit: int = 6) -> str:
    """`GpuXidError 3, GpuMissing 2, ...`: most first (then by name), at most `limit` named; "none" when empty."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{name} {n}" for name, n in ranked[:limit])
    if len(ranked) > limit:
        text += f", {len(ranked) - limit} more"
    return text or "none"
