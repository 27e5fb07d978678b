"""The problems a node has now: condition problems held until their rule's recovery says they are over.

A check's observations are facts of one run; a condition is a state. This module bridges the two:
each condition problem is held ("latched") per (rule, check) and released by the rule's recovery —
the next run of its check without a match (`observation`), a new boot (`reboot`), an operator
(`manual`), or its `ttl`. The state is persisted beside the kernel-log cursor, so a restarted agent
neither forgets an XID it already read nor reports it twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from detector.core import saved
from detector.core.check import COMMON_FIELDS
from detector.backends.quarantine import kept_at
from detector.backends.safefile import UnsafeFile, read_text_bounded, write_atomic
from detector.core.types import GpuRef, Problem, Severity, action_strength
from detector.rules.model import MESSAGE_LIMIT, Rule, compose_message, finding_of

STATE_VERSION = 1
# problems.json holds at most one latch per rule and check it judges: 241 pairs for the bundled rules (the
# rules over a run's status, check failed or timed out, count once per check). A latch is at most about
# 10 KB as saved: a message of MESSAGE_LIMIT (1,024) characters, 64 GPUs named and its times. All of them
# held at once, each naming 64 GPUs, would be about 2.3 MB, far beyond any real node
# (tests/test_state_files_hostile.py builds that file and checks it fits). The limit is small on purpose:
# parsing JSON can cost 25 times the file's size (a file of empty objects), so a planted file costs the
# daemon at most about 100 MiB for a moment. clear-result.json holds a subset of the same latches.
PROBLEMS_LIMIT = 4 << 20


@dataclass
class Verifying:
    """A problem whose cure (its rule stopped matching, or a reboot ended it) is not yet trusted: it stays
    held until every check has passed `verify_sweeps` rounds since the cure. A round ends once every
    scheduled check has run since it began."""

    since: float                 # when the cure was seen
    rebooted: bool               # the cure was a reboot (the problem belongs to an earlier boot)
    rounds: int = 0
    ran: set[str] = field(default_factory=set)      # checks run in the round under way

    def note(self, ran: Iterable[str], scheduled: set[str]) -> None:
        self.ran |= set(ran)
        if self.ran >= scheduled:
            self.rounds, self.ran = self.rounds + 1, set()


@dataclass
class Latch:
    problem: Problem
    boot: str           # the boot it was last seen in
    first: float
    last: float         # when its rule last matched
    verifying: Verifying | None = None

    def to_dict(self, recovery: str = "") -> dict[str, Any]:
        """`recovery` (the rule's) is written for `gpu-npd clear --list`; loading goes by the rules."""
        p = self.problem
        d = {"rule": p.rule, "check": p.check, "type": p.type, "reason": p.reason, "message": p.message,
             "severity": p.severity.value, "action": p.action, "gpus": [g.to_dict() for g in p.gpus],
             "time": p.time, "boot": self.boot, "first": self.first, "last": self.last, "recovery": recovery}
        if self.verifying is not None:
            d["verifying"] = {"since": self.verifying.since, "rebooted": self.verifying.rebooted,
                              "rounds": self.verifying.rounds}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Latch":
        """A latch as saved; ValueError when a field has the wrong shape (a hand-edited or planted file must
        not put a number where the agent later formats a message)."""
        d = saved.record(d, "a held problem")
        problem = Problem(rule=saved.text(d, "rule"), check=saved.text(d, "check"), type=saved.text(d, "type"),
                          reason=saved.text(d, "reason"), message=saved.text(d, "message"),
                          severity=Severity(d.get("severity")), action=saved.text(d, "action"), report="condition",
                          gpus=tuple(_gpu(g) for g in saved.listed(d, "gpus", [])), time=saved.number(d, "time"))
        v = d.get("verifying")
        verifying = None
        if v is not None:
            v = saved.record(v, "verifying")
            verifying = Verifying(saved.number(v, "since"), bool(v.get("rebooted")), int(saved.number(v, "rounds", 0)))
        return cls(problem, saved.text(d, "boot"), saved.number(d, "first"), saved.number(d, "last"), verifying)


def _gpu(g: Any) -> GpuRef:
    g = saved.record(g, "a GPU")
    return GpuRef(saved.whole_or_none(g.get("index"), "GPU index"), saved.text(g, "uuid", None),
                  saved.text(g, "pci_bus_id", None))


@dataclass
class ClearResult:
    """What an operator's clear did: the held problems it released, the live ones it left."""

    cleared: list[Latch] = field(default_factory=list)
    live: list[Latch] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.cleared)

    def to_dict(self) -> dict[str, Any]:
        return {"cleared": [l.to_dict() for l in self.cleared], "live": [l.to_dict() for l in self.live]}


