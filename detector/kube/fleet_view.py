"""The fleet at a glance, from the API server: which GPU nodes have unhealthy GPUs, a gpu-npd condition
True, or a gpu-npd that stopped reporting. It reads what the daemons already write and nothing else:

- the node annotation `gpu-npd.io/unhealthy-gpus` (annotations.py): each unhealthy GPU's index, bus id,
  UUID, serial, state, action and since when;
- gpu-npd's own conditions (types its rules produce, messages starting with conditions.MARKER): True
  ones are problems, and their lastHeartbeatTime says when the daemon last reported (every 300 s);
- the node's readiness: its Ready condition, cordon (spec.unschedulable) and taints, the Node Readiness
  Controller's `readiness.k8s.io/*` among them;
- GPUs whose failures recur across reboots (`flaky_gpus`, for `gpu-npd fleet --flaky`): an annotation entry's
  `boots` (distinct boots with an incident, written from 2 on), and the GpuFlaky condition, whose message
  names each flaky GPU's serial (rules/node.yaml);
- its multi-node NVLink domain: the label `nvidia.com/gpu.clique` (`<cluster UUID>.<clique ID>`, written by
  NVIDIA's DRA driver, GPU feature discovery or gpu-npd), else the clique its annotation's GPUs carry. Nodes
  are grouped by domain, and a domain with problems is judged as one (core/domain_origin.py): which GPU
  the fault most likely started on.

One LIST of nodes, in pages (`limit`/`continue`), each page reduced to the few facts above before the next
is read: memory stays one page of node objects however large the fleet. No printing here (cli/fleet.py).

What it reads is not trusted: every gpu-npd service account may patch any node's status, so one compromised
pod can plant annotations and conditions on every node, and a broken proxy can answer anything. So shapes
are checked where a page enters (a page of the wrong shape stops the list: FleetListError), a node object
of the wrong shape is skipped and counted (FleetView.malformed), and everything kept from a node is
bounded: its annotation (ANNOTATION_MAX), its GPUs (MAX_GPUS), its conditions (MAX_CONDITIONS), taints
(MAX_TAINTS) and each text (TEXT_MAX, MESSAGE_MAX). The listing itself ends: a continue token seen before
in the same listing stops it, and so does MAX_PAGES.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from detector.core.domain_origin import DomainGpu, DomainVerdict, judge_domain
from detector.core.gpu_health import DEGRADED, FAILED
from detector.core.nvlink_domain import CLIQUE_LABEL, parse_clique
from detector.kube.annotations import MAX_VALUE, UNHEALTHY_GPUS, UnhealthyGpu, read_unhealthy_gpus
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import MARKER
from detector.kube.stamps import parse_rfc3339


class FleetListError(Exception):
    """The list cannot go on: a page of the wrong shape, a continue token repeated, too many pages."""


class Malformed(ValueError):
    """A node object of the wrong shape (what and where): it is skipped, the rest still judged."""

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

# Bounds on what one node may make the view keep, each far above what gpu-npd and Kubernetes write:
# gpu-npd's annotation entry is about 180 characters, so 64 GPUs take about 12 KiB; Kubernetes allows 256 KiB
# of annotations per node, which read as is made a 2 GB table of four nodes.
MAX_GPUS = 64                    # a node's GPUs: 16 on the largest boards, 56 as MIG devices of 8 GPUs
ANNOTATION_MAX = MAX_VALUE       # characters of gpu-npd.io/unhealthy-gpus read; a longer one is not parsed
MAX_CONDITIONS = 64              # True gpu-npd conditions kept per node (the bundled rules have 24 types)
MAX_TAINTS = 32                  # taints kept per node
TEXT_MAX = 256                   # each text kept (a condition's type or reason, a taint's parts)
MESSAGE_MAX = 1024               # a condition's message, kept for the JSON only
NAME_MAX = 253                   # Kubernetes' own limit on a node's name: a longer one is malformed
TIME_MAX = 64                    # an RFC 3339 time is 20 characters: a longer text is not a time
# Pages in one listing: --chunk-size x 1,000 nodes (500,000 at the default; the largest clusters have
# 65,000), so a server that keeps handing out fresh continue tokens cannot keep gpu-npd fleet listing.
MAX_PAGES = 1000
TOKEN_MAX = 4096                 # a continue token is a few hundred characters; it is sent back in the URL


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
    more_conditions: int = 0      # True gpu-npd conditions past MAX_CONDITIONS, not kept
    clique: str = ""              # its NVLink domain, `<cluster UUID>.<clique ID>` ("" none)

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
                "annotationError": self.annotation_error or None, "verifying": self.verifying or None,
                "moreConditions": self.more_conditions, "clique": self.clique or None}


@dataclass
class FleetView:
    nodes: list[FleetNode] = field(default_factory=list)   # those with problems (every GPU node with keep_all)
    listed: int = 0               # nodes the LIST returned
    gpu_nodes: int = 0
    gpus: int = 0                 # GPUs of the GPU nodes that say how many they have
    uncounted: int = 0            # GPU nodes that do not say (no nvidia.com/gpu capacity or count label)
    failed: int = 0
    degraded: int = 0
    not_reporting: int = 0
    with_problems: int = 0
    pages: int = 0
    malformed: int = 0            # node objects of the wrong shape, skipped (counted in listed)
    first_malformed: str = ""     # what was wrong with the first of them, and where
    # NVLink domain (cluster UUID, clique ID) -> its nodes and the GPUs of them that are unhealthy
    domain_nodes: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    domain_gpus: dict[tuple[str, int], list[DomainGpu]] = field(default_factory=dict)

    def domains(self) -> list[DomainVerdict]:
        """Every NVLink domain seen, judged; sorted by cluster UUID and clique."""
        return [judge_domain(k[0], k[1], nodes, self.domain_gpus.get(k, []))
                for k, nodes in sorted(self.domain_nodes.items())]

    @property
    def nothing_wrong(self) -> bool:
        """No node to look at, and every node read: a skipped node might have been one."""
        return self.with_problems == 0 and self.malformed == 0

    def summary(self) -> dict[str, int]:
        return {"nodes": self.gpu_nodes, "gpus": self.gpus, "nodesWithoutGpuCount": self.uncounted,
                "failed": self.failed, "degraded": self.degraded, "notReporting": self.not_reporting,
                "nodesWithProblems": self.with_problems, "listed": self.listed, "pages": self.pages}

    def skip(self, where: str, error: Malformed) -> None:
        self.malformed += 1
        if not self.first_malformed:
            self.first_malformed = f"{where}: {error}"

    def add(self, node: FleetNode, keep_all: bool) -> None:
        self.gpu_nodes += 1
        if node.gpus is None:         # not 0 GPUs: a count beside its failed ones would contradict them
            self.uncounted += 1
        else:
            self.gpus += node.gpus
        self.failed += node.failed
        self.degraded += node.degraded
        self.not_reporting += not node.reporting
        self.with_problems += node.has_problems
        if node.has_problems or keep_all:
            self.nodes.append(node)
        if node.clique:
            domain = parse_clique(node.clique)
            self.domain_nodes.setdefault(domain, []).append(node.name)
            gpus = self.domain_gpus.setdefault(domain, [])
            gpus.extend(DomainGpu(node.name, g.index, g.pci_bus_id, g.link_xid) for g in node.unhealthy
                        if g.clique in (None, node.clique))


FLAKY_TYPE = "GpuFlaky"          # rules/node.yaml's gpu-flaky: "serial {serial}, incidents on {incident_boots} boots…"
_FLAKY_SERIAL = re.compile(r"\bserial ([0-9A-Za-z][0-9A-Za-z._-]{0,63}),")


@dataclass(frozen=True)
class FlakyGpu:
    """A GPU whose incidents recur across boots, as its node's daemon wrote it."""

    node: str
    gpu: UnhealthyGpu
    boots: int | None             # distinct boots with an incident (None: the daemon did not say: an older one)
    flaky: bool                   # the node's GpuFlaky condition names its serial: the daemon says send it back

    def to_dict(self) -> dict[str, Any]:
        g = self.gpu
        return {"node": self.node, "index": g.index, "serial": g.serial, "pciBusId": g.pci_bus_id, "uuid": g.uuid,
                "boots": self.boots, "flaky": self.flaky, "state": g.state, "action": g.action, "since": g.since}


