"""Compare what the scheduler is told (device plugin counts, DRA devices) with the GPUs NVML sees.

Two directions, judged differently because their costs differ:
- more advertised than NVML has (critical): pods are sent to GPUs that are not there and fail at
  admission or start, while the node stays Ready (pytorch/ci-infra #1058: 554 pods rejected in 1h46m by
  one node with a lost GPU whose allocatable stayed full; NVIDIA/NVSentinel #1424, #1899).
- fewer advertised than healthy GPUs (warning): capacity is lost, nothing breaks; most often the device
  plugin needs a restart (k8s-device-plugin #58, #1228, #1645: allocatable stuck at 0).
A GPU the device plugin stopped advertising because it failed or degraded is not a mismatch: the
plugin did its job (it marks a GPU unhealthy on any critical XID but 13, 31, 43, 45 and 68:
k8s-device-plugin internal/rm/health.go). `allocatable` is what the scheduler uses; `capacity` keeps
counting an unhealthy GPU by design ("Capacity: total; Allocatable: healthy", k8s-device-plugin #58), so
it is reported, never judged, except that capacity without any allocatable entry means kubelet offers the
scheduler none of the GPUs (allocatable 0). Counts are Kubernetes quantities (`8`, `8k`, `1e3`,
`8000m`); one that is no whole number (`500m`) is not a GPU count: nothing is judged on it, and `why`
says so.

A GPU "NVML sees" is one it enumerates and answers for (its UUID could be read): a GPU that fell off the
bus is still counted by nvmlDeviceGetCount but answers GPU_IS_LOST, and a pod sent to it fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from detector.checks.allocatable.resources import Advertising
from detector.core.gpu_health import HEALTHY, GpuHealth, gpu_key
from detector.core.nodestatus import DraDevice
from detector.core.types import GpuRef

DRA_DRIVER = "gpu.nvidia.com"


@dataclass(frozen=True)
class Gpus:
    """The node's GPUs as the comparison needs them."""

    seen: tuple[GpuRef, ...]          # NVML enumerates them and answers for them
    healthy: tuple[GpuRef, ...]       # seen and healthy (no warning or critical problem names them)
    lost: tuple[GpuRef, ...]          # known (health) but not seen: NVML lost them or no longer lists them


def gpus(visible: Sequence[GpuRef], health: Sequence[GpuHealth]) -> Gpus:
    seen = tuple(r for r in visible if r.uuid)
    state = {gpu_key(h.gpu): h.state for h in health}
    healthy = tuple(r for r in seen if state.get(gpu_key(r), HEALTHY) == HEALTHY)
    lost = tuple(h.gpu for h in health if not any(_same(h.gpu, r) for r in seen))
    return Gpus(seen, healthy, lost)


@dataclass(frozen=True)
class Verdict:
    """One source's comparison: the device plugin's resource, or the DRA driver's devices."""

    source: str                       # device-plugin or dra
    resource: str                     # nvidia.com/gpu, nvidia.com/gpu.shared, gpu.nvidia.com
    advertised: int
    capacity: int | None
    expected_max: int                 # what NVML's GPUs allow at most (seen x replicas)
    expected_min: int                 # what the healthy ones call for at least
    over: bool                        # more advertised than NVML has: critical
    under: bool                       # fewer advertised than healthy GPUs: warning
    differ: str                       # the GPUs that differ, named
    note: str = ""                    # what could not be judged, and why
    judged: bool = True               # False: the counts could not be read, so nothing was compared


def device_plugin(ad: Advertising, node: Gpus) -> Verdict:
    advertised = ad.allocatable or 0
    most, least = len(node.seen) * ad.replicas, len(node.healthy) * ad.replicas
    over = ad.provable_over and advertised > most
    notes = [n for n in (ad.unreadable, *ad.notes) if n]
    if over and not ad.replicas_known and node.seen and advertised % len(node.seen) == 0:
        # Whole multiples of the GPUs NVML sees, and no GFD label or setting saying how the GPUs are
        # shared: time-slicing without GPU Feature Discovery looks exactly like this (gpu-operator #684).
        over = False
        notes.append(f"{advertised} is {advertised // len(node.seen)} per GPU: shared GPUs (time-slicing) "
                     "without a nvidia.com/gpu.replicas label or the replicas setting, so not judged")
    if ad.mig_strategy == "single":
        notes.append("MIG single strategy: nvidia.com/gpu counts MIG devices, which NVML's GPU list does not "
                     "show, so the count is not judged")
    elif ad.mig_strategy:
        notes.append("MIG mixed strategy: GPUs in MIG mode are advertised as nvidia.com/mig-* and gpu-npd "
                     "does not know which GPUs are, so only more advertised than NVML sees is judged")
    under = ad.provable_under and advertised < least
    if over:
        differ = _lost(node)
    elif under and ad.allocatable_missing:
        differ = (f"capacity {ad.capacity} but no {ad.resource} allocatable at all: the scheduler is offered "
                  f"none of the {len(node.healthy)} healthy GPUs")
    elif under:
        differ = (f"{len(node.healthy)} healthy GPUs, {_times(advertised, ad.replicas)} advertised; which ones "
                  "the device plugin dropped is not in the node object")
    else:
        differ = ""
    return Verdict("device-plugin", ad.resource, advertised, ad.capacity, most, least, over, under, differ,
                   "; ".join(notes), judged=not ad.unreadable)


def dra(devices: Sequence[DraDevice], node: Gpus) -> Verdict:
    """Devices of kind gpu, matched to NVML's GPUs by UUID, else by bus id."""
    whole = [d for d in devices if d.kind == "gpu"]
    unseen = [d for d in whole if (d.uuid or d.pci_bus_id) and not any(_published(d, r) for r in node.seen)]
    unpublished = [r for r in node.healthy if not any(_published(d, r) for d in whole)]
    partitions = len(devices) - len(whole)
    note = ""
    if partitions:
        # A GPU in MIG mode may be published as its MIG devices only: not publishing it whole is no fault.
        unpublished, note = [], (f"{partitions} devices of other kinds (MIG): healthy GPUs without a gpu device "
                                 "are not judged")
    parts = []
    if unseen:
        parts.append("published but not seen by NVML: " + ", ".join(_device(d) for d in unseen))
    if unpublished:
        parts.append("healthy but not published: " + ", ".join(r.label() for r in unpublished))
    return Verdict("dra", DRA_DRIVER, len(whole), None, len(node.seen), len(node.healthy), bool(unseen),
                   bool(unpublished), "; ".join(parts), note)


def _lost(node: Gpus) -> str:
    if not node.lost:
        return "NVML lists no lost GPU: the device plugin advertises GPUs this node never had"
    return "GPUs NVML no longer sees: " + ", ".join(r.label() for r in node.lost)


def _times(advertised: int, replicas: int) -> str:
    return f"{advertised} ({advertised / replicas:g} GPUs x {replicas} replicas)" if replicas > 1 else str(advertised)


def _device(d: DraDevice) -> str:
    return f"{d.name} ({d.uuid or d.pci_bus_id})"


def _published(d: DraDevice, ref: GpuRef) -> bool:
    return bool((d.uuid and d.uuid == ref.uuid) or (d.pci_bus_id and d.pci_bus_id == ref.pci_bus_id))


def _same(a: GpuRef, b: GpuRef) -> bool:
    return bool((a.pci_bus_id and a.pci_bus_id == b.pci_bus_id) or (a.uuid and a.uuid == b.uuid))

