"""A node agent: one node's checks on their intervals, its rules, and the state it reports.

The agent is driven from outside (`run_due`, `next_due`, `kick`) and owns no thread, so the daemon
drives one with a loop and the fleet simulator drives thousands from one scheduler. What it concludes
goes to sinks (Kubernetes, metrics, a test's list); it knows nothing of where.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from detector.agent.active import PROBLEMS_LIMIT, ActiveProblems, ConditionStatus, Latch
from detector.backends.quarantine import kept_at
from detector.backends.safefile import read_text_bounded, write_atomic
from detector.core import saved
from detector.core.check import Check
from detector.core.gpu_health import APPLICATION_ACTIONS, GpuHealth, carry_since, fuller, gpu_health, gpu_key
from detector.core.inventory import Inventory
from detector.core.nodecheck import NodeCheck, NodeView, board_serials, judge_node
from detector.core.nodestatus import MAINTENANCE_ANNOTATION, MAINTENANCE_CONDITIONS
from detector.core.nvlink_domain import DomainFacts
from detector.core.sweep import CheckRun, Host, SweepResult, run_sweep
from detector.core.types import GpuRef, Problem, Severity
from detector.rules.engine import RuleEngine
from detector.rules.loader import RuleSet
from detector.rules.model import MESSAGE_LIMIT

log = logging.getLogger("gpu_npd.agent")

PROBLEMS_FILE = "problems.json"
CLEAR_FILE = "clear-request.json"
CLEAR_RESULT_FILE = "clear-result.json"      # what the daemon did with the last request, for `gpu-npd clear`
# A clear request is a time and the condition types named on `gpu-npd clear`'s command line: a few hundred
# bytes. 64 KiB is a hundred times that; anything bigger was not written by gpu-npd.
CLEAR_LIMIT = 64 << 10
CLEAR_RESULT_LIMIT = PROBLEMS_LIMIT          # the latches a clear released or left: a subset of problems.json


class AgentSink:
    """Where an agent's conclusions go. Calls come one at a time (under the agent's lock), from
    whichever thread ran the sweep."""

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        """The judged condition types, all of them, whenever one changed or became judged."""

    def events(self, problems: list[Problem]) -> None:
        """Event problems of one run, as they fire."""

    def sweep(self, result: SweepResult, problems: list[Problem]) -> None:
        """Every sweep and what its rules found (metrics)."""

    def gpus(self, health: list[GpuHealth]) -> None:
        """Every GPU the node has had, judged by the problems it has now; after every sweep."""


@dataclass
class AgentSettings:
    inventory_timeout_s: float = 10.0
    inventory_max_age_s: float = 60.0      # checks that can use an older inventory get one this old
    start_spread_s: float = 10.0           # first runs spread over this, so nodes do not act at once
    message_limit: int = MESSAGE_LIMIT
    state_dir: Path | None = None          # problems.json (held problems) and operator clear requests
    maintenance_annotation: str = MAINTENANCE_ANNOTATION   # a site's "under maintenance" annotation ("": none)
    # Condition types that ask for the node's remediation: False while the node is under maintenance, and,
    # like a failed GPU, lifted only once the cure is verified.
    remediation_types: tuple[str, ...] = ("GpuNodeNeedsRemediation",)
    verify_sweeps: int = 3                 # rounds of every check a cure must pass before it is trusted (0: none)
    # Held conditions that withdraw a remediation ask on purpose (another reboot will not help): the ask ends
    # at once, with no cure to verify.
    withdrawing_types: tuple[str, ...] = ("GpuRemediationLoop",)


class NodeAgent:
    def __init__(self, host: Host, checks: Sequence[Check], ruleset: RuleSet, sinks: Iterable[AgentSink] = (),
                 settings: AgentSettings | None = None, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None):
        self.host, self.ruleset = host, ruleset
        self.checks = [c for c in checks if not isinstance(c, NodeCheck)]       # scheduled, in sweeps
        self.node_checks = sorted((c for c in checks if isinstance(c, NodeCheck)),    # judged after every sweep
                                  key=lambda c: (c.judge_order, c.name))
        self._scheduled = {c.name for c in self.checks}
        self.sinks = list(sinks)
        self.settings = settings or AgentSettings()
        self.clock = clock
        self.engine = RuleEngine(ruleset)
        self.active = ActiveProblems(ruleset.rules, self._verifies)
        self.owned_types = sorted(ruleset.types())
        self._needs = _checks_per_type(ruleset, {c.name for c in [*self.checks, *self.node_checks]})
        self._node_scoped = frozenset(r.name for r in ruleset.rules if r.scope == "node")
        rng = rng or random.Random()
        self._rng = rng
        now = clock()
        self._next = {c.name: now + rng.uniform(0, self.settings.start_spread_s) for c in self.checks}
        self._by_name = {c.name: c for c in self.checks}
        self._ran: set[str] = set()
        self._attempted: set[str] = set()     # checks that ran at all, skipped included
        self._started = clock()
        self._node_due = False                # the node changed (its advertised GPUs, maintenance): judge it again
        self._maintenance = ""                # what the conditions last said of maintenance
        self._boot_runs: tuple[str, set[str]] = (host.current_boot(), set())   # checks run (not skipped) this boot
        self._judged: set[str] = set()
        self._inventory: tuple[float, str, Inventory] | None = None
        self._known_gpus: dict[str, GpuRef] = {}   # every GPU seen: one lost from NVML keeps its row
        self._serials: dict[str, str] = {}         # gpu_key -> serial, for histories kept by serial
        self._incidents: dict[str, int] = {}       # gpu_key -> incidents, from the node check
        self._incident_boots: dict[str, int] = {}  # gpu_key -> distinct boots with an incident, from the node check
        self._health: dict[str, GpuHealth] = {}    # gpu_key -> the GPU as last judged: its state's since
        self._domain = DomainFacts()               # each GPU's NVLink clique and link-level XID (fabric, xid)
        self._lock = threading.Lock()          # the schedule
        self._judging = threading.Lock()       # what runs concluded: held problems, sinks
        self.warnings: list[str] = []
        self._refused_clear: tuple[int, int] | None = None   # the unusable clear request last warned of
        # GPUs whose reset failed or did not cure in this boot (the GPU resetter's, with --reset-gpus)
        self.reset_failed: Callable[[], Sequence[str]] = lambda: ()
        self._restore()

    # -- scheduling -----------------------------------------------------------------------------

    def next_due(self, long_running: bool | None = None) -> float:
        """When the next check is due; `long_running` picks one lane (see `run_due`)."""
        with self._lock:
            if self._node_due and long_running is not True:
                return 0.0
            return min((t for name, t in self._next.items() if _in_lane(self._by_name[name], long_running)),
                       default=float("inf"))

    def kick(self, check_name: str) -> None:
        """Run this check as soon as possible (new kernel-log lines for the xid check)."""
        with self._lock:
            if check_name in self._next:
                self._next[check_name] = 0.0

    @property
    def has_swept(self) -> bool:
        """A sweep has run: there is something to judge the node by."""
        return self._inventory is not None

    def kick_node_checks(self) -> None:
        """What the cluster says of the node changed (host.node_status): judge the node again at once, from
        what the checks last saw, without waiting for the next check to be due."""
        with self._lock:
            self._node_due = bool(self.node_checks)

    def run_due(self, long_running: bool | None = None) -> list[Problem]:
        """Run every check that is due, in one sweep; returns the problems its rules found.
        `long_running` True or False runs only that lane, so a daemon can give probes that take
        minutes a thread of their own while the other checks keep their pace."""
        now = self.clock()
        with self._lock:
            due = [c for c in self.checks if self._next[c.name] <= now and _in_lane(c, long_running)]
            for c in due:
                self._next[c.name] = now + c.interval_s
            node_due = self._node_due and long_running is not True
            if node_due:
                self._node_due = False
        if due:
            return self.run(due)
        return self._rejudge() if node_due else []

    def _rejudge(self) -> list[Problem]:
        """The node checks alone, over the last inventory (nothing to judge before the first sweep)."""
        if self._inventory is None:
            return []
        result = SweepResult(self.host.node_name, self._inventory[2], [], time.time(), self.host.current_boot())
        with self._judging:
            return self._conclude(result, fresh_inventory=False)

    def run(self, checks: Sequence[Check]) -> list[Problem]:
        cached = self._cached_inventory(checks)
        result = run_sweep(self.host, checks, self.settings.inventory_timeout_s, cached)
        with self._judging:                   # sweeps of two lanes may finish at once
            return self._conclude(result, fresh_inventory=cached is None)

    def _conclude(self, result: SweepResult, fresh_inventory: bool) -> list[Problem]:
        if fresh_inventory:
            self._inventory = (time.monotonic(), result.boot, result.inventory)
            for gpu in result.inventory.gpus:
                key, before = gpu_key(gpu.ref()), self._known_gpus.get(gpu_key(gpu.ref()))
                # a GPU NVML lost reads without its UUID: the one known before goes on naming it
                self._known_gpus[key] = fuller(gpu.ref(), before) if before else gpu.ref()
                if gpu.identity.serial:
                    self._serials[key] = gpu.identity.serial
        now, boot = self.clock(), self.host.current_boot()
        # A fake node rebooted during the sweep: what it saw belongs to a boot that is over, so it holds
        # nothing and says nothing of the new boot (a real node's reboot takes the daemon with it).
        over = result.boot != boot
        changed = self.active.expire(now, boot) | self._take_clear_request()
        problems: list[Problem] = []
        if not over:
            for key, serial in board_serials(result.runs).items():
                self._serials.setdefault(key, serial)         # NVML's own reading comes first
        for run in result.runs:
            if not over:
                self._domain.observe(run.observations, boot)
            found = self.engine.evaluate(_observations(run))
            problems.extend(found)
            if not over:
                changed |= self.active.update(run.name, run.status == "ok", found, now, boot)
            self._attempted.add(run.name)
            if run.status == "skipped":       # it did not look, so what it judges is not judged yet
                self._retry_soon(run)
            else:
                self._ran.add(run.name)
                if not over:
                    self._ran_in(boot).add(run.name)
        if self.node_checks and not over:
            changed |= self._judge_node(result, problems, now, boot)
        if not over:
            verified = self.active.advance((r.name for r in result.runs if r.status != "skipped"), self._scheduled,
                                           self.settings.verify_sweeps)
            uptime = self.host.uptime_s()
            problems.extend(recovery_event(latch, now, uptime) for latch in verified)
            changed |= bool(verified)
        self._learn_identities(l.problem for l in self.active.latches.values())
        maintenance = self.maintenance()
        changed_maintenance, self._maintenance = maintenance != self._maintenance, maintenance
        newly_judged = self._judge() or changed_maintenance
        if changed:
            self._save()
        health = self.gpu_health()
        for sink in self.sinks:               # before conditions: a sink that sends both sends them together
            sink.gpus(health)
        if changed or newly_judged:
            statuses = self.conditions()
            for sink in self.sinks:
                sink.conditions(statuses)
        events = [p for p in problems if p.report == "event"]
        for sink in self.sinks:
            if events:
                sink.events(events)
            sink.sweep(result, problems)
        return problems

    def _learn_identities(self, problems: Iterable[Problem]) -> None:
        """A held problem that names a GPU by bus id and UUID teaches both: a daemon restarted after the GPU
        fell off the bus never read its UUID from NVML, and the GPU must not lose it when that problem ends
        while another (read by bus id alone) still fails it."""
        for ref in (r for p in problems for r in p.gpus if r.pci_bus_id and r.uuid):
            before = self._known_gpus.get(ref.pci_bus_id)
            if before is None or not before.uuid:
                self._known_gpus[ref.pci_bus_id] = fuller(before, ref) if before else ref

    def gpu_health(self) -> list[GpuHealth]:
        """Each GPU's state from the problems held now (conditions, not one-off events), since when, its
        serial and its incidents; `verifying` where only a cure being verified keeps it unhealthy."""
        latches = list(self.active.latches.values())
        health = gpu_health(self._known_gpus.values(), (l.problem for l in latches),
                            {l.problem: l.first for l in latches})
        if any(l.verifying for l in latches):
            live = {gpu_key(h.gpu): h.state for h in
                    gpu_health(self._known_gpus.values(), (l.problem for l in latches if not l.verifying))}
            health = [replace(h, verifying=live.get(gpu_key(h.gpu)) != h.state) for h in health]
        cliques, links = self._domain.cliques, self._domain.link_xids
        health = carry_since([replace(h, incidents=self._incidents.get(gpu_key(h.gpu), 0),
                                      boots=self._incident_boots.get(gpu_key(h.gpu), 0),
                                      serial=self._serials.get(gpu_key(h.gpu), ""),
                                      clique=cliques.get(gpu_key(h.gpu), ""), link_xid=links.get(gpu_key(h.gpu)))
                              for h in health], self._health)
        self._health = {gpu_key(h.gpu): h for h in health}
        return health

    def _ran_in(self, boot: str) -> set[str]:
        """The scheduled checks that have run (not skipped) in `boot`. A fake node's reboot starts afresh, as
        a real one does by restarting the daemon: every check is due again within the start spread."""
        if self._boot_runs[0] != boot:
            self._boot_runs = (boot, set())
            now = self.clock()
            with self._lock:
                for name in self._next:
                    self._next[name] = min(self._next[name], now + self._rng.uniform(0, self.settings.start_spread_s))
        return self._boot_runs[1]

    def _judge_node(self, result: SweepResult, problems: list[Problem], now: float, boot: str) -> bool:
        """The node checks: they judge what the others' rules held and found, most of them only once every
        scheduled check has run. Their runs join the sweep's (metrics), their problems the sweep's; True when
        held ones changed."""
        all_ran = self._attempted >= self._scheduled
        checks = [c for c in self.node_checks if all_ran or not c.needs_all_checks]
        if not checks:
            return False
        names = {c.name for c in self.node_checks}
        # Held problems count only once seen in this boot: one from before a reboot is not the new boot's.
        held = [l.problem for (_, check), l in self.active.latches.items() if check not in names and l.boot == boot]
        status = self.host.node_status()
        inventory = self._inventory[2] if self._inventory is not None else result.inventory
        view = NodeView(self.host.node_name, boot, now, self.gpu_health(), held,
                        found=[p for p in problems if p.check not in names], serials=dict(self._serials),
                        node_scoped=self._node_scoped, state_dir=self.settings.state_dir,
                        visible=tuple(g.ref() for g in inventory.gpus), node_status=status,
                        uptime_s=self.host.uptime_s(), agent_age_s=now - self._started,
                        pending=tuple(sorted(self._scheduled - self._ran_in(boot))),
                        maintenance=status.maintenance(self.settings.maintenance_annotation) if status else "",
                        reset_failed=tuple(self.reset_failed()))
        changed = False

        def evaluate(run: CheckRun) -> list[Problem]:
            nonlocal changed
            found = self.engine.evaluate(_observations(run))
            changed |= self.active.update(run.name, run.status == "ok", found, now, boot)
            return found

        def holding(check: str) -> list[Problem]:       # what the next node check sees of this one: its held
            return [l.problem for (_, c), l in self.active.latches.items() if c == check]

        for run, found in judge_node(checks, view, evaluate, holding):
            if run.result is not None and "incidents" in run.result:
                self._incidents = dict(run.result["incidents"])
                self._incident_boots = dict(run.result.get("incident_boots", {}))
            result.runs.append(run)
            problems.extend(found)
            self._attempted.add(run.name)
            self._ran.add(run.name)
        return changed

    def _retry_soon(self, run: CheckRun) -> None:
        if run.retry_after_s is None:
            return
        with self._lock:
            self._next[run.name] = min(self._next[run.name], self.clock() + run.retry_after_s)

    def _cached_inventory(self, checks: Sequence[Check]) -> Inventory | None:
        if self._inventory is None or any(c.needs_fresh_inventory for c in checks):
            return None
        read_at, boot, inventory = self._inventory
        fresh = time.monotonic() - read_at < self.settings.inventory_max_age_s and boot == self.host.current_boot()
        return inventory if fresh else None

    # -- state ----------------------------------------------------------------------------------

    def _judge(self) -> bool:
        """A condition type is judged once every check that can produce it has run: before that, the
        node keeps what it shows (a restart never resets conditions to healthy)."""
        judged = {t for t, needs in self._needs.items()
                  if needs <= self._ran or ("*" in needs and self._ran and needs - {"*"} <= self._ran)}
        new = judged - self._judged
        self._judged |= judged
        return bool(new)

    def conditions(self) -> list[ConditionStatus]:
        maintenance = self.maintenance()
        statuses = []
        for t in self.owned_types:
            if t not in self._judged:
                continue
            status = self.active.condition(t, self.settings.message_limit, self.settings.verify_sweeps)
            if maintenance and t in self.settings.remediation_types:
                status = under_maintenance(status, maintenance, self.settings.message_limit)
            statuses.append(status)
        return statuses

    def maintenance(self) -> str:
        """Why the node is under planned maintenance now ("" when it is not), from what the cluster says."""
        status = self.host.node_status()
        return status.maintenance(self.settings.maintenance_annotation) if status is not None else ""

    def _verifies(self, problem: Problem) -> bool:
        """Whose cure is verified before it is trusted: the node's remediation ask, and a failed GPU (not
        one an application's fault named: that never failed it)."""
        if self.settings.verify_sweeps <= 0:
            return False
        if problem.type in self.settings.remediation_types:
            return not any(l.problem.type in self.settings.withdrawing_types for l in self.active.latches.values())
        return (
            problem.severity is Severity.CRITICAL and bool(problem.gpus) and problem.action not in APPLICATION_ACTIONS)

    def report_events(self, problems: list[Problem]) -> None:
        """Events from outside a sweep (the GPU resetter's), to every sink in turn, as a sweep's would go."""
        with self._judging:
            for sink in self.sinks:
                sink.events(problems)

    def kick_all(self) -> None:
        """Run every scheduled check as soon as possible (a GPU was just reset: judge it at once)."""
        with self._lock:
            for name in self._next:
                self._next[name] = 0.0

    def clear(self, types: set[str] | None = None) -> None:
        """An operator's clear of held conditions (all types when None)."""
        with self._judging:
            if self.active.clear(types, self.clock()):
                self._save()
                statuses = self.conditions()
                for sink in self.sinks:
                    sink.conditions(statuses)

    def _take_clear_request(self) -> bool:
        """`gpu-npd clear` leaves a request file in the state directory; take it once. One that cannot be
        read (a link, a FIFO, over CLEAR_LIMIT, not a request) is warned of once and removed, or moved
        aside where it cannot be removed (a directory); it never stops the sweep."""
        if self.settings.state_dir is None:
            return False
        path = self.settings.state_dir / CLEAR_FILE
        try:
            request = read_json(path, CLEAR_LIMIT, "clear request")
            types, when = clear_request_of(request, self.clock())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            self._discard_clear_request(path, e)
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:            # taken only once it is gone: else it would clear at every sweep
            self._discard_clear_request(path, OSError(e.errno, f"cannot remove {path}: {e.strerror}"))
            if os.path.lexists(path):
                return False
        result = self.active.clear(types, when)
        log.info("operator clear of %s: cleared %s; left %s (live: they end when the fault does)",
                 ", ".join(sorted(types)) if types else "all held conditions",
                 ", ".join(l.problem.rule for l in result.cleared) or "nothing",
                 ", ".join(l.problem.rule for l in result.live) or "nothing")
        try:
            write_json(self.settings.state_dir / CLEAR_RESULT_FILE, {**result.to_dict(), "request": request})
        except OSError as e:
            log.warning("cannot write the clear result in %s: %s", self.settings.state_dir, e)
        return bool(result)

    def _discard_clear_request(self, path: Path, error: Exception) -> None:
        """Remove an unusable request (unlink never opens it, so a FIFO is safe) or move it aside; the
        warning is given once per thing found there, not at every sweep while it cannot be removed."""
        try:
            path.unlink()
            where = "removed it"
        except FileNotFoundError:
            return
        except OSError:
            where = kept_at(path)
        try:
            identity = os.stat(path, follow_symlinks=False)
            key: tuple[int, int] | None = (identity.st_dev, identity.st_ino)
        except OSError:
            key = None                           # gone (removed or moved aside): warn again for a new one
        if key is None or key != self._refused_clear:
            log.warning("ignoring the clear request: %s; %s", error, where)
        self._refused_clear = key

    def _restore(self) -> None:
        if self.settings.state_dir is None:
            return
        warning = self.active.load(self.settings.state_dir / PROBLEMS_FILE)
        if warning:
            self.warnings.append(warning)
            log.warning(warning)
        self.active.expire(self.clock(), self.host.current_boot())

    def _save(self) -> None:
        if self.settings.state_dir is None:
            return
        try:
            self.active.save(self.settings.state_dir / PROBLEMS_FILE)
        except OSError as e:                     # a full or read-only disk costs persistence, not the daemon
            log.warning("cannot save problem state in %s: %s", self.settings.state_dir, e)