def flaky_gpus(view: FleetView) -> list[FlakyGpu]:
    """The GPUs of the listed nodes whose incidents fell on two or more boots (their annotation entry's
    `boots`), or that the node's GpuFlaky condition names by serial; most boots first. A GPU fine now is
    not in the annotation, so it is not listed until it fails again (or is flaky, which keeps it degraded)."""
    out = []
    for node in view.nodes:
        named = {s for c in node.conditions if c.type == FLAKY_TYPE for s in _FLAKY_SERIAL.findall(c.message)}
        for g in node.unhealthy:
            flaky = bool(g.serial) and g.serial in named
            if g.boots is not None or flaky:
                out.append(FlakyGpu(node.name, g, g.boots, flaky))
    return sorted(out, key=lambda f: (-(f.boots or 0), not f.flaky, f.node, f.gpu.index is None, f.gpu.index or 0))


def read_fleet(api: KubeApi, owned_types: Iterable[str] = (), label_selector: str = "",
               page_size: int = PAGE_SIZE, stale_after_s: float = STALE_AFTER_S, keep_all: bool = False,
               clock: Callable[[], float] = time.time, max_pages: int | None = None) -> FleetView:
    """List the nodes (matching `label_selector`; every GPU node when it is empty) page by page and judge
    each. `owned_types`: gpu-npd's condition types (the rules', beside those its MARKER shows). A node
    listed by a selector is a GPU node; without one, a node is when it has a GPU label the DaemonSet
    selects by, or anything gpu-npd writes. A node object of the wrong shape is skipped and counted.
    Raises ApiError when a request fails, FleetListError when the list cannot go on (a page of the wrong
    shape, a continue token seen before in this listing, more than `max_pages` pages: MAX_PAGES)."""
    owned, restarts, max_pages = frozenset(owned_types), 0, max_pages or MAX_PAGES
    while True:
        view, token, seen = FleetView(), "", set()
        try:
            while True:
                if view.pages >= max_pages:
                    raise FleetListError(f"more than {max_pages} pages of {page_size} nodes: stopped (a larger "
                                         "--chunk-size, or -l to list fewer nodes)")
                items, token = _page(api.list_node_page(label_selector, page_size, token), view.pages + 1)
                view.pages += 1
                now = clock()
                for i, item in enumerate(items):
                    view.listed += 1
                    try:
                        node = fleet_node(item, owned, now, stale_after_s, selected=bool(label_selector))
                    except Malformed as e:
                        view.skip(f"page {view.pages}, item {i + 1}", e)
                        continue
                    if node is not None:
                        view.add(node, keep_all)
                if not token:
                    view.nodes.sort(key=lambda n: n.name)
                    return view
                if token in seen:
                    raise FleetListError(f"the API server repeated a continue token (page {view.pages}): stopped, "
                                         "as the list would never end")
                seen.add(token)
        except ApiError as e:
            if e.status != 410 or not token or restarts >= _RESTARTS:     # 410: the list's snapshot expired
                raise
            restarts += 1


