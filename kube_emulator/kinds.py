"""Every resource the emulator serves, by API group and version: core/v1 nodes and events (store.py),
core/v1 pods, coordination.k8s.io/v1 leases and resource.k8s.io ResourceSlices and DeviceTaintRules
(here, with the little validation they get).

Pods exist so that `kubectl describe node` (which lists the node's pods) works; none exist unless
someone creates them. Leases are what a leader election or a node heartbeat writes. ResourceSlices are
what a DRA driver publishes about a node's devices, DeviceTaintRules what taints them (KEP-5055); both
are registered at every version in DRA_VERSIONS, and one emulator serves them at one version only
(`Emulator(dra_version=...)`): Kubernetes 1.33-1.35 serve DeviceTaintRule at v1alpha3, 1.36 at v1beta2.
"""

from __future__ import annotations

import json
from typing import Any

from kube_emulator.store import (
    EVENTS,
    META_MERGE_KEYS,
    NODES,
    Cause,
    Kind,
    is_rfc3339,
    is_subdomain,
    required,
    validate_metadata,
    value_invalid,
)

CORE = ("", "v1")
COORDINATION = ("coordination.k8s.io", "v1")
DRA_GROUP = "resource.k8s.io"
DRA_VERSIONS = ("v1alpha3", "v1beta2")
DEFAULT_DRA_VERSION = "v1alpha3"
# Device taint effects (k8s.io/api/resource/*/types.go DeviceTaintEffect): v1beta2 (1.36) adds "None"
DEVICE_TAINT_EFFECTS = {"v1alpha3": ("NoExecute", "NoSchedule"), "v1beta2": ("NoExecute", "NoSchedule", "None")}


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


def taint_rule_validator(version: str) -> Any:
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
            causes.append(Cause("spec.taint.effect", f"Unsupported value: {json.dumps(taint['effect'])}: supported "
                                f"values: {', '.join(json.dumps(e) for e in effects)}", "FieldValueNotSupported"))
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