def write_clear_request(state_dir: Path, types: Sequence[str], now: float) -> Path:
    (state_dir / CLEAR_RESULT_FILE).unlink(missing_ok=True)      # an old answer is not this request's
    path = state_dir / CLEAR_FILE
    write_json(path, {"time": now, "types": list(types)})
    return path


def clear_request_of(request: Any, now: float) -> tuple[set[str] | None, float]:
    """The condition types a clear request names (None: all) and its time; ValueError for another shape."""
    types = saved.record(request, "a clear request").get("types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ValueError("its types are not a list of condition types")
    return (set(types) if types else None), saved.number(request, "time", now)


def read_json(path: Path, limit: int, what: str) -> Any:
    """A state file's JSON: a regular file only, at most `limit` bytes (read_text_bounded), so a FIFO, a
    link or a huge file planted in the state directory is refused at once. FileNotFoundError when absent;
    UnsafeFile (an OSError, one line for a person) when refused; ValueError when it is not JSON."""
    return json.loads(read_text_bounded(path, limit, what))


def write_json(path: Path, data: dict) -> None:
    """Atomically, through a fresh temporary name (write_atomic): a reader never sees half a file, and a
    link planted at the name or at a guessable temporary name is never written through."""
    write_atomic(path, json.dumps(data, indent=1))


def recovery_event(latch: Latch, now: float, uptime_s: float | None = None) -> Problem:
    """The event that says a cure was verified, and how long it took from the cure (for a reboot, from the
    boot itself where the uptime is known, not from when gpu-npd first saw the new boot)."""
    p, v = latch.problem, latch.verifying
    assert v is not None
    what = ", ".join(g.label() for g in p.gpus) or "the node"
    cure = "the reboot" if v.rebooted else "it cleared"
    took = uptime_s if v.rebooted and uptime_s is not None else now - v.since
    return Problem("recovery-verified", p.check, p.type, "RecoveryVerified",
                   f"{p.type} {p.reason} on {what} is over: every check passed {v.rounds} rounds in a row, "
                   f"verified {_duration(took)} after {cure}", Severity.INFO, "NONE", "event", p.gpus, now)


def under_maintenance(status: ConditionStatus, maintenance: str, limit: int) -> ConditionStatus:
    """A remediation ask while the node is under planned maintenance: False, its reason naming the
    maintenance, its message saying what would be asked otherwise. KEP-5683's lifecycle conditions are the
    shared signal that a node is worked on on purpose; a detector goes on judging but must not send it to
    a remediator mid-maintenance (a reboot in a firmware update is not a fault)."""
    reason = next((t for t in MAINTENANCE_CONDITIONS if maintenance.startswith(f"{t}=True")), "MaintenanceAnnotation")
    message = f"the node is under maintenance ({maintenance}): gpu-npd asks for no remediation"
    if status.active:
        message += f"; otherwise it would: {status.reason}: {status.message}"
    return ConditionStatus(status.type, False, reason, message[:limit], status.severity)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _in_lane(check: Check, long_running: bool | None) -> bool:
    return long_running is None or check.long_running == long_running


def _observations(run: CheckRun) -> list:
    return [run.status_observation(), *run.observations]


def _checks_per_type(ruleset: RuleSet, loaded: set[str]) -> dict[str, set[str]]:
    """For each condition type, the loaded checks that can produce it. A type none of them can produce
    is never judged: with its check switched off, the node keeps whatever that type says."""
    needs: dict[str, set[str]] = {}
    for rule in ruleset.rules:
        if rule.report != "condition":
            continue
        checks = {"*"} if rule.checks is None else set(rule.checks) & loaded
        needs.setdefault(rule.type, set()).update(checks)
    return {t: checks for t, checks in needs.items() if checks - {"*"} or checks == {"*"}}
