"""Every resource the emulator serves, by API group and version, and what the store needs to know about
each (`Kind`): core/v1 nodes, events and pods, coordination.k8s.io/v1 leases and resource.k8s.io
ResourceSlices and DeviceTaintRules, with the validation they get.

Pods exist so that `kubectl describe node` (which lists the node's pods) works; none exist unless
someone creates them. Leases are what a leader election or a node heartbeat writes. ResourceSlices are
what a DRA driver publishes about a node's devices, DeviceTaintRules what taints them (KEP-5055); both
are registered at every version in DRA_VERSIONS, and one emulator serves them at one version only
(`Emulator(dra_version=...)`): Kubernetes 1.33-1.35 serve DeviceTaintRule at v1alpha3, 1.36 at v1beta2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kube_emulator.errors import Cause
from kube_emulator.patch import PRIMITIVE
from kube_emulator.validation import (
    is_rfc3339,
    is_subdomain,
    required,
    unsupported,
    validate_metadata,
    validate_times,
    value_invalid,
)

CORE = ("", "v1")
COORDINATION = ("coordination.k8s.io", "v1")
DRA_GROUP = "resource.k8s.io"
DRA_VERSIONS = ("v1alpha3", "v1beta2")
DEFAULT_DRA_VERSION = "v1alpha3"
# Device taint effects (k8s.io/api/resource/*/types.go DeviceTaintEffect): v1beta2 (1.36) adds "None"
DEVICE_TAINT_EFFECTS = {"v1alpha3": ("NoExecute", "NoSchedule"), "v1beta2": ("NoExecute", "NoSchedule", "None")}


@dataclass(frozen=True)
class Kind:
    """What the store needs to know about one resource type."""

    resource: str
    kind: str
    namespaced: bool
    has_status: bool
    merge_keys: Mapping[str, str]
    field_selectors: frozenset[str]
    validate: Callable[[dict], list[Cause]]
    create_on_update: bool = False
    group: str = ""                  # "" is the core group (/api/v1), else /apis/{group}/{version}
    version: str = "v1"
    singular: str = ""
    short_names: tuple[str, ...] = ()

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """The resource as RBAC messages and Status details name it: `leases.coordination.k8s.io`."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


META_MERGE_KEYS = {"metadata.finalizers": PRIMITIVE, "metadata.ownerReferences": "uid"}

CONDITION_STATUSES = ("False", "True", "Unknown")
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "PreferNoSchedule")


def validate_node(node: dict) -> list[Cause]:
    causes = validate_metadata(node)
    spec = node.get("spec") or {}
    for i, taint in enumerate(spec.get("taints") or []):
        if not isinstance(taint, dict) or not taint.get("key"):
            causes.append(required(f"spec.taints[{i}].key"))
        elif taint.get("effect") not in TAINT_EFFECTS:
            causes.append(unsupported(f"spec.taints[{i}].effect", taint.get("effect"), TAINT_EFFECTS))
    status = node.get("status") or {}
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        return causes + [value_invalid("status.conditions", conditions, "must be a list")]
    seen: set[str] = set()
    for i, cond in enumerate(conditions):
        path = f"status.conditions[{i}]"
        if not isinstance(cond, dict):
            causes.append(value_invalid(path, cond, "must be an object"))
            continue
        kind = cond.get("type")
        if not kind:
            causes.append(required(f"{path}.type"))
        elif kind in seen:
            causes.append(Cause(f"{path}.type", f"Duplicate value: {json.dumps(kind)}", "FieldValueDuplicate"))
        else:
            seen.add(kind)
        if cond.get("status") not in CONDITION_STATUSES:
            causes.append(required(f"{path}.status") if not cond.get("status")
                          else unsupported(f"{path}.status", cond.get("status"), CONDITION_STATUSES))
        causes += validate_times(cond, ("lastHeartbeatTime", "lastTransitionTime"), f"{path}.")
    for i, address in enumerate(status.get("addresses") or []):
        if not isinstance(address, dict) or not address.get("type"):
            causes.append(required(f"status.addresses[{i}].type"))
    return causes


