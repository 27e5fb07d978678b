"""Shared helpers: build fake nodes and run one diagnosis through the builtin rules."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from detector.agent.oneshot import diagnose_once
from detector.rules.sources import builtin_rules_dir
from detector.config import build_checks
from detector.core.check import CheckRegistry
from detector.core.sweep import Host, SweepResult
from detector.core.types import Problem
from detector.rules.loader import RuleSet, load_rules
from fake_nvml.host import fake_host
from fake_nvml.node import FakeNode
from fake_nvml.scenario import load_scenario

REPO = Path(__file__).resolve().parent.parent


class Clock:
    """A clock tests move by hand: `clock.now += 60`."""

    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Outcome:
    sweep: SweepResult
    problems: list[Problem]

    def by_rule(self) -> dict[str, Problem]:
        return {p.rule: p for p in self.problems}

    def rules(self) -> set[str]:
        return {p.rule for p in self.problems}


@pytest.fixture(scope="session")
def registry() -> CheckRegistry:
    return CheckRegistry.from_entry_points()


@functools.cache
def builtin_rules() -> RuleSet:
    """The bundled rules, read once per test process (no test changes them): hundreds of tests judge by them."""
    return load_rules([builtin_rules_dir()], CheckRegistry.from_entry_points().fields_by_check())


def diagnose_host(host: Host, registry: CheckRegistry, checks: Sequence[str] | None = None,
                  settings: dict | None = None, inventory_timeout_s: float = 5.0) -> Outcome:
    rules = builtin_rules()
    try:
        sweep, problems = diagnose_once(host, build_checks(registry, checks, settings or {}), rules,
                                        inventory_timeout_s)
    finally:
        host.close()
    return Outcome(sweep, problems)


def node_for(scenario: str, name: str | None = None) -> FakeNode:
    return load_scenario(scenario).build(name)


def diagnose_scenario(scenario: str, registry: CheckRegistry, **kwargs) -> Outcome:
    return diagnose_host(fake_host(node_for(scenario)), registry, **kwargs)


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """End a gpu-npd the test started: SIGTERM (its polite stop), then SIGKILL if it outlives `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