def _page(page: dict[str, Any], number: int) -> tuple[list[Any], str]:
    """A NodeList page's items and continue token ("" at the end); FleetListError when its shape is wrong
    (the client already refused an answer that is not a JSON object)."""
    where = f"page {number} of the node list"
    items, meta = page.get("items"), page.get("metadata")
    if items is not None and not isinstance(items, list):
        raise FleetListError(f"{where}: items is {_kind(items)}, not a list")
    if meta is not None and not isinstance(meta, dict):
        raise FleetListError(f"{where}: metadata is {_kind(meta)}, not an object")
    token = (meta or {}).get("continue")
    if token is not None and not isinstance(token, str):
        raise FleetListError(f"{where}: metadata.continue is {_kind(token)}, not a string")
    if token and len(token) > TOKEN_MAX:
        raise FleetListError(f"{where}: its continue token is {len(token)} characters, more than {TOKEN_MAX}")
    return items or [], token or ""


def fleet_node(node: Any, owned_types: frozenset[str], now: float, stale_after_s: float,
               selected: bool = False) -> FleetNode | None:
    """One node object as the fleet view sees it; None when it is not a GPU node (see read_fleet).
    Malformed when a field it reads has the wrong JSON type (what a real API server never sends). The
    conditions' loops check types inline: they run for every condition of every node listed."""
    if type(node) is not dict:
        raise Malformed(f"the node is {'null' if node is None else _kind(node)}, not an object")
    meta = _obj(node.get("metadata"), "", "metadata")
    name = meta.get("name")
    if type(name) is not str or not name:
        raise Malformed(f"metadata.name is {_kind(name) if name != '' else 'empty'}, not a node's name")
    if len(name) > NAME_MAX:
        raise Malformed(f"metadata.name is {len(name)} characters, more than Kubernetes allows ({NAME_MAX})")
    where = f"node {name}: "
    spec, status = _obj(node.get("spec"), where, "spec"), _obj(node.get("status"), where, "status")
    labels = _obj(meta.get("labels"), where, "metadata.labels")
    annotations = _obj(meta.get("annotations"), where, "metadata.annotations")
    ready: str | None = None
    ours = []
    for c in _list(status.get("conditions"), where, "status.conditions"):
        if type(c) is not dict:
            raise Malformed(f"{where}a condition is {_kind(c)}, not an object")
        type_, message = c.get("type"), c.get("message")
        if type(type_) is not str or type(message) is not str:
            type_, message = _str(c, "type", where), _str(c, "message", where)
        if type_ == "Ready" and ready is None:
            ready = _text(c, "status", where)
        if type_ in owned_types or message.startswith(MARKER):
            ours.append(c)
    value = annotations.get(UNHEALTHY_GPUS)
    if value is not None and type(value) is not str:
        raise Malformed(f"{where}annotation {UNHEALTHY_GPUS} is {_kind(value)}, not a string")
    gpu_label = any(_str(labels, k, where, "label ") == v for k, v in GPU_NODE_LABELS)
    if not (selected or ours or value is not None or gpu_label):
        return None
    unhealthy, error = read_annotation(value)
    beats, true, verifying = [], [], []
    for c in ours:
        beat, state, reason = c.get("lastHeartbeatTime"), c.get("status"), c.get("reason")
        if type(beat) is not str or type(state) is not str or type(reason) is not str:
            beat, state = _str(c, "lastHeartbeatTime", where), _str(c, "status", where)
            reason = _str(c, "reason", where)
        if beat:
            beats.append(beat)
        if state == "True":
            (verifying if reason in VERIFYING_REASONS else true).append(c)
    last = _newest(beats)
    unschedulable = spec.get("unschedulable")
    if unschedulable is not None and type(unschedulable) is not bool:
        raise Malformed(f"{where}spec.unschedulable is {_kind(unschedulable)}, not true or false")
    taints = [_obj(t, where, "a taint") for t in _list(spec.get("taints"), where, "spec.taints")]
    label = _str(labels, CLIQUE_LABEL, where, "label ")
    return FleetNode(
        name=name, ready=ready or "", unschedulable=bool(unschedulable),
        taints=tuple(Taint(_text(t, "key", where, "a taint's "), _text(t, "value", where, "a taint's "),
                           _text(t, "effect", where, "a taint's ")) for t in taints[:MAX_TAINTS]),
        gpus=_gpu_count(_obj(status.get("capacity"), where, "status.capacity"), labels, where),
        unhealthy=unhealthy,
        conditions=tuple(TrueCondition(_text(c, "type", where), _text(c, "reason", where),
                                       _text(c, "message", where, limit=MESSAGE_MAX),
                                       _time(_str(c, "lastTransitionTime", where)))
                         for c in true[:MAX_CONDITIONS]),
        last_heartbeat=last[1] if last else None, reporting=last is not None and now - last[0] <= stale_after_s,
        annotation_error=error, more_conditions=max(0, len(true) - MAX_CONDITIONS),
        verifying=_clip("; ".join(_text(c, "message", where, limit=MESSAGE_MAX) for c in verifying[:MAX_CONDITIONS]),
                        MESSAGE_MAX),
        clique=_clique(label, unhealthy))