def validate_event(event: dict) -> list[Cause]:
    """Legacy core/v1 Event rules, including the namespace agreement Kubernetes insists on."""
    causes = validate_metadata(event)
    involved = event.get("involvedObject")
    if not isinstance(involved, dict):
        causes.append(required("involvedObject"))
        involved = {}
    if not event.get("reason"):
        causes.append(required("reason"))
    count = event.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        causes.append(value_invalid("count", count, "must be greater than or equal to 0"))
    causes += validate_times(event, ("firstTimestamp", "lastTimestamp", "eventTime"), "")
    namespace = (event.get("metadata") or {}).get("namespace", "")
    involved_ns = involved.get("namespace") or ""
    if event.get("eventTime") is None:
        ok = namespace in ("", "default") if not involved_ns else namespace == involved_ns
    else:
        ok = bool(involved_ns) or namespace in ("default", "kube-system")
        for name in ("reportingComponent", "reportingInstance", "action"):
            if not event.get(name):
                causes.append(required(name))
    if not ok:
        causes.append(value_invalid("involvedObject.namespace", involved_ns, "does not match event.namespace"))
    return causes


NODES = Kind(
    resource="nodes", kind="Node", namespaced=False, has_status=True,
    merge_keys={**META_MERGE_KEYS, "spec.taints": "key", "spec.podCIDRs": PRIMITIVE,
                "status.conditions": "type", "status.addresses": "type"},
    field_selectors=frozenset({"metadata.name", "spec.unschedulable"}),
    validate=validate_node, singular="node", short_names=("no",))

EVENTS = Kind(
    resource="events", kind="Event", namespaced=True, has_status=False, merge_keys=dict(META_MERGE_KEYS),
    field_selectors=frozenset({
        "metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
        "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion",
        "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason", "reportingComponent",
        "source", "type"}),
    validate=validate_event, create_on_update=True, singular="event", short_names=("ev",))


def validate_pod(pod: dict) -> list[Cause]:
    causes = validate_metadata(pod)
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        return causes + [required("spec.containers")]
    names: set[str] = set()
    for i, container in enumerate(containers):
        if not isinstance(container, dict) or not container.get("name"):
            causes.append(required(f"spec.containers[{i}].name"))
            continue
        if container["name"] in names:
            causes.append(Cause(f"spec.containers[{i}].name", f'Duplicate value: "{container["name"]}"',
                                "FieldValueDuplicate"))
        names.add(container["name"])
        if not container.get("image"):
            causes.append(required(f"spec.containers[{i}].image"))
    return causes


def validate_lease(lease: dict) -> list[Cause]:
    causes = validate_metadata(lease)
    spec: Any = lease.get("spec") or {}
    if not isinstance(spec, dict):
        return causes + [value_invalid("spec", spec, "must be an object")]
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0):
        causes.append(value_invalid("spec.leaseDurationSeconds", duration, "must be greater than 0"))
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or isinstance(transitions, bool)
                                    or transitions < 0):
        causes.append(value_invalid("spec.leaseTransitions", transitions, "must be greater than or equal to 0"))
    holder = spec.get("holderIdentity")
    if holder is not None and not isinstance(holder, str):
        causes.append(value_invalid("spec.holderIdentity", holder, "must be a string"))
    for name in ("acquireTime", "renewTime"):
        if spec.get(name) is not None and not is_rfc3339(spec[name]):
            causes.append(value_invalid(f"spec.{name}", spec[name], "must be an RFC 3339 timestamp (MicroTime)"))
    return causes


