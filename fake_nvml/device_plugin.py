"""The fake node's NVIDIA device plugin and DRA driver: what they would tell the scheduler of its GPUs, the
faults that make them lie, and how `recover`/`reboot` heal them.

Modelled roughly on NVIDIA/k8s-device-plugin (internal/rm/health.go): it advertises every GPU NVML
enumerated when it started as `nvidia.com/gpu` capacity, and marks a GPU unhealthy (out of allocatable)
on any critical XID NVML delivers except the application ones, 13, 31, 43, 45 and 68, or when it cannot
get the GPU's handle (a lost GPU); capacity keeps counting unhealthy GPUs ("Capacity: total; Allocatable:
healthy", k8s-device-plugin #58). Without the driver it advertises 0 allocatable. Simplification: a GPU
reset gives the GPU back to it (the real one keeps it unhealthy until it restarts: the
`device_plugin_stale` fault rehearses a plugin that never notices).

The DRA driver (gpu.nvidia.com, when the node state says it runs) publishes one device of type gpu per
GPU NVML enumerates, with its UUID and bus id, in one ResourceSlice (resource.k8s.io/v1 layout).
"""

from __future__ import annotations

from typing import Any

from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.node import FakeGpu, FakeNode, NodeState

GPU_RESOURCE = "nvidia.com/gpu"
DRA_DRIVER = "gpu.nvidia.com"
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})      # health.go: "the GPU should still be healthy"


def advertised(state: NodeState) -> dict[str, dict[str, str]]:
    """{"capacity": {...}, "allocatable": {...}}: the device plugin's part of the node's status."""
    if state.device_plugin == "down":
        return _both(0, 0)
    if state.device_plugin in ("stale", "count"):
        return _both(state.device_plugin_capacity, state.device_plugin_allocatable)
    enumerated = [g for g in state.gpus if g.nvml_visible]
    if not state.driver_loaded:
        return _both(len(enumerated), 0)
    healthy = [g for g in enumerated if not g.lost and g.uuid not in state.device_plugin_unhealthy]
    return _both(len(enumerated), len(healthy))


def resource_slices(state: NodeState, node_name: str) -> list[dict[str, Any]]:
    """The DRA driver's ResourceSlices for this node ([] when no DRA driver runs on it, or it is down)."""
    if not state.dra_driver or state.device_plugin == "down" or not state.driver_loaded:
        return []
    devices = [{"name": f"gpu-{g.index}", "attributes": {
        "type": {"string": "gpu"}, "uuid": {"string": g.uuid}, "index": {"int": g.index},
        "resource.kubernetes.io/pciBusID": {"string": g.pci_bus_id},
        "productName": {"string": g.model.name}}} for g in state.gpus if g.nvml_visible]
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{node_name}-{DRA_DRIVER}"},
             "spec": {"driver": DRA_DRIVER, "nodeName": node_name,
                      "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1}, "devices": devices}}]


def on_xid(state: NodeState, gpu: FakeGpu, code: int) -> None:
    """A critical XID delivered through NVML's events: the plugin marks the GPU unhealthy."""
    if code not in APPLICATION_XIDS and gpu.uuid not in state.device_plugin_unhealthy:
        state.device_plugin_unhealthy.append(gpu.uuid)


# -- faults ------------------------------------------------------------------------------------------------

def stale(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """It stops noticing: the counts it advertises now stay, whatever happens to the GPUs."""
    now = advertised(state)
    state.device_plugin_capacity = int(now["capacity"][GPU_RESOURCE])
    state.device_plugin_allocatable = int(now["allocatable"][GPU_RESOURCE])
    state.device_plugin = "stale"


def count(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    state.device_plugin = "count"
    state.device_plugin_capacity = state.device_plugin_allocatable = f.params["count"]


def down(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    state.device_plugin = "down"


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A node repair or reboot restarts the plugin (it enumerates afresh); a GPU reset gives it that GPU back."""
    uuids = {g.uuid for g in gpus}
    state.device_plugin_unhealthy = [u for u in state.device_plugin_unhealthy if u not in uuids]
    if whole_node:
        state.device_plugin, state.device_plugin_unhealthy = "", []


def _both(capacity: int, allocatable: int) -> dict[str, dict[str, str]]:
    return {"capacity": {GPU_RESOURCE: str(capacity)}, "allocatable": {GPU_RESOURCE: str(allocatable)}}


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("device_plugin_stale", False, {}, (), stale,
              "the NVIDIA device plugin keeps advertising the nvidia.com/gpu counts it has now, whatever "
              "happens to the GPUs (until recover without a gpu, or reboot, restarts it)"),
    FaultKind("device_plugin_count", False, {"count": int}, ("count",), count,
              "the device plugin advertises this many nvidia.com/gpu (capacity and allocatable)"),
    FaultKind("device_plugin_down", False, {}, (), down,
              "the device plugin is gone: nvidia.com/gpu 0 (as kubelet shows it), no DRA devices"),
)
