"""Faults a fake node can suffer. Each fault changes the node's one state, so NVML, nvidia-smi,
the PCI bus and the kernel log all tell the same story.

The catalogue (FAULT_KINDS) is built from the kinds each fake module declares it applies (its FAULTS,
fake_nvml/fault_kind.py). This module applies the basic GPU and node faults itself, and `recover` and
`reboot`, which heal every module's state through its `heal`."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from fake_nvml import (
    device_plugin,
    driver_lines,
    imex,
    infiniband,
    nvml_latency,
    nvml_memory,
    nvml_nvlink,
    nvml_thermal,
    pci,
    system,
)
from fake_nvml.fault_kind import FaultArgs, FaultKind, set_field
from fake_nvml.node import FakeGpu, FakeNode, NodeState

# What the driver prints for the XIDs whose text a test is likely to look at.
XID_TEXT: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_3456a000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    43: "Ch 00000008",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 0.",
    63: "Row Remapper: New row (0x0000000000012345) was marked for remapping, reset gpu to activate.",
    64: "Row Remapper Error: row (0x0000000000012345) remapping failed",
    74: "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate detected",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    109: "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL).",
}


@dataclass(frozen=True)
class Fault:
    kind: str
    gpu: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = FAULT_KINDS.get(self.kind)
        if spec is None:
            raise ValueError(f"unknown fault kind {self.kind!r} (known: {', '.join(sorted(FAULT_KINDS))})")
        if spec.needs_gpu and self.gpu is None:
            raise ValueError(f"fault {self.kind!r} needs a 'gpu'")
        for key, value in self.params.items():
            want = spec.params.get(key)
            if want is None:
                known = ", ".join(sorted(spec.params)) or "none"
                raise ValueError(f"fault {self.kind!r} takes no parameter {key!r} (it takes: {known})")
            if not isinstance(value, want) or isinstance(value, bool) and want is not bool:
                if not (want is float and isinstance(value, int) and not isinstance(value, bool)):
                    raise ValueError(f"fault {self.kind!r}: {key} must be {want.__name__}, got {value!r}")
        if self.kind == "xid" and self.params.get("via", "both") not in ("both", "kernel", "nvml"):
            raise ValueError("fault 'xid': via must be both, kernel or nvml")
        for key in spec.required:
            if key not in self.params:
                raise ValueError(f"fault {self.kind!r} needs parameter {key!r}")

    def apply(self, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
        FAULT_KINDS[self.kind].apply(self, state, gpu, node)

    def describe(self) -> str:
        where = f" on GPU {self.gpu}" if self.gpu is not None else ""
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.kind}{where}" + (f" ({args})" if args else "")


def xid_line(gpu: FakeGpu, code: int, message: str | None, pid: int | None) -> str:
    domain, bus, dev_fn = gpu.pci_bus_id.split(":")
    text = message or XID_TEXT.get(code, "Graphics Exception")
    if 144 <= code <= 150 and not pid:
        # NVLink5 lines name no process: `149, NETIR_LINK_DOWN Fatal XC0 i0 Link 14 (0x025001c6 ...)`
        return f"NVRM: Xid (PCI:{domain}:{bus}:{dev_fn.split('.')[0]}): {code}, {text}"
    who = f"pid={pid}, name=python3" if pid else "pid='<unknown>', name=<unknown>"
    return f"NVRM: Xid (PCI:{domain}:{bus}:{dev_fn.split('.')[0]}): {code}, {who}, {text}"


def _xid(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    code = f.params["code"]
    via = f.params.get("via", "both")
    if via in ("both", "kernel"):
        node.log_kernel(xid_line(gpu, code, f.params.get("message"), f.params.get("pid")))
    if via in ("both", "nvml"):
        node.emit_xid(gpu, code)
        device_plugin.on_xid(state, gpu, code)      # the device plugin listens to NVML's XID events
    if code == 79:
        gpu.lost = True          # from now on the driver answers GPU_IS_LOST for this GPU
    if code in (48, 95):
        gpu.ecc_uncorrected += 1
    if code == 63:
        gpu.remapped_uncorrected += 1
        gpu.remap_pending = True
    if code == 64:
        gpu.remap_failure = True


# A degraded link is a fault where it shows: under load. At idle NVIDIA lets the width and generation drop
# by design ("may be reduced when the GPU is not in use"), so the detector judges a link only while the GPU
# works, and a link fault puts the GPU to work unless told otherwise (utilization 0: narrow at idle, no fault).
_PCIE_LOAD_PCT = 90


def _pcie(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.pcie_width = f.params.get("width", gpu.pcie_width)
    gpu.pcie_gen = f.params.get("gen", gpu.pcie_gen)
    if "utilization" in f.params:
        gpu.utilization_pct = f.params["utilization"]
    elif gpu.pcie_width < gpu.pcie_max_width or gpu.pcie_gen < gpu.pcie_max_gen:
        gpu.utilization_pct = max(gpu.utilization_pct, _PCIE_LOAD_PCT)


def _nvlink_down(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    link = f.params["link"]
    if link not in gpu.nvlinks_down:
        gpu.nvlinks_down.append(link)
    state.nccl_busbw_factor = min(state.nccl_busbw_factor, 0.5)


def _ecc(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.ecc_corrected += f.params.get("corrected", 0)
    gpu.ecc_uncorrected += f.params.get("uncorrected", 0)


def _busy(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.utilization_pct = f.params.get("utilization", 100)
    gpu.processes = [(f.params.get("pid", 4242), f.params.get("memory_mib", 1024))]
    gpu.memory_used_mib = sum(m for _, m in gpu.processes)


def _idle(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.utilization_pct, gpu.processes, gpu.memory_used_mib = 0, [], 0


def _kernel_line(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    node.log_kernel(f.params["message"], f.params.get("priority", 4))


# The fake modules that keep a check's own state: each declares the fault kinds it applies (its FAULTS) and
# heals its state on `recover` (a GPU reset, or with no GPU a node repair) and `reboot` (its `heal`), in this order.
_MODULES = (
    nvml_memory,       # the memory check: ECC, row remapping, retired pages
    nvml_thermal,      # the thermal check: throttling, power, memory temperature
    system,            # the driver check: kernel modules, device files, recovery actions
    nvml_nvlink,       # the nvlink and fabric checks
    infiniband,        # the infiniband check
    device_plugin,     # the allocatable check
    pci,               # the pcie check's replay counter
    nvml_latency,      # the visibility check's latency: a GPU whose NVML calls are slow
    driver_lines,      # the xid check's driver lines without an Xid: RM init, GSP timeout, PCIe AER, peermem
    imex,              # the imex check: the IMEX daemon and its peers
)


def _recover(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """A GPU reset (with a gpu) or a node repair (without): back to the healthy baseline."""
    gpus = [gpu] if gpu is not None else state.gpus
    for g in gpus:
        g.lost, g.nvml_visible, g.nvml_hang_s = False, True, 0.0
        g.pcie_gen, g.pcie_width = g.pcie_max_gen, g.pcie_max_width
        g.nvlinks_down = []
        g.remap_pending = False
    if gpu is None:
        state.driver_loaded, state.smi_hang_s, state.nccl_busbw_factor = True, 0.0, 1.0
        state.nccl_hang_s, state.nccl_wrong = 0.0, 0
    for module in _MODULES:        # each check's fake state heals its own way
        module.heal(state, gpus, gpu is None)


def _gpu_reset(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`nvidia-smi -r` went through (fake_nvml/smi.py checked it may): the GPU is back to its healthy
    baseline as by `recover`, unless its fault is one a reset does not cure (reset_cures false)."""
    assert gpu is not None
    if gpu.reset_cures:
        _recover(f, state, gpu, node)


