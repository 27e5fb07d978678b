"""Apply rules to a sweep's observations."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from detector.core.types import Observation, Problem
from detector.rules.loader import RuleSet


class RuleEngine:
    def __init__(self, ruleset: RuleSet):
        self.ruleset = ruleset

    def evaluate(self, observations: Iterable[Observation]) -> list[Problem]:
        """One problem per rule that matched anything, in rule-file order."""
        hits: dict[int, list[Observation]] = defaultdict(list)
        for obs in observations:
            for i, rule in enumerate(self.ruleset.rules):
                if rule.applies_to(obs.check) and rule.when(obs.fields):
                    hits[i].append(obs)
        return [self.ruleset.rules[i].problem(hits[i]) for i in sorted(hits)]
