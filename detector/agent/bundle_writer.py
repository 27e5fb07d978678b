"""Write an evidence bundle: what a person or a support case needs about a GPU node at the moment it failed,
laid out as a replay folder (`gpu-npd diagnose --nvml replay:DIR` judges it again).

Files, in the order the size cap spends on them (what does not fit is cut or left out, and listed in the
manifest's `truncated`):

- verdict.json: gpu-npd's verdict, the same document as `diagnose -o json`.
- nvidia-smi-q.xml (`nvidia-smi -q -x`, run with SMI_TIMEOUT_S) or, for a replayed node, the capture it came
  from (nvidia-smi-q.xml or .txt).
- nvidia-smi-nvlink.txt (`nvidia-smi nvlink -s`, NVLINK_TIMEOUT_S) where nvidia-smi answers it.
- proc-modules.txt, proc-driver-nvidia-version.txt, dev-nvidia.txt: the driver plumbing as the driver check
  read it, in the files' own formats (detector/backends/replay/side_files.py).
- nvml.json: every per-GPU NVML read the bundle's own diagnose made (detector/backends/replay/recording.py).
- history.json: the daemon's per-GPU history, when there is a state directory.
- kernel.log: this boot's kernel log as /dev/kmsg records, the last KERNEL_TAIL_LINES lines plus every line of
  the NVIDIA driver or PCIe AER before them (at most KERNEL_KEPT_LINES): what the XID and driver-line rules read.
- manifest.json: what the bundle holds (written last, never cut).

Redaction (on by default): IPv4 and IPv6 addresses, MAC addresses, host names (dotted names of three or more
labels), e-mail addresses and the user name in home-directory paths become [ip], [host], [email], [user].
The node name, GPU identities (serial, UUID, bus id), process names and kernel messages otherwise stay: the
rules and a support case need them. gpu-npd writes no environment into a bundle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from detector.backends.kernlog.records import LogLine
from detector.backends.nvml_timing import TimedNvml
from detector.backends.replay.recording import RECORDING, NvmlRecorder
from detector.core.check import Check
from detector.core.sweep import Host, SweepResult
from detector.core.types import GpuRef, Problem

MANIFEST_VERSION = 1
DEFAULT_MAX_BYTES = 64 << 20
SMI_TIMEOUT_S = 30.0
NVLINK_TIMEOUT_S = 15.0
KERNEL_TAIL_LINES = 20_000
KERNEL_KEPT_LINES = 5_000
_INCIDENT_LINE = re.compile(r"NVRM|Xid|NVLink|nvidia|AER|pcieport|GPU", re.IGNORECASE)
_MANIFEST_ROOM = 256 << 10          # kept back from the cap for manifest.json

Verdict = Callable[[SweepResult, list[Problem]], dict]
Progress = Callable[[str], None]


class BundleError(Exception):
    """The bundle cannot be written at all (its folder): one line saying which and why."""


@dataclass(frozen=True)
class BundleOptions:
    reason: str = "on request"
    incident: str = ""
    gpus: tuple[GpuRef, ...] = ()      # what the bundle is about; none: every GPU a problem names
    max_bytes: int = DEFAULT_MAX_BYTES
    redact: bool = True
    history: Path | None = None        # the state directory's history.json
    smi_timeout_s: float = SMI_TIMEOUT_S
    inventory_timeout_s: float = 10.0
    kernel_text: str | None = None     # a saved kernel log to keep as it is (`--kernel-log`, a replay's own)


@dataclass
class Manifest:
    created: str
    node: str
    boot_id: str
    reason: str
    incident: str
    redacted: bool
    gpus: list[dict] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # what could not be gathered, and why

    def to_dict(self) -> dict[str, Any]:
        return {"version": MANIFEST_VERSION, "created": self.created, "node": self.node, "boot_id": self.boot_id,
                "reason": self.reason, "incident": self.incident, "gpus": self.gpus, "files": self.files,
                "bytes": sum(f["bytes"] for f in self.files), "redacted": self.redacted,
                "truncated": self.truncated, "notes": self.notes}


# -- the kernel log a bundle keeps ------------------------------------------------------------------------


class KernelLogTail:
    """Stands where a kernel-log reader stands and passes it through, keeping the newest `tail` lines and,
    beyond them, up to `kept` lines of the NVIDIA driver or PCIe AER: this boot's log around its incidents,
    in bounded memory, without reading the log a second time."""

    def __init__(self, reader: Any, tail: int = KERNEL_TAIL_LINES, kept: int = KERNEL_KEPT_LINES):
        self.reader = reader
        self._tail: deque[LogLine] = deque(maxlen=tail)
        self._kept: deque[LogLine] = deque(maxlen=kept)
        self._boot: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)

    def read_available(self, *args: Any, **kwargs: Any) -> list[LogLine]:
        lines = self.reader.read_available(*args, **kwargs)
        for line in lines:
            if line.boot_id and line.boot_id != self._boot:
                self._tail.clear()             # a new boot: the old boot's lines are not this one's log
                self._kept.clear()
                self._boot = line.boot_id
            if len(self._tail) == self._tail.maxlen and _INCIDENT_LINE.search(self._tail[0].text):
                self._kept.append(self._tail[0])
            self._tail.append(line)
        return lines

    def lines(self) -> list[LogLine]:
        return [*self._kept, *self._tail]


class SavedLines:
    """A kernel-log reader over lines already read: hands them out once (a bundle's own diagnose)."""

    name = "bundle"
    wait_is_cheap = False

    def __init__(self, lines: Iterable[LogLine]):
        self._lines = list(lines)

    def read_available(self, *args: Any, **kwargs: Any) -> list[LogLine]:
        lines, self._lines = self._lines, []
        return lines


def kmsg_record(line: LogLine, number: int) -> str:
    """A line as /dev/kmsg hands it out (`PRI,SEQ,USEC,-;MESSAGE`), which a saved-log scan reads as the
    kernel's; a line whose priority is unknown is written bare (a scan then reports it, acting on none)."""
    text = _escape(line.text)
    if line.priority is None:
        return text
    seq = line.seq if line.seq is not None else number
    return f"{line.priority},{seq},{line.monotonic_us or 0},-;{text}"


def _escape(text: str) -> str:
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text
    return "".join(c if " " <= c <= "~" and c != "\\" else "".join(f"\\x{b:02x}" for b in c.encode("utf-8"))
                   for c in text)


# -- redaction --------------------------------------------------------------------------------------------

_REDACTIONS = (
    (re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"), "[email]"),
    (re.compile(r"\b(?:[0-9A-Fa-f]{2}[:-]){5}[0-9A-Fa-f]{2}\b"), "[mac]"),
    (re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){3,7}[0-9A-Fa-f]{1,4}(?![\w:])"
                r"|(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){1,6}(?::[0-9A-Fa-f]{1,4}){1,6}(?![\w:])"), "[ip]"),
    (re.compile(r"(?<![\w.])(?:25[0-5]|2[0-4]\d|1?\d?\d)(?:\.(?:25[0-5]|2[0-4]\d|1?\d?\d)){3}(?![\w.])"), "[ip]"),
    (re.compile(r"(?<=/home/)[^/\s\"'<]+|(?<=/Users/)[^/\s\"'<]+"), "[user]"),
    (re.compile(r"(?<![\w.-])(?=[\w-]*[A-Za-z])[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+){2,}\.[A-Za-z]{2,}(?![\w.-])"), "[host]"),
)


