"""A fleet of fake GPU nodes in one process: each node is a fake NVML node with the daemon's own node
agent (checks, rules, held problems) and Kubernetes reporter, so its conditions and events are what a
real node would show. Every node shares one scheduler and one API client (one connection pool)."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from detector.agent.agent import AgentSettings, NodeAgent
from detector.config import build_checks
from detector.core.check import CheckRegistry
from detector.kube.api import ApiError, KubeApi
from detector.core.domain import key
from detector.core.nodestatus import NodeStatus
from detector.kube.conditions import MARKER, MESSAGE_LIMIT, rfc3339
from detector.kube.node_status import node_status
from detector.kube.nodewatch import signature
from detector.kube.reporter import KubeReporter, ReporterSettings
from detector.rules.loader import RuleSet
from detector.sim.annotations import INJECT_ANNOTATION, STATUS_ANNOTATION, AnnotationError, parse_faults, plan, status_value
from detector.sim.faultlog import FaultLog
from detector.sim.fleetfile import FleetSpec, SimNodeSpec
from detector.sim.scheduler import Scheduler, Task
from detector.sim.tally import FleetTally
from detector.sim.timeline import PlannedFault, plan_faults
from detector.sim.watch import NodeWatch
from fake_nvml import device_plugin
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.node import FakeNode
from fake_nvml.scenario import load_scenario

log = logging.getLogger("gpu_npd.sim")

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
SCENARIO_LABEL = key("scenario")
RACK_LABEL = key("rack")
# Every fault in a fleet is injected, and an injection runs the node's checks at once (as a kernel line
# wakes the daemon), so polling only follows what changes with time (ECC or NVLink counters rising, a
# throttle duty cycle): every 5 minutes, or the check's own interval where that is longer; thermal every
# minute (its 600 s window needs 6 samples). One process plays thousands of nodes on one core: at the
# daemon's own intervals an 8-GPU fake node's checks cost about 1.5 CPU-s per hour, 3 cores for 7,500
# nodes, and the scheduler would fall further behind every minute (faults then show late or not at all);
# at these, about 0.3 CPU-s, 0.6 of a core. A fleet file's `checks:` overrides any of them.
FLEET_POLL_S = 300.0
FLEET_INTERVALS_S = {"thermal": 60.0}


def fleet_check_defaults(registry: CheckRegistry) -> dict[str, dict[str, Any]]:
    """The interval of every scheduled check in a fleet (see FLEET_POLL_S)."""
    defaults = {}
    for name in registry.names():
        cls = registry.get(name)
        if cls.scheduled:
            interval = FLEET_INTERVALS_S.get(name, max(cls.default_interval_s, FLEET_POLL_S))
            defaults[name] = {"interval": interval}
    return defaults


@dataclass
class FleetSettings:
    workers: int = 8
    start_spread_s: float = 60.0          # nodes start over this long (a rolling start)
    horizon_s: float = 24 * 3600.0        # random faults are planned this far ahead
    create_nodes: bool = True             # False: adopt existing nodes (`adopt_selector`)
    adopt_selector: str = "type=kwok"
    watch_annotations: bool = True        # faults by node annotation (one watch of every node)
    watch_timeout_s: int = 300
    shard: int = 0                        # this process plays shard `shard` of `shards`: a disjoint block
    shards: int = 1                       # of the fleet file's nodes (see shard_of)
    agent: AgentSettings = field(default_factory=lambda: AgentSettings(start_spread_s=0.0))
    reporter: ReporterSettings = field(default_factory=ReporterSettings)


class SimNode:
    """One simulated node: its fake GPUs, the daemon's agent and reporter, and its two tasks."""

    def __init__(self, spec: SimNodeSpec, fake: FakeNode, agent: NodeAgent, reporter: KubeReporter):
        self.spec, self.fake, self.agent, self.reporter = spec, fake, agent, reporter
        self.checks_task = _ChecksTask(self)
        self.send_task = _SendTask(self)
        self.annotation = ""                  # the inject-fault value last acted on
        self.annotated: tuple[Fault, ...] = ()  # the faults it applied, still on the node
        self.annotation_error: str | None = None  # what was wrong with the value, if anything
        self.status_task = _WriteTask(self, "fault status")
        self.resources_task = _WriteTask(self, "resources")
        self.node_status: NodeStatus | None = None   # the node object the fleet's watch saw last, parsed
        self.published: dict[str, dict[str, str]] | None = None   # the device plugin's counts last written

    @property
    def name(self) -> str:
        return self.spec.name


