"""The fleet at a glance, from the API server: which GPU nodes have unhealthy GPUs, a gpu-npd condition
True, or a gpu-npd that stopped reporting. It reads what the daemons already write and nothing else:

- the node annotation `gpu-npd.io/unhealthy-gpus` (annotations.py): each unhealthy GPU's index, bus id,
  UUID, serial, state, action and since when;
- gpu-npd's own conditions (types its rules produce, messages starting with conditions.MARKER): True
  ones are problems, and their lastHeartbeatTime says when the daemon last reported (every 300 s);
- the node's readiness: its Ready condition, cordon (spec.unschedulable) and taints, the Node Readiness
  Controller's `readiness.k8s.io/*` among them.

One LIST of nodes, in pages (`limit`/`continue`), each page reduced to the few facts above before the next
is read: memory stays one page of node objects however large the fleet. No printing here (cli/fleet.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from detector.core.gpu_health import DEGRADED, FAILED
from detector.kube.annotations import UNHEALTHY_GPUS, UnhealthyGpu, read_unhealthy_gpus
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import MARKER
from detector.kube.stamps import parse_rfc3339

PAGE_SIZE = 500                  # what kubectl asks for (--chunk-size): a page is a few MiB of JSON
HEARTBEAT_S = 300.0              # the daemon's --heartbeat (node-problem-detector's heartbeat period)
STALE_AFTER_S = 3 * HEARTBEAT_S  # three heartbeats missed (each jittered by up to 10%): not one slow PATCH
READINESS_TAINT_PREFIX = "readiness.k8s.io/"
# A True gpu-npd condition that says the node is still being verified after a boot (rules/readiness.yaml),
# not that something is wrong: shown in the node's status, never counted as a problem.
VERIFYING_REASONS = frozenset({"ChecksPending"})
GPU_RESOURCE = "nvidia.com/gpu"
# The labels deploy/base's DaemonSet selects GPU nodes by (its node-affinity terms, ORed; a test keeps
# them equal). Its `type NotIn [kwok]` is left out: the fleet simulator reports for KWOK's GPU nodes.
GPU_NODE_LABELS: tuple[tuple[str, str], ...] = (
    ("nvidia.com/gpu.present", "true"),
    ("feature.node.kubernetes.io/pci-10de.present", "true"),
    ("feature.node.kubernetes.io/pci-0302_10de.present", "true"),
    ("feature.node.kubernetes.io/pci-0300_10de.present", "true"),
)
_RESTARTS = 2                    # a continue token that expired mid-list: list again from the start


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


@dataclass(frozen=True)
class TrueCondition:
    """A gpu-npd condition that is True: a problem the node has now."""

    type: str
    reason: str
    message: str
    since: str | None             # lastTransitionTime

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "reason": self.reason, "message": self.message, "since": self.since}


@dataclass(frozen=True)
class FleetNode:
    name: str
    ready: str                    # the Ready condition's status: True, False, Unknown, or "" (none)
    unschedulable: bool           # cordoned
    taints: tuple[Taint, ...]
    gpus: int | None              # its GPUs (capacity nvidia.com/gpu, else the nvidia.com/gpu.count label)
    unhealthy: tuple[UnhealthyGpu, ...]
    conditions: tuple[TrueCondition, ...]
    last_heartbeat: str | None    # the newest lastHeartbeatTime of gpu-npd's conditions; None: it never reported
    reporting: bool
    annotation_error: str = ""    # the annotation is there but unreadable
    verifying: str = ""           # gpu-npd has not run every check in this boot yet (the condition's message)

    @property
    def failed(self) -> int:
        return sum(g.state == FAILED for g in self.unhealthy)

    @property
    def degraded(self) -> int:
        return sum(g.state == DEGRADED for g in self.unhealthy)

    @property
    def has_problems(self) -> bool:
        return bool(self.unhealthy or self.conditions or not self.reporting or self.annotation_error)

    @property
    def readiness_taints(self) -> tuple[Taint, ...]:
        return tuple(t for t in self.taints if t.key.startswith(READINESS_TAINT_PREFIX))

    @property
    def status(self) -> str:
        """As `kubectl get nodes` says it: Ready, NotReady or Unknown, and SchedulingDisabled when cordoned."""
        words = [{"True": "Ready", "False": "NotReady"}.get(self.ready, "Unknown")]
        return ",".join(words + (["SchedulingDisabled"] if self.unschedulable else [])
                        + (["Verifying"] if self.verifying else []))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "ready": self.ready or None,
                "unschedulable": self.unschedulable, "taints": [t.to_dict() for t in self.taints],
                "readinessTaints": [str(t) for t in self.readiness_taints], "gpus": self.gpus,
                "reporting": self.reporting, "lastHeartbeat": self.last_heartbeat,
                "unhealthyGpus": [g.to_dict() for g in self.unhealthy],
                "conditions": [c.to_dict() for c in self.conditions],
                "annotationError": self.annotation_error or None, "verifying": self.verifying or None}


@dataclass
class FleetView:
    nodes: list[FleetNode] = field(default_factory=list)   # those with problems (every GPU node with keep_all)
    listed: int = 0               # nodes the LIST returned
    gpu_nodes: int = 0
    gpus: int = 0                 # GPUs of the GPU nodes that say how many they have
    failed: int = 0
    degraded: int = 0
    not_reporting: int = 0
    with_problems: int = 0
    pages: int = 0

    @property
    def nothing_wrong(self) -> bool:
        return self.with_problems == 0

    def summary(self) -> dict[str, int]:
        return {"nodes": self.gpu_nodes, "gpus": self.gpus, "failed": self.failed, "degraded": self.degraded,
                "notReporting": self.not_reporting, "nodesWithProblems": self.with_problems,
                "listed": self.listed, "pages": self.pages}

    def add(self, node: FleetNode, keep_all: bool) -> None:
        self.gpu_nodes += 1
        self.gpus += node.gpus or 0
        self.failed += node.failed
        self.degraded += node.degraded
        self.not_reporting += not node.reporting
        self.with_problems += node.has_problems
        if node.has_problems or keep_all:
            self.nodes.append(node)


def read_fleet(api: KubeApi, owned_types: Iterable[str] = (), label_selector: str = "",
               page_size: int = PAGE_SIZE, stale_after_s: float = STALE_AFTER_S, keep_all: bool = False,
               clock: Callable[[], float] = time.time) -> FleetView:
    """List the nodes (matching `label_selector`; every GPU node when it is empty) page by page and judge
    each. `owned_types`: gpu-npd's condition types (the rules'), beside those its MARKER shows. A node
    listed by a selector is a GPU node; without one, a node is when it has a GPU label the DaemonSet
    selects by, or anything gpu-npd writes. Raises ApiError when the list fails."""
    owned, restarts = frozenset(owned_types), 0
    while True:
        view, token = FleetView(), ""
        try:
            while True:
                page = api.list_node_page(label_selector, page_size, token)
                view.pages += 1
                now = clock()
                for item in page.get("items") or []:
                    view.listed += 1
                    node = fleet_node(item, owned, now, stale_after_s, selected=bool(label_selector))
                    if node is not None:
                        view.add(node, keep_all)
                token = (page.get("metadata") or {}).get("continue") or ""
                if not token:
                    view.nodes.sort(key=lambda n: n.name)
                    return view
        except ApiError as e:
            if e.status != 410 or not token or restarts >= _RESTARTS:     # 410: the list's snapshot expired
                raise
            restarts += 1


def fleet_node(node: Mapping[str, Any], owned_types: frozenset[str], now: float, stale_after_s: float,
               selected: bool = False) -> FleetNode | None:
    """One node object as the fleet view sees it; None when it is not a GPU node (see read_fleet)."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    ours = [c for c in conditions if c.get("type") in owned_types or (c.get("message") or "").startswith(MARKER)]
    value = annotations.get(UNHEALTHY_GPUS)
    if not (selected or ours or value is not None or any(labels.get(k) == v for k, v in GPU_NODE_LABELS)):
        return None
    try:
        unhealthy, error = tuple(read_unhealthy_gpus(value)), ""
    except ValueError as e:
        unhealthy, error = (), str(e)
    beats = [(t, c.get("lastHeartbeatTime")) for c in ours if (t := parse_rfc3339(c.get("lastHeartbeatTime")))]
    last = max(beats)[1] if beats else None
    ready = next((str(c.get("status") or "") for c in conditions if c.get("type") == "Ready"), "")
    true = [c for c in ours if c.get("status") == "True"]
    verifying = [c for c in true if c.get("reason") in VERIFYING_REASONS]
    return FleetNode(
        name=str(meta.get("name") or ""), ready=ready, unschedulable=bool(spec.get("unschedulable")),
        taints=tuple(Taint(str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
                     for t in spec.get("taints") or [] if isinstance(t, dict)),
        gpus=_gpu_count(status, labels), unhealthy=unhealthy,
        conditions=tuple(TrueCondition(str(c.get("type")), str(c.get("reason") or ""), str(c.get("message") or ""),
                                       c.get("lastTransitionTime")) for c in true if c not in verifying),
        last_heartbeat=last, reporting=bool(beats) and now - max(beats)[0] <= stale_after_s,
        annotation_error=error, verifying="; ".join(str(c.get("message") or "") for c in verifying))


def _gpu_count(status: Mapping[str, Any], labels: Mapping[str, str]) -> int | None:
    for value in ((status.get("capacity") or {}).get(GPU_RESOURCE), labels.get("nvidia.com/gpu.count")):
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    return None