def redact(text: str, keep: Sequence[str] = ()) -> str:
    """`text` with addresses, host names and user names replaced; the names in `keep` (the node's) stay."""
    held = {f"\x00{i}\x00": name for i, name in enumerate(n for n in keep if n)}
    for token, name in held.items():
        text = text.replace(name, token)
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    for token, name in held.items():
        text = text.replace(token, name)
    return text


# -- writing ----------------------------------------------------------------------------------------------


def prepare_folder(out: Path) -> None:
    """`out` made, or taken when empty; BundleError when it holds anything or cannot be written."""
    if out.exists() and not out.is_dir():
        raise BundleError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise BundleError(f"{out}: folder is not empty (a bundle is written into a new or empty folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gpu-npd-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BundleError(f"{out}: cannot write there: {e.strerror or e}") from None


class _Writer:
    def __init__(self, out: Path, manifest: Manifest, max_bytes: int, keep: Sequence[str]):
        self.out, self.manifest, self.keep = out, manifest, keep
        self.left = max(0, max_bytes - _MANIFEST_ROOM)

    def write(self, name: str, text: str, *, redacted: bool, cut_from_start: bool = False) -> None:
        if redacted:
            text = redact(text, self.keep)
        data = text.encode("utf-8")
        if len(data) > self.left:
            self.manifest.truncated.append(name)
            if not cut_from_start or self.left <= 0:
                self.manifest.notes.append(f"{name}: left out ({len(data)} bytes, {self.left} left under the cap)")
                return
            data = data[len(data) - self.left:]
            data = data[data.find(b"\n") + 1:]          # whole lines only: the newest are kept
            self.manifest.notes.append(f"{name}: cut to its last {len(data)} bytes under the cap")
        (self.out / name).write_bytes(data)
        self.left -= len(data)
        self.manifest.files.append({"name": name, "bytes": len(data)})


def write_bundle(host: Host, checks: Sequence[Check], ruleset: Any, out: Path, options: BundleOptions,
                 verdict: Verdict, kernel_lines: Sequence[LogLine] | None,
                 progress: Progress = lambda message: None) -> Manifest:
    """Gather and write the bundle into `out` (prepare_folder first). `checks` and `ruleset` judge it as
    diagnose does, over `kernel_lines` (the kernel log kept) and the host's NVML, recorded as it answers."""
    from detector.agent.oneshot import diagnose_once
    from detector.backends.replay.side_files import DEV, LSPCI, MODULES, NVLINK, VERSION

    manifest = Manifest(created=datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
                        node=host.node_name, boot_id=host.current_boot(), reason=options.reason,
                        incident=options.incident, redacted=options.redact)
    writer = _Writer(out, manifest, options.max_bytes, [host.node_name])
    recorder = NvmlRecorder(host.nvml.wrapped if isinstance(host.nvml, TimedNvml) else host.nvml)
    judged = replace(host, nvml=TimedNvml(recorder) if isinstance(host.nvml, TimedNvml) else recorder, kernel_log=SavedLines(kernel_lines) if kernel_lines is not None else None,
                     one_sweep=True)
    progress("judging the node (one sweep of the checks)")
    sweep, problems = diagnose_once(judged, [c for c in checks if c.name != "nccl"], ruleset,
                                    options.inventory_timeout_s)
    manifest.gpus = _gpus(sweep, problems, options.gpus)
    writer.write("verdict.json", json.dumps(verdict(sweep, problems), indent=2) + "\n", redacted=options.redact)

    replay = getattr(host, "replay", None)
    if replay:
        _copy_capture(Path(replay["path"]), writer, options.redact)
    else:
        progress(f"running nvidia-smi -q -x (timeout {options.smi_timeout_s:g} s)")
        outcome = host.smi.run(["-q", "-x"], options.smi_timeout_s)
        if outcome.status == "ok" and outcome.returncode == 0 and outcome.stdout.strip():
            writer.write("nvidia-smi-q.xml", outcome.stdout, redacted=options.redact)
        else:
            manifest.notes.append(f"nvidia-smi -q -x: {_failed(outcome)}")
        progress(f"running nvidia-smi nvlink -s (timeout {NVLINK_TIMEOUT_S:g} s)")
        nvlink = host.smi.run(["nvlink", "-s"], NVLINK_TIMEOUT_S)
        if nvlink.status == "ok" and nvlink.returncode == 0:
            writer.write(NVLINK, nvlink.stdout, redacted=False)
        else:
            manifest.notes.append(f"nvidia-smi nvlink -s: {_failed(nvlink)}")
    progress("reading the driver plumbing and NVML's answers")
    system = _system(host, manifest)
    if system is not None:
        if system.modules is not None:
            writer.write(MODULES, "".join(f"{n} 0 0 - {s} 0x0000000000000000\n" for n, s in system.modules.items()),
                         redacted=False)
        if system.kernel_module_version:
            kind = "Open Kernel Module for x86_64" if system.kernel_module_flavor == "open" else \
                "UNIX x86_64 Kernel Module"
            writer.write(VERSION, f"NVRM version: NVIDIA {kind}  {system.kernel_module_version}\n", redacted=False)
        if system.device_files is not None:
            writer.write(DEV, "".join(f"/dev/{n}\n" for n in sorted(system.device_files)), redacted=False)
    listing = _lspci(host)
    if listing is not None:
        writer.write(LSPCI, listing, redacted=False)
    bus_ids = {g.index: g.pci_bus_id for g in sweep.inventory.gpus if g.index is not None}
    writer.write(RECORDING, json.dumps(recorder.to_json(bus_ids)) + "\n", redacted=False)
    if options.history is not None:
        _copy_history(options.history, writer, manifest, options.redact)
    if options.kernel_text is not None:
        writer.write("kernel.log", options.kernel_text, redacted=options.redact, cut_from_start=True)
    elif kernel_lines is not None:
        progress(f"writing the kernel log ({len(kernel_lines)} lines)")
        writer.write("kernel.log", "".join(kmsg_record(line, i) + "\n" for i, line in enumerate(kernel_lines)),
                     redacted=options.redact, cut_from_start=True)
    else:
        manifest.notes.append("kernel.log: no kernel log readable here")
    (out / "manifest.json").write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest


def _lspci(host: Host) -> str | None:
    """The node's NVIDIA devices as `lspci -Dnk` prints them (bus id, class, ids, the driver bound): the PCI
    bus a replay reads, where a GPU NVML lost still is. None when the bus cannot be read (a replay of a
    capture without one)."""
    from detector.backends.pci import NVIDIA_VENDOR

    if getattr(host, "replay", None) and getattr(host.pci, "listed", None) is None:
        return None                       # a replayed capture's bus is its GPUs: nothing new to say
    try:
        devices = [d for d in host.pci.devices() if d.vendor == NVIDIA_VENDOR]
    except OSError:
        return None
    return "".join(f"{d.bus_id} {d.class_code >> 8:04x}: {d.vendor:04x}:{d.device:04x}\n"
                   + (f"\tKernel driver in use: {d.driver}\n" if d.driver else "") for d in devices)


def _failed(outcome: Any) -> str:
    if outcome.status != "ok":
        return f"{outcome.status}: {outcome.detail}" if getattr(outcome, "detail", "") else outcome.status
    first = (outcome.stdout or outcome.stderr or "").strip().splitlines()[:1]
    return f"exit {outcome.returncode}" + (f": {first[0][:200]}" if first else "")


def _system(host: Host, manifest: Manifest) -> Any:
    if host.system is None:
        manifest.notes.append("driver plumbing: not readable here")
        return None
    try:
        return host.system.read()
    except Exception as e:  # noqa: BLE001 - a bundle keeps what it can
        manifest.notes.append(f"driver plumbing: {type(e).__name__}: {e}")
        return None


def _copy_capture(path: Path, writer: _Writer, redacted: bool) -> None:
    """A replayed node's evidence is the capture it came from (and its NVLink listing), as it was."""
    from detector.backends.replay.limits import MAX_CAPTURE_BYTES
    from detector.backends.replay.load import SNAPSHOT_NAMES, read_capture, snapshot_file
    from detector.backends.replay.side_files import NVLINK, read_side_file

    file = snapshot_file(path)
    text = read_capture(file, MAX_CAPTURE_BYTES, "capture").decode("utf-8", "replace")
    name = SNAPSHOT_NAMES[0] if text.lstrip("\ufeff").lstrip().startswith("<") else SNAPSHOT_NAMES[1]
    writer.write(name, text, redacted=redacted)
    if path.is_dir() and (nvlink := read_side_file(path, NVLINK)) is not None:
        writer.write(NVLINK, nvlink, redacted=False)


def _copy_history(path: Path, writer: _Writer, manifest: Manifest, redacted: bool) -> None:
    from detector.backends.safefile import read_bounded

    try:
        text = read_bounded(path, 16 << 20, "history").decode("utf-8", "replace")
    except FileNotFoundError:
        manifest.notes.append(f"history.json: {path} does not exist yet")
        return
    except OSError as e:
        manifest.notes.append(f"history.json: {e}")
        return
    writer.write("history.json", text, redacted=redacted)


def _gpus(sweep: SweepResult, problems: list[Problem], asked: Sequence[GpuRef]) -> list[dict]:
    named = list(asked) or [g for p in problems for g in p.gpus]
    wanted_bus = {g.pci_bus_id for g in named if g.pci_bus_id}
    wanted_uuid = {g.uuid for g in named if g.uuid}
    wanted_index = {g.index for g in named if g.index is not None and not g.pci_bus_id and not g.uuid}
    out = []
    for g in sweep.inventory.gpus:
        if g.pci_bus_id in wanted_bus or g.uuid in wanted_uuid or g.index in wanted_index:
            out.append({"index": g.index, "serial": g.identity.serial, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id})
    return out


def bundle_name(reason: str, when: float | None = None) -> str:
    """`<UTC time>-<short reason>`: sorts by time, and says why at a glance."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when if when is not None else time.time()))
    short = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")[:40] or "bundle"
    return f"{stamp}-{short}"


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        raise OSError(f"{path}: could not be removed")
