"""Faults a fake node can suffer. Each fault changes the node's one state, so NVML, nvidia-smi,
the PCI bus and the kernel log all tell the same story."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from fake_nvml import device_plugin

if TYPE_CHECKING:
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


# What `recover` (a GPU reset, or with no GPU a node repair) and `reboot` do to the state the newer checks
# keep: fn(state, the GPUs recovered, whole_node). Each check's fake state adds its own (below).
RECOVERY_HOOKS: list[Callable[["NodeState", "list[FakeGpu]", bool], None]] = []


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault: which parameters it takes and what it does to the node."""

    name: str
    needs_gpu: bool
    params: dict[str, type]            # optional parameters and their types
    required: tuple[str, ...]
    apply: Callable[["Fault", "NodeState", "FakeGpu | None", "FakeNode"], None]
    help: str


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

    def apply(self, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
        FAULT_KINDS[self.kind].apply(self, state, gpu, node)

    def describe(self) -> str:
        where = f" on GPU {self.gpu}" if self.gpu is not None else ""
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.kind}{where}" + (f" ({args})" if args else "")


def xid_line(gpu: "FakeGpu", code: int, message: str | None, pid: int | None) -> str:
    domain, bus, dev_fn = gpu.pci_bus_id.split(":")
    who = f"pid={pid}, name=python3" if pid else "pid='<unknown>', name=<unknown>"
    text = message or XID_TEXT.get(code, "Graphics Exception")
    return f"NVRM: Xid (PCI:{domain}:{bus}:{dev_fn.split('.')[0]}): {code}, {who}, {text}"