def _clique(label: str, unhealthy: tuple[UnhealthyGpu, ...]) -> str:
    """The node's NVLink domain in canonical form: its clique label, else the one clique its annotation's
    GPUs carry; "" when neither says one (a label that is not `<UUID>.<clique ID>` says none)."""
    if label:
        try:
            cluster, clique = parse_clique(label)
            return f"{cluster}.{clique}"
        except ValueError:
            return ""
    cliques = {g.clique for g in unhealthy if g.clique}
    return next(iter(cliques)) if len(cliques) == 1 else ""


def read_annotation(value: str | None) -> tuple[tuple[UnhealthyGpu, ...], str]:
    """The annotation's GPUs and "", or none and why it was not read: longer than ANNOTATION_MAX (not
    parsed at all), not what gpu-npd writes, more than MAX_GPUS GPUs, or one GPU twice. An annotation a
    node could never have is not counted, so a planted one cannot make the summary's counts what it says."""
    try:
        gpus = read_unhealthy_gpus(value)         # refuses a value over ANNOTATION_MAX unparsed
    except ValueError as e:
        return (), _clip(str(e), TEXT_MAX)
    if len(gpus) > MAX_GPUS:
        return (), f"{UNHEALTHY_GPUS} lists {len(gpus)} GPUs, more than the {MAX_GPUS} a node can have: not counted"
    ids = [(g.index, g.pci_bus_id, g.uuid) for g in gpus]
    if len(set(ids)) < len(ids):
        return (), f"{UNHEALTHY_GPUS} lists the same GPU twice: not counted"
    return tuple(gpus), ""