def _holder(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """A process holds the GPU without working on it (a monitoring client, a stuck job): no utilization."""
    assert gpu is not None
    gpu.processes = [(f.params.get("pid", 4242), f.params.get("memory_mib", 512))]
    gpu.memory_used_mib = sum(m for _, m in gpu.processes)


def _reboot(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """Repaired as by `recover`, then booted afresh, so the driver's load lines follow the repair."""
    _recover(f, state, None, node)
    node.reboot()


# The kinds this module applies: what NVML, nvidia-smi, the PCI bus, NCCL and the kernel log show of a GPU and
# its node, and the repairs.
FAULTS: tuple[FaultKind, ...] = (
    FaultKind("xid", True, {"code": int, "message": str, "pid": int, "via": str}, ("code",), _xid,
              "an XID: kernel log line and NVML event (via: both, kernel or nvml); 79 also makes the GPU lost"),
    FaultKind("pcie", True, {"width": int, "gen": int, "utilization": int}, (), _pcie,
              "the PCIe link retrains at this width and/or generation, seen under load: the GPU works at "
              "utilization % (default 90 for a degraded link; 0: a link narrowed at idle, which is no fault)"),
    FaultKind("nvml_invisible", True, {}, (), set_field("nvml_visible", None, False),
              "on the PCI bus, but NVML and nvidia-smi do not enumerate it"),
    FaultKind("lost", True, {}, (), set_field("lost", None, True),
              "NVML answers GPU_IS_LOST for it, with no kernel line"),
    FaultKind("nvml_hang", True, {"seconds": float}, ("seconds",), set_field("nvml_hang_s", "seconds"),
              "NVML calls on this GPU block for this long"),
    FaultKind("smi_hang", False, {"seconds": float}, ("seconds",), set_field("smi_hang_s", "seconds"),
              "nvidia-smi blocks for this long"),
    FaultKind("driver_unloaded", False, {}, (), set_field("driver_loaded", None, False),
              "the kernel driver is gone: nvmlInit fails, nvidia-smi cannot talk to it"),
    FaultKind("nvlink_down", True, {"link": int}, ("link",), _nvlink_down,
              "one NVLink goes inactive (NCCL bandwidth halves)"),
    FaultKind("ecc", True, {"corrected": int, "uncorrected": int}, (), _ecc,
              "add to the volatile ECC error counters"),
    FaultKind("temperature", True, {"celsius": int}, ("celsius",), set_field("temperature_c", "celsius"),
              "the GPU's temperature"),
    FaultKind("busy", True, {"utilization": int, "pid": int, "memory_mib": int}, (), _busy,
              "a compute process runs on the GPU"),
    FaultKind("idle", True, {}, (), _idle, "no process on the GPU"),
    FaultKind("nccl_degraded", False, {"factor": float}, ("factor",), set_field("nccl_busbw_factor", "factor"),
              "NCCL all-reduce bus bandwidth scaled by this factor"),
    FaultKind("nccl_hang", False, {"seconds": float}, ("seconds",), set_field("nccl_hang_s", "seconds"),
              "the NCCL probe hangs this long (a wedged collective)"),
    FaultKind("nccl_wrong", False, {"count": int}, ("count",), set_field("nccl_wrong", "count"),
              "an all-reduce returns this many wrong elements (silent data corruption)"),
    FaultKind("kernel_line", False, {"message": str, "priority": int}, ("message",), _kernel_line,
              "an arbitrary kernel log line (SXid lines, noise)"),
    FaultKind("vbios", True, {"version": str}, ("version",), set_field("vbios_version", "version"),
              "the GPU's VBIOS is updated to this version (NVML reports it from now on)"),
    FaultKind("recover", False, {}, (), _recover,
              "reset a GPU (with gpu) or repair the node (without) back to healthy"),
    FaultKind("gpu_reset", True, {}, (), _gpu_reset,
              "what `nvidia-smi -r` does to the GPU it reset: back to healthy unless reset_uncured"),
    FaultKind("reset_uncured", True, {}, (), set_field("reset_cures", None, False),
              "the GPU's faults are ones a GPU reset does not cure: a reset goes through and changes nothing"),
    FaultKind("reset_unsupported", False, {}, (), set_field("reset_unsupported", None, True),
              "the platform refuses GPU resets (nvidia-smi -r: not supported), as a VM whose hypervisor blocks FLR"),
    FaultKind("process_holds", True, {"pid": int, "memory_mib": int}, (), _holder,
              "a process holds the GPU (NVML lists it) without load: a reset is refused while it is there"),
    FaultKind("persistence", True, {"on": bool}, ("on",), set_field("persistence_mode", "on"),
              "persistence mode set on or off (nvidia-smi -pm)"),
    FaultKind("reboot", False, {}, (), _reboot,
              "the node reboots: a new boot id, a kernel log started afresh, the driver loaded, every GPU healthy"),
)

# Every fault kind by name: read-only, built once from the modules' declarations, shared by every fake node.
FAULT_KINDS: Mapping[str, FaultKind] = MappingProxyType(
    {k.name: k for k in (*FAULTS, *(kind for m in _MODULES for kind in m.FAULTS))})
