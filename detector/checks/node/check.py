"""The node check: the node as a whole, judged after the other checks' rules ran.

It answers what remediators and the scheduler need, and leaves the verdicts to rules (rules/node.yaml):
- how many GPUs failed or degraded, and which node-wide problems are held: so a rule decides when the
  node (not one GPU) needs remediation;
- the boot history: a problem that came back after each of `loop_reboots` reboots within `loop_window`
  is a remediation loop (another reboot will not fix it);
- each GPU's incidents (critical problems whose action is reset-, reboot- or replace-class), by serial:
  incidents on `flaky_boots` distinct boots within `flaky_window` make a flaky GPU.
History lives in the state directory (history.py); without one it lasts as long as the process.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from detector.checks.node.history import HISTORY_FILE, GpuRecord, History, Incident
from detector.core.check import CheckOutput, ConfigField
from detector.core.gpu_health import DEGRADED, FAILED, GpuHealth, gpu_key
from detector.core.nvlink_domain import parse_clique
from detector.core.nodecheck import NodeCheck, NodeView
from detector.core.types import GpuRef, Observation, Problem, Severity, action_strength

log = logging.getLogger("gpu_npd.node")

DAY = 86400.0
INCIDENT_ACTIONS = ["RESET_GPU", "DRAIN_AND_RESET", "RESTART_BM", "RESTART_VM", "CONTACT_SUPPORT"]
# What a drain and reboot can cure: not a cable (CHECK_NETWORK), cooling, or hardware to replace.
REMEDIABLE_ACTIONS = ["RESTART_BM", "RESTART_VM", "RESET_GPU", "DRAIN_AND_RESET", "CHECK_DRIVER", "CHECK_NVLINK"]


class NodeStateCheck(NodeCheck):
    name = "node"
    description = ("the node as a whole, after the other checks' rules: failed and degraded GPUs, node-wide "
                   "problems, remediation loops over the boot history, and flaky GPUs over their incident "
                   "history (kept in the state directory)")
    fields = {
        "gpus": "GPUs the node has had (those NVML lost included)",
        "failed_gpus": "GPUs failed now (a critical problem names them)",
        "rebootable_failed_gpus": "failed GPUs whose recommended action is in remediable_actions: a reboot may "
                                  "cure them (a GPU to replace, CONTACT_SUPPORT, is fenced, not rebooted for)",
        "degraded_gpus": "GPUs degraded now (a warning names them)",
        "failed_list": "the failed GPUs a reboot may cure, named, with their reasons",
        "node_problems": "critical problems held now that are the node's (they name no GPU, or their rule "
                         "says scope: node) and whose action is in remediable_actions",
        "node_problem_list": "those problems' reasons",
        "node_action": "the most demanding recommended action among them",
        "remediation_loop": "true when a problem came back after each of loop_reboots reboots within loop_window",
        "loop_reboots": "reboots the longest-returning problems of this boot came back after",
        "loop_problem": "those problems (condition type and reason)",
        "loop_boots": "when the boots it was seen in began",
        "loop_window": "loop_window, as text",
        "serial": "a GPU's serial number (per-GPU observations: one per GPU with incidents)",
        "incidents": "the GPU's incidents within flaky_window",
        "incident_boots": "distinct boots with an incident on the GPU within flaky_window",
        "incident_dates": "when the first incident of each of those boots happened",
        "incident_reasons": "the reasons of those incidents",
        "flaky": "true when incident_boots reached flaky_boots",
        "flaky_window": "flaky_window, as text",
        "nvlink_domain": "the node's multi-node NVLink domain, <cluster UUID>/<clique ID> ('' when none)",
        "link_origin": "its GPUs with a fatal link-level XID other than the downstream 145 (where a domain-wide "
                       "fault may start), named with the XID and link ('' when none)",
        "downstream_only": "true when the node is in an NVLink domain, holds no origin-class link XID, and every "
                           "failed GPU a reboot may cure failed only by the downstream XID 145",
        "downstream_hold": "true while downstream_only and the first downstream XID is younger than "
                           "downstream_hold: the node waits for the domain's origin tray to be remediated first",
        "domain_note": "what the node knows of a domain-wide fault, to end the remediation ask with ('' when none)",
        "reset_failed_gpus": "GPUs whose reset (--reset-gpus) failed or did not cure them in this boot",
        "reset_failed_list": "those GPUs, each named with why",
    }
    config_fields = {
        "loop_reboots": ConfigField(int, 3, "reboots after which the same problem coming back is a remediation loop"),
        "loop_window": ConfigField(float, DAY, "seconds within which those reboots must fall"),
        "flaky_boots": ConfigField(int, 3, "distinct boots with an incident on one GPU that make it flaky"),
        "flaky_window": ConfigField(float, 30 * DAY, "seconds within which those boots must fall"),
        "incident_actions": ConfigField(list, INCIDENT_ACTIONS, "recommended actions of critical problems that "
                                        "count as a GPU's incidents (reset-, reboot- and replace-class)"),
        "remediable_actions": ConfigField(list, REMEDIABLE_ACTIONS, "recommended actions of node-wide problems "
                                          "that a drain and reboot can cure (node_problems counts only these)"),
        "retention": ConfigField(float, 90 * DAY, "seconds of history kept (at least both windows)"),
        "downstream_hold": ConfigField(float, 1800.0, "seconds a node whose failed GPUs show only the downstream "
                                       "XID 145 of an NVLink domain waits before asking for a reboot (0: never waits)"),
    }

    def __init__(self, config: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._history: History | None = None
        self.warnings: list[str] = []

    def judge(self, view: NodeView) -> CheckOutput:
        history = self._open(view)
        boot = history.note_boot(view.boot, view.now, view.maintenance)
        for problem in _critical(view.held + view.found):
            history.note_problem(view.boot, f"{problem.type}/{problem.reason}", view.now)
        for ref in view.visible:
            if ref.pci_bus_id and ref.uuid:            # read, not lost: a lost GPU has no UUID to say
                history.note_seen(ref.pci_bus_id, view.serials.get(gpu_key(ref)), ref.uuid, view.boot, view.now)
        if not boot.maintenance:               # KEP-5683: a boot of planned maintenance is no GPU's fault
            self._note_incidents(history, view)
        history.prune(view.now)
        try:
            history.save()
        except OSError as e:                     # a full or read-only disk costs history, not the daemon
            log.warning("cannot save the GPU history in %s: %s", view.state_dir, e)
        observations = [self._node_observation(history, view), *self._gpu_observations(history, view)]
        incidents = {gpu_key(o.gpu): o.fields["incidents"] for o in observations if o.gpu is not None}
        boots = {gpu_key(o.gpu): o.fields["incident_boots"] for o in observations if o.gpu is not None}
        return CheckOutput(observations, result={"incidents": incidents, "incident_boots": boots},
                           summary=_summary(observations))

    # -- history --------------------------------------------------------------------------------------

    def _open(self, view: NodeView) -> History:
        if self._history is None:
            retention = max(self.config["retention"], self.config["loop_window"], self.config["flaky_window"])
            path = view.state_dir / HISTORY_FILE if view.state_dir is not None else None
            self._history = History(path, retention)
            warning = self._history.load()
            if warning:
                log.warning(warning)
                self.warnings.append(warning)
        return self._history

    def _note_incidents(self, history: History, view: NodeView) -> None:
        """Each GPU's incidents of this boot (not for a boot that began under planned maintenance)."""
        actions = set(self.config["incident_actions"])
        for problem in _critical(view.held + view.found):
            if problem.action not in actions:
                continue
            for ref in problem.gpus:
                known = _known(ref, view.health)
                serial, uuid = view.serials.get(gpu_key(known)), known.uuid
                board = history.seen_in_boot(known.pci_bus_id, view.boot)    # read before it was lost
                if board is not None:
                    serial, uuid = serial or board.serial, uuid or board.uuid
                key = serial or uuid or known.pci_bus_id
                if not key:
                    continue
                history.note_incident(GpuRecord(key, serial, uuid, known.pci_bus_id, known.index),
                                      Incident(view.now, view.boot, problem.reason, problem.action))

    # -- observations ---------------------------------------------------------------------------------

    def _node_observation(self, history: History, view: NodeView) -> Observation:
        failed = [h for h in view.health if h.state == FAILED and not h.verifying]   # a cure being verified
        remediable = set(self.config["remediable_actions"])
        node_wide = [p for p in _critical(view.held)
                     if (not p.gpus or p.rule in view.node_scoped) and p.action in remediable]
        node_wide.sort(key=lambda p: -action_strength(p.action))
        loop = history.loop(view.boot, self.config["loop_window"], view.now)
        return Observation(self.name, {
            "gpus": len(view.health),
            "failed_gpus": len(failed),
            "rebootable_failed_gpus": sum(h.action in remediable for h in failed),
            "degraded_gpus": sum(h.state == DEGRADED and not h.verifying for h in view.health),
            "failed_list": ", ".join(_named(h) for h in failed if h.action in remediable),
            "node_problems": len(node_wide),
            "node_problem_list": ", ".join(dict.fromkeys(f"{p.type} {p.reason}" for p in node_wide)),
            "node_action": node_wide[0].action if node_wide else "NONE",
            "remediation_loop": loop is not None and loop.reboots >= self.config["loop_reboots"],
            "loop_reboots": loop.reboots if loop else 0,
            "loop_problem": ", ".join(k.replace("/", " ") for k in loop.problems) if loop else "",
            "loop_boots": ", ".join(_when(b.first_seen) for b in loop.boots) if loop else "",
            "loop_window": span(self.config["loop_window"]),
            **domain_fields(view.health, [h for h in failed if h.action in remediable], view.now,
                            self.config["downstream_hold"]),
            "reset_failed_gpus": len(view.reset_failed),
            "reset_failed_list": "; ".join(view.reset_failed),
        }, time=view.now)

    def _gpu_observations(self, history: History, view: NodeView) -> list[Observation]:
        since = view.now - self.config["flaky_window"]
        by_serial = {serial: key for key, serial in view.serials.items()}
        refs = {gpu_key(h.gpu): h.gpu for h in view.health}
        out = []
        for record in history.gpus.values():
            firsts = record.boots_since(since)
            if not firsts:
                continue
            ref = refs.get(by_serial.get(record.serial or "", "")) or \
                GpuRef(record.index, record.uuid, record.pci_bus_id)
            out.append(Observation(self.name, {
                "serial": record.serial or "unknown",
                "incidents": sum(i.time >= since for i in record.incidents),
                "incident_boots": len(firsts),
                "incident_dates": ", ".join(_when(i.time) for i in firsts),
                "incident_reasons": ", ".join(dict.fromkeys(i.reason for i in firsts)),
                "flaky": len(firsts) >= self.config["flaky_boots"],
                "flaky_window": span(self.config["flaky_window"]),
            }, gpu=ref, time=view.now))
        return out