def _gpu_count(capacity: Mapping[str, Any], labels: Mapping[str, Any], where: str) -> int | None:
    """Capacity nvidia.com/gpu, else the nvidia.com/gpu.count label; a count no node can have (more than
    MAX_GPUS) is not taken: anyone who may patch a node's status may write its capacity."""
    for value in (_str(capacity, GPU_RESOURCE, where, "status.capacity "),
                  _str(labels, "nvidia.com/gpu.count", where, "label ")):
        if value.isascii() and value.isdigit() and len(value) <= 3 and int(value) <= MAX_GPUS:
            return int(value)
    return None


def _newest(beats: list[str]) -> tuple[float, str] | None:
    """The newest of these heartbeat times and when it is, None when none is a time. The API server writes
    each as RFC 3339 in UTC to the second, `2026-03-02T10:41:07Z`, which sorts as time does: then only the
    newest is parsed (this runs for every gpu-npd condition of every node listed)."""
    if beats and all(len(b) == 20 and b[10] == "T" and b[19] == "Z" for b in beats):
        newest = max(beats)
        if (t := parse_rfc3339(newest)) is not None:
            return t, newest
    times = [(t, b) for b in beats if _time(b) and (t := parse_rfc3339(b)) is not None]
    return max(times) if times else None


def _kind(value: Any) -> str:
    """A JSON value's type as a person says it."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "missing"}
    return names.get(type(value), type(value).__name__)


def _obj(value: Any, where: str, what: str) -> Mapping[str, Any]:
    """An object field, {} when missing; Malformed when it is something else. `where` and `what` name it
    (joined only for the error: this runs for every node)."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise Malformed(f"{where}{what} is {_kind(value)}, not an object")
    return value


def _list(value: Any, where: str, what: str) -> list[Any]:
    if value is None:
        return []
    if type(value) is not list:
        raise Malformed(f"{where}{what} is {_kind(value)}, not a list")
    return value


def _str(obj: Mapping[str, Any], key: str, where: str, what: str = "a condition's ") -> str:
    """A text field, "" when missing; Malformed when it is not a string."""
    value = obj.get(key)
    if value is None:
        return ""
    if type(value) is not str:
        raise Malformed(f"{where}{what}{key} is {_kind(value)}, not a string")
    return value


def _text(obj: Mapping[str, Any], key: str, where: str, what: str = "a condition's ", limit: int = TEXT_MAX) -> str:
    return _clip(_str(obj, key, where, what), limit)


def _time(text: str) -> str | None:
    """A time as written, None when missing or too long to be one (shown as is, never cut)."""
    return text if text and len(text) <= TIME_MAX else None


def _clip(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with an ellipsis at the cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"
