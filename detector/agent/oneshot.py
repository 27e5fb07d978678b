"""`diagnose` and preflight: one sweep judged on its own, or a watch of the node for a while (`--duration`),
each judged by the checks, their rules, then the node checks over what those found, as the daemon's agent
does after every sweep (without its held state or history)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from detector.core.check import Check
from detector.core.nodecheck import NodeCheck, judge_node, sweep_view
from detector.core.sweep import CheckRun, Host, SweepResult, run_sweep
from detector.core.types import Problem
from detector.rules.engine import RuleEngine
from detector.rules.loader import RuleSet


@dataclass(frozen=True)
class Watch:
    """How long a `diagnose --duration` watched, and on what time."""

    duration_s: float          # asked for
    watched_s: float           # covered (less when interrupted)
    sweeps: int
    simulated: bool            # a fake node's simulated time: the watch took a moment, not `watched_s`
    interrupted: bool = False

    def to_dict(self) -> dict:
        return {"duration_s": self.duration_s, "watched_s": round(self.watched_s, 1), "sweeps": self.sweeps,
                "time": "simulated" if self.simulated else "real", "interrupted": self.interrupted}


def diagnose_once(host: Host, checks: Sequence[Check], ruleset: RuleSet, inventory_timeout_s: float = 10.0,
                  progress: Callable[[str, str], None] | None = None) -> tuple[SweepResult, list[Problem]]:
    """The sweep (node check runs included) and every problem found. The caller closes the host."""
    sweep = run_sweep(host, _swept(checks), inventory_timeout_s, progress=progress)
    engine = RuleEngine(ruleset)
    problems = engine.evaluate(sweep.observations)
    return sweep, problems + _judge_node(host, checks, ruleset, engine, sweep, problems)


def diagnose_over(host: Host, checks: Sequence[Check], ruleset: RuleSet, duration_s: float,
                  inventory_timeout_s: float = 10.0, progress: Callable[[str, str], None] | None = None,
                  step_s: float | None = None) -> tuple[SweepResult, list[Problem], Watch]:
    """Watch the node for `duration_s` on the host's clock, each check run on its own interval as the daemon
    runs it (first at the start, last at the end), so windows fill and counters become rates.

    The result is the last run of every check, with every problem seen during the watch: one per rule and
    GPUs, the latest of each, so a rate that tripped and an event logged midway both count (a preflight
    asks whether anything was wrong while it watched). Ctrl-C ends the watch early and judges what was seen."""
    swept = _swept(checks)
    step = step_s or min([c.interval_s for c in swept] + [15.0])
    start = host.clock()
    end = start + duration_s
    due = {c.name: start for c in swept}
    engine = RuleEngine(ruleset)
    latest: dict[str, CheckRun] = {}
    seen: dict[tuple, Problem] = {}
    sweep: SweepResult | None = None
    sweeps, interrupted = 0, False
    while True:
        now = host.clock()
        final = now >= end - 1e-6
        running = [c for c in swept if final or due[c.name] <= now + 1e-6]
        try:
            sweep = run_sweep(host, running, inventory_timeout_s, progress=progress)
        except KeyboardInterrupt:
            interrupted = True
            break
        sweeps += 1
        for run in sweep.runs:
            latest[run.name] = run
            due[run.name] = now + next(c.interval_s for c in swept if c.name == run.name)
        for problem in engine.evaluate(sweep.observations):
            seen[_identity(problem)] = problem
        if final:
            break
        if progress is not None:
            progress("watch", f"{now - start:.0f} of {duration_s:g} s watched, {sweeps} sweep(s), "
                              f"{len(seen)} problem(s) so far")
        try:
            host.sleep(max(0.0, min(now + step, end) - host.clock()))
        except KeyboardInterrupt:
            interrupted = True
            break
    if sweep is None:                       # interrupted before the first sweep finished
        raise KeyboardInterrupt
    merged = SweepResult(sweep.node, sweep.inventory, [latest[c.name] for c in swept if c.name in latest],
                         sweep.started, sweep.boot)
    problems = list(seen.values())
    problems += _judge_node(host, checks, ruleset, engine, merged, problems)
    watch = Watch(duration_s, host.clock() - start, sweeps, host.simulated_time, interrupted)
    return merged, problems, watch


def _swept(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if not isinstance(c, NodeCheck)]


def _identity(problem: Problem) -> tuple:
    """What makes two problems of a watch the same one: the rule, and the GPUs it names."""
    return problem.rule, tuple((g.pci_bus_id, g.index) for g in problem.gpus)


def _judge_node(host: Host, checks: Sequence[Check], ruleset: RuleSet, engine: RuleEngine, sweep: SweepResult,
                problems: list[Problem]) -> list[Problem]:
    """The node checks over what the swept checks found; their runs join the sweep."""
    view = sweep_view(sweep, problems, frozenset(r.name for r in ruleset.rules if r.scope == "node"),
                      sweep.boot, host.node_status(), host.uptime_s())
    node_checks = sorted((c for c in checks if isinstance(c, NodeCheck)), key=lambda c: (c.judge_order, c.name))
    found: list[Problem] = []
    for run, judged in judge_node(node_checks, view,
                                  lambda run: engine.evaluate([run.status_observation(), *run.observations])):
        sweep.runs.append(run)
        found += judged
    return found
