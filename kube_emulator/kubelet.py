"""What a kubelet writes, for tests and demos that need a node without one: the Node it registers, its
heartbeat Lease, and the status changes a device plugin's registration or a condition update make."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

from kube_emulator.values import clone

NODE_LEASE_NAMESPACE = "kube-node-lease"


def registered_node(name: str, now: str, labels: Mapping[str, str] | None = None,
                    capacity: Mapping[str, str] | None = None, conditions: Sequence[dict] | None = None) -> dict:
    """A node as a kubelet registers it: Ready, no pressure, heartbeats `now` (RFC 3339)."""
    resources = {"cpu": "8", "ephemeral-storage": "100Gi", "memory": "32Gi", "pods": "110", **(capacity or {})}
    conds = [dict(c) for c in conditions] if conditions is not None else [
        _condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        _condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        _condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        _condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
    ]
    for cond in conds:
        cond.setdefault("lastHeartbeatTime", now)
        cond.setdefault("lastTransitionTime", now)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
                                              "kubernetes.io/os": "linux", **(labels or {})}},
        "spec": {},
        "status": {
            "capacity": dict(resources), "allocatable": dict(resources), "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": _internal_ip(name)},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"architecture": "amd64", "bootID": "", "containerRuntimeVersion": "containerd://1.7.20",
                         "kernelVersion": "6.8.0-45-generic", "kubeProxyVersion": "v1.31.0",
                         "kubeletVersion": "v1.31.0", "machineID": "", "operatingSystem": "linux",
                         "osImage": "Ubuntu 24.04.1 LTS", "systemUUID": ""},
        },
    }


def node_lease(node: dict, now: float) -> dict:
    """The kubelet's heartbeat Lease (kube-node-lease/<node>), which `kubectl describe node` shows."""
    meta = node["metadata"]
    renewed = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + ".000000Z"
    return {"metadata": {"name": meta["name"], "namespace": NODE_LEASE_NAMESPACE,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": meta["name"],
                                              "uid": meta["uid"]}]},
            "spec": {"holderIdentity": meta["name"], "leaseDurationSeconds": 40, "renewTime": renewed}}


def with_resources(capacity: Mapping[str, str], allocatable: Mapping[str, str]) -> Callable[[dict], dict]:
    """What a device plugin's registration makes kubelet write: extended resources merged into the
    node's status.capacity and status.allocatable (the other resources are left as they are)."""
    def build(current: dict) -> dict:
        node = clone(current)
        status = node.setdefault("status", {})
        status["capacity"] = {**(status.get("capacity") or {}), **capacity}
        status["allocatable"] = {**(status.get("allocatable") or {}), **allocatable}
        return node
    return build


def with_condition(condition: dict, now: str) -> Callable[[dict], dict]:
    """One condition added or updated by type, as the kubelet does: heartbeat `now`, transition time
    moved only when the status changes."""
    def build(current: dict) -> dict:
        node = clone(current)
        conds = node.setdefault("status", {}).setdefault("conditions", [])
        old = next((c for c in conds if c.get("type") == condition["type"]), None)
        new = {**(old or {}), **condition}
        if "lastHeartbeatTime" not in condition:
            new["lastHeartbeatTime"] = now
        if "lastTransitionTime" not in condition and (old is None or old.get("status") != new.get("status")):
            new["lastTransitionTime"] = now
        if old is None:
            conds.append(new)
        else:
            conds[conds.index(old)] = new
        return node
    return build


def _condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _internal_ip(name: str) -> str:
    h = sum(name.encode()) * 2654435761 % (254 * 254)
    return f"10.0.{h // 254}.{h % 254 + 1}"
