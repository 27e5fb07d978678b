"""XID and NVSwitch SXid lines, in every driver format, inside every log wrapper.

The wrapper is peeled first (`wrappers.peel`: times, origin); the message must then *start* with
`NVRM: ` or `nvidia-nvswitchN: `, so a program quoting an XID inside its own text (a grep, a JSON log,
an alert) is never an event. Whether a line whose wrapper does not prove kernel origin counts is the
caller's choice: each event carries its `origin`.

Driver formats read (open-gpu-kernel-modules prints `NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u
GPU-CI:%02u]): %d, pid=%s, name=%s, %s`):

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). ...  (MIG)
    NVRM: Xid (0000:03:00): 14, Channel 00000001                                  (old drivers)
    NVRM: Xid (PCI:...): 79, ...   /  (PCI:0000:xx:00)  /  ([...])                (redacted: GPU unknown)
    NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.                           (XID 79 without an Xid)
    NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1db4) installed in this system has
          fallen off the bus and is not responding to commands.                 (older drivers: XID 79)
    nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error
    NVRM: GPU at PCI:0000:06:00: GPU-604d7f6a-...                                 (bus id -> UUID)
    NVRM: GPU Board Serial Number: 1653723052734                                  (that GPU's serial)
    NVRM: GPU 0000:91:00.0: GPU serial number is 1653723052734.                   (after an XID 79)

The driver prints a GPU's UUID and board serial before the first Xid of that GPU in a boot: for a GPU
that fell off the bus, the only place its serial is still written (NVML has no handle for a lost GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from detector.backends.kernlog.wrappers import KERNEL, UNVERIFIED, USER_SPACE, peel
from detector.backends.pciaddr import normalize_bus_id

_BUS_TEXT = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?|[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_BUS = rf"(?:PCI:)?(?P<bus>{_BUS_TEXT})"
# Whatever stands in the parentheses: a bus id (maybe redacted), then MIG instance ids.
_XID = re.compile(r"^NVRM: Xid \((?P<where>[^)]*)\):\s*(?P<code>\d{1,5})\b,?\s?(?P<rest>.*)$")
_WHERE = re.compile(rf"^\s*(?:PCI:)?(?P<bus>{_BUS_TEXT})?(?P<tail>.*)$")
_GPU_I = re.compile(r"GPU-I:\s*(?P<gi>\d+)(?:\s+GPU-CI:\s*(?P<ci>\d+))?")
_PID = re.compile(r"^pid=(?P<pid>'?<unknown>'?|\d+)(?:,\s*|$)")
_NAME = re.compile(r"^name=(?P<name><unknown>|[^,]*)(?:,\s*|$)")
_FELL_OFF = re.compile(r"^NVRM: GPU (?:at )?" + _BUS + r":? (?:GPU )?has fallen off the bus")
_FELL_OFF_OLD = re.compile(r"^NVRM: The NVIDIA GPU " + _BUS + r"\s.*has\s+(?:NVRM: )?fallen off the bus", re.S)
# The same message as dmesg prints it, split over indented lines; the first names the GPU, the last says
# what happened, and the check joins them.
_SPLIT_START = re.compile(r"^NVRM: The NVIDIA GPU " + _BUS + r"\s*$")
_FELL_OFF_TAIL = re.compile(r"^NVRM: fallen off the bus and is not responding to commands")
_SXID = re.compile(r"^nvidia-nvswitch(?P<switch>\d+): SXid \((?P<where>[^)]*)\):\s*(?P<code>\d{1,6}),?\s?"
                   r"(?P<rest>.*)$")
_UUID = re.compile(r"^NVRM: GPU at " + _BUS + r": (?P<uuid>GPU-[0-9a-fA-F-]{36})\s*$")
_BOARD_SERIAL = re.compile(r"^NVRM: GPU Board Serial Number:[ \t]*(?P<serial>\S*)\s*$")
_SERIAL_IS = re.compile(r"^NVRM: GPU " + _BUS + r": GPU serial number is (?P<serial>[^\s.]*)\.?\s*$")
# A serial is the InfoROM's board serial (13 digits on data-center boards); boards without one print
# nothing, `0` (GeForce, open-gpu-kernel-modules#1045) or `[N/A]`.
_SERIAL = re.compile(r"^[0-9A-Za-z][0-9A-Za-z-]{3,39}$")
_FATAL = re.compile(r"\b(Fatal|Non-?fatal|Nonfatal)\b", re.IGNORECASE)
_RECOVERY = re.compile(r"GPU recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to 0x[0-9a-fA-F]+ \((?P<to>[^)]*)\)")
_SXID_DETAIL = re.compile(r"^(?:Severity \d+ Engine instance|Data \{)")
_CAUSED_BY = re.compile(r"caused by previous Xid (?P<code>\d+)")
_LINK = re.compile(r"\bLink (?P<link>\d+)\b")
_JOURNAL_BOOT = re.compile(r"^-- (?:Boot (?P<id>[0-9a-f]{32}) --|Reboot --)")

# XID 154's labels (NVIDIA's catalogue writes "GPU Reset Required", "Node Reboot Required", ...).
RECOVERY_ACTIONS = {"none": "NONE", "gpu reset": "RESET_GPU", "gpu reset required": "RESET_GPU",
                    "reset": "RESET_GPU", "node reboot": "RESTART_BM", "node reboot required": "RESTART_BM",
                    "reboot": "RESTART_BM", "drain p2p": "DRAIN_P2P", "drain and reset": "DRAIN_AND_RESET"}


@dataclass(frozen=True, slots=True)
class KernelEvent:
    """One XID or SXid line, parsed."""

    kind: str                    # "xid" or "sxid"
    code: int
    pci_bus_id: str              # 0000:3b:00.0; "" when the log redacted it
    message: str                 # the rest of the first line after the code (and pid/name)
    pid: int | None = None
    process_name: str = ""
    fatal: bool | None = None    # from "Fatal"/"Nonfatal" in the line (XID 144-150, SXid)
    recovery_action: str = ""    # XID 154: the action the driver now asks for
    time: float | None = None    # epoch seconds when the wrapper says; else None
    monotonic_s: float | None = None   # seconds since boot, when the wrapper says
    origin: str = KERNEL         # KERNEL; UNVERIFIED when the wrapper cannot tell; USER_SPACE when it shows
                                 # a facility that is not the kernel's (never an XID: the caller drops it)
    gpu_instance: int | None = None    # MIG: the GPU instance the driver attributed it to
    boot_id: str | None = None   # journalctl -o json's _BOOT_ID
    detail: bool = False         # an SXid `Severity ...`/`Data {...}` line: detail of the headline before it
    names_process: bool = False  # the line has the driver's pid=/name= (even `pid='<unknown>'`)

    @property
    def caused_by(self) -> int | None:
        """XID 45 names the XID it cleans up after (`... caused by previous Xid 149`)."""
        m = _CAUSED_BY.search(self.message) if self.code == 45 else None
        return int(m["code"]) if m else None

    @property
    def link(self) -> int | None:
        """The NVLink a 144-150 line names (`... Link 01 ...`)."""
        m = _LINK.search(self.message)
        return int(m["link"]) if m else None


@dataclass(frozen=True, slots=True)
class UuidMapping:
    """`NVRM: GPU at PCI:0000:06:00: GPU-604d...`: which UUID a bus id belongs to."""

    pci_bus_id: str
    uuid: str


@dataclass(frozen=True, slots=True)
class BoardSerial:
    """A GPU's board serial as the driver printed it: `NVRM: GPU Board Serial Number: 1653723052734` (bus
    id "": the GPU is the one the `NVRM: GPU at ...` line just before it named) or `NVRM: GPU
    0000:91:00.0: GPU serial number is 1653723052734.`. `serial` is "" for a board without one."""

    pci_bus_id: str
    serial: str


def _serial(text: str) -> str:
    return text if _SERIAL.match(text) and text.strip("0") else ""


@dataclass(frozen=True, slots=True)
class SplitStart:
    """`NVRM: The NVIDIA GPU 0000:b3:00.0` alone on a line: the start of a message dmesg split over
    indented lines; the line that ends it (`NVRM: fallen off the bus ...`) is about this GPU."""

    pci_bus_id: str


@dataclass(frozen=True, slots=True)
class BootBanner:
    """The kernel started (`Linux version ...`, `Command line: ...`, journalctl's `-- Boot ID --` and
    `-- Reboot --`): later lines belong to a new boot."""

    boot_id: str | None = None
    time: float | None = None


Parsed = KernelEvent | UuidMapping | BoardSerial | BootBanner | SplitStart

# A line holds one of these or it is nobody's business here (checked before any regex: most lines).
_INTERESTING = ("NVRM: ", "SXid (", "Linux version ", "Command line: ", "-- Boot ", "-- Reboot --")


def parse_line(line: str, year: int | None = None, kernel: bool = False) -> Parsed | None:
    """An XID/SXid event, a bus-id-to-UUID mapping, a boot banner, or None for every other line.
    Events carry the wrapper's times and origin (`KERNEL`, `UNVERIFIED`, `USER_SPACE`); `kernel`: the source
    already proved the kernel wrote it (a kmsg or journald record with the kernel's facility)."""
    if not ("NVRM: " in line or "SXid (" in line or "Linux version " in line or "Command line: " in line
            or "-- " in line or "MESSAGE" in line):
        return None                       # (spelled out: a generator here costs a flood 10% more)
    if line.startswith("-- "):
        m = _JOURNAL_BOOT.match(line)
        return BootBanner(m["id"]) if m else None
    w = peel(line, year)
    msg = w.message.lstrip()              # dmesg indents the continuation of a split message
    if msg.startswith(("Linux version ", "Command line: ")):
        # A bare line may be the kernel's (journalctl -o cat), and so may dmesg's; one another program
        # tagged, or one a user-space facility wrote, is not.
        banner = (w.origin == KERNEL or not w.wrapped or w.ring_buffer) and w.origin != USER_SPACE
        return BootBanner(w.boot_id, w.time) if banner else None
    if not msg.startswith(("NVRM: ", "nvidia-nvswitch")):
        return None
    event = _parse_message_cached(msg)
    if event is None or not isinstance(event, KernelEvent):
        return event
    origin = KERNEL if kernel else w.origin
    if w.time is None and w.monotonic_s is None and origin == KERNEL and w.boot_id is None:
        return event                      # the live path's bare kmsg message: the cached event as it is
    # Direct construction: dataclasses.replace costs a flood of 800,000 lines seconds.
    return KernelEvent(event.kind, event.code, event.pci_bus_id, event.message, event.pid, event.process_name,
                       event.fatal, event.recovery_action, w.time, w.monotonic_s, origin, event.gpu_instance,
                       w.boot_id, event.detail, event.names_process)


@lru_cache(maxsize=1024)
def _parse_message_cached(msg: str) -> KernelEvent | UuidMapping | BoardSerial | SplitStart | None:
    """In a flood the same message repeats under new timestamps: parse it once (results are frozen)."""
    return parse_message(msg)


def parse_message(msg: str) -> KernelEvent | UuidMapping | BoardSerial | SplitStart | None:
    """The kernel's message itself (no wrapper), as /dev/kmsg and journald deliver it (a kmsg record
    holds a split message whole, its lines joined by newlines)."""
    if msg.startswith("NVRM: Xid"):
        return _parse_xid(msg)
    if msg.startswith("NVRM: "):
        if m := (_FELL_OFF.match(msg) or _FELL_OFF_OLD.match(msg)):
            return KernelEvent("xid", 79, normalize_bus_id(m["bus"]), "GPU has fallen off the bus.")
        if m := _UUID.match(msg):
            return UuidMapping(normalize_bus_id(m["bus"]), "GPU-" + m["uuid"][4:].lower())
        if m := _BOARD_SERIAL.match(msg):
            return BoardSerial("", _serial(m["serial"]))
        if m := _SERIAL_IS.match(msg):
            return BoardSerial(normalize_bus_id(m["bus"]), _serial(m["serial"]))
        if m := _SPLIT_START.match(msg):
            return SplitStart(normalize_bus_id(m["bus"]))
        if _FELL_OFF_TAIL.match(msg):
            return KernelEvent("xid", 79, "", "GPU has fallen off the bus.")
        return None
    if "SXid" in msg and (m := _SXID.match(msg)):
        rest = m["rest"].strip()
        bus, _ = _where(m["where"])
        if _SXID_DETAIL.match(rest):      # the incidents fold it into its headline, when it follows one
            return KernelEvent("sxid", int(m["code"]), bus, rest, detail=True)
        return KernelEvent("sxid", int(m["code"]), bus, rest, fatal=_fatal(rest))
    return None


def _parse_xid(msg: str) -> KernelEvent | None:
    m = _XID.match(msg)
    if not m:
        return None
    bus, gpu_instance = _where(m["where"])
    rest, pid, name = m["rest"], None, ""
    if p := _PID.match(rest):
        pid = int(p["pid"]) if p["pid"].isdigit() else None
        rest = rest[p.end():]
    if n := _NAME.match(rest):
        name = "" if n["name"] == "<unknown>" else n["name"]
        rest = rest[n.end():]
    code = int(m["code"])
    rest = rest.strip()
    fatal = _fatal(rest) if 144 <= code <= 150 else None
    action = ""
    if code == 154 and (r := _RECOVERY.search(rest)):
        action = RECOVERY_ACTIONS.get(r["to"].strip().lower(), "INSPECT")
    return KernelEvent("xid", code, bus, rest, pid, name, fatal, action, gpu_instance=gpu_instance,
                       names_process=p is not None or n is not None)


def _where(text: str) -> tuple[str, int | None]:
    """`PCI:0000:01:00 GPU-I:05` -> ("0000:01:00.0", 5). A redacted or unreadable bus id is "": the
    event still counts, on an unknown GPU."""
    m = _WHERE.match(text)
    bus = ""
    if m and m["bus"] and not m["tail"].startswith((":", "x", "X")):
        try:
            bus = normalize_bus_id(m["bus"])
        except ValueError:
            bus = ""
    gi = _GPU_I.search(text)
    return bus, int(gi["gi"]) if gi else None


def _fatal(text: str) -> bool | None:
    m = _FATAL.search(text)
    return None if m is None else m.group(1).lower() == "fatal"


__all__ = ["KERNEL", "UNVERIFIED", "USER_SPACE", "BootBanner", "KernelEvent", "Parsed", "SplitStart", "UuidMapping", "parse_line",
           "parse_message", "RECOVERY_ACTIONS"]
