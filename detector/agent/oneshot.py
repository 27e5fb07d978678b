"""One sweep judged on its own, for `diagnose` and preflight: the checks, their rules, then the node checks
over what those found, as the daemon's agent does after every sweep (without its held state or history)."""

from __future__ import annotations

from typing import Callable, Sequence

from detector.core.check import Check
from detector.core.nodecheck import NodeCheck, judge_node, sweep_view
from detector.core.sweep import Host, SweepResult, run_sweep
from detector.core.types import Problem
from detector.rules.engine import RuleEngine
from detector.rules.loader import RuleSet


def diagnose_once(host: Host, checks: Sequence[Check], ruleset: RuleSet, inventory_timeout_s: float = 10.0,
                  progress: Callable[[str, str], None] | None = None) -> tuple[SweepResult, list[Problem]]:
    """The sweep (node check runs included) and every problem found. The caller closes the host."""
    sweep = run_sweep(host, [c for c in checks if not isinstance(c, NodeCheck)], inventory_timeout_s,
                      progress=progress)
    engine = RuleEngine(ruleset)
    problems = engine.evaluate(sweep.observations)
    view = sweep_view(sweep, problems, frozenset(r.name for r in ruleset.rules if r.scope == "node"),
                      sweep.boot, host.node_status(), host.uptime_s())
    node_checks = sorted((c for c in checks if isinstance(c, NodeCheck)), key=lambda c: (c.judge_order, c.name))
    for run, found in judge_node(node_checks, view,
                                 lambda run: engine.evaluate([run.status_observation(), *run.observations])):
        sweep.runs.append(run)
        problems += found
    return sweep, problems
