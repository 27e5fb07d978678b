"""This node's DRA devices as the DRA device taints find a GPU among them: one list of the node's
ResourceSlices of one driver, each device indexed by its UUID and its PCI bus id.

ResourceSlice (resource.k8s.io): spec{driver, pool{name, generation, resourceSliceCount}, nodeName,
devices[{name, attributes{<name>: {string|int|bool|version}}}]}; before v1beta2 the attributes sit under
devices[].basic (node_status.dra_devices reads both). spec.nodeName and spec.driver are field selectors.
Sources: the API reference "ResourceSlice v1beta1" and k8s-openapi's resource/v1beta2 and resource/v1
ResourceSliceSpec. The node watch follows the same slices with a watch instead (nodewatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detector.core.nodestatus import DraDevice
from detector.backends.pciaddr import normalize_bus_id
from detector.kube.api import ApiError, KubeApi
from detector.kube.node_status import dra_devices


@dataclass(frozen=True)
class NodeDevices:
    """A node's devices by "uuid:<uuid>" and "bus:<normalized PCI bus id>"; false when there are none."""

    by_key: dict[str, DraDevice] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def find(self, uuid: str | None, bus_id: str | None) -> DraDevice | None:
        """The device with this UUID, else the one at this PCI bus id (any spelling of it)."""
        if uuid and (d := self.by_key.get(f"uuid:{uuid}")):
            return d
        if bus_id:
            try:
                return self.by_key.get(f"bus:{normalize_bus_id(bus_id)}")
            except ValueError:
                return None
        return None


def list_node_devices(api: KubeApi, version: str | None, node: str, driver: str) -> NodeDevices:
    """The devices of `node`'s ResourceSlices of `driver` at `version` (None: the cluster serves no
    ResourceSlice, so none). A version without these field selectors (400) is listed whole and filtered
    here; any other failure raises ApiError."""
    devices: dict[str, DraDevice] = {}
    if version is not None:
        selector = f"spec.nodeName={node},spec.driver={driver}"
        try:
            slices = api.list_resource_slices(version, selector)
        except ApiError as e:
            if e.status != 400:
                raise
            slices = api.list_resource_slices(version)
        for device in dra_devices(slices, node, driver):
            if device.uuid:
                devices[f"uuid:{device.uuid}"] = device
            if device.pci_bus_id:
                devices[f"bus:{device.pci_bus_id}"] = device
    return NodeDevices(devices)
