"""Server-side printing: the meta.k8s.io/v1 Table a client gets when its Accept header asks for
`as=Table` (kubectl get does), with the columns the API server prints for each kind, so `kubectl get
nodes` shows NAME STATUS ROLES AGE VERSION as against a real cluster, not just NAME AGE.

`includeObject` (None, Metadata — the default —, Object) says what each row carries beside its cells.
"""

from __future__ import annotations

import calendar
import time
from typing import Any, Callable, Mapping

from kube_emulator.errors import bad_request
from kube_emulator.kinds import Kind

Row = Callable[[dict[str, Any], float], list[Any]]


def wants_table(headers: Mapping[str, str]) -> bool:
    accept = (headers.get("Accept") or "").replace(" ", "")
    return any("as=Table" in part.split(";") and "g=meta.k8s.io" in part.split(";")
               for part in accept.split(","))


def _seconds_since(timestamp: Any, now: float) -> float | None:
    if not isinstance(timestamp, str) or len(timestamp) < 19:
        return None
    try:
        return now - calendar.timegm(time.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def human_duration(seconds: float | None) -> str:
    """How kubectl and the API server write an age: 45s, 3m20s, 5h, 2d3h, 400d."""
    if seconds is None:
        return "<unknown>"
    if seconds < -1:
        return "<invalid>"
    s = max(int(seconds), 0)
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    return f"{days // 365}y{days % 365}d" if days < 365 * 8 else f"{days // 365}y"


def _age(obj: dict[str, Any], now: float) -> str:
    return human_duration(_seconds_since((obj.get("metadata") or {}).get("creationTimestamp"), now))


def _node_row(node: dict[str, Any], now: float) -> list[Any]:
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Unknown" if ready is None or ready.get("status") == "Unknown" else (
        "Ready" if ready.get("status") == "True" else "NotReady")
    if spec.get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = meta.get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k}
                   | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()))
    roles = [r for r in roles if r]
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or [] if isinstance(a, dict)}
    info = status.get("nodeInfo") or {}
    return [meta.get("name", ""), state, ",".join(roles) or "<none>", _age(node, now), info.get("kubeletVersion", ""),
            addresses.get("InternalIP") or "<none>", addresses.get("ExternalIP") or "<none>",
            info.get("osImage") or "<unknown>", info.get("kernelVersion") or "<unknown>",
            info.get("containerRuntimeVersion") or "<unknown>"]


def _event_row(event: dict[str, Any], now: float) -> list[Any]:
    involved = event.get("involvedObject") or {}
    last = event.get("lastTimestamp") or event.get("eventTime") or (event.get("metadata") or {}).get(
        "creationTimestamp")
    kind = (involved.get("kind") or "").lower()
    return [human_duration(_seconds_since(last, now)), event.get("type", ""), event.get("reason", ""),
            f"{kind}/{involved.get('name', '')}", event.get("message", "")]


def _pod_row(pod: dict[str, Any], now: float) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    return [(pod.get("metadata") or {}).get("name", ""), f"{ready}/{len(spec.get('containers') or [])}",
            status.get("reason") or status.get("phase") or "Pending", restarts, _age(pod, now),
            status.get("podIP") or "<none>", spec.get("nodeName") or "<none>"]


def _lease_row(lease: dict[str, Any], now: float) -> list[Any]:
    return [(lease.get("metadata") or {}).get("name", ""), (lease.get("spec") or {}).get("holderIdentity") or "",
            _age(lease, now)]


def _column(name: str, description: str, priority: int = 0, type_: str = "string", fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": type_, "format": fmt, "description": description, "priority": priority}


_NAME = _column("Name", "Name must be unique within a namespace.", fmt="name")
_AGE = _column("Age", "CreationTimestamp is a timestamp representing the server time when this object was created.")
COLUMNS: dict[str, tuple[list[dict[str, Any]], Row]] = {
    "Node": ([_NAME, _column("Status", "The status of the node"), _column("Roles", "The roles of the node"), _AGE,
              _column("Version", "Kubelet Version reported by the node."),
              _column("Internal-IP", "List of internal IPs.", 1), _column("External-IP", "List of external IPs.", 1),
              _column("OS-Image", "OS Image reported by the node.", 1),
              _column("Kernel-Version", "Kernel Version reported by the node.", 1),
              _column("Container-Runtime", "Container Runtime Version reported by the node.", 1)], _node_row),
    "Event": ([_column("Last Seen", "The time when this event was last observed."),
               _column("Type", "Type of this event (Normal, Warning), new types could be added in the future."),
               _column("Reason", "A short, machine understandable string that gives the reason for the transition "
                                 "into the object's current status."),
               _column("Object", "The object that this event is about."),
               _column("Message", "A human-readable description of the status of this operation.")], _event_row),
    "Pod": ([_NAME, _column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
             _column("Status", "The aggregate status of the containers in this pod."),
             _column("Restarts", "The number of times the containers in this pod have been restarted.",
                     type_="integer"), _AGE,
             _column("IP", "IP address allocated to the pod.", 1), _column("Node", "Name of the node.", 1)], _pod_row),
    "Lease": ([_NAME, _column("Holder", "The holder of the lease."), _AGE], _lease_row),
}


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata") or {}}


def to_table(kind: Kind, objects: list[dict[str, Any]], now: float, query: Mapping[str, str],
             list_meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Table of `objects` (list items, a got object, or one watch event's object)."""
    include = query.get("includeObject") or "Metadata"
    if include not in ("None", "Metadata", "Object"):
        raise bad_request(f'includeObject: Unsupported value: "{include}": supported values: "Metadata", "None", '
                          '"Object"')
    columns, row = COLUMNS.get(kind.kind, ([_NAME, _AGE],
                                           lambda o, t: [(o.get("metadata") or {}).get("name", ""), _age(o, t)]))
    rows = []
    for obj in objects:
        full = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        entry: dict[str, Any] = {"cells": row(obj, now)}
        shown = _row_object(full, include)
        if shown is not None:
            entry["object"] = shown
        rows.append(entry)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": dict(list_meta or {}),
            "columnDefinitions": columns, "rows": rows}