class _ChecksTask(Task):
    def __init__(self, node: SimNode):
        super().__init__()
        self.node = node
        self.name = f"checks of {node.name}"

    def run(self) -> float | None:
        self.node.agent.run_due()
        return self.node.agent.next_due()


class _SendTask(Task):
    def __init__(self, node: SimNode):
        super().__init__()
        self.node = node
        self.name = f"reports of {node.name}"

    def run(self) -> float | None:
        """Reads the node first, then sends; the shared client's ApiHealth says what fails, once."""
        self.node.reporter.flush()
        return self.node.reporter.due_at()


class _WriteTask(Task):
    """One write for one node, run on the shared scheduler so the thread that asked for it (the watch that saw
    a fault annotation, the sweep that changed the fake device plugin's counts) goes on at once instead of
    waiting for the API server: the node's fault-status annotation, or its KWOK node's capacity and
    allocatable (one PATCH of nodes/status when the counts changed, none otherwise)."""

    def __init__(self, node: SimNode, what: str):
        super().__init__()
        self.node = node
        self.name = f"{what} of {node.name}"
        self.write: Callable[[SimNode], None] = lambda node: None      # set by the fleet

    def run(self) -> float | None:
        self.write(self.node)
        return None


class _FaultsTask(Task):
    name = "fault timeline"

    def __init__(self, fleet: "Fleet", planned: list[PlannedFault]):
        super().__init__()
        self.fleet, self.planned, self.next = fleet, planned, 0

    def run(self) -> float | None:
        now = self.fleet.clock()
        while self.next < len(self.planned) and self.fleet.started_at + self.planned[self.next].at_s <= now:
            p = self.planned[self.next]
            self.next += 1
            if p.node in self.fleet.nodes:
                self.fleet.inject(p.node, p.fault, p.source)
        if self.next < len(self.planned):
            return self.fleet.started_at + self.planned[self.next].at_s
        return None


