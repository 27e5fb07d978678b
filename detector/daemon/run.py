"""The daemon: one node agent, driven by three small threads, reporting to Kubernetes and Prometheus.

- scheduler: runs checks when due, or at once when the kernel log has news;
- kernel-log watcher: blocks until the log has new lines, then wakes the scheduler for the xid check;
- prober (only with long-running checks such as the NCCL probe): runs them on their own schedule, so a
  five-minute probe never delays an XID;
- sender: reads the node, then sends conditions and events when they change or are due, backing off when
  the API server is unwell, so a slow, absent or refusing API server never delays a check;
- dra-taints (only with --dra-taints): keeps a DeviceTaintRule per failed or degraded GPU (device_taints.py);
- gpu-reset (only with --reset-gpus): resets a fenced GPU whose action is RESET_GPU, one at a time, at a
  bounded rate, and escalates to the node's remediation ask when that fails (agent/gpu_reset.py);
- node-watch (with an API server, unless --no-node-watch): one watch on this node (and its ResourceSlices
  when the allocatable check or DRA taints need them) that is Host.node_status, and judges the node again
  at once when something a check reads changed (nodewatch.py);
- endpoints: /metrics, /healthz (the daemon's own loops are turning: an API outage never gets the pod
  killed) and /readyz (reports are reaching the API server, and none is overdue).
Every loop is kept (core/keeper.py): one that dies of a bug is started again, and one that keeps dying
turns /healthz unhealthy. Changes to the node arrive through the watch in bursts (a label flapping): a
burst is judged once (core/debounce.py).
SIGTERM sets `stop`; every loop wakes within a second and the daemon exits within a few seconds, abandoning
a sweep stuck in a hung NVML call.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from detector.agent.active import ConditionStatus
from detector.agent.agent import AgentSettings, AgentSink, NodeAgent
from detector.agent.bundle_writer import BundleOptions, KernelLogTail, Manifest, Verdict, write_bundle
from detector.agent.bundles import BUNDLES, BundleKeeper, KeeperSettings, kept_message
from detector.agent.gpu_reset import GpuResetter, ResetSettings
from detector.agent.metrics import AgentMetrics
from detector.core.check import Check
from detector.core.deadline import Hung, call_with_deadline
from detector.core.debounce import Debounce
from detector.core.keeper import Kept, keep
from detector.core.sweep import Host
from detector.core.types import GpuRef, Problem
from detector.daemon.endpoints import Endpoints
from detector.kube.api import KubeApi
from detector.kube.conditions import MARKER, MESSAGE_LIMIT
from detector.kube.device_taints import DeviceTaintSettings, DeviceTaintSink
from detector.kube.health import ApiHealth, ReportingState
from detector.kube.nodewatch import NodeWatch, NodeWatchSettings
from detector.kube.pacing import Backoff
from detector.kube.reporter import KubeReporter, ReporterSettings
from detector.rules.loader import RuleSet

log = logging.getLogger("gpu_npd.daemon")
EVIDENCE_KEPT = "EvidenceKept"    # the Event naming a bundle kept on the node
HISTORY_FILE = "history.json"     # the node check's per-GPU history in the state dir (checks/node/history.py)

EXIT_OK = 0
ALLOCATABLE_CHECK = "allocatable"   # compares the node's advertised GPUs with NVML's: reads ResourceSlices
STALL_S = 120.0          # /healthz fails when the scheduler has not come round for this long
SHUTDOWN_WAIT_S = 2.0    # on SIGTERM, how long the loops get to finish before they are abandoned
FINAL_SEND_S = 4.0       # ... and the last send; the DaemonSet's grace period is 10 s
# /readyz fails when a send has been under way this long: requests that hang one after another, or a
# sender stuck, are not "reporting" even before the API server has refused anything. Longer than one
# request's whole deadline (kube/api.py REQUEST_DEADLINE_S, 30 s), shorter than two.
OVERDUE_S = 45.0
# How long a GPU reset waits for the evidence bundle it asked for (the reset's own thread waits, never the
# agent's): nvidia-smi's 30 s and its nvlink listing's 15 s, with room for the rest of the bundle.
BUNDLE_BEFORE_RESET_WAIT_S = 90.0

@dataclass
class DaemonSettings:
    listen: str = "0.0.0.0:9808"
    agent: AgentSettings = field(default_factory=AgentSettings)
    reporter: ReporterSettings = field(default_factory=ReporterSettings)
    watch_kernel_log: bool = True
    dra_taints: DeviceTaintSettings | None = None     # opt-in DRA device taints (--dra-taints)
    node_watch: NodeWatchSettings | None = field(default_factory=NodeWatchSettings)   # None: --no-node-watch
    bundles: KeeperSettings | None = field(default_factory=KeeperSettings)   # None: keep no evidence bundles
    gpu_reset: ResetSettings | None = None            # opt-in GPU resets (--reset-gpus); needs dra_taints


class LogSink(AgentSink):
    """What the node has, in the daemon's log: condition changes and events, as they happen."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[bool, str]] = {}

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        for s in statuses:
            if self._last.get(s.type) != (s.active, s.reason):
                self._last[s.type] = (s.active, s.reason)
                level = logging.WARNING if s.active else logging.INFO
                log.log(level, "condition %s=%s reason=%s: %s", s.type, s.active, s.reason, s.message)

    def events(self, problems: list[Problem]) -> None:
        for p in problems:
            log.warning("event %s (x%d): %s", p.reason, p.occurrences, p.message)


