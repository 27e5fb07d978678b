"""The fake node's driver plumbing, for the driver check (and the fabric check's fabric manager): the
kernel modules, device files, kernel module version and registered GPUs the node would show, a reader
over them (what `detector.backends.system` reads from /proc and /dev, computed), a writer that lays the
same out as files so the real reader can be tested on the fake's tree, the driver faults and how
`recover`/`reboot` heal them."""

from __future__ import annotations

from pathlib import Path

from detector.backends.system import SystemInfo
from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.node import FakeGpu, FakeNode, NodeState
from fake_nvml.nvml_driver import RECOVERY_ACTIONS, driver_branch

# What a healthy GPU node loads, in /proc/modules order (newest first), with sizes from real nodes
# (tests/fixtures/driver/SOURCE.md). nvidia_peermem comes with InfiniBand (GPUDirect RDMA).
_NVIDIA_MODULES = {"nvidia_uvm": "1884160", "nvidia_drm": "94208", "nvidia_modeset": "1531904",
                   "nvidia": "62754816"}
_OTHER_MODULES = {"drm_kms_helper": "200704", "drm": "581632", "i2c_nvidia_gpu": "16384"}
_IB_MODULES = {"nvidia_peermem": "16384", "mlx5_ib": "397312", "ib_core": "434176"}
# Reset by a GPU reset; a reboot-class action needs the whole node.
_RESET_CLEARS = {RECOVERY_ACTIONS[n] for n in ("GPU_RESET", "DRAIN_P2P", "DRAIN_AND_RESET", "BUS_RESET")}


def loaded_modules(state: NodeState) -> dict[str, str]:
    """name -> size of every Live module, NVIDIA's first."""
    nvidia = _NVIDIA_MODULES if state.driver_loaded else {}
    extra = {name: "2490368" for name in state.modules_loaded}
    modules = {**extra, **nvidia, **(_IB_MODULES if state.ib_ports else {}), **_OTHER_MODULES}
    if not state.driver_loaded:
        modules.pop("nvidia_peermem", None)
    return {name: size for name, size in modules.items() if name not in state.modules_unloaded}


def kernel_module_version(state: NodeState) -> str | None:
    return (state.kernel_module_version or state.driver_version) if state.driver_loaded else None


def flavor(state: NodeState) -> str:
    """Open kernel modules are the default from driver 560 on (NVIDIA driver README, "Open Linux Kernel Modules")."""
    return "open" if driver_branch(kernel_module_version(state) or state.driver_version) >= (560,) else "proprietary"


def gpu_minors(state: NodeState) -> dict[str, int]:
    return {g.pci_bus_id: g.minor for g in state.nvml_gpus()} if state.driver_loaded else {}


def device_files(state: NodeState) -> set[str]:
    """/dev/nvidia*: made by nvidia-modprobe or udev; they stay when the module unloads (static nodes)."""
    names = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps"}
    names |= {f"nvidia{g.minor}" for g in state.gpus if g.nvml_visible}
    if state.nvswitches:
        names |= {"nvidia-nvswitchctl", *(f"nvidia-nvswitch{i}" for i in range(len(state.nvswitches)))}
    return names - set(state.device_files_missing)


def system_info(state: NodeState) -> SystemInfo:
    return SystemInfo(
        fabric_manager_running=state.fabric_manager_running,
        modules={name: "Live" for name in loaded_modules(state)},
        kernel_module_version=kernel_module_version(state),
        kernel_module_flavor=flavor(state) if state.driver_loaded else None,
        gpu_minors=gpu_minors(state),
        device_files=frozenset(device_files(state)),
    )


class FakeSystem:
    """A plumbing reader over the fake node: what HostSystem would read from a machine in that state."""

    def __init__(self, node: FakeNode):
        self.node = node

    def read(self) -> SystemInfo:
        return self.node.read(system_info)


def fake_system(node: FakeNode) -> FakeSystem:
    """A plumbing reader over the fake node."""
    return FakeSystem(node)


def version_text(state: NodeState) -> str:
    """/proc/driver/nvidia/version as the proprietary or open module writes it (samples: tests/fixtures/driver)."""
    version = kernel_module_version(state)
    if flavor(state) == "open":
        return (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
                f"(dvs-builder@U16-I3-B03-4-3)  Tue Jun  3 20:35:29 UTC 2025\nGCC version:  gcc version 12.3.0 "
                f"(Ubuntu 12.3.0-1ubuntu1~22.04) \n")
    return (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Jun  4 00:14:22 UTC 2024\n"
            f"GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n")