@dataclass(frozen=True)
class ConditionStatus:
    """One condition type, as the problems behind it add up (no Kubernetes here)."""

    type: str
    active: bool
    reason: str
    message: str
    severity: Severity | None = None
    since: float | None = None            # earliest first match of the active problems
    names_gpu: bool = False               # a problem behind it names a GPU (not the node as a whole)


def accumulated(held: Problem, new: Problem) -> Problem:
    """A rule held until a reboot (or a ttl, or an operator) that fires again on other GPUs keeps naming the
    GPUs it named: a run of the xid check reports only the lines it read, so a 149 on GPU 1 and, a second
    later, a 145 on GPUs 0, 2 and 3 are two runs of one rule, and the node has all four. The latest
    problem leads; the GPUs only the held one named follow, with its findings."""
    if held.rule != new.rule:
        return new
    missing = tuple(g for g in held.gpus if g not in new.gpus)
    if not missing:
        return new
    body, said = finding_of(new.message)
    old_body, _ = finding_of(held.message)
    message = compose_message([body, old_body], new.action if said else "NONE")
    return Problem(new.rule, new.check, new.type, new.reason, message, new.severity, new.action, new.report,
                   (*new.gpus, *missing), new.time, new.occurrences)


class ActiveProblems:
    def __init__(self, rules: Iterable[Rule], verify: Callable[[Problem], bool] = lambda p: False):
        """`verify`: which problems, once cured, stay held until the cure is verified (`advance`)."""
        self.rules = {r.name: r for r in rules}
        self.latches: dict[tuple[str, str], Latch] = {}
        self.verify = verify

    def update(self, check: str, ran_ok: bool, problems: Iterable[Problem], now: float, boot: str) -> bool:
        """Take one run of `check` and what the rules made of it; True when the held set changed."""
        before = self._fingerprint()
        fired = set()
        for p in problems:
            if p.report != "condition":
                continue
            key = (p.rule, check)
            fired.add(key)
            held = self.latches.get(key)
            rule = self.rules.get(p.rule)
            if held is not None and held.verifying is None and held.boot == boot and rule is not None \
                    and rule.recovery != "observation":
                p = accumulated(held.problem, p)
            self.latches[key] = Latch(p, boot, held.first if held else now, now)
        for key in [k for k in self.latches if k[1] == check and k not in fired]:
            rule = self.rules.get(key[0])
            if rule is None or (rule.recovery == "observation" and (ran_ok or _judges_status(rule))):
                self._release(key, now, boot, verify=rule is not None)
        return self._fingerprint() != before

    def expire(self, now: float, boot: str) -> bool:
        """Release what a reboot or a ttl ends, and what no loaded rule holds any more (a reboot's cure is
        verified first, like any other)."""
        before = self._fingerprint()
        for key, latch in list(self.latches.items()):
            if latch.verifying is None and self._over(key[0], latch, now, boot):
                rule = self.rules.get(key[0])
                ttl_over = rule is not None and rule.ttl_s is not None and now - latch.last >= rule.ttl_s
                self._release(key, now, boot, verify=rule is not None and not ttl_over)
        return self._fingerprint() != before

    def _release(self, key: tuple[str, str], now: float, boot: str, verify: bool) -> None:
        latch = self.latches[key]
        if verify and self.verify(latch.problem):
            if latch.verifying is None:
                latch.verifying = Verifying(now, latch.boot != boot)
        else:
            del self.latches[key]

    def advance(self, ran: Iterable[str], scheduled: set[str], rounds_needed: int) -> list[Latch]:
        """A sweep ran these checks: count them towards each cure being verified; release and return the
        latches whose cure is now verified (every check passed `rounds_needed` rounds since)."""
        ran = set(ran)
        released = []
        for key, latch in list(self.latches.items()):
            if latch.verifying is None:
                continue
            latch.verifying.note(ran, scheduled)
            if latch.verifying.rounds >= rounds_needed:
                released.append(self.latches.pop(key))
        return released

    def clear(self, types: set[str] | None, before: float) -> "ClearResult":
        """An operator's clear: release the held problems (recovery reboot or manual) of these types (all
        if None) last seen before `before`. A problem that reflects a live observation (a GPU missing now)
        is left alone: clearing it would only flip its condition off until the next run sets it again."""
        result = ClearResult()
        for key, latch in list(self.latches.items()):
            if types is not None and latch.problem.type not in types:
                continue
            if self.is_held(latch) or latch.verifying is not None:
                if latch.last <= before:
                    result.cleared.append(latch)
                    del self.latches[key]
            else:
                result.live.append(latch)
        return result

    def is_held(self, latch: Latch) -> bool:
        """Held until a reboot or an operator clears it, as opposed to one that ends with its observation."""
        rule = self.rules.get(latch.problem.rule)
        return rule is not None and rule.recovery != "observation"

    def _over(self, rule_name: str, latch: Latch, now: float, boot: str) -> bool:
        rule = self.rules.get(rule_name)
        if rule is None or rule.report != "condition":
            return True
        if rule.ttl_s is not None and now - latch.last >= rule.ttl_s:
            return True
        return rule.recovery == "reboot" and latch.boot != boot

    def _fingerprint(self) -> set[tuple[Any, ...]]:
        return {(k, l.problem.reason, l.problem.message, l.verifying.rounds if l.verifying else None)
                for k, l in self.latches.items()}

    # -- what the node shows ------------------------------------------------------------------------

    def condition(self, type_: str, limit: int = MESSAGE_LIMIT, rounds_needed: int = 1) -> ConditionStatus:
        """The most urgent problem leads (the action it demands, then severity, then recency); the others
        follow once each, and the message ends with the leading problem's recommended action."""
        held = sorted((l for l in self.latches.values() if l.problem.type == type_),
                      key=lambda l: (-action_strength(l.problem.action), -l.problem.severity.rank, -l.last,
                                     l.problem.rule))
        if not held:
            return ConditionStatus(type_, False, f"No{type_}", "no problem found")   # the reason names the type
        top = held[0].problem
        bodies: list[str] = []
        for latch in held:
            body, _ = finding_of(latch.problem.message)
            if latch.verifying is not None:
                body += f" [{verifying_note(latch.verifying, rounds_needed)}]"
            if body not in bodies:
                bodies.append(body)
        action = top.action if finding_of(top.message)[1] else "NONE"
        return ConditionStatus(type_, True, top.reason, compose_message(bodies, action, limit, sep=" | "),
                               top.severity, min(l.first for l in held), any(l.problem.gpus for l in held))

    # -- persistence ----------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write atomically through a fresh temporary name (write_atomic): a crash mid-write leaves the
        previous state, never a torn file, and a link planted at the name or beside it is never written
        through."""
        data = {"version": STATE_VERSION, "latches": [
            l.to_dict(self.rules[l.problem.rule].recovery if l.problem.rule in self.rules else "")
            for l in self.latches.values()]}
        write_atomic(path, json.dumps(data, indent=1))

    def load(self, path: Path) -> str | None:
        """Restore held problems; returns a warning (not an exception) when the file is unusable (a link, a
        FIFO, over PROBLEMS_LIMIT, corrupt, the wrong shape), which is then moved aside so the held problems
        in it are kept for an operator, never silently dropped. A FIFO is renamed, never opened."""
        try:
            data = json.loads(read_text_bounded(path, PROBLEMS_LIMIT, "problem state"))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                found = data.get("version") if isinstance(data, dict) else None
                raise ValueError(f"version {found!r}, this gpu-npd reads {STATE_VERSION}")
            if not isinstance(data.get("latches"), list):
                raise ValueError("latches is not a list")
            latches = [Latch.from_dict(d) for d in data["latches"]]
        except FileNotFoundError:
            return None
        except UnsafeFile as e:
            return f"cannot read problem state: {e}; {kept_at(path)}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"cannot read problem state {path} ({type(e).__name__}: {e}); {kept_at(path)}"
        for latch in latches:
            if latch.problem.rule in self.rules:
                self.latches[(latch.problem.rule, latch.problem.check)] = latch
        return None


def verifying_note(v: Verifying, rounds_needed: int) -> str:
    cure = "after a reboot" if v.rebooted else "cleared"
    return f"{cure}; verifying: {v.rounds} of {rounds_needed} rounds of every check passed"


def _judges_status(rule: Rule) -> bool:
    """A rule over the run's own status (check failed, timed out) is decided even by a failed run."""
    return bool(rule.when.names) and rule.when.names <= set(COMMON_FIELDS)
