"""One fake GPU node: the single source of truth behind the fake NVML, fake nvidia-smi, fake PCI bus
and fake kernel log, so a fault injected once is seen the same way by every source."""

from __future__ import annotations

import copy
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Protocol

from fake_nvml.ib_port import FakeIbPort, ports_from_dicts
from fake_nvml.models import GpuModel, model_by_key
from fake_nvml.identity import board_of

Clock = Callable[[], float]
UP_BEFORE_START_S = 3600.0      # how long a fake node has been up when it is built (see FakeNode.uptime_s)


@dataclass
class FakeGpu:
    """One GPU's state. `index` is its position in PCI bus order (what NVML calls it when all are visible)."""

    index: int
    model: GpuModel
    uuid: str
    serial: str
    pci_bus_id: str                 # canonical 0000:bb:dd.f
    minor: int
    pcie_gen: int                   # current link generation
    pcie_width: int                 # current link width
    pcie_max_gen: int               # max possible with this device and system
    pcie_max_width: int
    pcie_replays: int = 0
    temperature_c: int = 33
    power_mw: int = 72_000
    utilization_pct: int = 0
    memory_used_mib: int = 0
    processes: list[tuple[int, int]] = field(default_factory=list)   # (pid, used MiB)
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_corrected: int = 0
    remapped_uncorrected: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    nvlinks_down: list[int] = field(default_factory=list)
    persistence_mode: bool = True
    # -- driver state (the driver check) --
    recovery_action: int = 0         # NVML_GPU_RECOVERY_ACTION_* the driver asks for (field 230, driver 565+)
    # -- memory state (the memory check: ECC, retired pages, row remapping) --
    # ecc_corrected/ecc_uncorrected above are the volatile counts (since the driver loaded); these are
    # the aggregate counts from before, which persist in the InfoROM across reloads and resets.
    ecc_enabled: bool = True                  # ECC mode on an ECC-capable GPU (nvidia-smi -e)
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    ecc_uncorrected_per_min: float = 0.0      # a rising fault: volatile uncorrectable errors per minute
    ecc_rising_since_s: float = 0.0           # from this node time (FakeNode.elapsed_s)
    retired_sbe: int = 0                      # pages retired for multiple single-bit errors (pre-Ampere)
    retired_dbe: int = 0                      # pages retired for a double-bit error (pre-Ampere)
    retire_pending: bool = False              # a page waits for a driver reload to be retired
    # -- counters rising with node time (the pcie and memory checks' rates; fake_nvml/pci.py, nvml_memory.py) --
    # pcie_replays and ecc_corrected above are what has been counted so far; these add what a rising fault
    # adds from its start (FakeNode.elapsed_s) on.
    pcie_replays_per_min: float = 0.0         # PCIe replays per minute (a marginal link retrying TLPs)
    pcie_replays_since_s: float = 0.0
    ecc_corrected_per_s: float = 0.0          # volatile corrected (single-bit) ECC errors per second: an SBE storm
    ecc_corrected_since_s: float = 0.0
    # -- thermal and power state (the thermal check) --
    # temperature_c and power_mw above are the GPU's; throttle patterns move with node time
    # (fake_nvml/nvml_thermal.py).
    memory_temperature_c: int = 40            # HBM temperature (NVML_FI_DEV_MEMORY_TEMP), where sensed
    power_limit_mw: int = 0                   # enforced power limit; 0: the model's
    throttles: list[dict[str, Any]] = field(default_factory=list)   # {reason, duty, period_s, since_s}
    app_clock_mhz: int = 0                    # application (target) graphics clock; 0: the model's max
    # -- NVLink and fabric state (the nvlink and fabric checks) --
    # nvlinks_down above: links inactive for good. Counters move with node time (fake_nvml/nvml_nvlink.py).
    nvlink_errors: dict[str, int] = field(default_factory=dict)        # "link/counter" -> count added so far
    nvlink_rising: list[dict[str, Any]] = field(default_factory=list)  # {link, counter, per_min, since_s}
    nvlink_flaps: list[dict[str, Any]] = field(default_factory=list)   # {link, period_s, down_s, since_s}
    fabric_state: int | None = None   # NVML_GPU_FABRIC_STATE_*; None: the model's and node's (completed on NVSwitch nodes)
    fabric_status: int = 0            # nvmlReturn_t of the fabric registration once completed
    # FabricHealth fields (detector/backends/fabric_health.py) of a fabric_health fault; None: healthy
    fabric_health: dict[str, Any] | None = None
    # -- identity --
    board_part_number: str = ""      # empty: the model's (fake_nvml/identity.py)
    vbios_version: str = ""          # empty: the model's; a firmware update sets it
    # Fault state.
    lost: bool = False               # NVML raises GPU_IS_LOST for this GPU
    nvml_visible: bool = True        # False: on the PCI bus, but the driver never attached
    nvml_hang_s: float = 0.0         # NVML calls touching this GPU block this long
    nvml_slow_s: float = 0.0         # NVML calls touching this GPU take this much longer (fake_nvml/nvml_latency.py)
    reset_cures: bool = True         # False: a GPU reset leaves its faults as they are (a reset that does not cure)

    @property
    def idle(self) -> bool:
        return self.utilization_pct == 0 and not self.processes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.key
        d["processes"] = [list(p) for p in self.processes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FakeGpu":
        d = dict(d)
        d["model"] = model_by_key(d["model"])
        d["processes"] = [tuple(p) for p in d.get("processes", [])]
        return cls(**d)


@dataclass(frozen=True)
class KernelRecord:
    """A kernel log record as /dev/kmsg would give it."""

    seq: int
    usec: int          # microseconds since boot
    priority: int      # syslog priority (facility 0 = kernel)
    message: str


@dataclass(frozen=True)
class XidEvent:
    """An XID as NVML's event API delivers it."""

    seq: int
    gpu_index: int
    code: int


@dataclass(frozen=True)
class NvSwitch:
    pci_bus_id: str


@dataclass
class NodeState:
    """Everything about a node that can be serialised for another process (fake nvidia-smi)."""

    name: str
    driver_version: str
    cuda_version: int                # as nvmlSystemGetCudaDriverVersion: 12040 for 12.4
    gpus: list[FakeGpu]
    nvswitches: list[NvSwitch] = field(default_factory=list)
    driver_loaded: bool = True
    smi_hang_s: float = 0.0
    reset_unsupported: bool = False     # the platform refuses GPU resets (a VM whose hypervisor blocks FLR)
    nccl_busbw_factor: float = 1.0   # measured NCCL bus bandwidth relative to the healthy figure
    nccl_hang_s: float = 0.0         # the NCCL probe hangs this long (a wedged collective)
    nccl_wrong: int = 0              # elements an all-reduce gets wrong (silent data corruption)
    boot_id: str = "00000000-0000-0000-0000-000000000000"
    # -- node-level state of the driver plumbing check (kernel modules, device files, services) --
    modules_unloaded: list[str] = field(default_factory=list)   # kernel modules gone (nvidia_uvm ...)
    modules_loaded: list[str] = field(default_factory=list)     # extra modules loaded (nouveau ...)
    device_files_missing: list[str] = field(default_factory=list)  # /dev names gone (nvidia-uvm, nvidia3)
    kernel_module_version: str = ""  # the nvidia.ko loaded; "" = driver_version (another: a version mismatch)
    # -- node-level state of the fabric check (fabric manager) --
    fabric_manager_running: bool = True     # nv-fabricmanager's daemon (needed on NVSwitch systems)
    fabric_clique_id: int = 0               # the NVLink domain the GPUs registered in (NVML's cliqueId) ...
    fabric_cluster_uuid: str = ""           # ... and its cluster UUID; "": none (NVML reads zeros)
    # -- node-level state of the infiniband check (HCA ports) --
    ib_ports: list[FakeIbPort] = field(default_factory=list)   # InfiniBand/RoCE ports (fake_nvml/ib_port.py)
    # -- the device plugin and DRA driver (the allocatable check; fake_nvml/device_plugin.py) --
    device_plugin: str = ""                  # "": follows the GPUs; stale, count (lies) or down
    device_plugin_capacity: int = 0          # what a stale or count plugin advertises
    device_plugin_allocatable: int = 0
    device_plugin_unhealthy: list[str] = field(default_factory=list)   # UUIDs it marked unhealthy (XIDs)
    dra_driver: bool = False                 # the gpu.nvidia.com DRA driver publishes this node's GPUs
    # -- IMEX (the imex check; fake_nvml/imex.py) --
    imex_installed: bool = False             # the nvidia-imex packages (nvidia-imex-ctl) are on the node
    imex_service_enabled: bool = False       # the nvidia-imex systemd unit is enabled
    imex_nodes: list[str] = field(default_factory=list)   # the nodes config: this node's address first, then peers
    imex_daemon: str = "READY"               # what `nvidia-imex-ctl -q` says while the service is configured
    imex_unreachable: list[int] = field(default_factory=list)   # peers (1-based, their line) not connected
    imex_hang_s: float = 0.0                 # nvidia-imex-ctl blocks this long

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON: nested dataclasses become dicts (`from_dict` rebuilds them)."""
        d = asdict(self)
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["nvswitches"] = [s.pci_bus_id for s in self.nvswitches]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeState":
        """Fields missing from `d` keep their defaults; nested ones are rebuilt by `_NODE_FIELD_LOADERS`."""
        known = {f.name for f in fields(cls)}
        values = {k: _NODE_FIELD_LOADERS.get(k, _as_is)(v) for k, v in d.items() if k in known}
        return cls(**values)

    def nvml_gpus(self) -> list[FakeGpu]:
        """GPUs NVML enumerates, in its index order (PCI bus order, skipping ones the driver lacks)."""
        return [g for g in self.gpus if g.nvml_visible]


def _as_is(value: Any) -> Any:
    return value


# How NodeState.from_dict rebuilds the fields that are not plain JSON values.
_NODE_FIELD_LOADERS: dict[str, Callable[[Any], Any]] = {
    "gpus": lambda gpus: [FakeGpu.from_dict(g) for g in gpus],
    "nvswitches": lambda buses: [NvSwitch(b) for b in buses],
    "ib_ports": ports_from_dicts,
}


class NodeFault(Protocol):
    """What a node applies, from its timeline or `inject`: a Fault (fake_nvml/faults.py). The node knows no
    more of it than this, so the fault catalogue, built over the modules that read the node, sits above it."""

    @property
    def gpu(self) -> int | None: ...

    def apply(self, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None: ...


@dataclass(frozen=True)
class TimedFault:
    at_s: float
    fault: NodeFault


_XID_ON = re.compile(r"^NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")


class FakeNode:
    """A fake GPU node whose faults can be injected at any time, from any thread.

    Holds no global state: a simulator keeps thousands of these in one process.
    """

    def __init__(self, state: NodeState, timeline: list[TimedFault] | None = None,
                 clock: Clock = time.monotonic, on_change: Callable[["FakeNode"], None] | None = None):
        self._state = state
        self._lock = threading.RLock()
        self._kernel_logged = threading.Condition(self._lock)   # notified on every record and reboot
        self._clock = clock
        self._started = clock()          # the timeline counts from here, across reboots
        self._boot_started = self._started
        self._first_boot = True          # the boot the node was built in (see uptime_s)
        self._timeline = sorted(timeline or [], key=lambda t: t.at_s)
        self._kernel: list[KernelRecord] = []
        self._introduced: set[str] = set()   # GPUs (`0000:5d:00`) the driver named before an Xid this boot
        self._xids: list[XidEvent] = []
        self._on_change = on_change
        self.injected: list[tuple[float, NodeFault]] = []
        self._log_driver_load()
        self._apply_due()

    # -- reading ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def boot_id(self) -> str:
        """The live boot id: a `reboot` fault changes it under running readers."""
        return self.read(lambda state: state.boot_id)

    def snapshot(self) -> NodeState:
        """A private copy of the current state: consistent across every field read from it."""
        with self._lock:
            self._apply_due()
            return copy.deepcopy(self._state)

    def read(self, fn: Callable[[NodeState], Any]) -> Any:
        """Run `fn` against the live state under the node's lock (cheap reads without a copy)."""
        with self._lock:
            self._apply_due()
            return fn(self._state)

    def kernel_records(self, after_seq: int = -1) -> list[KernelRecord]:
        with self._lock:
            self._apply_due()
            return self._kernel[max(after_seq + 1, 0):]          # seq is the index

    def xid_events(self, after_seq: int = -1) -> list[XidEvent]:
        with self._lock:
            self._apply_due()
            return [e for e in self._xids if e.seq > after_seq]

    def kernel_head(self) -> tuple[str, int]:
        """(boot id, newest seq; -1 when empty): enough for a reader to tell whether anything is new."""
        with self._lock:
            self._apply_due()
            return self._state.boot_id, len(self._kernel) - 1

    def wait_kernel(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `ready()` (called under the lock) holds or `timeout_s` passes; False on timeout.
        Woken by every kernel record, every reboot and `notify_kernel`; wakes early for the next timeline
        fault too, since nothing else would apply it while every reader waits."""
        deadline = time.monotonic() + timeout_s
        with self._kernel_logged:
            while True:
                self._apply_due()
                if ready():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._timeline:
                    due = self._timeline[0].at_s - (self._clock() - self._started)
                    left = min(left, max(due, 0.001))
                self._kernel_logged.wait(left)

    def notify_kernel(self) -> None:
        """Wake every `wait_kernel` to re-check its condition (a reader being interrupted for shutdown)."""
        with self._kernel_logged:
            self._kernel_logged.notify_all()

    def elapsed_s(self) -> float:
        """Seconds since the node was built, on its clock (the timeline's time, across reboots): what
        counters that move with time (a rising ECC count, a throttle pattern) are computed from."""
        return self._clock() - self._started

    def uptime_usec(self) -> int:
        return int((self._clock() - self._boot_started) * 1e6)

    def uptime_s(self) -> float:
        """Seconds since this boot as the node itself would say: a fake node starts as a node that has been
        up for an hour (its links trained long ago), and a `reboot` fault starts a boot at 0."""
        with self._lock:
            before = UP_BEFORE_START_S if self._first_boot else 0.0
            return before + self._clock() - self._boot_started

    def _log_driver_load(self) -> None:
        """What the driver prints when it loads: its version and each GPU's bus id and UUID."""
        if not self._state.driver_loaded:
            return
        self.log_kernel(f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {self._state.driver_version}", 6)
        for gpu in self._state.gpus:
            domain, bus, dev_fn = gpu.pci_bus_id.split(":")
            self.log_kernel(f"NVRM: GPU at PCI:{domain}:{bus}:{dev_fn.split('.')[0]}: {gpu.uuid}", 6)

    # -- changing --------------------------------------------------------------------------------

    def inject(self, fault: NodeFault) -> None:
        """Apply a fault now. Every source (NVML, nvidia-smi, PCI, kernel log) sees it at once."""
        with self._lock:
            self._apply(fault)
        if self._on_change:
            self._on_change(self)

    def _apply_due(self) -> None:
        if not self._timeline:
            return
        elapsed = self._clock() - self._started
        changed = False
        while self._timeline and self._timeline[0].at_s <= elapsed:
            self._apply(self._timeline.pop(0).fault)
            changed = True
        if changed and self._on_change:
            self._on_change(self)

    def _apply(self, fault: NodeFault) -> None:
        self.injected.append((self._clock(), fault))
        gpu = self._gpu(fault.gpu) if fault.gpu is not None else None
        fault.apply(self._state, gpu, self)

    def _gpu(self, index: int) -> FakeGpu:
        for g in self._state.gpus:
            if g.index == index:
                return g
        raise ValueError(f"node {self.name} has no GPU {index} (it has {len(self._state.gpus)})")

    def log_kernel(self, message: str, priority: int = 3) -> None:
        """Append a kernel log line (called by faults, under the lock; the lock is re-entrant, and
        notifying waiting readers needs it held). Before a GPU's first Xid of the boot, the driver's two
        lines naming it (`NVRM: GPU at PCI:...: GPU-...`, `NVRM: GPU Board Serial Number: ...`), as the
        real driver prints them (leptonai/gpud components/accelerator/nvidia/sxid/README.md)."""
        with self._kernel_logged:
            xid = _XID_ON.match(message)
            if xid and xid[1].lower() not in self._introduced:
                self._introduced.add(xid[1].lower())
                gpu = next((g for g in self._state.gpus if g.pci_bus_id.lower().startswith(xid[1].lower())), None)
                if gpu is not None:
                    serial = gpu.serial if board_of(gpu.model.key).has_inforom else "0"
                    self._append_kernel(f"NVRM: GPU at PCI:{xid[1]}: {gpu.uuid}", priority)
                    self._append_kernel(f"NVRM: GPU Board Serial Number: {serial}", priority)
            self._append_kernel(message, priority)

    def _append_kernel(self, message: str, priority: int) -> None:
        with self._kernel_logged:
            seq = len(self._kernel)
            self._kernel.append(KernelRecord(seq, self.uptime_usec(), priority, message))
            self._kernel_logged.notify_all()

    def reboot(self) -> None:
        """A new boot (called by the `reboot` fault, under the lock): a fresh boot id, an empty kernel log
        whose seq and uptime start again at 0, and the driver's load lines. The timeline keeps its clock."""
        with self._kernel_logged:
            self._state.boot_id = str(uuid.uuid4())
            self._kernel = []
            self._introduced = set()
            self._boot_started = self._clock()
            self._first_boot = False
            self._log_driver_load()
            self._kernel_logged.notify_all()

    def emit_xid(self, gpu: FakeGpu, code: int) -> None:
        """Deliver an XID to NVML's event API (called by faults, under the lock)."""
        self._xids.append(XidEvent(len(self._xids), gpu.index, code))