def write_system(state: NodeState, root: Path) -> None:
    """Lay the plumbing out under `root` as the real reader expects it: root/proc/modules,
    root/proc/driver/nvidia/{version,gpus/<bus id>/information}, root/dev/nvidia* (empty files standing
    for the device nodes), and root/proc/1/comm plus the fabric manager's pid file and process."""
    proc, dev, run = root / "proc", root / "dev", root / "run"
    proc.mkdir(parents=True, exist_ok=True)
    dev.mkdir(parents=True, exist_ok=True)
    (proc / "modules").write_text("".join(
        f"{name} {size} 0 - Live 0x0000000000000000{' (POE)' if name.startswith('nvidia') else ''}\n"
        for name, size in loaded_modules(state).items()))
    _write(proc / "1" / "comm", "systemd\n")              # a host process table (pid 1 is the init system)
    if state.driver_loaded:
        _write(proc / "driver" / "nvidia" / "version", version_text(state))
        for bus_id, minor in gpu_minors(state).items():
            _write(proc / "driver" / "nvidia" / "gpus" / bus_id / "information",
                   f"Model: \t\t NVIDIA GPU\nIRQ:   \t\t 0\nBus Location: \t {bus_id}\nDevice Minor: \t {minor}\n"
                   f"GPU Excluded:\t No\n")
    for name in device_files(state):
        (dev / name).touch()
    if state.fabric_manager_running:
        _write(run / "nvidia-fabricmanager" / "nv-fabricmanager.pid", "4242\n")
        _write(proc / "4242" / "comm", "nv-fabricmanage\n")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- faults (declared in FAULTS below) -------------------------------------------------------------


def module_unloaded(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    module = f.params["module"]
    state.modules_loaded = [m for m in state.modules_loaded if m != module]
    if module not in state.modules_unloaded:
        state.modules_unloaded.append(module)


def module_loaded(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    module = f.params["module"]
    state.modules_unloaded = [m for m in state.modules_unloaded if m != module]
    if module not in state.modules_loaded and module not in _NVIDIA_MODULES:
        state.modules_loaded.append(module)


def device_file_missing(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    name = f.params.get("name") or (f"nvidia{gpu.minor}" if gpu is not None else "nvidia-uvm")
    if name not in state.device_files_missing:
        state.device_files_missing.append(name)


def version_mismatch(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The user-space driver was upgraded while the old kernel module stays loaded (or the reverse)."""
    other = "535.183.01" if state.driver_version != "535.183.01" else "550.90.07"
    state.kernel_module_version = f.params.get("kernel_version", other)
    node.log_kernel(f"NVRM: API mismatch: the client has the version {state.driver_version}, but", 4)
    node.log_kernel(f"NVRM: this kernel module has the version {state.kernel_module_version}.  Please", 4)


def persistence_off(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    for g in [gpu] if gpu is not None else state.gpus:
        g.persistence_mode = False


def recovery_action(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    name = f.params["action"]
    if name not in RECOVERY_ACTIONS:
        raise ValueError(f"fault 'recovery_action': action must be one of {', '.join(RECOVERY_ACTIONS)}, got {name!r}")
    gpu.recovery_action = RECOVERY_ACTIONS[name]


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset clears the recovery actions a reset satisfies; a node repair or reboot restores the
    modules, device files and matching module version, and persistence mode (nvidia-persistenced
    starts at boot)."""
    for g in gpus:
        if whole_node or g.recovery_action in _RESET_CLEARS:
            g.recovery_action = RECOVERY_ACTIONS["NONE"]
        if whole_node:
            g.persistence_mode = True
    if whole_node:
        state.modules_unloaded, state.modules_loaded, state.device_files_missing = [], [], []
        state.kernel_module_version = ""


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("module_unloaded", False, {"module": str}, ("module",), module_unloaded,
              "a kernel module is unloaded (nvidia_uvm, nvidia_modeset, nvidia_peermem ...)"),
    FaultKind("module_loaded", False, {"module": str}, ("module",), module_loaded,
              "another kernel module is loaded (nouveau, which keeps the nvidia driver off the GPUs)"),
    FaultKind("device_file_missing", False, {"name": str}, (), device_file_missing,
              "a /dev entry is gone: name (nvidia-uvm, nvidiactl), else the GPU's /dev/nvidiaN, else nvidia-uvm"),
    FaultKind("version_mismatch", False, {"kernel_version": str}, (), version_mismatch,
              "the loaded kernel module's version differs from the user-space driver's: nvmlInit fails "
              "with LibRmVersionMismatch until a reboot"),
    FaultKind("persistence_off", False, {}, (), persistence_off,
              "persistence mode off on a GPU (every GPU without gpu)"),
    FaultKind("recovery_action", True, {"action": str}, ("action",), recovery_action,
              "the driver asks for a recovery action (GPU_RESET, NODE_REBOOT, DRAIN_P2P, DRAIN_AND_RESET ...; "
              "NVML reports it from driver 565)"),
)
