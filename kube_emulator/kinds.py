"""Every resource the emulator serves, by API group and version: core/v1 nodes and events (store.py),
core/v1 pods and coordination.k8s.io/v1 leases (here, with the little validation they get).

Pods exist so that `kubectl describe node` (which lists the node's pods) works; none exist unless
someone creates them. Leases are what a leader election or a node heartbeat writes.
"""

from __future__ import annotations

from typing import Any

from kube_emulator.store import (
    EVENTS,
    META_MERGE_KEYS,
    NODES,
    Cause,
    Kind,
    is_rfc3339,
    required,
    validate_metadata,
    value_invalid,
)

CORE = ("", "v1")
COORDINATION = ("coordination.k8s.io", "v1")


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
}


def kind_for(group: str, version: str, resource: str) -> Kind | None:
    return GROUP_VERSIONS.get((group, version), {}).get(resource)
