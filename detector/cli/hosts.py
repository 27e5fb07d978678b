"""Turn `--nvml real|fake:NAME|fake:PATH|replay:PATH` into a Host. The choice is always explicit: the detector
never falls back to a fake on its own."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Callable

from detector.backends.pci import SysfsPciBus
from detector.backends.smi import SubprocessSmi
from detector.core.sweep import Host


NO_DRIVER = "LibraryNotFound"     # nvmlInit's error on a machine without the NVIDIA driver


class BackendError(Exception):
    """The chosen backend cannot be used at all (as opposed to a GPU problem it reports)."""


def open_host(spec: str, *, node_name: str | None = None, sysfs_root: Path | None = None,
              nvidia_smi: str | None = None, kernel_cursor: Path | None = None, post_mortem: bool = False,
              clock: Callable[[], float] = time.monotonic) -> Host:
    """`kernel_cursor`: where the kernel-log reader keeps its place across restarts (the daemon's).
    `post_mortem`: only a saved log will be read, so a machine without an NVIDIA driver will do and
    the live kernel log is not opened. `clock`: a SimulatedClock makes a fake node's time pass only
    between sweeps (`diagnose --duration`); real and replayed hosts keep the real clock."""
    kind, _, arg = spec.partition(":")
    if kind == "real" and not arg:
        return _real_host(node_name or socket.gethostname(), sysfs_root or Path("/sys"), nvidia_smi or "nvidia-smi",
                          kernel_cursor, post_mortem)
    if kind == "fake" and arg:
        return _fake_host(arg, node_name, sysfs_root, nvidia_smi, kernel_cursor, clock)
    if kind == "replay":
        return _replay_host(arg, node_name)
    raise BackendError(f"--nvml {spec!r}: expected 'real', 'fake:SCENARIO', 'fake:PATH.yaml' or 'replay:PATH'")


def _replay_host(path: str, node_name: str | None) -> Host:
    """A node rebuilt from what a real machine printed (detector/backends/replay): one snapshot, judged as held."""
    from detector.cli.replay_host import replay_host
    from detector.backends.replay.raw import SnapshotError

    if not path.strip():
        raise BackendError("--nvml replay: name a file or folder: replay:PATH, where PATH is nvidia-smi -q (or -q -x) "
                           "output or a folder holding nvidia-smi-q.xml or nvidia-smi-q.txt")
    try:
        return replay_host(Path(path), node_name)
    except SnapshotError as e:
        raise BackendError(f"--nvml replay: {e}") from None


def _real_host(node_name: str, sysfs_root: Path, nvidia_smi: str, kernel_cursor: Path | None,
               post_mortem: bool = False) -> Host:
    import pynvml

    from detector.core.inventory import nvml_error_name

    init_error = None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        if not post_mortem:
            raise BackendError("NVML library libnvidia-ml.so.1 not found: no NVIDIA driver is installed here "
                               "(to try gpu-npd without GPUs, use --nvml fake:h100-sxm-8; to read a saved log, "
                               "--checks xid --kernel-log FILE)") from None
        init_error = NO_DRIVER
    except pynvml.NVMLError as e:
        # The library is there but unusable (driver not loaded, version mismatch): that is a node finding.
        init_error = nvml_error_name(e)
    if post_mortem:
        boot_id, kernel_log = "current", None
    else:
        boot_id, kernel_log = live_kernel_log(cursor_file=kernel_cursor)
    from detector.backends.imex import host_imex
    from detector.backends.infiniband import sysfs_infiniband
    from detector.backends.nvml_timing import TimedNvml
    from detector.backends.system import host_system

    host = Host(node_name, TimedNvml(pynvml), SubprocessSmi([nvidia_smi]), SysfsPciBus(sysfs_root),
                nvml_init_error=init_error, kernel_log=kernel_log, boot_id=boot_id,
                close=_shutdown(pynvml) if init_error is None else (lambda: None))
    host.infiniband = sysfs_infiniband(sysfs_root)
    host.system = host_system(sysfs_root)
    host.imex = host_imex(sysfs_root)
    host.uptime_s = _uptime
    return host


def _uptime() -> float | None:
    import psutil
    try:
        return max(0.0, time.time() - psutil.boot_time())
    except (OSError, RuntimeError):
        return None


def live_kernel_log(start: str = "beginning", cursor_file: Path | None = None) -> tuple[str, Any]:
    """This machine's kernel log: /dev/kmsg when readable, else the journal, else none."""
    from detector.backends.kernlog import CursorStore, DevKmsg, JournaldReader, KmsgReader, KmsgUnavailable
    from detector.backends.kernlog import boot_time, read_boot_id

    boot_id = read_boot_id()         # None: unknown, so no saved cursor is ever trusted
    cursor = CursorStore(cursor_file)
    try:
        return boot_id or "current", KmsgReader(DevKmsg(), boot_id, boot_time(), cursor, start=start)
    except KmsgUnavailable:
        journal = JournaldReader(cursor)
        return boot_id or "current", journal if journal.available() else None


def _shutdown(nvml: Any):
    def close() -> None:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a broken library must not mask the report
            pass
    return close


def _fake_host(scenario: str, node_name: str | None, sysfs_root: Path | None, nvidia_smi: str | None,
               kernel_cursor: Path | None, clock: Callable[[], float] = time.monotonic) -> Host:
    import shutil
    import tempfile

    from detector.yamlsource import SourceError
    from fake_nvml.host import fake_host
    from fake_nvml.scenario import load_scenario
    from fake_nvml.statefile import STATE_ENV, mirror_to, save_state

    try:
        loaded = load_scenario(scenario)
    except SourceError as e:
        raise BackendError(f"fake scenario: {e}") from None
    if not nvidia_smi:
        return fake_host(loaded.build(node_name, clock=clock), sysfs_root=sysfs_root, kernel_cursor=kernel_cursor,
                         clock=clock)
    # An external fake-nvidia-smi reads the node through a state file kept current on every fault.
    tmp = Path(tempfile.mkdtemp(prefix="gpu-npd-fake-"))
    state_file = tmp / "state.json"
    node = loaded.build(node_name, clock=clock, on_change=mirror_to(state_file))
    save_state(node, state_file)
    host = fake_host(node, sysfs_root=sysfs_root, smi_command=[nvidia_smi], smi_env={STATE_ENV: str(state_file)},
                     kernel_cursor=kernel_cursor, clock=clock)
    shutdown = host.close

    def close() -> None:
        shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    host.close = close
    return host
