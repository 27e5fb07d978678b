"""Bind a FakeNode to the detector's backends: fake NVML, fake nvidia-smi, fake PCI bus."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import pynvml

from detector.backends.infiniband import sysfs_infiniband
from detector.backends.kernlog import CursorStore, KmsgReader
from detector.backends.nvml_timing import TimedNvml
from detector.backends.pci import SysfsPciBus
from detector.backends.smi import SmiOutcome, SubprocessSmi
from detector.core.clock import SimulatedClock
from detector.core.inventory import nvml_error_name
from detector.core.sweep import Host
from fake_nvml.imex import fake_imex
from fake_nvml.infiniband import fake_infiniband
from fake_nvml.kmsg import FakeKmsgDevice
from fake_nvml.nccl import FakeNcclProbe
from fake_nvml.node import FakeNode
from fake_nvml.nvml import FakeNvml
from fake_nvml.pci import FakePciBus
from fake_nvml.smi import EXIT_DRIVER_NOT_LOADED, EXIT_NOT_FOUND, EXIT_OTHER, run_smi, smi_fault
from fake_nvml.smi_xml import query_xml
from fake_nvml.system import fake_system


class InProcessSmi:
    """fake nvidia-smi without a process: what a fleet of thousands of fake nodes needs."""

    def __init__(self, node: FakeNode, sleep=time.sleep):
        self.node = node
        self._sleep = sleep

    def run(self, args: list[str], timeout_s: float) -> SmiOutcome:
        state = self.node.snapshot()
        if state.smi_hang_s > 0:
            self._sleep(min(state.smi_hang_s, timeout_s))
            if state.smi_hang_s >= timeout_s:
                return SmiOutcome("timeout", detail=f"nvidia-smi did not finish within {timeout_s:g}s")
        if args == ["-q", "-x"]:
            first = run_smi(state, ["-L"])        # no driver, a version mismatch, no GPUs: -q fails alike
            if first.returncode in (EXIT_DRIVER_NOT_LOADED, EXIT_OTHER, EXIT_NOT_FOUND):
                return SmiOutcome("ok", first.returncode, first.stdout, first.stderr)
            return _query_xml_within(self.node, timeout_s)
        result = run_smi(state, args)
        for action in result.actions:           # -r and -pm change the node, seen by every source at once
            self.node.inject(smi_fault(action))
        return SmiOutcome("ok", result.returncode, result.stdout, result.stderr)


def _query_xml_within(node: FakeNode, timeout_s: float) -> SmiOutcome:
    """nvidia-smi -q reads NVML: on a node whose NVML hangs it hangs too, and is given up as the real one is."""
    result: list[str] = []
    def query() -> None:
        try:
            result.append(_query_xml(node))
        except pynvml.NVMLError as e:         # what nvidia-smi prints when NVML fails it
            result.append(f"Failed to initialize NVML: {e}\n")
    worker = threading.Thread(target=query, name="fake-smi-q", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        return SmiOutcome("timeout", detail=f"nvidia-smi did not finish within {timeout_s:g}s")
    failed = result[0].startswith("Failed to initialize NVML")
    return SmiOutcome("ok", EXIT_OTHER if failed else 0, result[0], "")


def _query_xml(node: FakeNode) -> str:
    """`nvidia-smi -q -x` of the node, read through its own NVML as nvidia-smi reads the real one."""
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    try:
        return query_xml(nvml)
    finally:
        nvml.nvmlShutdown()


def fake_host(node: FakeNode, *, sysfs_root: Path | None = None, smi_command: list[str] | None = None,
              smi_env: dict[str, str] | None = None, threaded: bool = True,
              kernel_cursor: Path | None = None, simulated_time: bool = False,
              clock: Callable[[], float] | None = None) -> Host:
    """A Host whose every backend reads `node`. `sysfs_root`/`smi_command` swap in the real readers
    (over a written-out tree, or a fake-nvidia-smi process) to exercise them end to end. `simulated_time`:
    the node runs on a simulated clock, so slow NVML calls are declared, not slept. `clock`: the node's own,
    which the host's checks and waits then keep; a SimulatedClock implies `simulated_time` (`diagnose
    --duration`: time passes only by the host's sleep). NVML is timed per GPU as on a real node
    (detector/backends/nvml_timing.py)."""
    simulated_time = simulated_time or isinstance(clock, SimulatedClock)
    nvml = FakeNvml(node, simulated_time=simulated_time)
    init_error = None
    try:
        nvml.nvmlInit()
    except pynvml.NVMLError as e:
        init_error = nvml_error_name(e)
    smi = SubprocessSmi(smi_command, smi_env) if smi_command else InProcessSmi(node)
    pci = SysfsPciBus(sysfs_root) if sysfs_root else FakePciBus(node)
    kmsg = FakeKmsgDevice(node)
    kernel_log = KmsgReader(kmsg, kmsg.boot_id, kmsg.boot_time, CursorStore(kernel_cursor), start="beginning")

    def close() -> None:
        if init_error is None:
            nvml.nvmlShutdown()

    host = Host(node.name, TimedNvml(nvml), smi, pci, nvml_init_error=init_error, kernel_log=kernel_log,
                boot_id=kmsg.boot_id, threaded=threaded, close=close, boot_source=lambda: node.boot_id,
                nccl_probe=FakeNcclProbe(node))
    host.infiniband = sysfs_infiniband(sysfs_root) if sysfs_root else fake_infiniband(node)
    host.system = fake_system(node)
    host.imex = fake_imex(node, clock.sleep if isinstance(clock, SimulatedClock) else time.sleep)
    host.uptime_s = node.uptime_s
    if clock is not None:
        host.clock = clock
    if isinstance(clock, SimulatedClock):
        host.sleep, host.simulated_time = clock.sleep, True
    return host
