"""What the cluster says of this node: the resources it advertises to the scheduler, its conditions, labels
and annotations, and the GPUs a DRA driver published for it.

Plain data, read by checks that compare what the scheduler is told with what NVML sees (`allocatable`) and
by the agent (planned maintenance). Nothing of Kubernetes' client here: the daemon fills it from one watch
on its node, the fleet simulator from its shared watch, a test by hand. `None` where it is unknown (no API
server, `diagnose` on a laptop): checks that need it are then not applicable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping
from detector.core.quantity import whole_count

# KEP-5683 "Node Lifecycle Conditions" (alpha in Kubernetes 1.37): while one is True the node is being
# worked on on purpose, so what gpu-npd finds is not a reason to remediate it.
MAINTENANCE_CONDITIONS = ("MaintenanceInProgress", "DrainInProgress")
MAINTENANCE_ANNOTATION = "gpu-npd.io/maintenance"   # a site's own tooling may set this instead


@dataclass(frozen=True)
class NodeCondition:
    type: str
    status: str                        # "True", "False" or "Unknown"
    reason: str = ""
    message: str = ""
    since: float | None = None         # lastTransitionTime, as seconds since the epoch


@dataclass(frozen=True)
class DraDevice:
    """One device of a ResourceSlice published for this node by the NVIDIA DRA driver (gpu.nvidia.com)."""

    name: str
    pool: str = ""
    kind: str = "gpu"                  # the driver's `type` attribute: gpu, mig, ...
    uuid: str | None = None
    pci_bus_id: str | None = None
    index: int | None = None


@dataclass(frozen=True)
class NodeStatus:
    name: str
    read_at: float                                              # when it was read (time.time())
    capacity: Mapping[str, str] = field(default_factory=dict)   # resource -> quantity, as the API writes it
    allocatable: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    conditions: Mapping[str, NodeCondition] = field(default_factory=dict)   # by type
    dra_devices: tuple[DraDevice, ...] | None = None           # None: not read (DRA off, or not permitted)
    dra_error: str = ""                                         # why the ResourceSlices could not be read
    taints: tuple[str, ...] = ()                                # "key=value:Effect", as kubectl shows them
    unschedulable: bool = False                                 # cordoned

    def count(self, resource: str, allocatable: bool = True) -> int | None:
        """An extended resource's count (`nvidia.com/gpu`), None when the node does not advertise it."""
        value = (self.allocatable if allocatable else self.capacity).get(resource)
        if value is None:
            return None
        try:
            return whole_count(str(value), resource)        # a Kubernetes quantity: `8`, `8k`, `8000m`
        except ValueError:
            return None

    def maintenance(self, annotation: str = MAINTENANCE_ANNOTATION) -> str:
        """Why the node is under planned maintenance now ("" when it is not): a KEP-5683 lifecycle condition
        that is True, else the site's maintenance annotation (any value but "false" or empty)."""
        for type_ in MAINTENANCE_CONDITIONS:
            condition = self.conditions.get(type_)
            if condition is not None and condition.status == "True":
                return f"{type_}=True" + (f" ({condition.reason})" if condition.reason else "")
        value = self.annotations.get(annotation, "") if annotation else ""
        if value.strip() and value.strip().lower() != "false":
            return f"annotation {annotation}={value.strip()}"
        return ""