def domain_fields(health: list[GpuHealth], failed: list[GpuHealth], now: float, hold_s: float) -> dict[str, Any]:
    """What this node alone can say of a fault in its NVLink domain: whether it holds a likely origin (a
    fatal link-level XID other than 145 on one of its GPUs) or shows only the downstream XID 145. Which
    tray the fault started on, when it is not this one, only the fleet view knows (`gpu-npd fleet`)."""
    cliques = {h.clique for h in health if h.clique}
    domain = ""
    if len(cliques) == 1:
        cluster, clique = parse_clique(next(iter(cliques)))
        domain = f"{cluster}/{clique}"
    origins = [h for h in health if h.link_xid is not None and h.link_xid.origin_class]
    downstream = [h for h in failed if h.link_xid is not None and h.link_xid.code == 145 and len(h.reasons) == 1]
    only = bool(domain) and not origins and bool(failed) and len(downstream) == len(failed)
    times = [h.link_xid.time if h.link_xid.time is not None else h.since for h in downstream if h.link_xid]
    first = min((t for t in times if t is not None), default=now)
    note = ""
    if domain and origins:
        named = ", ".join(f"GPU {_index(h)} ({h.link_xid.describe()})" for h in origins if h.link_xid)
        note = (f"; domain {domain}: this node holds the likely origin of a fault in its NVLink domain: {named}; "
                "remediate this tray, not the rack")
    elif only:
        note = (f"; domain {domain}: this node shows only the downstream XID 145 (GPU "
                f"{', '.join(_index(h) for h in downstream)}): the fault likely started on another tray, which "
                "gpu-npd fleet names")
    return {"nvlink_domain": domain,
            "link_origin": ", ".join(f"GPU {_index(h)} {h.link_xid.describe()}" for h in origins if h.link_xid),
            "downstream_only": only, "downstream_hold": only and now - first < hold_s, "domain_note": note}


