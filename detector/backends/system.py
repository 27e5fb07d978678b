"""The driver's plumbing on this machine: kernel modules, device files, the kernel module's version, the
GPUs the driver registered, and whether the fabric manager runs. Cheap file reads only: no subprocess,
nothing that can block on a GPU.

Where each fact comes from (NVIDIA's driver README, "Using the /proc File System Interface"):
- /proc/modules: loaded modules (`name size refcount users state address [taint]`); only state `Live`
  counts as loaded (`Loading`/`Unloading` are on their way).
- /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  ..." (proprietary)
  or "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build ..." (open).
- /proc/driver/nvidia/gpus/<bus id>/information: each GPU the driver registered, with its "Device Minor",
  the N of /dev/nvidiaN.
- /dev: nvidiactl, nvidia-uvm, nvidia<minor> (nvidia-modprobe(1) creates them where udev does not).
- Fabric Manager: its systemd unit runs nv-fabricmanager with PIDFile=/run/nvidia-fabricmanager/
  nv-fabricmanager.pid (Fabric Manager user guide); the process's comm is "nv-fabricmanage" (15 characters).

Paths are rooted (`proc_root`, `dev_root`, `run_root`) so a DaemonSet can mount the host's at /host/... and
tests can point them at a written tree.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol

FABRIC_MANAGER_COMM = "nv-fabricmanage"     # "nv-fabricmanager" cut to the kernel's 15-character comm
FABRIC_MANAGER_PID_FILES = (                # the systemd unit's, and the GPU Operator driver container's
    "nvidia-fabricmanager/nv-fabricmanager.pid",
    "nvidia/driver/run/nvidia-fabricmanager/nv-fabricmanager.pid",
)
_VERSION = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")
_HOST_INITS = {"systemd", "init"}


@dataclass(frozen=True)
class SystemInfo:
    """What the driver's plumbing looks like now. A field that is None could not be read here
    (a container without the host's /proc or /run), which is not the same as absent."""

    fabric_manager_running: bool | None = None     # NVIDIA Fabric Manager's daemon (nv-fabricmanager)
    modules: Mapping[str, str] | None = None       # loaded kernel modules: name -> state (Live, Loading, Unloading)
    kernel_module_version: str | None = None       # the nvidia.ko loaded, from /proc/driver/nvidia/version
    kernel_module_flavor: str | None = None        # open or proprietary
    gpu_minors: Mapping[str, int] | None = None    # bus id -> device minor, for the GPUs the driver registered
    device_files: frozenset[str] | None = None     # /dev entries named nvidia* (nvidiactl, nvidia-uvm, nvidia0 ...)
    errors: tuple[str, ...] = ()                   # what could not be read, for the check's result

    def loaded(self, module: str) -> bool | None:
        return None if self.modules is None else self.modules.get(module) == "Live"


class SystemReader(Protocol):
    def read(self) -> SystemInfo: ...


# -- parsers (pure, tested on real text) ----------------------------------------------------------


def parse_proc_modules(text: str) -> dict[str, str]:
    """/proc/modules -> {name: state}. Lines too short to carry a state are skipped."""
    modules = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5:
            modules[parts[0]] = parts[4]
    return modules


def parse_driver_version(text: str) -> tuple[str | None, str | None]:
    """/proc/driver/nvidia/version -> (version, flavor). (None, None) when the NVRM line is not there."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            match = _VERSION.search(line)
            if match:
                return match.group(1), "open" if " Open Kernel Module" in line else "proprietary"
    return None, None


def parse_device_minor(text: str) -> int | None:
    """The "Device Minor:" of /proc/driver/nvidia/gpus/<bus id>/information."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Device Minor":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


# -- the real reader ------------------------------------------------------------------------------


class HostSystem:
    """Reads the plumbing under the given roots. A result is reused for `max_age_s` so that the checks
    of one sweep (driver, fabric) share one read."""

    def __init__(self, proc_root: Path, dev_root: Path, run_root: Path, max_age_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.proc_root, self.dev_root, self.run_root = proc_root, dev_root, run_root
        self._max_age_s, self._clock = max_age_s, clock
        self._last: tuple[float, SystemInfo] | None = None

    def read(self) -> SystemInfo:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._max_age_s:
            return self._last[1]
        info = self._read()
        self._last = (now, info)
        return info

    def _read(self) -> SystemInfo:
        errors: list[str] = []
        modules_text = self._text(self.proc_root / "modules", errors)
        modules = parse_proc_modules(modules_text) if modules_text is not None else None
        version = flavor = None
        version_file = self.proc_root / "driver" / "nvidia" / "version"
        if version_file.exists():
            text = self._text(version_file, errors)
            version, flavor = parse_driver_version(text or "")
        return SystemInfo(
            fabric_manager_running=self._fabric_manager(),
            modules=modules,
            kernel_module_version=version,
            kernel_module_flavor=flavor,
            gpu_minors=self._gpu_minors(errors) if modules is not None else None,
            device_files=self._device_files(errors),
            errors=tuple(errors),
        )

    @staticmethod
    def _text(path: Path, errors: list[str]) -> str | None:
        try:
            return path.read_text(errors="replace")
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
            return None

    def _gpu_minors(self, errors: list[str]) -> dict[str, int]:
        gpus = self.proc_root / "driver" / "nvidia" / "gpus"
        minors: dict[str, int] = {}
        try:
            entries = sorted(os.listdir(gpus))
        except FileNotFoundError:
            return minors                     # no driver loaded: it registered no GPU
        except OSError as e:
            errors.append(f"{gpus}: {e.strerror or e}")
            return minors
        for bus_id in entries:
            text = self._text(gpus / bus_id / "information", errors)
            minor = parse_device_minor(text or "")
            if minor is not None:
                minors[bus_id.lower()] = minor
        return minors

    def _device_files(self, errors: list[str]) -> frozenset[str] | None:
        try:
            return frozenset(name for name in os.listdir(self.dev_root) if name.startswith("nvidia"))
        except OSError as e:
            errors.append(f"{self.dev_root}: {e.strerror or e}")
            return None

    def _fabric_manager(self) -> bool | None:
        """True when nv-fabricmanager runs; False when this host's process table shows it does not;
        None when that cannot be told (the process table seen is a container's)."""
        for relative in FABRIC_MANAGER_PID_FILES:
            try:
                pid = (self.run_root / relative).read_text().strip()
            except OSError:
                continue
            if pid.isdigit() and self._comm(pid) == FABRIC_MANAGER_COMM:
                return True
        if not self._host_process_table():
            return None
        try:
            pids = [name for name in os.listdir(self.proc_root) if name.isdigit()]
        except OSError:
            return None
        return any(self._comm(pid) == FABRIC_MANAGER_COMM for pid in pids)

    def _comm(self, pid: str) -> str | None:
        try:
            return (self.proc_root / pid / "comm").read_text().strip()
        except OSError:
            return None

    def _host_process_table(self) -> bool:
        """Does proc_root show the host's processes? Yes when it is another PID namespace's procfs than
        ours (the host's /proc mounted into the pod), or when its PID 1 is an init system."""
        try:
            if os.readlink(self.proc_root / "self") != str(os.getpid()):
                return True
        except OSError:
            pass
        return self._comm("1") in _HOST_INITS


def host_system(sysfs_root: Path | None, *, proc_root: Path | None = None, dev_root: Path | None = None,
                run_root: Path | None = None) -> HostSystem:
    """The plumbing reader for this machine. Its roots sit beside the sysfs root: --sysfs-root /host/sys
    reads /host/proc, /host/dev and /host/run (the DaemonSet's host mounts); /sys reads /proc, /dev, /run."""
    host = sysfs_root.parent if sysfs_root is not None and sysfs_root.name == "sys" else Path("/")
    return HostSystem(proc_root or host / "proc", dev_root or host / "dev", run_root or host / "run")