class Daemon:
    def __init__(self, host: Host, checks: list[Check], ruleset: RuleSet, api: KubeApi | None,
                 settings: DaemonSettings | None = None, clock: Callable[[], float] = time.time,
                 fresh_checks: Callable[[], list[Check]] | None = None, verdict: Verdict | None = None,
                 before_reset: Callable[[str, list[GpuRef]], None] | None = None):
        """`fresh_checks`: new instances of the checks, for an evidence bundle's own diagnose (the agent's
        are busy and keep state); `verdict`: the bundle's verdict.json (diagnose -o json's document).
        `before_reset(reason, gpus)`: called before each GPU reset (--reset-gpus), to keep the evidence; by
        default the evidence keeper's capture (a bundle is queued before the reset)."""
        self.host, self.settings, self.clock = host, settings or DaemonSettings(), clock
        self.stop = threading.Event()
        self.metrics = AgentMetrics()
        rng = random.Random()
        self.reporter = None
        self.api_health: ApiHealth | None = None
        if api is not None:
            api.counts.listener = self.metrics.api_request
            self.api_health = api.health = ApiHealth(logging.getLogger("gpu_npd.kube"),
                                                     self.settings.reporter.outage_log_every_s)
            # what a remediator keys on is written from its first judgement, whatever the remediation types
            reporter = self.settings.reporter
            always = tuple(dict.fromkeys((*reporter.always_written, *self.settings.agent.remediation_types)))
            self.reporter = KubeReporter(api, host.node_name, sorted(ruleset.types()),
                                         replace(reporter, always_written=always), clock, rng)
        self.device_taints: DeviceTaintSink | None = None
        if api is not None and self.settings.dra_taints is not None:
            self.device_taints = DeviceTaintSink(api, host.node_name, self.settings.dra_taints, rng=rng)
            if self.reporter is not None:
                self.device_taints.on_note = self.reporter.note_gpus
        self.node_watch: NodeWatch | None = None
        if api is not None and self.settings.node_watch is not None:
            watch = self.settings.node_watch
            read_slices = (watch.read_slices or self.settings.dra_taints is not None
                           or any(c.name == ALLOCATABLE_CHECK for c in checks))
            self.node_watch = NodeWatch(api, host.node_name, replace(watch, read_slices=read_slices),
                                        self._node_changed, clock, rng)
            host.node_status = self.node_watch.current
        self.bundles = self._bundle_keeper(ruleset, fresh_checks, verdict)
        if before_reset is None:
            keeper = self.bundles
            before_reset = (lambda reason, gpus: None) if keeper is None else \
                (lambda reason, gpus: keeper.capture(reason, gpus, wait_s=BUNDLE_BEFORE_RESET_WAIT_S) and None)
        self.resetter: GpuResetter | None = None
        if self.settings.gpu_reset is not None and self.device_taints is not None:
            taints = self.device_taints
            self.resetter = GpuResetter(
                host, self.settings.gpu_reset, fenced=taints.tainted, events=lambda p: self.agent.report_events(p),
                before_reset=before_reset, escalated=self._node_changed, after_reset=self._after_reset,
                verifying_rounds=self.settings.agent.verify_sweeps, state_dir=self.settings.agent.state_dir)
        elif self.settings.gpu_reset is not None:
            log.error("--reset-gpus needs --dra-taints (and an API server): a GPU is reset only once it is fenced "
                      "by its DRA device taint, and nothing else fences it here; no GPU is reset")
        sinks = [self.metrics, LogSink()] + ([self.reporter] if self.reporter else [])
        sinks += [self.device_taints] if self.device_taints else []
        sinks += [self.bundles] if self.bundles else []
        sinks += [self.resetter] if self.resetter else []
        agent_settings = replace(self.settings.agent,
                                 message_limit=min(self.settings.agent.message_limit, MESSAGE_LIMIT - len(MARKER)))
        self.agent = NodeAgent(host, checks, ruleset, sinks, agent_settings, clock, rng)
        if self.resetter is not None:
            self.agent.reset_failed = self.resetter.reset_failed
        self._kick = threading.Event()
        self._node_burst = Debounce()
        self._send_began: float | None = None        # monotonic time of the flush under way, if any
        self._kept: list[Kept] = []
        self._xid_done = threading.Event()
        self._last_loop = time.monotonic()
        self._split_lanes = any(c.long_running for c in self.agent.checks)
        if api is not None:                   # with --no-kube there is nothing to report to: no gauge
            self.metrics.reporting_from(lambda: self.readiness()[0])
        self.endpoints = Endpoints(self.settings.listen, self.metrics.registry, self.health, self.readiness)

    def _bundle_keeper(self, ruleset: RuleSet, fresh_checks: Callable[[], list[Check]] | None,
                       verdict: Verdict | None) -> BundleKeeper | None:
        """Evidence bundles under <state dir>/bundles (detector/agent/bundles.py); none without a state dir."""
        settings, state_dir = self.settings.bundles, self.settings.agent.state_dir
        if settings is None:
            return None
        if state_dir is None:
            log.info("no --state-dir: no evidence bundles are kept when a GPU fails")
            return None
        host = self.host
        tail = KernelLogTail(host.kernel_log) if host.kernel_log is not None else None
        if tail is not None:
            host.kernel_log = tail            # the kernel log a bundle keeps, as the agent reads it
        judge = verdict or _plain_verdict

        def write(out: Path, options: BundleOptions) -> Manifest:
            return write_bundle(host, fresh_checks() if fresh_checks else [], ruleset, out, options, judge,
                                tail.lines() if tail is not None else None)

        settings = replace(settings, remediation_types=self.settings.agent.remediation_types)
        return BundleKeeper(state_dir / BUNDLES, write, settings, self._evidence_kept, state_dir / HISTORY_FILE,
                            boot_id=host.current_boot())

    def _evidence_kept(self, out: Path, manifest: Manifest) -> None:
        if self.reporter is not None:
            self.reporter.event_out.record("Normal", EVIDENCE_KEPT, kept_message(out, manifest)[:MESSAGE_LIMIT])
            self.reporter.wake.set()

    def health(self) -> tuple[bool, str]:
        """Liveness: the daemon's own loops are turning. Never the API server's state."""
        stalled = time.monotonic() - self._last_loop
        if stalled > STALL_S:
            return False, f"failing: the check scheduler has not run for {stalled:.0f}s"
        kept = self._kept + (self.node_watch.kept if self.node_watch is not None else [])
        failing = [k.describe() for k in kept if k.failing]
        if failing:
            return False, "failing: " + "; ".join(failing)
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """Readiness: alive, and reports reach the API server (always, with no API server configured)."""
        alive, text = self.health()
        if not alive:
            return alive, text
        state = self.api_health.state() if self.api_health else ReportingState(True, "ok")
        began = self._send_began
        if state.reporting and began is not None and time.monotonic() - began > OVERDUE_S:
            return False, f"not reporting: a send to the API server has not finished in {time.monotonic() - began:.0f}s"
        return state.reporting, state.detail

    def run(self) -> int:
        """Block until `stop` is set (SIGTERM, SIGINT); returns the exit code. An API server that is down or
        refuses (401, 403, no such node) never ends the daemon: checks, metrics and logs go on, the log says
        what is wrong, /readyz fails, and reports resume when it is fixed."""
        self.endpoints.start()
        log.info("gpu-npd on node %s: %d checks, %d rules, metrics and health on http://%s",
                 self.host.node_name, len(self.agent.checks), len(self.agent.ruleset.rules), self.endpoints.address)
        threads = [self._spawn("scheduler", self._schedule_loop)]
        if self.reporter is not None:
            threads.append(self._spawn("sender", self._send_loop))
        if self.node_watch is not None:
            node_watch = self.node_watch
            threads.append(self._spawn("node-watch", lambda: node_watch.run(self.stop)))
        if self.device_taints is not None:
            taints = self.device_taints
            threads.append(self._spawn("dra-taints", lambda: taints.run(self.stop)))
        if self.resetter is not None:
            resetter = self.resetter
            threads.append(self._spawn("gpu-reset", lambda: resetter.run(self.stop)))
        if self._split_lanes:
            threads.append(self._spawn("prober", self._probe_loop))
        if self.bundles is not None:
            bundles = self.bundles
            threads.append(self._spawn("bundles", lambda: bundles.run(self.stop)))
        reader = self.host.kernel_log
        if (self.settings.watch_kernel_log and reader is not None and getattr(reader, "wait_is_cheap", True)
                and hasattr(reader, "wait") and any(c.name == "xid" for c in self.agent.checks)):
            threads.append(self._spawn("kernel-log", self._watch_kernel_log))
        try:
            while not self.stop.wait(1.0):
                pass
        finally:
            self._shut_down(threads)
        log.info("stopped")
        return EXIT_OK

    def _shut_down(self, threads: list[threading.Thread]) -> None:
        """Every loop wakes within a second. A sweep stuck in a hung NVML call or nvidia-smi is abandoned
        (its thread is a daemon thread; child processes are killed at exit), so stopping never waits
        on the GPU that is the reason for stopping."""
        self.stop.set()
        self._kick.set()
        self._xid_done.set()
        wake = getattr(self.host.kernel_log, "wake", None)
        if wake:
            wake()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning("stopping without waiting for %s (a check or an API request still running: hung NVML, "
                        "nvidia-smi or API server?)", ", ".join(stuck))
        self._final_flush()
        self.endpoints.stop()
        try:
            call_with_deadline(self.host.close, SHUTDOWN_WAIT_S, "closing the GPU backend")
        except Hung:
            log.warning("closing the GPU backend hung; exiting without it")

    def _spawn(self, name: str, target: Callable[[], None]) -> threading.Thread:
        kept = keep(name, target, self.stop, log)
        self._kept.append(kept)
        assert kept.thread is not None
        return kept.thread

    def _node_changed(self) -> None:
        """The node watch saw something a check reads change: judge the node again once the burst it
        belongs to has passed (the scheduler loop takes it)."""
        if self._node_burst.poke():
            self._kick.set()

    def _after_reset(self) -> None:
        """A GPU was reset: every check runs at once, so the cure is judged without waiting for intervals."""
        self.agent.kick_all()
        self._kick.set()

    # -- loops ----------------------------------------------------------------------------------

    def _schedule_loop(self) -> None:
        lane = False if self._split_lanes else None
        while not self.stop.is_set():
            self._last_loop = time.monotonic()
            wait = self.agent.next_due(lane) - self.clock()
            burst = self._node_burst.due_in()
            if burst is not None:
                wait = min(wait, burst)
            if wait > 0:
                self._kick.wait(min(wait, 1.0))
                self._kick.clear()
            if self._node_burst.take():
                self.agent.kick_node_checks()
            try:
                self.agent.run_due(lane)
            except Exception:  # noqa: BLE001 - a bug in one sweep must not end the daemon
                log.exception("sweep failed")
            self._xid_done.set()

    def _probe_loop(self) -> None:
        """Long-running checks, one at a time. On shutdown a probe in flight is not waited for: its
        process group is killed when the daemon exits."""
        while not self.stop.is_set():
            wait = self.agent.next_due(True) - self.clock()
            if wait > 0:
                self.stop.wait(min(wait, 1.0))
                continue
            try:
                self.agent.run_due(True)
            except Exception:  # noqa: BLE001
                log.exception("probe sweep failed")

    def _watch_kernel_log(self) -> None:
        reader = self.host.kernel_log
        while not self.stop.is_set():
            try:
                woke = reader.wait(1.0)
            except OSError as e:
                log.warning("waiting on the kernel log failed (%s); falling back to the xid interval", e)
                return
            if woke and not self.stop.is_set():
                self._xid_done.clear()
                self.agent.kick("xid")
                self._kick.set()
                self._xid_done.wait(5.0)            # until the xid check has read what woke us

    def _send_loop(self) -> None:
        """Send what is due. A flush that raises (a bug, or something the API server sent that slipped
        past the shape checks) is said once per failing spell and waited on with a growing pause, never
        retried in a tight loop with a traceback each time."""
        assert self.reporter is not None
        backoff = Backoff(1.0, 60.0)
        while not self.stop.is_set():
            due = self.reporter.due_at()
            wait = 1.0 if due is None else min(1.0, max(0.0, due - self.clock()))
            if wait > 0:
                self.reporter.wake.wait(wait)
            self.reporter.wake.clear()
            self._send_began = time.monotonic()
            try:
                self.reporter.flush()
            except Exception as e:  # noqa: BLE001
                pause = backoff.next_delay()
                if backoff.failures == 1:
                    log.exception("sending to the API server failed; trying again in %.0fs", pause)
                else:
                    log.debug("sending still failing (%s: %s)", type(e).__name__, e)
                self.stop.wait(pause)
                continue
            finally:
                self._send_began = None
            if backoff.failures:
                log.info("sending to the API server works again after %d failures", backoff.failures)
                backoff.reset()

    def _final_flush(self) -> None:
        """On the way out, one last try to send what changed (bounded by the request timeout)."""
        if self.reporter is None or not self.readiness()[0]:
            return                       # not reaching the API server: do not hold up the exit
        try:
            call_with_deadline(self.reporter.flush, FINAL_SEND_S, "the final send")
        except Exception as e:  # noqa: BLE001 - Hung included: the pod's grace period is short
            log.warning("final send failed: %s", e)


def _plain_verdict(sweep, problems) -> dict:
    """The verdict when the caller gives none: the node, its GPUs and the problems found."""
    return {"node": sweep.node, "gpus": [{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id}
                                         for g in sweep.inventory.gpus],
            "problems": [p.to_dict() for p in problems], "healthy": not problems}
