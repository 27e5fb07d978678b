"""A Node object (and this node's ResourceSlices) as the plain NodeStatus that checks and the agent read.

Tolerant by design: a field missing or malformed reads as absent, never as an error, since a node object is
written by kubelet, device plugins, DRA drivers and people (and any gpu-npd pod may patch a node's status),
and a check must still judge what is there: every field is read through the shape checks of shapes.py.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping

from detector.backends.pciaddr import normalize_bus_id
from detector.core.nodestatus import DraDevice, NodeCondition, NodeStatus
from detector.kube.shapes import obj, objects, text

NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
UUID_ATTRIBUTES = ("uuid", f"{NVIDIA_DRA_DRIVER}/uuid")
# The standard attribute since the driver's 25.12 releases (k8s-dra-driver-gpu PR 800); `pcieBusID` before it
# (as the slices pasted in kubernetes-sigs/dra-driver-nvidia-gpu issue 719 show).
BUS_ID_ATTRIBUTES = ("resource.kubernetes.io/pciBusID", "pcieBusID", "pciBusID", f"{NVIDIA_DRA_DRIVER}/pciBusID")
TYPE_ATTRIBUTES = ("type", f"{NVIDIA_DRA_DRIVER}/type")
INDEX_ATTRIBUTES = ("index", f"{NVIDIA_DRA_DRIVER}/index")


def node_status(node: Mapping[str, Any], read_at: float, dra_devices: tuple[DraDevice, ...] | None = None,
                dra_error: str = "") -> NodeStatus:
    metadata = obj(node.get("metadata"))
    status = obj(node.get("status"))
    conditions = {}
    for c in objects(status.get("conditions")):
        if type_ := text(c.get("type")):
            conditions[type_] = NodeCondition(type_, text(c.get("status"), "Unknown"), text(c.get("reason")),
                                              text(c.get("message")), parse_time(c.get("lastTransitionTime")))
    spec = obj(node.get("spec"))
    taints = tuple(_taint(t) for t in objects(spec.get("taints")) if text(t.get("key")))
    return NodeStatus(text(metadata.get("name")), read_at, _strings(status.get("capacity")),
                      _strings(status.get("allocatable")), _strings(metadata.get("labels")),
                      _strings(metadata.get("annotations")), conditions, dra_devices, dra_error, taints,
                      bool(spec.get("unschedulable")))


def _taint(taint: Mapping[str, Any]) -> str:
    value = f"={text(taint.get('value'))}" if text(taint.get("value")) else ""
    return f"{text(taint.get('key'))}{value}:{text(taint.get('effect'))}"


def dra_devices(slices: Iterable[Mapping[str, Any]], node: str,
                driver: str = NVIDIA_DRA_DRIVER) -> tuple[DraDevice, ...]:
    """The devices of `node`'s ResourceSlices of `driver` (attributes sit under devices[].basic before
    resource.k8s.io/v1beta2, directly under devices[] from it on). A pool being republished has slices of
    two generations for a while: only its newest generation counts, as the API asks of every consumer."""
    specs = [obj(s.get("spec")) for s in slices if isinstance(s, dict)]
    mine = [spec for spec in specs if spec.get("nodeName") == node and spec.get("driver") == driver]
    newest: dict[str, int] = {}
    for spec in mine:
        pool = obj(spec.get("pool"))
        newest[text(pool.get("name"))] = max(newest.get(text(pool.get("name")), 0), _int(pool.get("generation")))
    out = []
    for spec in mine:
        pool = text(obj(spec.get("pool")).get("name"))
        if _int(obj(spec.get("pool")).get("generation")) < newest[pool]:
            continue
        for d in objects(spec.get("devices")):
            attributes = obj(d.get("attributes")) or obj(obj(d.get("basic")).get("attributes"))
            bus = _first(attributes, BUS_ID_ATTRIBUTES)
            try:
                bus = normalize_bus_id(bus) if bus else ""
            except ValueError:
                bus = ""
            index = _first(attributes, INDEX_ATTRIBUTES)
            out.append(DraDevice(text(d.get("name")), pool, _first(attributes, TYPE_ATTRIBUTES) or "gpu",
                                 _first(attributes, UUID_ATTRIBUTES) or None, bus or None,
                                 int(index) if str(index).isdigit() else None))
    return tuple(out)


def parse_time(value: Any) -> float | None:
    """An RFC 3339 time as the API writes it (`2026-11-26T10:00:00Z`), as seconds since the epoch."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _first(attributes: Mapping[str, Any], names: Iterable[str]) -> str:
    for name in names:
        value = attributes.get(name)
        if isinstance(value, dict):
            value = value.get("string", value.get("int", value.get("version")))
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
            return str(value)
    return ""


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return 0


def _strings(mapping: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in mapping.items()} if isinstance(mapping, dict) else {}