def _index(h: GpuHealth) -> str:
    return str(h.gpu.index) if h.gpu.index is not None else h.gpu.pci_bus_id or "?"


def _summary(observations: list[Observation]) -> str:
    node = observations[0].fields
    flaky = sum(bool(o.fields["flaky"]) for o in observations[1:])
    loop = f"{node['loop_problem']} back after {node['loop_reboots']} reboot(s)" if node["loop_reboots"] else "none"
    return (f"{node['failed_gpus']} of {node['gpus']} GPUs failed, {node['degraded_gpus']} degraded; "
            f"node-wide problems a reboot may cure: {node['node_problems']}; returning problem: {loop}; "
            f"GPUs with incidents: {len(observations) - 1} ({flaky} flaky)")


def _critical(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity is Severity.CRITICAL]


def _known(ref: GpuRef, health: list[GpuHealth]) -> GpuRef:
    """The inventory's fuller reference for a GPU a problem names (a kernel-log XID knows only its bus id)."""
    for h in health:
        if (ref.pci_bus_id and ref.pci_bus_id == h.gpu.pci_bus_id) or (ref.uuid and ref.uuid == h.gpu.uuid):
            return h.gpu
    return ref


def _named(h: GpuHealth) -> str:
    return f"{h.gpu.label()}: {', '.join(h.reasons)}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def span(seconds: float) -> str:
    """`24h`, `30d`, `90m`: a window as people write it (days from two on)."""
    for unit, size in (("d", DAY), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size * (2 if unit == "d" else 1) and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