def validate_resource_slice(slice_: dict) -> list[Cause]:
    """ResourceSliceSpec: driver and pool.name required, exactly one of nodeName/nodeSelector/allNodes,
    devices named (unique) when listed."""
    causes = validate_metadata(slice_)
    spec: Any = slice_.get("spec")
    if not isinstance(spec, dict):
        return causes + [required("spec")]
    if not spec.get("driver"):
        causes.append(required("spec.driver"))
    elif not is_subdomain(spec["driver"]):
        causes.append(value_invalid("spec.driver", spec["driver"], "must be a DNS subdomain"))
    pool = spec.get("pool")
    if not isinstance(pool, dict) or not pool.get("name"):
        causes.append(required("spec.pool.name"))
    if sum(bool(spec.get(k)) for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")) != 1:
        causes.append(Cause("spec", "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                                    "`perDeviceNodeSelection` is required"))
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return causes + [value_invalid("spec.devices", devices, "must be a list")]
    names: set[str] = set()
    for i, device in enumerate(devices):
        name = device.get("name") if isinstance(device, dict) else None
        if not name:
            causes.append(required(f"spec.devices[{i}].name"))
        elif name in names:
            causes.append(Cause(f"spec.devices[{i}].name", f"Duplicate value: {json.dumps(name)}",
                                "FieldValueDuplicate"))
        names.add(name or "")
    return causes


def taint_rule_validator(version: str) -> Callable[[dict], list[Cause]]:
    effects = DEVICE_TAINT_EFFECTS[version]

    def validate(rule: dict) -> list[Cause]:
        """DeviceTaintRuleSpec: taint.key (a label name) and taint.effect required; deviceSelector optional."""
        causes = validate_metadata(rule)
        spec: Any = rule.get("spec")
        if not isinstance(spec, dict):
            return causes + [required("spec")]
        taint = spec.get("taint")
        if not isinstance(taint, dict):
            return causes + [required("spec.taint")]
        if not taint.get("key"):
            causes.append(required("spec.taint.key"))
        else:
            causes += [Cause(c.field.replace("metadata.labels", "spec.taint.key"), c.message, c.reason)
                       for c in validate_metadata({"metadata": {"name": "x", "labels": {taint["key"]: ""}}})]
        if not taint.get("effect"):
            causes.append(required("spec.taint.effect"))
        elif taint["effect"] not in effects:
            causes.append(unsupported("spec.taint.effect", taint["effect"], effects))
        selector = spec.get("deviceSelector")
        if selector is not None and not isinstance(selector, dict):
            causes.append(value_invalid("spec.deviceSelector", selector, "must be an object"))
        return causes
    return validate


def resource_kinds(version: str) -> dict[str, Kind]:
    """resource.k8s.io's ResourceSlice and DeviceTaintRule at one version (both cluster-scoped)."""
    slices = Kind(
        resource="resourceslices", kind="ResourceSlice", namespaced=False, has_status=False,
        merge_keys=dict(META_MERGE_KEYS), field_selectors=frozenset({"metadata.name", "spec.nodeName", "spec.driver"}),
        validate=validate_resource_slice, group=DRA_GROUP, version=version, singular="resourceslice")
    rules = Kind(
        resource="devicetaintrules", kind="DeviceTaintRule", namespaced=False, has_status=False,
        merge_keys=dict(META_MERGE_KEYS), field_selectors=frozenset({"metadata.name"}),
        validate=taint_rule_validator(version), group=DRA_GROUP, version=version, singular="devicetaintrule")
    return {k.resource: k for k in (slices, rules)}


def hidden_versions(dra_version: str | None) -> frozenset[tuple[str, str]]:
    """The resource.k8s.io versions an emulator serving `dra_version` (None: none) does not serve."""
    if dra_version is not None and dra_version not in DRA_VERSIONS:
        raise ValueError(f"dra_version {dra_version!r}: the emulator serves resource.k8s.io at "
                         f"{', '.join(DRA_VERSIONS)}")
    return frozenset((DRA_GROUP, v) for v in DRA_VERSIONS if v != dra_version)


PODS = Kind(
    resource="pods", kind="Pod", namespaced=True, has_status=True,
    merge_keys={**META_MERGE_KEYS, "spec.containers": "name", "spec.initContainers": "name",
                "spec.volumes": "name", "status.conditions": "type"},
    field_selectors=frozenset({
        "metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
        "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"}),
    validate=validate_pod, singular="pod", short_names=("po",))

LEASES = Kind(
    resource="leases", kind="Lease", namespaced=True, has_status=False, merge_keys=dict(META_MERGE_KEYS),
    field_selectors=frozenset({"metadata.name", "metadata.namespace"}),
    validate=validate_lease, group="coordination.k8s.io", version="v1", singular="lease")

# (group, version) -> resource -> Kind; core/v1 is ("", "v1")
GROUP_VERSIONS: dict[tuple[str, str], dict[str, Kind]] = {
    CORE: {k.resource: k for k in (NODES, EVENTS, PODS)},
    COORDINATION: {LEASES.resource: LEASES},
    **{(DRA_GROUP, v): resource_kinds(v) for v in DRA_VERSIONS},
}


def kind_for(group: str, version: str, resource: str) -> Kind | None:
    return GROUP_VERSIONS.get((group, version), {}).get(resource)