def _xid(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
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


def _pcie(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.pcie_width = f.params.get("width", gpu.pcie_width)
    gpu.pcie_gen = f.params.get("gen", gpu.pcie_gen)
    if "utilization" in f.params:
        gpu.utilization_pct = f.params["utilization"]
    elif gpu.pcie_width < gpu.pcie_max_width or gpu.pcie_gen < gpu.pcie_max_gen:
        gpu.utilization_pct = max(gpu.utilization_pct, _PCIE_LOAD_PCT)


def _set(attr: str, value_param: str | None, value: Any = None):
    def apply(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
        target = gpu if gpu is not None else state
        setattr(target, attr, f.params[value_param] if value_param else value)
    return apply


def _nvlink_down(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    link = f.params["link"]
    if link not in gpu.nvlinks_down:
        gpu.nvlinks_down.append(link)
    state.nccl_busbw_factor = min(state.nccl_busbw_factor, 0.5)


def _ecc(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.ecc_corrected += f.params.get("corrected", 0)
    gpu.ecc_uncorrected += f.params.get("uncorrected", 0)


def _busy(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.utilization_pct = f.params.get("utilization", 100)
    gpu.processes = [(f.params.get("pid", 4242), f.params.get("memory_mib", 1024))]
    gpu.memory_used_mib = sum(m for _, m in gpu.processes)


def _idle(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.utilization_pct, gpu.processes, gpu.memory_used_mib = 0, [], 0


def _kernel_line(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    node.log_kernel(f.params["message"], f.params.get("priority", 4))


def _ecc_rising(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    from fake_nvml.nvml_memory import volatile_uncorrected
    now = node.elapsed_s()
    gpu.ecc_uncorrected = volatile_uncorrected(gpu, now)         # what has arrived so far stays counted
    gpu.ecc_uncorrected_per_min, gpu.ecc_rising_since_s = f.params["per_min"], now


def _remap_pending(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.remapped_uncorrected += 1
    gpu.remap_pending = True


def _retired_pages(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    assert gpu is not None
    gpu.retired_sbe += f.params.get("sbe", 0)
    gpu.retired_dbe += f.params.get("dbe", 0)
    gpu.retire_pending = f.params.get("pending", gpu.retire_pending)


def _memory_reset(state: "NodeState", gpus: "list[FakeGpu]", whole_node: bool) -> None:
    """A GPU reset or reboot: volatile ECC counts move into the aggregate ones and start again at 0, a
    rising fault stops, pending remaps and page retirements take effect. A remap failure, retired pages
    and aggregate counts stay: they live in the InfoROM."""
    for g in gpus:
        from fake_nvml.nvml_memory import volatile_uncorrected
        g.ecc_aggregate_corrected += g.ecc_corrected
        g.ecc_aggregate_uncorrected += volatile_uncorrected(g, g.ecc_rising_since_s)
        g.ecc_corrected = g.ecc_uncorrected = 0
        g.ecc_uncorrected_per_min = 0.0
        g.remap_pending = g.retire_pending = False


RECOVERY_HOOKS.append(_memory_reset)


def _recover(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
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
    for heal in RECOVERY_HOOKS:            # each check's fake state heals its own way
        heal(state, gpus, gpu is None)


def _reboot(f: Fault, state: "NodeState", gpu: "FakeGpu | None", node: "FakeNode") -> None:
    """Repaired as by `recover`, then booted afresh, so the driver's load lines follow the repair."""
    _recover(f, state, None, node)
    node.reboot()


def _in_module(module: str, name: str) -> Callable[..., None]:
    """A fault's apply (or a recovery hook) that lives in a check's own fake module, imported when first
    called: that module imports the node module, which imports this one."""
    def call(*args: Any) -> None:
        getattr(importlib.import_module(f"fake_nvml.{module}"), name)(*args)
    return call


# Faults applied by a check's own fake module, and the recovery each module does on `recover`/`reboot`:
#   nvml_thermal   thermal and power (the thermal check)
#   system         driver plumbing (the driver check)
#   nvml_nvlink    NVLink and the fabric (the nvlink and fabric checks)
#   infiniband     InfiniBand/RoCE ports (the infiniband check)
RECOVERY_HOOKS.extend(_in_module(module, "heal") for module in ("nvml_thermal", "system", "nvml_nvlink", "infiniband"))
RECOVERY_HOOKS.append(device_plugin.heal)       # the device plugin restarts with the node


def _thermal(name: str) -> Callable[..., None]:
    return _in_module("nvml_thermal", name)


def _driver(name: str) -> Callable[..., None]:
    return _in_module("system", name)


def _nvlink(name: str) -> Callable[..., None]:
    return _in_module("nvml_nvlink", name)


def _ib(name: str) -> Callable[..., None]:
    return _in_module("infiniband", name)


FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("xid", True, {"code": int, "message": str, "pid": int, "via": str}, ("code",), _xid,
              "an XID: kernel log line and NVML event (via: both, kernel or nvml); 79 also makes the GPU lost"),
    FaultKind("pcie", True, {"width": int, "gen": int, "utilization": int}, (), _pcie,
              "the PCIe link retrains at this width and/or generation, seen under load: the GPU works at "
              "utilization % (default 90 for a degraded link; 0: a link narrowed at idle, which is no fault)"),
    FaultKind("nvml_invisible", True, {}, (), _set("nvml_visible", None, False),
              "on the PCI bus, but NVML and nvidia-smi do not enumerate it"),
    FaultKind("lost", True, {}, (), _set("lost", None, True),
              "NVML answers GPU_IS_LOST for it, with no kernel line"),
    FaultKind("nvml_hang", True, {"seconds": float}, ("seconds",), _set("nvml_hang_s", "seconds"),
              "NVML calls on this GPU block for this long"),
    FaultKind("smi_hang", False, {"seconds": float}, ("seconds",), _set("smi_hang_s", "seconds"),
              "nvidia-smi blocks for this long"),
    FaultKind("driver_unloaded", False, {}, (), _set("driver_loaded", None, False),
              "the kernel driver is gone: nvmlInit fails, nvidia-smi cannot talk to it"),
    FaultKind("nvlink_down", True, {"link": int}, ("link",), _nvlink_down,
              "one NVLink goes inactive (NCCL bandwidth halves)"),
    FaultKind("ecc", True, {"corrected": int, "uncorrected": int}, (), _ecc,
              "add to the volatile ECC error counters"),
    FaultKind("temperature", True, {"celsius": int}, ("celsius",), _set("temperature_c", "celsius"),
              "the GPU's temperature"),
    FaultKind("busy", True, {"utilization": int, "pid": int, "memory_mib": int}, (), _busy,
              "a compute process runs on the GPU"),
    FaultKind("idle", True, {}, (), _idle, "no process on the GPU"),
    FaultKind("nccl_degraded", False, {"factor": float}, ("factor",), _set("nccl_busbw_factor", "factor"),
              "NCCL all-reduce bus bandwidth scaled by this factor"),
    FaultKind("nccl_hang", False, {"seconds": float}, ("seconds",), _set("nccl_hang_s", "seconds"),
              "the NCCL probe hangs this long (a wedged collective)"),
    FaultKind("nccl_wrong", False, {"count": int}, ("count",), _set("nccl_wrong", "count"),
              "an all-reduce returns this many wrong elements (silent data corruption)"),
    FaultKind("kernel_line", False, {"message": str, "priority": int}, ("message",), _kernel_line,
              "an arbitrary kernel log line (SXid lines, noise)"),
    # -- memory faults (the memory check) --
    FaultKind("ecc_rising", True, {"per_min": float}, ("per_min",), _ecc_rising,
              "volatile uncorrectable ECC errors keep arriving at this rate (per minute) until a reset"),
    FaultKind("remap_pending", True, {}, (), _remap_pending,
              "a row is remapped for an uncorrectable error and waits for a GPU reset to take effect"),
    FaultKind("remap_failure", True, {}, (), _set("remap_failure", None, True),
              "a row remapping failed (no spare rows left in the bank): persists across resets"),
    FaultKind("retired_pages", True, {"sbe": int, "dbe": int, "pending": bool}, (), _retired_pages,
              "pages retired on a pre-Ampere GPU (adds sbe/dbe; pending: one waits for a driver reload)"),
    FaultKind("ecc_disabled", True, {}, (), _set("ecc_enabled", None, False),
              "ECC turned off on an ECC-capable GPU (its counters are then unavailable)"),
    # -- driver plumbing faults (the driver check): applied and healed by fake_nvml/system.py --
    FaultKind("module_unloaded", False, {"module": str}, ("module",), _driver("module_unloaded"),
              "a kernel module is unloaded (nvidia_uvm, nvidia_modeset, nvidia_peermem ...)"),
    FaultKind("module_loaded", False, {"module": str}, ("module",), _driver("module_loaded"),
              "another kernel module is loaded (nouveau, which keeps the nvidia driver off the GPUs)"),
    FaultKind("device_file_missing", False, {"name": str}, (), _driver("device_file_missing"),
              "a /dev entry is gone: name (nvidia-uvm, nvidiactl), else the GPU's /dev/nvidiaN, else nvidia-uvm"),
    FaultKind("version_mismatch", False, {"kernel_version": str}, (), _driver("version_mismatch"),
              "the loaded kernel module's version differs from the user-space driver's: nvmlInit fails "
              "with LibRmVersionMismatch until a reboot"),
    FaultKind("persistence_off", False, {}, (), _driver("persistence_off"),
              "persistence mode off on a GPU (every GPU without gpu)"),
    FaultKind("recovery_action", True, {"action": str}, ("action",), _driver("recovery_action"),
              "the driver asks for a recovery action (GPU_RESET, NODE_REBOOT, DRAIN_P2P, DRAIN_AND_RESET ...; "
              "NVML reports it from driver 565)"),
    # -- thermal and power faults (the thermal check) --
    FaultKind("throttle", True, {"reason": str, "duty": float, "period_s": float}, (), _thermal("throttle"),
              "a clock event reason (hw_slowdown, hw_thermal, hw_power_brake, sw_thermal, sw_power_cap, sync_boost; "
              "default hw_slowdown) is on for duty (default 1.0) of every period_s (default 60) from now until a "
              "reset; the reasons mask and the violation counters follow it"),
    FaultKind("power_brake", True, {"duty": float, "period_s": float}, (), _thermal("power_brake"),
              "the power supply or BMC asserts the GPU's external power brake (HW power brake slowdown) for duty "
              "of every period_s"),
    FaultKind("memory_temperature", True, {"celsius": int}, ("celsius",), _set("memory_temperature_c", "celsius"),
              "the GPU's memory (HBM) temperature; a GPU without a memory sensor keeps answering NotSupported"),
    FaultKind("power_draw", True, {"watts": float, "limit_watts": float, "utilization": int}, ("watts",),
              _thermal("power_draw"), "the GPU draws this power (its enforced limit becomes limit_watts, its "
              "utilization this %); a busy GPU at its limit shows the SW power cap reason, which is normal"),
    # -- NVLink and fabric faults (the nvlink and fabric checks) --
    FaultKind("nvlink_errors", True, {"link": int, "counter": str, "add": int, "per_min": float}, ("link", "counter"),
              _nvlink("nvlink_errors"), "an NVLink error counter (replay, recovery, crc_flit, crc_data) jumps by add "
              "and/or rises per_min from now until a reset"),
    FaultKind("nvlink_flap", True, {"link": int, "period_s": float, "down_s": float}, ("link",), _nvlink("nvlink_flap"),
              "an NVLink goes down for down_s (default 20) at the start of every period_s (default 120), "
              "retraining (a recovery) each time, until a reset"),
    FaultKind("fabric_failed", True, {"status": int}, (), _nvlink("fabric_failed"),
              "the GPU's NVLink fabric registration completes with an error status (an nvmlReturn_t, default "
              "999 Unknown): it loses NVLink peer-to-peer"),
    FaultKind("fabric_not_started", False, {"state": str}, (), _nvlink("fabric_unfinished"),
              "the fabric registration of a GPU (every GPU without gpu) stays not_started (default) or in_progress"),
    FaultKind("fabric_manager_stopped", False, {}, (), _nvlink("fabric_manager_stopped"),
              "nv-fabricmanager stops (recover without a gpu, or reboot, starts it again)"),
    # -- InfiniBand faults (the infiniband check) --
    FaultKind("ib_port_down", False, {"device": str, "port": int, "phys_state": str}, ("device",),
              _ib("port_down"), "an InfiniBand/RoCE port goes DOWN (phys_state Polling: link lost, the default; "
              "Disabled: turned off by software)"),
    FaultKind("ib_port_state", False, {"device": str, "port": int, "state": str, "phys_state": str},
              ("device", "state"), _ib("port_state"),
              "a port's state (DOWN, INIT, ARMED, ACTIVE) and physical state (Polling, Disabled, LinkUp ...)"),
    FaultKind("ib_rate", False, {"device": str, "port": int, "rate_gbps": float}, ("device", "rate_gbps"),
              _ib("port_rate"), "a port retrains at this rate in Gb/s (lanes or speed lost)"),
    FaultKind("ib_errors", False, {"device": str, "port": int, "counter": str, "per_min": float, "add": int},
              ("device", "counter"), _ib("port_errors"),
              "a port error counter (symbol_error, link_downed ...) jumps by add and/or rises per_min from now"),
    FaultKind("ib_missing", False, {"device": str}, ("device",), _ib("port_missing"),
              "an HCA's ports vanish from /sys/class/infiniband (fell off the bus, driver gone)"),
    FaultKind("vbios", True, {"version": str}, ("version",), _set("vbios_version", "version"),
              "the GPU's VBIOS is updated to this version (NVML reports it from now on)"),
    # -- device plugin faults (the allocatable check): fake_nvml/device_plugin.py --
    FaultKind("device_plugin_stale", False, {}, (), device_plugin.stale,
              "the NVIDIA device plugin keeps advertising the nvidia.com/gpu counts it has now, whatever "
              "happens to the GPUs (until recover without a gpu, or reboot, restarts it)"),
    FaultKind("device_plugin_count", False, {"count": int}, ("count",), device_plugin.count,
              "the device plugin advertises this many nvidia.com/gpu (capacity and allocatable)"),
    FaultKind("device_plugin_down", False, {}, (), device_plugin.down,
              "the device plugin is gone: nvidia.com/gpu 0 (as kubelet shows it), no DRA devices"),
    FaultKind("recover", False, {}, (), _recover,
              "reset a GPU (with gpu) or repair the node (without) back to healthy"),
    FaultKind("reboot", False, {}, (), _reboot,
              "the node reboots: a new boot id, a kernel log started afresh, the driver loaded, every GPU healthy"),
)}
