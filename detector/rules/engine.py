"""Apply rules to a sweep's observations.

The engine belongs to one node agent and remembers, per escalating rule, recent matches (bounded),
so "XID 13 twice in 24 h" or "the same fatal XID after two reboots" holds across sweeps.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Iterable

from detector.core.types import Observation, Problem
from detector.rules.loader import RuleSet
from detector.rules.model import Rule

HISTORY_LIMIT = 10_000          # remembered matches per escalating rule


class RuleEngine:
    def __init__(self, ruleset: RuleSet):
        self.ruleset = ruleset
        self._history: dict[str, deque[tuple[float, Any, int, str]]] = defaultdict(
            lambda: deque(maxlen=HISTORY_LIMIT))
        self._applicable: dict[frozenset[str], list[int]] = {}

    def _rules_for(self, checks: frozenset[str]) -> list[int]:
        """The rules (by position) that apply to any of these checks: a run of one check is matched
        against its own rules, not the whole XID catalogue."""
        found = self._applicable.get(checks)
        if found is None:
            found = self._applicable[checks] = [i for i, rule in enumerate(self.ruleset.rules)
                                                if any(rule.applies_to(c) for c in checks)]
        return found

    def evaluate(self, observations: Iterable[Observation]) -> list[Problem]:
        """One problem per rule that matched, in rule-file order."""
        observations = list(observations)
        rules = self.ruleset.rules
        applicable = self._rules_for(frozenset(obs.check for obs in observations))
        hits: dict[int, list[Observation]] = defaultdict(list)
        claimed: set[int] = set()                       # observations a non-fallback rule matched
        for i in applicable:
            rule = rules[i]
            if rule.fallback:
                continue
            for n, obs in enumerate(observations):
                if rule.applies_to(obs.check) and rule.when(obs.fields):
                    hits[i].append(obs)
                    claimed.add(n)
        for i in applicable:
            rule = rules[i]
            if rule.fallback:
                hits[i] = [obs for n, obs in enumerate(observations)
                           if n not in claimed and rule.applies_to(obs.check) and rule.when(obs.fields)]
        problems = []
        for i in sorted(hits):
            if not hits[i]:
                continue
            rule = rules[i]
            if rule.escalates:
                problem = self._escalate(rule, hits[i])
                if problem is not None:
                    problems.append(problem)
            else:
                problems.extend(rule.problem(group) for group in _per_process(rule, hits[i]))
        return problems

    def _escalate(self, rule: Rule, hits: list[Observation]) -> Problem | None:
        """Count incidents (an observation's `incidents`, 1 when it has none), each judged at its own
        time: in a saved log, two incidents three days apart are not "twice in 24 h"."""
        history = self._history[rule.name]
        for obs in hits:
            history.append((obs.time, _gpu_key(obs), _incidents(obs), str(obs.fields.get("boot", ""))))
        firing: list[Observation] = []
        extra: dict[str, Any] = {}
        for obs in hits:
            key = _gpu_key(obs)
            since = obs.time - rule.window_s if rule.window_s is not None else float("-inf")
            entries = [(c, b) for t, k, c, b in history if k == key and since <= t <= obs.time and c > 0]
            matches, boots = sum(c for c, _ in entries), len({b for _, b in entries})
            if (rule.count is None or matches >= rule.count) and (rule.boots is None or boots >= rule.boots):
                firing.append(obs)
                if matches >= extra.get("matches", 0):
                    extra = {"matches": matches, "boots_seen": boots}
        return rule.problem(firing, extra) if firing else None


def _incidents(obs: Observation) -> int:
    value = obs.fields.get("incidents", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 1


def _gpu_key(obs: Observation) -> Any:
    if obs.gpu is None:
        return None
    return obs.gpu.pci_bus_id or obs.gpu.uuid or obs.gpu.index


def _per_process(rule: Rule, hits: list[Observation]) -> list[list[Observation]]:
    """An event about processes is one per process and GPU: two programs faulting in one sweep are two
    Events, each naming its own pid, never one. Conditions, and events that name no process, make one
    problem of all their hits (one condition, many GPUs)."""
    if rule.report != "event":
        return [hits]
    groups: dict[Any, list[Observation]] = {}
    for obs in hits:
        pid = obs.fields.get("pid")
        groups.setdefault(None if pid is None else (obs.gpu, pid), []).append(obs)
    return list(groups.values())
