"""The allocatable check: what the scheduler is told of this node's GPUs matches what NVML sees.

A node check, judged after every sweep and again whenever the node object changes (the daemon's watch on
its node calls NodeAgent.kick_node_checks). It reads NodeView.node_status (the node's capacity,
allocatable, GFD labels and the gpu.nvidia.com ResourceSlice devices), never the API itself, and leaves
the verdicts to rules/allocatable.yaml. How the counts are compared: judge.py; how resource names and
labels are read (time-slicing, MIG): resources.py.

Nothing is judged
- without a NodeStatus (no API server: `diagnose` on a laptop), on a node with no nvidia.com/* resource
  and no DRA device (no device plugin, no DRA driver), on a DRA-only node (nvidia.com/gpu 0 or absent
  by design while the DRA driver publishes GPUs): `not_applicable`;
- within `settle` seconds of the node's boot or the agent's start, whichever is later: the device plugin
  registers only after the driver (a driver container builds and loads its modules first) and kubelet,
  and until then allocatable reads 0 or the count of the boot before.
"""

from __future__ import annotations

from typing import Any

from detector.checks.allocatable.judge import Verdict, device_plugin, dra, gpus
from detector.checks.allocatable.resources import advertising, has_nvidia_resources
from detector.core.check import CheckOutput, ConfigField
from detector.core.nodecheck import NodeCheck, NodeView
from detector.core.types import Observation

# Kubernetes' own GPU end-to-end test gives a fresh GPU node 600 s to advertise nvidia.com/gpu before it
# fails ("nvidia GPUs not available on Node ... Timed out after 600s": kubernetes/kubernetes #93187,
# #138650): the driver install, the container toolkit and the device plugin's registration come in turn.
SETTLE_S = 600.0


class AllocatableCheck(NodeCheck):
    name = "allocatable"
    description = ("what the scheduler is told of the GPUs (nvidia.com/gpu allocatable with time-slicing and "
                   "MIG resources, and gpu.nvidia.com DRA devices) matches the GPUs NVML sees and their health")
    # Judged from the first sweep on: it needs the inventory and the node object, not the other checks'
    # verdicts (a GPU failed by a check judged later is still counted as NVML sees it, never as missing).
    needs_all_checks = False
    fields = {
        "source": "what is compared: device-plugin (an extended resource) or dra (ResourceSlice devices); "
                  "empty when nothing is",
        "not_applicable": "true when there is nothing to compare: no node object (no API server), no device "
                          "plugin and no DRA driver, or a DRA-only node's device plugin resource",
        "settling": "true within `settle` seconds of the node's boot or the agent's start (nothing is judged)",
        "why": "why nothing is judged (not_applicable or settling), or what could not be judged",
        "resource": "the resource compared: nvidia.com/gpu, nvidia.com/gpu.shared, or the DRA driver gpu.nvidia.com",
        "advertised": "the resource's allocatable count, or the DRA devices of kind gpu",
        "capacity": "the resource's capacity (-1 when not advertised); it keeps counting unhealthy GPUs by design",
        "replicas": "advertised units per GPU (time-slicing or MPS replicas; 1 when not shared)",
        "nvml_gpus": "GPUs NVML enumerates and answers for",
        "healthy_gpus": "of those, the healthy ones (no problem names them)",
        "expected_max": "the most that may be advertised: nvml_gpus x replicas",
        "expected_min": "the least that should be: healthy_gpus x replicas",
        "over": "more advertised than NVML's GPUs allow: pods will be sent to GPUs that are not there",
        "under": "fewer advertised than the healthy GPUs call for: capacity lost",
        "differ": "the GPUs that differ, named",
        "mig_strategy": "none, single or mixed (nvidia.com/mig.strategy, or mixed when nvidia.com/mig-* resources exist)",
    }
    config_fields = {
        "settle": ConfigField(float, SETTLE_S, "seconds after the node boots or the agent starts (the later) during "
                              "which nothing is judged: the device plugin registers after the driver and kubelet, "
                              "and Kubernetes' GPU e2e test allows a fresh node 600 s for it"),
        "replicas": ConfigField(int, 0, "advertised units per GPU when GPUs are shared (time-slicing/MPS); 0: from "
                                "the GFD label nvidia.com/gpu.replicas, else 1"),
    }

    def judge(self, view: NodeView) -> CheckOutput:
        why = self._not_applicable(view)
        if why:
            return _only(view, {"not_applicable": True, "why": why}, f"not applicable: {why}")
        left = self._settle_left(view)
        if left > 0:
            why = f"settling: {left:.0f}s more after the node's boot or gpu-npd's start"
            return _only(view, {"settling": True, "why": why}, why)
        status = view.node_status
        assert status is not None
        node = gpus(view.visible, view.health)
        devices = status.dra_devices or ()
        ad = advertising(status, self.config["replicas"])
        verdicts: list[Verdict] = []
        dra_only = bool(devices) and not ad.allocatable
        if has_nvidia_resources(status) and not dra_only:
            verdicts.append(device_plugin(ad, node))
        if devices:
            verdicts.append(dra(devices, node))
        observations = [Observation(self.name, _fields(v, node, ad.replicas if v.source == "device-plugin" else 1,
                                                       ad.mig_strategy or "none"), time=view.now)
                        for v in verdicts]
        return CheckOutput(observations, summary="; ".join(_summary(v) for v in verdicts))

    def _not_applicable(self, view: NodeView) -> str:
        status = view.node_status
        if status is None:
            return "what the cluster says of the node is unknown (no API server)"
        if not has_nvidia_resources(status) and not status.dra_devices:
            return "no nvidia.com/* resource and no gpu.nvidia.com DRA device: no device plugin or DRA driver"
        return ""

    def _settle_left(self, view: NodeView) -> float:
        since = [s for s in (view.uptime_s, view.agent_age_s) if s is not None]
        return self.config["settle"] - min(since) if since else 0.0


def _fields(v: Verdict, node: Any, replicas: int, mig: str) -> dict[str, Any]:
    return {**_EMPTY, "source": v.source, "resource": v.resource, "advertised": v.advertised,
            "capacity": -1 if v.capacity is None else v.capacity, "replicas": replicas,
            "nvml_gpus": len(node.seen), "healthy_gpus": len(node.healthy), "expected_max": v.expected_max,
            "expected_min": v.expected_min, "over": v.over, "under": v.under, "differ": v.differ, "why": v.note,
            "mig_strategy": mig}


_EMPTY: dict[str, Any] = {"source": "", "not_applicable": False, "settling": False, "why": "", "resource": "",
                          "advertised": 0, "capacity": -1, "replicas": 1, "nvml_gpus": 0, "healthy_gpus": 0,
                          "expected_max": 0, "expected_min": 0, "over": False, "under": False, "differ": "",
                          "mig_strategy": "none"}


def _only(view: NodeView, fields: dict[str, Any], summary: str) -> CheckOutput:
    return CheckOutput([Observation(AllocatableCheck.name, {**_EMPTY, **fields}, time=view.now)], summary=summary)


def _summary(v: Verdict) -> str:
    if not v.judged:
        return f"{v.resource}: not judged: {v.note}"
    state = "MORE than NVML sees" if v.over else "fewer than healthy" if v.under else "matches"
    return f"{v.resource}: {v.advertised} advertised, NVML sees {v.expected_max} (healthy {v.expected_min}): {state}"
