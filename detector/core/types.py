"""The small problem API shared by checks, rules and reporters.

Checks emit Observations (neutral facts). Rules turn them into Problems (what the facts mean).
Reporters (terminal, JSON, Kubernetes, Prometheus) only ever see Problems.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


# Recommended actions: NVIDIA's XID catalogue buckets, plus what an operator needs beyond them.
ACTIONS: dict[str, str] = {
    "NONE": "no action needed",
    "IGNORE": "no action needed; informational",
    "RESTART_APP": "restart the application that used the GPU",
    "RESET_GPU": "stop the GPU's workloads and reset it with nvidia-smi -r, or reboot the node",
    "RESTART_BM": "drain the node and reboot it; power-cycle it if the GPU does not come back",
    "RESTART_VM": "drain the node and restart the VM",
    "CHECK_MECHANICALS": "drain the node and check the GPU's power cables and seating",
    "CHECK_UVM": "check the UVM driver and the application's memory use",
    "UPDATE_SWFW": "update the GPU driver, vGPU software and firmware to versions supported together",
    "DRAIN_P2P": "stop peer-to-peer GPU traffic (and UVM persistence), then check the GPU again",
    "DRAIN_AND_RESET": "drain the GPU's workloads, then reset it with nvidia-smi -r",
    "CHECK_DRIVER": "check that the NVIDIA driver is installed, loaded and matches its user-space libraries",
    "RESTART_DEVICE_PLUGIN": "restart the NVIDIA device plugin (or DRA driver) pod on the node, so that what the "
                             "scheduler is told matches the GPUs again",
    "RESTART_IMEX": "restart the node's IMEX daemon (systemctl restart nvidia-imex, or delete the ComputeDomain's "
                    "IMEX daemon pod on the node) and check its nodes config and peers; not a reboot",
    "INSPECT": "look at the node: the detector could not tell what is wrong",
    "CHECK_NVLINK": "drain the node and check NVLink and NVSwitch health (nvidia-smi nvlink -s, the fabric "
                    "manager's log); reboot, and open a hardware case if it persists",
    "CHECK_PCIE": "drain the node and check the GPUs' PCIe links (width, generation, AER errors) and ACS "
                  "settings; reseat or replace risers if a reboot does not help",
    "CHECK_COOLING": "check the node's cooling (fans, airflow, inlet temperature, liquid-cooling flow) and the "
                     "GPU's power delivery; drain the node if the GPU keeps slowing down",
    "CHECK_NETWORK": "check the InfiniBand/RoCE port (cable, transceiver, switch port: ibstat, the switch's "
                     "counters); NCCL traffic over it is slow or failing",
    "CONTACT_SUPPORT": "drain the node and open a hardware case with the vendor",
    "REPLACE_GPU": "stop scheduling on the GPU and replace it: open an RMA with the vendor, quoting its serial",
}


# How much an action asks of an operator, most first: when problems share a condition, the one demanding
# the most leads its reason and message (then the more severe, then the more recent).
ACTION_ORDER = ("REPLACE_GPU", "CONTACT_SUPPORT", "RESTART_BM", "CHECK_MECHANICALS", "RESTART_VM", "DRAIN_AND_RESET",
                "RESET_GPU", "CHECK_NVLINK", "CHECK_PCIE", "CHECK_NETWORK", "CHECK_COOLING", "DRAIN_P2P", "UPDATE_SWFW", "CHECK_DRIVER",
                "RESTART_DEVICE_PLUGIN", "RESTART_IMEX", "CHECK_UVM", "RESTART_APP", "INSPECT", "IGNORE", "NONE")


def action_strength(action: str) -> int:
    """Larger for actions that demand more (an unknown action counts as INSPECT)."""
    return len(ACTION_ORDER) - ACTION_ORDER.index(action if action in ACTION_ORDER else "INSPECT")


@dataclass(frozen=True)
class GpuRef:
    """Which GPU something is about, as far as it is known."""

    index: int | None
    uuid: str | None = None
    pci_bus_id: str | None = None

    def label(self) -> str:
        ids = ", ".join(x for x in (self.uuid, self.pci_bus_id) if x)
        if self.index is None and not ids:
            return "GPU (unnamed: its bus id was not in the log)"
        name = f"GPU {self.index}" if self.index is not None else "GPU"
        return f"{name} ({ids})" if ids else name

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id}


@dataclass(frozen=True)
class Observation:
    """A fact one check saw, about the node (gpu=None) or one GPU."""

    check: str
    fields: Mapping[str, Any]
    gpu: GpuRef | None = None
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Problem:
    """What a rule concluded: a condition to set on the node, or an event to record."""

    rule: str
    check: str
    type: str                 # the NodeCondition type (or the event's problem type)
    reason: str
    message: str
    severity: Severity
    action: str
    report: str               # "condition" or "event"
    gpus: tuple[GpuRef, ...] = ()
    time: float = field(default_factory=time.time)
    occurrences: int = 1      # how many times it happened in this run (identical XID lines add up)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule, "check": self.check, "type": self.type, "reason": self.reason,
            "message": self.message, "severity": self.severity.value, "action": self.action,
            "report": self.report,
            "gpus": [g.index for g in self.gpus if g.index is not None],
            "gpu_details": [g.to_dict() for g in self.gpus],
        }