class Fleet:
    def __init__(self, spec: FleetSpec, api: KubeApi, ruleset: RuleSet, registry: CheckRegistry,
                 settings: FleetSettings | None = None, fault_log: FaultLog | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.spec, self.api, self.ruleset, self.registry = spec, api, ruleset, registry
        self.settings = settings or FleetSettings()
        self.fault_log = fault_log or FaultLog(None)
        self.clock = clock
        self.rng = rng or random.Random(spec.seed)
        self.scheduler = Scheduler(self.settings.workers, clock)
        self.stopping = threading.Event()
        self.nodes: dict[str, SimNode] = {}
        self.started_at = clock()
        self._owned_types = sorted(ruleset.types())
        defaults = fleet_check_defaults(registry)
        self._check_settings = {name: {**defaults.get(name, {}), **(spec.check_settings.get(name) or {})}
                                for name in {*defaults, *spec.check_settings}}
        self._agent_settings = replace(self.settings.agent, state_dir=None,
                                       message_limit=min(self.settings.agent.message_limit,
                                                         MESSAGE_LIMIT - len(MARKER)))
        self.watch: NodeWatch | None = None
        self._annotation_lock = threading.Lock()
        self.tally = FleetTally(self.settings.agent.remediation_types)   # what the nodes showed, for the summary
        self.planned: list[PlannedFault] = []             # the timeline, once started

    # -- life -------------------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda message: None) -> None:
        """Register (or adopt) every node, then start them spread over `start_spread_s`; faults follow
        the timeline from now."""
        specs, adopted = self._bind_nodes(progress)
        scenarios = {s: load_scenario(s) for s in {spec.scenario for spec in specs}}
        for i, spec in enumerate(specs):
            fake = scenarios[spec.scenario].build(spec.name, nvlink_domain=spec.domain())
            if self.settings.create_nodes:
                self._create(spec, fake)
            self.nodes[spec.name] = self._build(spec, fake)
            if i and i % 1000 == 0:
                progress(f"registered and built {i} of {len(specs)} nodes")
        self.started_at = self.clock()
        spread = self.settings.start_spread_s
        for i, node in enumerate(self.nodes.values()):
            self.scheduler.wake(node.checks_task, self.started_at + spread * i / max(len(self.nodes), 1))
            if not self.settings.create_nodes:            # an adopted node shows what its device plugin says
                self.scheduler.wake(node.resources_task, self.started_at + spread * i / max(len(self.nodes), 1))
        planned = plan_faults(self.spec, self.settings.horizon_s)
        if adopted:
            planned = [replace(p, node=adopted.get(p.node, p.node)) for p in planned]
        self.planned = [p for p in planned if p.node in self.nodes]
        if planned:
            self.scheduler.wake(_FaultsTask(self, planned), self.started_at + planned[0].at_s)
        self.scheduler.start()
        if self.settings.watch_annotations:
            selector = SCENARIO_LABEL if self.settings.create_nodes else self.settings.adopt_selector
            self.watch = NodeWatch(self.api, selector, self.on_node_seen, self.settings.watch_timeout_s,
                                   random.Random(self.rng.random()))
            self.watch.start()
        progress(f"{len(self.nodes)} nodes starting over {spread:g}s; {len(planned)} faults planned")

    def stop(self) -> None:
        self.stopping.set()
        if self.watch is not None:
            self.watch.stop()
        self.scheduler.stop()

    # -- faults ---------------------------------------------------------------------------------------

    def inject(self, node_name: str, fault: Fault, source: str = "command") -> dict[str, Any]:
        """Inject now, log it, and run the node's checks at once (as its kernel log would wake the daemon)."""
        node = self.nodes.get(node_name)
        if node is None:
            raise KeyError(f"no simulated node named {node_name!r}")
        node.fake.inject(fault)
        now = self.clock()
        record = self.fault_log.record(now, now - self.started_at, node_name, fault, source)
        for check in node.agent.checks:
            node.agent.kick(check.name)
        self.scheduler.wake(node.checks_task)
        self.scheduler.wake(node.resources_task)
        return record

    def on_node_seen(self, node_object: dict[str, Any]) -> None:
        """A node as listed or watched: act on its inject-fault annotation when that changed (see
        detector/sim/annotations.py). Nodes of another simulator (or shard) are not ours to touch."""
        metadata = node_object.get("metadata") or {}
        node = self.nodes.get(metadata.get("name", ""))
        if node is None:
            return
        self._note_status(node, node_object)
        value = (metadata.get("annotations") or {}).get(INJECT_ANNOTATION, "")
        with self._annotation_lock:
            if value == node.annotation:
                return                          # unchanged (our own status write comes back this way)
            node.annotation = value
            try:
                wanted = parse_faults(value)
                _check_gpus(wanted, node)
            except AnnotationError as e:
                log.warning("node %s: %s (its faults stay as they were)", node.name, e)
                node.reporter.event_out.record("Warning", "InvalidFaultAnnotation", f"{e}; nothing was changed")
                self.scheduler.wake(node.send_task)
                node.annotation_error = str(e)
            else:
                step = plan(node.annotated, wanted)
                for fault in step.heal + step.inject:
                    self.inject(node.name, fault, "annotation")
                node.annotated, node.annotation_error = wanted, None
        self.scheduler.wake(node.status_task)

    def _note_status(self, node: SimNode, node_object: dict[str, Any]) -> None:
        """What the cluster says of the node, for its agent's node checks (host.node_status): when it
        changed in what they read (resources, labels, annotations, conditions), they judge again at once.
        The agent's own writes come back this way too, and kick nothing (nodewatch.signature leaves them out)."""
        status = node_status(node_object, self.clock())
        before = node.node_status
        node.node_status = status
        # A node not started yet (the rolling start) is judged when its turn comes, with what was seen last:
        # waking it now would start every node at once when the watch lists them all.
        if node.agent.has_swept and (before is None or signature(before) != signature(status)):
            node.agent.kick_node_checks()
            self.scheduler.wake(node.checks_task)

    def _publish_resources(self, node: SimNode) -> None:
        advertised = node.fake.read(device_plugin.advertised)
        if advertised == node.published:
            return
        try:
            self.api.patch_node_status(node.name, {"status": advertised})
        except ApiError as e:                   # the next change (or fault) tries again
            log.warning("node %s: cannot publish its device plugin's resources: %s", node.name, e)
            return
        node.published = advertised

    def _write_status(self, node: SimNode) -> None:
        with self._annotation_lock:
            value = status_value(node.annotated, rfc3339(self.clock()), node.annotation_error)
        try:
            self.api.patch_node_annotations(node.name, {STATUS_ANNOTATION: value})
        except ApiError as e:                   # the faults are applied; only the record of them is late
            log.warning("node %s: cannot write %s: %s", node.name, STATUS_ANNOTATION, e)

    # -- building -------------------------------------------------------------------------------------

    def _bind_nodes(self, progress: Callable[[str], None]) -> tuple[list[SimNodeSpec], dict[str, str]]:
        """The nodes to play (this shard's), and (when adopting) the fleet file's names -> the adopted
        nodes' names."""
        specs, adopted = self._bind_all_nodes(progress)
        mine = shard_of(specs, self.settings.shard, self.settings.shards)
        if self.settings.shards > 1:
            progress(f"shard {self.settings.shard}/{self.settings.shards}: {len(mine)} of {len(specs)} nodes"
                     + (f", {mine[0].name} to {mine[-1].name}" if mine else ""))
        return mine, adopted

    def _bind_all_nodes(self, progress: Callable[[str], None]) -> tuple[list[SimNodeSpec], dict[str, str]]:
        if self.settings.create_nodes:
            return list(self.spec.nodes), {}
        found = sorted(n["metadata"]["name"] for n in self.api.list_nodes(self.settings.adopt_selector))
        if len(found) < len(self.spec.nodes):
            log.warning("%d nodes match %r; the fleet file describes %d: simulating %d", len(found),
                        self.settings.adopt_selector, len(self.spec.nodes), len(found))
        bound = [replace(spec, name=name) for spec, name in zip(self.spec.nodes, found)]
        progress(f"adopted {len(bound)} nodes matching {self.settings.adopt_selector!r}")
        return bound, {spec.name: name for spec, name in zip(self.spec.nodes, found)}

    def _create(self, spec: SimNodeSpec, fake: FakeNode) -> None:
        gpus = fake.read(lambda state: [g.model.name for g in state.gpus])
        advertised = fake.read(device_plugin.advertised)
        try:
            self.api.create_node(kwok_node(spec, self.spec.groups[spec.group].scenario,
                                           gpus[0].replace(" ", "-") if gpus else None, advertised))
        except ApiError as e:
            if e.status != 409:                # already there: adopt it as it is
                raise

    def _build(self, spec: SimNodeSpec, fake: FakeNode) -> SimNode:
        host = fake_host(fake, threaded=False)
        checks = build_checks(self.registry, None, self._check_settings)
        rng = random.Random(self.rng.random())
        reporter = KubeReporter(self.api, spec.name, self._owned_types, self.settings.reporter, self.clock, rng)
        agent = NodeAgent(host, checks, self.ruleset, [reporter, self.tally.sink(spec.name)], self._agent_settings,
                          self.clock, rng)
        node = SimNode(spec, fake, agent, reporter)
        reporter.on_pending = lambda: self.scheduler.wake(node.send_task)
        node.status_task.write = self._write_status
        node.resources_task.write = self._publish_resources
        if self.settings.create_nodes:
            node.published = fake.read(device_plugin.advertised)        # what the node was created with
        host.node_status = lambda: node.node_status
        return node


def shard_of(nodes: list[SimNodeSpec], shard: int, shards: int) -> list[SimNodeSpec]:
    """Shard `shard` (0-based) of `shards`: a contiguous block of the fleet file's nodes, the blocks as
    even as they can be. Every process reads the same fleet file (and plans the same seeded faults), so
    the blocks are disjoint and together the whole fleet; a fault reaches only the shard owning its node."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 to {shards - 1}")
    return nodes[len(nodes) * shard // shards:len(nodes) * (shard + 1) // shards]


def _check_gpus(faults: tuple[Fault, ...], node: SimNode) -> None:
    for i, fault in enumerate(faults):
        if fault.gpu is not None and fault.gpu >= node.spec.gpus:
            where = f"{INJECT_ANNOTATION}[{i}]" if len(faults) > 1 else INJECT_ANNOTATION
            raise AnnotationError(f"{where}.gpu: node {node.name} has GPUs 0 to {node.spec.gpus - 1}, not {fault.gpu}")


def kwok_node(spec: SimNodeSpec, scenario: str, product: str | None = None,
              advertised: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """A KWOK fake node carrying what GPU feature discovery and the device plugin would put on a real one
    (`advertised`: the fake device plugin's capacity and allocatable; else every GPU)."""
    labels = {
        "type": "kwok", "kubernetes.io/hostname": spec.name, "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(spec.gpus),
        SCENARIO_LABEL: scenario,
    }
    if product:
        labels["nvidia.com/gpu.product"] = product
    if spec.rack:
        labels[RACK_LABEL] = spec.rack
    labels.update(spec.labels)
    resources = {"cpu": "192", "memory": "2064Gi", "pods": "110", "nvidia.com/gpu": str(spec.gpus)}
    advertised = advertised or {}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels, "annotations": {KWOK_ANNOTATION: "fake"}},
        "spec": {"taints": [dict(KWOK_TAINT)]},
        "status": {"capacity": {**resources, **advertised.get("capacity", {})},
                   "allocatable": {**resources, **advertised.get("allocatable", {})}},
    }
