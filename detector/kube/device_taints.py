"""DRA device taints (KEP-5055), opt-in (`gpu-npd run --dra-taints`): a DeviceTaintRule per unhealthy GPU.

For each failed or degraded GPU the NVIDIA DRA driver publishes (a device in one of this node's
ResourceSlices of driver gpu.nvidia.com, matched by its `uuid` or `resource.kubernetes.io/pciBusID`
attribute), gpu-npd keeps one DeviceTaintRule selecting that device by driver, pool and device name,
with a taint in gpu-npd's own domain (`gpu-npd.io/gpu-unhealthy=<state>`, so it never overwrites the
driver's own gpu.nvidia.com taints): NoExecute for a failed GPU, NoSchedule for a degraded one (each
configurable, or None for no taint). The rule is deleted when the GPU recovers.

API shapes used (resource.k8s.io; the same at v1alpha3, Kubernetes 1.33-1.35, and v1beta2, 1.36):
- DeviceTaintRule (cluster-scoped): spec.deviceSelector{deviceClassName?, driver, pool, device} and
  spec.taint{key (a label name), value (a label value), effect: NoSchedule | NoExecute (| None from
  v1beta2), timeAdded (set by the server)}. Sources: the Kubernetes API reference "DeviceTaintRule
  v1alpha3" (kubernetes.io/docs/reference/kubernetes-api/workload-resources/device-taint-rule-v1alpha3/),
  k8s-openapi's v1_36 resource/v1beta2 DeviceTaintRule, DeviceTaintSelector and DeviceTaint (docs.rs),
  and kubernetes-client/python's V1alpha3DeviceTaintSelector. Kubernetes 1.35 dropped
  deviceSelector.deviceClassName and .selectors, so gpu-npd sends deviceClassName only when configured.
- ResourceSlice: where a GPU's device, pool and driver are found (slices.py).

The version is discovered, never assumed (dra.py): the first resource.k8s.io version serving
devicetaintrules is used for rules, the first serving resourceslices for slices. When the cluster serves
no DeviceTaintRule, or this node has no slice of the driver, that is said once in the log, and `note`
(which the daemon appends to the message of each true condition naming a GPU, while it holds) says why
the GPU is not tainted; nothing else is done.

Names are deterministic (`gpu-npd-<node>-<device>`, DNS-1123, shortened with a hash when long), and
every rule carries the labels `gpu-npd.io/managed-by=gpu-npd` and `gpu-npd.io/node=<node>`: a restarted
daemon lists its node's rules, keeps those still wanted and deletes the others (a GPU that recovered
while it was down), so restarts neither duplicate nor orphan rules.

The sink never blocks the agent: `gpus()` records the desired state (latest wins) and wakes the sender
thread (`run`), which does the API work with backoff. Its requests go through a client of its own with
no ApiHealth: a missing permission (the base RBAC does not grant these) is one error in the log naming
the overlay or Helm value that grants it (and the note), and conditions, events and /readyz are reported
as before.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from detector.agent.agent import AgentSink
from detector.core.domain import key
from detector.core.gpu_health import DEGRADED, FAILED, GpuHealth, gpu_key
from detector.core.nodestatus import DraDevice
from detector.kube.api import ApiError, KubeApi
from detector.kube.dra import GROUP, discover
from detector.kube.node_status import NVIDIA_DRA_DRIVER
from detector.kube.shapes import obj, objects, text
from detector.kube.pacing import Backoff
from detector.kube.slices import NodeDevices, list_node_devices

log = logging.getLogger("gpu_npd.dra")

NVIDIA_DRIVER = NVIDIA_DRA_DRIVER
TAINT_KEY = key("gpu-unhealthy")
MANAGED_BY = key("managed-by")
MANAGER = "gpu-npd"
NODE_LABEL = key("node")
GPU_ANNOTATION = key("gpu")               # the GPU's bus id or UUID: which GPU a rule is about
REASONS_ANNOTATION = key("reasons")
EFFECTS = ("NoSchedule", "NoExecute")          # None (Python's) in the settings: no taint for that state
RBAC_HINT = ("deploy/overlays/dra-taints does (get, list, create, update and delete devicetaintrules; "
             "deploy/base lists resourceslices), as does the Helm chart with draTaints.enabled=true")
NAME_LIMIT = 63


@dataclass
class DeviceTaintSettings:
    degraded_effect: str | None = "NoSchedule"
    failed_effect: str | None = "NoExecute"
    driver: str = NVIDIA_DRIVER
    device_class_name: str | None = None     # optional deviceSelector.deviceClassName (gone in 1.35's v1alpha3)
    qps: float = 2.0
    burst: int = 5
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 60.0
    refused_retry_s: float = 300.0          # after a 403: ask again this rarely
    slice_relist_s: float = 60.0            # a GPU missing from the slices: look again at most this often
    start_grace_s: float = 60.0             # rules found on start are not deleted before this: the first
                                            # sweeps may not have run every check that holds a GPU unhealthy


def dns_name(text: str, limit: int = NAME_LIMIT) -> str:
    """`text` as a DNS-1123 label-like name (lower case, [a-z0-9-], alphanumeric at both ends), cut to
    `limit` with a hash of the whole when longer, so distinct long names stay distinct."""
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "x"
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{name[: limit - len(digest) - 1].rstrip('-')}-{digest}"


def rule_name(node: str, device: str) -> str:
    return dns_name(f"gpu-npd-{node}-{device}")


def _label_value(text: str) -> str:
    return dns_name(text)


@dataclass(frozen=True)
class _Want:
    """One GPU that should be tainted now."""
    gpu: str            # gpu_key
    uuid: str | None
    bus_id: str | None
    label: str
    state: str
    effect: str
    reasons: tuple[str, ...]


class DeviceTaintSink(AgentSink):
    def __init__(self, api: KubeApi, node: str, settings: DeviceTaintSettings | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        """`api`: the daemon's client; the sink talks through a client of its own on the same connection
        and pool (same request counts), without the daemon's ApiHealth."""
        self.settings = s = settings or DeviceTaintSettings()
        for effect in (s.degraded_effect, s.failed_effect):
            if effect is not None and effect not in EFFECTS:
                raise ValueError(f"device taint effect {effect!r}: one of {', '.join(EFFECTS)} or None")
        self.api = KubeApi(api.connection, qps=s.qps, burst=s.burst, counts=api.counts, pool=api.http,
                           watchdog=api.watchdog)
        self.node, self.clock = node, clock
        self.wake = threading.Event()
        self.backoff = Backoff(s.backoff_base_s, s.backoff_cap_s, rng or random.Random(), refused_s=s.refused_retry_s)
        self._lock = threading.Lock()
        self._wanted: dict[str, _Want] = {}
        self._dirty = False                   # set by the agent's first judgement: nothing before it
        self._heard = False
        self._retry_at = 0.0
        self.off = False                      # the cluster serves no DeviceTaintRule: nothing to do, ever
        self._note = ""                       # why a GPU is not tainted, for a person ("" when all is well)
        self.on_note: Callable[[str], None] | None = None   # told each change of the note (the conditions)
        self.rule_version: str | None = None
        self.slice_version: str | None = None
        self._devices: NodeDevices | None = None              # None: not listed yet
        self._listed_at = -1e18
        self._rules: dict[str, dict[str, Any]] | None = None  # our rules on the server, by name
        self._said: set[str] = set()
        self._refused: set[str] = set()
        self._started = clock()
        self._adopted: set[str] = set()       # rules found on start, not yet confirmed or deleted

    @property
    def note(self) -> str:
        return self._note

    @note.setter
    def note(self, text: str) -> None:
        changed, self._note = text != self._note, text
        if changed and self.on_note is not None:
            self.on_note(text)

    def tainted(self, gpu: str) -> bool:
        """This GPU (its gpu_key) has a rule of ours on the server with a taint: it is fenced. Read from any
        thread (the GPU resetter's): the sender replaces entries, and a copy is taken before looking."""
        rules = self._rules
        if not rules:
            return False
        return any(obj(obj(r.get("metadata")).get("annotations")).get(GPU_ANNOTATION) == gpu
                   and obj(obj(r.get("spec")).get("taint")).get("effect") in EFFECTS for r in list(rules.values()))

    # -- the sink (the agent's thread: never waits on the API server) -----------------------------

    def gpus(self, health: list[GpuHealth]) -> None:
        wanted: dict[str, _Want] = {}
        for h in health:
            effect = {FAILED: self.settings.failed_effect, DEGRADED: self.settings.degraded_effect}.get(h.state)
            gpu = gpu_key(h.gpu)
            if effect is None or not gpu:
                continue
            wanted[gpu] = _Want(gpu, h.gpu.uuid, h.gpu.pci_bus_id, h.gpu.label(), h.state, effect, h.reasons)
        with self._lock:
            if wanted == self._wanted and self._heard:
                return
            self._wanted, self._dirty, self._heard = wanted, True, True
        self.wake.set()

    # -- the sender ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """The sender thread's loop, until `stop` is set."""
        while not stop.is_set():
            due = self.due_at()
            wait = 1.0 if due is None else min(1.0, max(0.0, due - self.clock()))
            if wait > 0:
                self.wake.wait(wait)
            self.wake.clear()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a bug here must not end the thread
                log.exception("DRA device taints: reconciling failed")

    def due_at(self) -> float | None:
        with self._lock:
            return None if self.off or not self._dirty else self._retry_at

    def flush(self) -> bool:
        """Bring this node's DeviceTaintRules to the latest wanted state, if due. False when the API
        server did not take it all (retried after a backoff)."""
        now = self.clock()
        with self._lock:
            if self.off or not self._dirty or now < self._retry_at:
                return True
            wanted, self._dirty = dict(self._wanted), False
        try:
            done = self._reconcile(wanted, now)
        except ApiError as e:
            self._failed(e, now)
            return False
        if self._refused:
            log.info("DRA device taints: the API server now lets gpu-npd manage DeviceTaintRules")
            self._refused.clear()
            self.note = ""
        self.backoff.reset()
        with self._lock:
            self._retry_at = 0.0 if done else now + min(self.settings.slice_relist_s, max(
                1.0, self.settings.start_grace_s - (now - self._started)))
            self._dirty = self._dirty or not done
        return True

    def _failed(self, e: ApiError, now: float) -> None:
        with self._lock:
            self._dirty = True
            self._retry_at = now + self.backoff.after(e.status, e.retry_after_s)
        what = f"{e.verb} {e.resource}"
        if e.status in (401, 403):
            if what not in self._refused:
                self._refused.add(what)
                self.note = f"DRA device taints: not permitted to {what} ({e.status})"
                log.error("DRA device taints: the API server forbids gpu-npd to %s (%d %s); grant it as %s. "
                          "Conditions and events are not affected", what, e.status, e.reason, RBAC_HINT)
        else:
            log.log(logging.WARNING if self.backoff.failures <= 1 else logging.DEBUG,
                    "DRA device taints: %s failed (%s); retrying in %.0fs", what, e, max(0.0, self._retry_at - now))

    def _say_once(self, topic: str, text: str, level: int = logging.WARNING) -> None:
        self.note = text
        if topic not in self._said:
            self._said.add(topic)
            log.log(level, "%s", text)

    # -- reconciling (the sender thread only) ----------------------------------------------------

    def _reconcile(self, wanted: dict[str, _Want], now: float) -> bool:
        """True when everything wanted is done; False when a GPU was not found in the slices (looked
        for again later)."""
        if self.rule_version is None and not self._discover():
            return True
        assert self.rule_version is not None
        first = self._rules is None
        # This node's rules as they are now (one request per change): on start what earlier runs left,
        # later whatever someone else deleted or edited meanwhile.
        listed = self.api.list_device_taint_rules(
            self.rule_version, f"{MANAGED_BY}={MANAGER},{NODE_LABEL}={_label_value(self.node)}")
        self._rules = {name: r for r in objects(listed) if (name := text(obj(r.get("metadata")).get("name")))}
        if first:
            self._adopted = set(self._rules)
        missing = [w for w in wanted.values() if self._device(w) is None]
        if missing and now - self._listed_at >= self.settings.slice_relist_s:
            self._list_slices(now)
            missing = [w for w in wanted.values() if self._device(w) is None]
        desired: dict[str, dict[str, Any]] = {}
        for w in wanted.values():
            device = self._device(w)
            if device is not None:
                body = self._body(w, device)
                desired[body["metadata"]["name"]] = body
        in_grace = now - self._started < self.settings.start_grace_s
        self._adopted &= set(self._rules)
        for name in sorted(set(self._rules) - set(desired)):
            if in_grace and name in self._adopted:
                continue                            # a GPU restored as unhealthy by a check yet to run
            self._delete(name)
        self._adopted -= set(desired)
        for name, body in sorted(desired.items()):
            self._put(name, body)
        if self._devices and missing:
            for w in missing:
                self._say_once(f"gpu:{w.gpu}", f"DRA device taints: {w.label} is {w.state} but no device of "
                               f"driver {self.settings.driver} in node {self.node}'s ResourceSlices has its UUID "
                               "or PCI bus id: not tainted")
        if in_grace and self._adopted:
            return False                            # come back once the grace is over
        if not missing:
            self.note = ""
        return not missing

    def _discover(self) -> bool:
        """Find the resource.k8s.io versions serving DeviceTaintRules and ResourceSlices. False when the
        cluster serves no DeviceTaintRule (then the sink is off)."""
        dra = discover(self.api)
        self.rule_version = dra.version_of("devicetaintrules")
        self.slice_version = dra.version_of("resourceslices")
        if self.rule_version is None:
            self.off = True
            served = ", ".join(dra.versions) or "none"
            self._say_once("off", f"DRA device taints: the cluster serves no DeviceTaintRule ({GROUP} versions: "
                           f"{served}; DeviceTaintRule needs Kubernetes 1.33+ with the DRADeviceTaints feature "
                           "gate and its API version enabled): no GPU is tainted", logging.ERROR)
            return False
        log.info("DRA device taints: DeviceTaintRules at %s/%s, ResourceSlices at %s; tainting failed GPUs "
                 "%s and degraded ones %s", GROUP, self.rule_version, self.slice_version or "(none served)",
                 self.settings.failed_effect, self.settings.degraded_effect)
        return True

    def _list_slices(self, now: float) -> None:
        self._listed_at = now
        self._devices = list_node_devices(self.api, self.slice_version, self.node, self.settings.driver)
        if self._devices:
            self._said.discard("no-slice")
        else:
            self._say_once("no-slice", f"DRA device taints: node {self.node} has no ResourceSlice of driver "
                           f"{self.settings.driver} (is the NVIDIA DRA driver running here?): no GPU is tainted")

    def _device(self, w: _Want) -> DraDevice | None:
        return self._devices.find(w.uuid, w.bus_id) if self._devices else None

    def _body(self, w: _Want, device: DraDevice) -> dict[str, Any]:
        selector: dict[str, str] = {"driver": self.settings.driver, "pool": device.pool, "device": device.name}
        if self.settings.device_class_name:
            selector = {"deviceClassName": self.settings.device_class_name, **selector}
        return {
            "apiVersion": f"{GROUP}/{self.rule_version}", "kind": "DeviceTaintRule",
            "metadata": {"name": rule_name(self.node, device.name),
                         "labels": {MANAGED_BY: MANAGER, NODE_LABEL: _label_value(self.node)},
                         "annotations": {GPU_ANNOTATION: w.gpu, REASONS_ANNOTATION: ",".join(w.reasons)}},
            "spec": {"deviceSelector": selector, "taint": {"key": TAINT_KEY, "value": w.state, "effect": w.effect}},
        }

    def _put(self, name: str, body: dict[str, Any]) -> None:
        assert self._rules is not None and self.rule_version is not None
        current = self._rules.get(name)
        if current is not None and _same(current, body):
            return
        if current is None:
            try:
                self._rules[name] = self.api.create_device_taint_rule(self.rule_version, body)
                log.warning("DRA device taints: tainted %s device %s (%s=%s:%s)", body["metadata"]["annotations"]
                            [GPU_ANNOTATION], body["spec"]["deviceSelector"]["device"], TAINT_KEY,
                            body["spec"]["taint"]["value"], body["spec"]["taint"]["effect"])
                return
            except ApiError as e:
                if e.status != 409:
                    raise
                current = self._rules[name] = self.api.get_device_taint_rule(self.rule_version, name)
                if _same(current, body):
                    return
        update = {**body, "metadata": {**body["metadata"],
                                       "resourceVersion": text(obj(current.get("metadata")).get("resourceVersion"))}}
        try:
            self._rules[name] = self.api.update_device_taint_rule(self.rule_version, name, update)
        except ApiError as e:
            if e.status in (404, 409):              # gone or changed meanwhile: read it again next time
                self._rules.pop(name, None)
                if e.status == 409:
                    self._rules[name] = self.api.get_device_taint_rule(self.rule_version, name)
            raise
        log.warning("DRA device taints: %s now %s=%s:%s", name, TAINT_KEY, body["spec"]["taint"]["value"],
                    body["spec"]["taint"]["effect"])

    def _delete(self, name: str) -> None:
        assert self._rules is not None and self.rule_version is not None
        try:
            self.api.delete_device_taint_rule(self.rule_version, name)
        except ApiError as e:
            if e.status != 404:
                raise
        self._rules.pop(name, None)
        log.info("DRA device taints: removed %s (its GPU is no longer unhealthy)", name)


def _same(current: dict[str, Any], body: dict[str, Any]) -> bool:
    """The server's rule already says what `body` says (timeAdded is the server's)."""
    spec = obj(current.get("spec"))
    taint = {k: v for k, v in obj(spec.get("taint")).items() if k != "timeAdded"}
    annotations = obj(obj(current.get("metadata")).get("annotations"))
    return (spec.get("deviceSelector") == body["spec"]["deviceSelector"] and taint == body["spec"]["taint"]
            and all(annotations.get(k) == v for k, v in body["metadata"]["annotations"].items()))
