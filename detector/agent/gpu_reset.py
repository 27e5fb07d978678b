"""Reset a failed GPU instead of rebooting the node (opt-in: `gpu-npd run --reset-gpus`).

A GPU whose recommended action is RESET_GPU (NVML's recovery action GPU_RESET, an XID whose catalogue row
says so, a rule's action) is fenced alone (its DRA device taint) and would stay fenced until a person or a
reboot came. The resetter resets it, one GPU at a time, on its own thread (a reset takes seconds and
nvidia-smi may hang: never on the sweep's thread), and says each step in an Event of reason `GpuReset`.

Before a reset it checks, and says what it checked:
- the node does not ask for remediation already (a reboot is coming: a reset would race it);
- the GPU is fenced: its DeviceTaintRule is written (so the scheduler sends no new work to it);
- no compute process is on it (NVML); else it waits (the NoExecute taint evicts the pods) and says so;
- MIG is off: a reset drops the MIG layout the MIG manager or DRA driver made, so a MIG GPU is escalated;
- NVLink: a GPU with active NVLinks is reset alone only while the fabric manager runs (nvidia-smi(1): without
  it, every NVLink-connected GPU must be reset in the same command, which means the whole baseboard:
  escalated instead);
- the rate: at most one reset per node per `min_interval_s`, and `per_gpu_per_day` per GPU (then escalated);
- persistence mode: turned off for the reset (nvidia-persistenced's handle alone makes nvidia-smi refuse it,
  NVSentinel #1690) and turned back on after, whatever the reset's outcome.
The platform may refuse any reset (a VM whose hypervisor blocks the function-level reset: "not supported",
or AWS's "Unknown Error", ai-cloud-validation #603): then no other reset is tried in this boot.

After a reset the checks' next runs judge the GPU: the cure is verified over the daemon's verification rounds
(`--verify-sweeps`) before the GPU counts as healthy and its taint is lifted. A reset that fails, or after
which the GPU is still failed once `cure_wait_s` has passed, escalates: the node check sees it
(NodeView.reset_failed) and the node asks for remediation (GpuNodeNeedsRemediation, reason GpuResetFailed),
with the evidence bundle taken before the reset (`before_reset`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from detector.agent.active import ConditionStatus
from detector.agent.agent import AgentSink
from detector.backends.gpu_reset import NOT_SUPPORTED, GpuFacts, ResetAnswer, SmiGpuControl, read_facts
from detector.backends.safefile import read_text_bounded, write_atomic
from detector.core.deadline import Hung, call_with_deadline
from detector.core.gpu_health import FAILED, GpuHealth, gpu_key
from detector.core.sweep import Host
from detector.core.types import GpuRef, Problem, Severity

log = logging.getLogger("gpu_npd.reset")

REASON = "GpuReset"
RESET_ACTIONS = frozenset({"RESET_GPU"})
RESETS_FILE = "gpu-resets.json"          # reset times per GPU, so a restarted daemon keeps the rate
RESETS_LIMIT = 64 << 10
DAY = 86400.0


@dataclass
class ResetSettings:
    min_interval_s: float = 600.0        # at most one reset per node this often
    per_gpu_per_day: int = 2             # resets of one GPU within 24 h; past that it is escalated
    timeout_s: float = 60.0              # each nvidia-smi run (-pm, -r)
    nvml_timeout_s: float = 10.0         # reading the GPU's facts
    cure_wait_s: float = 300.0           # after a reset, how long the checks have to see the GPU cured
    remediation_types: tuple[str, ...] = ("GpuNodeNeedsRemediation",)


@dataclass
class _Pending:
    ref: GpuRef
    at: float
    checked: str


@dataclass
class _Said:
    """What was last said of a GPU that is not reset yet, so a wait is said once, not every second."""
    why: dict[str, str] = field(default_factory=dict)


class GpuResetter(AgentSink):
    def __init__(self, host: Host, settings: ResetSettings | None = None, *,
                 fenced: Callable[[str], bool] = lambda gpu: False,
                 events: Callable[[list[Problem]], None] = lambda problems: None,
                 before_reset: Callable[[str, list[GpuRef]], None] = lambda reason, gpus: None,
                 escalated: Callable[[], None] = lambda: None,
                 after_reset: Callable[[], None] = lambda: None,
                 verifying_rounds: int = 3, state_dir: Path | None = None,
                 clock: Callable[[], float] = time.time):
        """`fenced(gpu_key)`: its DRA taint is written. `events`: where GpuReset Events go (the agent's sinks).
        `before_reset(reason, gpus)`: called before each reset (the evidence bundle). `escalated()`: a reset
        failed or did not cure (the daemon judges the node again). `after_reset()`: a reset went through (the
        daemon runs every check at once, so the cure is judged and verified without waiting for intervals)."""
        self.host, self.settings = host, settings or ResetSettings()
        self.control = SmiGpuControl(host.smi, self.settings.timeout_s)
        self.fenced, self.emit, self.before_reset, self.on_escalate = fenced, events, before_reset, escalated
        self.after_reset = after_reset
        self.rounds, self.clock = verifying_rounds, clock
        self.path = state_dir / RESETS_FILE if state_dir is not None else None
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._health: list[GpuHealth] = []
        self._node_asks = False
        self._pending: _Pending | None = None
        self._escalated: dict[str, tuple[str, str]] = {}     # gpu_key -> (boot, why)
        self._platform: tuple[str, str] | None = None        # (boot, why) the platform refused a reset
        self._said = _Said()
        self._resets: dict[str, list[float]] = self._load()

    # -- the sink (the agent's thread) ----------------------------------------------------------------

    def gpus(self, health: list[GpuHealth]) -> None:
        with self._lock:
            self._health = list(health)
        self.wake.set()

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        asks = any(s.active for s in statuses if s.type in self.settings.remediation_types)
        with self._lock:
            self._node_asks = asks

    def reset_failed(self) -> list[str]:
        """This boot's GPUs whose reset failed or did not cure, each named with why: the node check's
        reset_failed (NodeView). A reboot ends them."""
        boot = self.host.current_boot()
        with self._lock:
            return [why for b, why in self._escalated.values() if b == boot]

    # -- the resetter's thread ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.wake.wait(1.0)
            self.wake.clear()
            if not stop.is_set():
                self.step()

    def step(self) -> None:
        """One look: follow the reset under way, else reset the next GPU that may be."""
        with self._lock:
            health, node_asks, pending = list(self._health), self._node_asks, self._pending
        if pending is not None:
            self._follow(pending, health)
            return
        for h in health:
            if h.state == FAILED and h.action in RESET_ACTIONS and not h.verifying \
                    and gpu_key(h.gpu) not in self._escalated:
                if self._consider(h, node_asks):
                    return                                   # one GPU at a time

    def _follow(self, pending: _Pending, health: list[GpuHealth]) -> None:
        """After a reset: healthy (verified) ends it; still failed, not verifying, past cure_wait escalates."""
        now = self.clock()
        h = next((x for x in health if gpu_key(x.gpu) == gpu_key(pending.ref)), None)
        if h is None or h.state != FAILED and not h.verifying:
            self._event(pending.ref, f"{pending.ref.label()}: the reset worked: verified over {self.rounds} "
                        "round(s) of every check; its device taint is lifted", Severity.INFO)
            self._pending = None
        elif not h.verifying and now - pending.at >= self.settings.cure_wait_s:
            self._pending = None
            self._escalate(pending.ref, f"{pending.ref.label()}: the reset did not cure it: still failed "
                           f"({', '.join(h.reasons)}) {now - pending.at:.0f}s after the reset")

    def _consider(self, h: GpuHealth, node_asks: bool) -> bool:
        """Reset this GPU if every check allows; True when something was done (a reset tried, or escalated)."""
        ref, key = h.gpu, gpu_key(h.gpu)
        boot = self.host.current_boot()
        if node_asks:
            return self._wait(ref, "the node asks for remediation already (GpuNodeNeedsRemediation): a reboot "
                                   "is coming, no reset")
        if self._platform is not None and self._platform[0] == boot:
            self._escalate(ref, f"{ref.label()}: not reset: this platform refused a GPU reset in this boot "
                                f"({self._platform[1]})")
            return True
        if not ref.pci_bus_id:
            self._escalate(ref, f"{ref.label()}: not reset: its PCI bus id is unknown")
            return True
        if not self.fenced(key):
            return self._wait(ref, "not fenced yet: its DRA device taint is not written")
        now = self.clock()
        recent = [t for t in self._resets.get(key, []) if now - t < DAY]
        if len(recent) >= self.settings.per_gpu_per_day:
            self._escalate(ref, f"{ref.label()}: not reset: reset {len(recent)} times within 24h already "
                                f"(at most {self.settings.per_gpu_per_day})")
            return True
        last = max((t for times in self._resets.values() for t in times), default=None)
        if last is not None and now - last < self.settings.min_interval_s:
            return self._wait(ref, f"waiting for the node's reset rate: the last reset was {now - last:.0f}s ago "
                                   f"(at most one per {self.settings.min_interval_s:.0f}s)")
        facts = self._facts(ref)
        if facts is None:
            return True
        checked, refusal, escalate = self._judge(facts)
        if refusal:
            if escalate:
                self._escalate(ref, f"{ref.label()}: not reset: {refusal} (checked: {checked})")
                return True
            return self._wait(ref, f"{refusal} (checked: {checked})")
        self._reset(ref, facts, checked)
        return True

    def _facts(self, ref: GpuRef) -> GpuFacts | None:
        assert ref.pci_bus_id is not None
        try:
            return call_with_deadline(lambda: read_facts(self.host.nvml, ref.pci_bus_id or ""),
                                      self.settings.nvml_timeout_s, "reading the GPU before a reset")
        except Hung:
            self._escalate(ref, f"{ref.label()}: not reset: NVML did not answer within "
                                f"{self.settings.nvml_timeout_s:g}s")
            return None

    def _judge(self, facts: GpuFacts) -> tuple[str, str, bool]:
        """(what was checked, why not ("" to go ahead), whether that refusal escalates)."""
        if facts.processes is None or facts.persistence is None:
            return "NVML", f"cannot read it ({'; '.join(facts.errors)})", True
        fabric = None
        if self.host.system is not None:
            try:
                fabric = self.host.system.read().fabric_manager_running
            except Exception:  # noqa: BLE001 - unreadable plumbing: unknown, as for a node without it
                fabric = None
        links = facts.nvlinks_active or 0
        link_text = "no active NVLink" if not links else \
            f"{links} NVLinks up, fabric manager {'running' if fabric else 'not running' if fabric is False else 'unknown'}"
        checked = (f"fenced; {len(facts.processes)} process(es); persistence mode "
                   f"{'on' if facts.persistence else 'off'}; MIG {'on' if facts.mig else 'off'}; {link_text}")
        if facts.processes:
            return checked, f"in use by {len(facts.processes)} process(es) (pid {', '.join(map(str, facts.processes))})", False
        if facts.mig:
            return checked, "MIG mode is on: a reset would drop the MIG layout its manager made", True
        if links and not fabric:
            return checked, ("its NVLinks are up and the fabric manager is not running: every NVLink-connected "
                             "GPU (the baseboard) would need resetting together"), True
        return checked, "", False

    def _reset(self, ref: GpuRef, facts: GpuFacts, checked: str) -> None:
        bus = ref.pci_bus_id or ""
        key = gpu_key(ref)
        try:
            self.before_reset(REASON, [ref])
        except Exception:  # noqa: BLE001 - the evidence is best effort; the reset goes on
            log.exception("taking the evidence before resetting %s failed", ref.label())
        restore = ""
        if facts.persistence:
            off = self.control.set_persistence(bus, False)
            if not off.done:
                self._escalate(ref, f"{ref.label()}: not reset: turning persistence mode off failed "
                                    f"({off.detail}) (checked: {checked})")
                return
        now = self.clock()
        self._resets.setdefault(key, []).append(now)
        self._save()
        answer = self.control.reset(bus)
        if facts.persistence:
            on = self.control.set_persistence(bus, True)
            restore = "; persistence mode turned back on" if on.done else \
                f"; turning persistence mode back on failed ({on.detail})"
        self._record(ref, answer, checked, restore, now)

    def _record(self, ref: GpuRef, answer: ResetAnswer, checked: str, restore: str, at: float) -> None:
        if answer.done:
            self._pending = _Pending(ref, at, checked)
            self._said.why.pop(gpu_key(ref), None)
            self._event(ref, f"{ref.label()}: reset done (checked: {checked}){restore}; nvidia-smi: "
                        f"{answer.detail}; verifying over {self.rounds} round(s) of every check before its "
                        "device taint is lifted", Severity.WARNING)
            self.after_reset()
            return
        if answer.kind == NOT_SUPPORTED:
            self._platform = (self.host.current_boot(), answer.detail)
        self._escalate(ref, f"{ref.label()}: the reset failed ({answer.kind}): nvidia-smi: {answer.detail} "
                            f"(checked: {checked}){restore}")

    # -- saying it --------------------------------------------------------------------------------------

    def _wait(self, ref: GpuRef, why: str) -> bool:
        """Not now, said once per reason: the Event names the GPU and why it is not reset yet."""
        key = gpu_key(ref)
        if self._said.why.get(key) != why:
            self._said.why[key] = why
            self._event(ref, f"{ref.label()}: not reset yet: {why}", Severity.WARNING)
        return False

    def _escalate(self, ref: GpuRef, why: str) -> None:
        with self._lock:
            self._escalated[gpu_key(ref)] = (self.host.current_boot(), why)
        self._event(ref, f"{why}; escalated: the node asks for remediation", Severity.WARNING)
        self.on_escalate()

    def _event(self, ref: GpuRef, message: str, severity: Severity) -> None:
        log.log(logging.INFO if severity is Severity.INFO else logging.WARNING, "GPU reset: %s", message)
        self.emit([Problem("gpu-reset", "gpu_reset", REASON, REASON, message, severity, "NONE", "event", (ref,),
                           self.clock())])

    # -- the rate, kept across restarts ----------------------------------------------------------------

    def _load(self) -> dict[str, list[float]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(read_text_bounded(self.path, RESETS_LIMIT, "the GPU reset times"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s (the reset rate starts afresh)", self.path, e)
            return {}
        resets = data.get("resets") if isinstance(data, dict) else None
        if not isinstance(resets, dict):
            log.warning("ignoring %s: no 'resets' object (the reset rate starts afresh)", self.path)
            return {}
        return {k: [float(t) for t in v if isinstance(t, (int, float)) and not isinstance(t, bool)]
                for k, v in resets.items() if isinstance(k, str) and isinstance(v, list)}

    def _save(self) -> None:
        if self.path is None:
            return
        now = self.clock()
        kept = {k: [t for t in v if now - t < DAY] for k, v in self._resets.items()}
        self._resets = {k: v for k, v in kept.items() if v}
        try:
            write_atomic(self.path, json.dumps({"resets": self._resets}))
        except OSError as e:
            log.warning("cannot save the GPU reset times in %s: %s", self.path, e)
