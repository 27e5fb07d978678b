"""The readiness check: may work land on this node? Judged after every sweep, from the first one on.

A node is verified when every enabled check has run at least once in this boot and nothing asks for the
node's remediation (one failed GPU, fenced by itself, does not block the node). Its rules
(rules/readiness.yaml) make the condition a Node Readiness Controller `NodeReadinessRule` gates on
(deploy/readiness/): a rebooted or new node keeps its readiness taint until gpu-npd has seen its GPUs work.
Sources: kubernetes-sigs/node-readiness-controller (conditions gate a readiness.k8s.io taint), and the
reports that motivate it (pytorch/ci-infra #1058: a node back from repair took jobs with a broken GPU).

It also says, once each time it changes, what others keep on the node (a cordon, taints): gpu-npd lifts
only what it placed, and it places nothing on the node object itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable, ClassVar, Mapping

from detector.core.check import CheckOutput, ConfigField
from detector.core.nodecheck import NodeCheck, NodeView
from detector.core.types import Observation

REMEDIATION_TYPES = ["GpuNodeNeedsRemediation"]


class ReadinessCheck(NodeCheck):
    name = "readiness"
    description = ("whether work may land on the node: every enabled check ran in this boot and nothing asks for "
                   "the node's remediation (for a NodeReadinessRule to gate scheduling on)")
    fields = {
        "verified": "true when every enabled check ran in this boot and nothing asks for the node's remediation",
        "pending_checks": "enabled checks that have not run in this boot yet",
        "pending_list": "their names",
        "asks_remediation": "true while a condition of blocking_types is held (a cure being verified included), "
                            "even under maintenance, when it is not reported",
        "remediation_list": "those conditions' types and reasons",
        "uptime": "time since this boot, as text (unknown when it cannot be read)",
        "held_by_others": "what others keep on the node: a cordon and its taints (gpu-npd lifts neither)",
        "held_by_others_changed": "true in the judgement where held_by_others changed",
    }
    config_fields = {
        "blocking_types": ConfigField(list, REMEDIATION_TYPES, "condition types that, while held, keep the node "
                                      "unverified (they ask for its remediation)"),
    }
    needs_all_checks: ClassVar[bool] = False
    judge_order: ClassVar[int] = 100            # after the node checks whose conclusions it reads

    def __init__(self, config: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._held_by_others: str | None = None

    def judge(self, view: NodeView) -> CheckOutput:
        blocking = set(self.config["blocking_types"])
        asks = [p for p in view.concluded if p.type in blocking and p.report == "condition"]
        others = _held_by_others(view)
        changed = self._held_by_others is not None and others != self._held_by_others
        self._held_by_others = others
        fields = {
            "verified": not view.pending and not asks,
            "pending_checks": len(view.pending),
            "pending_list": ", ".join(view.pending),
            "asks_remediation": bool(asks),
            "remediation_list": ", ".join(dict.fromkeys(f"{p.type} {p.reason}" for p in asks)),
            "uptime": _uptime(view.uptime_s),
            "held_by_others": others,
            "held_by_others_changed": changed,
        }
        summary = ("verified" if fields["verified"] else
                   f"waiting for {fields['pending_list']}" if view.pending else f"asks for remediation: "
                   f"{fields['remediation_list']}")
        return CheckOutput([Observation(self.name, fields, time=view.now)], summary=summary)


def _held_by_others(view: NodeView) -> str:
    status = view.node_status
    if status is None:
        return ""
    held = (["cordoned"] if status.unschedulable else []) + [f"taint {t}" for t in status.taints]
    return ", ".join(held)


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    minutes = int(seconds) // 60
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
