"""What the node's labels and resource names say about how the NVIDIA device plugin advertises its GPUs.

The device plugin (NVIDIA/k8s-device-plugin) advertises one `nvidia.com/gpu` per GPU, except:
- time-slicing or MPS sharing: each GPU is advertised `replicas` times, under `nvidia.com/gpu` or, with
  `renameByDefault: true`, under `nvidia.com/gpu.shared` (k8s-device-plugin README, "Shared Access to
  GPUs"; gpu-operator docs, "Time-Slicing GPUs in Kubernetes"). GPU Feature Discovery says so in labels:
  `nvidia.com/gpu.replicas` (1 when not shared), `nvidia.com/gpu.sharing-strategy` (none, time-slicing,
  mps) and `nvidia.com/gpu.count` (physical GPUs) (k8s-device-plugin docs/gfd_labels.md). Real nodes:
  gpu-operator #684 (1 GPU, replicas 12: nvidia.com/gpu 12), bottlerocket #4418 (8 GPUs, MIG, replicas 4:
  nvidia.com/gpu.shared 128).
- MIG: with `migStrategy: single` every GPU is in MIG mode and `nvidia.com/gpu` counts MIG devices, not
  GPUs; with `mixed`, GPUs not in MIG mode stay `nvidia.com/gpu` and each MIG profile is its own
  resource `nvidia.com/mig-<profile>` (gpu-operator #637, where the maintainers explain it;
  gpu-feature-discovery #7). GFD labels the strategy `nvidia.com/mig.strategy`.

gpu-npd's inventory does not read MIG mode, so on a MIG node it judges only what holds whatever the
MIG layout: see `Advertising.provable_*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from detector.core.nodestatus import NodeStatus
from detector.core.quantity import whole_count

GPU = "nvidia.com/gpu"
SHARED_GPU = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
SHARING_LABEL = "nvidia.com/gpu.sharing-strategy"
COUNT_LABEL = "nvidia.com/gpu.count"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"


@dataclass(frozen=True)
class Count:
    """One resource's quantity as the node lists it, read as a whole count."""

    present: bool                 # the node lists the resource
    value: int | None             # its count; None when absent or not a whole count
    error: str = ""               # why a listed value is not a count (a person reads it)


def read_count(values: Mapping[str, str], resource: str, where: str) -> Count:
    """`values[resource]` as a Kubernetes quantity (`8`, `8k`, `1e3`, `8000m`), which must be a whole,
    non-negative number to count GPUs: `500m` is no GPU count, and saying so beats calling a GPU lost."""
    raw = values.get(resource)
    if raw is None:
        return Count(False, None)
    try:
        return Count(True, whole_count(str(raw), f"{resource} {where}"))
    except ValueError as e:
        return Count(True, None, f"{e}: not a valid GPU count, so not judged")


@dataclass(frozen=True)
class Advertising:
    """How the device plugin advertises this node's GPUs, as far as the node object tells."""

    resource: str                 # the resource that counts whole GPUs (or their replicas); "" if none
    allocatable: int | None       # that resource's allocatable count; None when not advertised or unreadable
    capacity: int | None
    replicas: int                 # advertised units per GPU (time-slicing/MPS), 1 when not shared
    replicas_known: bool          # a label or setting said so (else sharing may be unknown)
    sharing: str                  # none, time-slicing, mps, or unknown
    mig_strategy: str             # none, single, mixed, or "" when no MIG is seen
    mig_resources: dict[str, int]  # nvidia.com/mig-<profile> -> allocatable count
    # Capacity listed but no allocatable entry: kubelet offers the scheduler none of these GPUs, so the
    # allocatable count is 0 (the scheduler reads an absent resource as none).
    allocatable_missing: bool = False
    unreadable: str = ""          # why the counts cannot be judged (a quantity that is no whole count)
    notes: tuple[str, ...] = ()   # what was read but not judged (a capacity that is no whole count)

    @property
    def provable_over(self) -> bool:
        """Can "more advertised than NVML has" be proven? Not under MIG single (it counts MIG devices)."""
        return self.allocatable is not None and not self.unreadable and self.mig_strategy != "single"

    @property
    def provable_under(self) -> bool:
        """Can "fewer advertised than healthy GPUs" be proven? Not on any MIG node: GPUs in MIG mode are
        not counted in nvidia.com/gpu (mixed) or are counted as their instances (single), and which GPUs
        are in MIG mode is not known here."""
        return self.allocatable is not None and not self.unreadable and not self.mig_strategy


def advertising(status: NodeStatus, replicas_setting: int = 0) -> Advertising:
    """Read the node's resources and GFD labels. `replicas_setting` > 0 overrides the replicas label."""
    labels = status.labels
    alloc = {r: read_count(status.allocatable, r, "allocatable") for r in (GPU, SHARED_GPU)}
    cap = {r: read_count(status.capacity, r, "capacity") for r in (GPU, SHARED_GPU)}
    if not alloc[GPU].value and (alloc[SHARED_GPU].value or 0) > 0:
        resource = SHARED_GPU                                  # renameByDefault: true
    elif alloc[GPU].present or alloc[SHARED_GPU].present:
        resource = GPU if alloc[GPU].present else SHARED_GPU
    else:                       # no allocatable entry: capacity says which resource kubelet knows of
        resource = GPU if cap[GPU].present else SHARED_GPU if cap[SHARED_GPU].present else ""
    allocatable, capacity, missing, unreadable, notes = None, None, False, "", ()
    if resource:
        a, c = alloc[resource], cap[resource]
        allocatable, capacity, unreadable = a.value, c.value, a.error
        if not a.present:
            missing, allocatable, unreadable = True, 0, c.error
        elif c.error:
            notes = (c.error,)
    label_replicas = _positive_int(labels.get(REPLICAS_LABEL))
    replicas = replicas_setting if replicas_setting > 0 else (label_replicas or 1)
    known = replicas_setting > 0 or label_replicas is not None
    sharing = labels.get(SHARING_LABEL) or ("none" if known and replicas == 1 else
                                              "time-slicing" if known else "unknown")
    mig = {name: read_count(status.allocatable, name, "allocatable").value or 0
           for name in status.allocatable if name.startswith(MIG_PREFIX)}
    strategy = labels.get(MIG_STRATEGY_LABEL, "")
    if strategy == "none":
        strategy = ""
    if mig and not strategy:
        strategy = "mixed"                  # per-profile resources exist only under the mixed strategy
    return Advertising(resource, allocatable, capacity, replicas, known, sharing, strategy, mig, missing,
                       unreadable, notes)


def has_nvidia_resources(status: NodeStatus) -> bool:
    """Does anything of NVIDIA's advertise here (a device plugin ran on this node at some point)?"""
    return any(name.startswith("nvidia.com/") for name in (*status.capacity, *status.allocatable))


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(str(value))
    except ValueError:
        return None
    return number if number > 0 else None
