"""XID and NVSwitch SXid lines, in every driver format, inside every log wrapper.

A kernel line reaches us wrapped: plain, `dmesg` (`[  123.456789] `), `dmesg -T`, syslog or journalctl
(`Oct  6 17:59:27 host kernel: `), RFC 3339 syslog, or a /dev/kmsg record (`PRI,SEQ,USEC,-;`). The
wrapper is peeled first and must say the line came from the kernel; the message must then *start*
with `NVRM: ` or `nvidia-nvswitchN: `. So a user echoing an XID into syslog, a grep in a shell history
or a container log quoting one is never an event.
"""

from __future__ import annotations

import re
from functools import lru_cache
from dataclasses import dataclass
from datetime import datetime, timezone

from detector.core.pciaddr import normalize_bus_id


_BUS = r"(?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?|[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_WRAPPER = re.compile(
    r"^(?:<(?P<lpri>\d{1,3})>)?"                                                    # dmesg -r
    r"(?:"
    r"(?P<kpri>\d{1,4}),(?P<kseq>\d+),(?P<kusec>\d+),[^;]*;"                           # /dev/kmsg record
    r"|(?:kern\s*:\s*\w+\s*:\s*)?(?P<itime>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d+[+-]\d\d:\d\d) "  # dmesg --time-format iso
    r"|\[\s*(?P<mono>\d+\.\d+)\]\s(?:\[\s*[TC]\d+\]\s)?"                              # dmesg (with caller id)
    r"|\[(?P<ctime>\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s"                     # dmesg -T
    r"|kern\s*:\s*\w+\s*:\s*(?:\[\s*(?P<xmono>\d+\.\d+)\]\s)?"                          # dmesg -x
    r"|(?P<stime>\w{3} +\d{1,2} \d\d:\d\d:\d\d(?:\.\d+)?) \S+ kernel: ?(?:\[\s*(?P<smono>\d+\.\d+)\]\s)?"  # syslog
    r"|(?P<rtime>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?) \S+ kernel: ?"
    r"(?:\[\s*(?P<rmono>\d+\.\d+)\]\s)?"                                              # RFC 3339 syslog
    r")?"
    r"(?P<msg>.*)$"
)
_XID = re.compile(r"^NVRM: Xid \(" + _BUS + r"\): (?P<code>\d{1,3}),(?: (?P<rest>.*))?$")
_PID = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+), name=(?P<name><unknown>|[^,]*), ?(?P<rest>.*)$")
_FELL_OFF = re.compile(r"^NVRM: GPU (?:at )?" + _BUS + r":? (?:GPU )?has fallen off the bus")
_SXID = re.compile(r"^nvidia-nvswitch(?P<switch>\d+): SXid \(" + _BUS + r"\): (?P<code>\d{1,5}),(?: (?P<rest>.*))?$")
_UUID = re.compile(r"^NVRM: GPU at " + _BUS + r": (?P<uuid>GPU-[0-9a-fA-F-]{36})\s*$")
_FATAL = re.compile(r"\b(Fatal|Non-?fatal|Nonfatal)\b", re.IGNORECASE)
_RECOVERY = re.compile(r"GPU recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to 0x[0-9a-fA-F]+ \((?P<to>[^)]*)\)")
_SXID_DETAIL = re.compile(r"^(?:Severity \d+ Engine instance|Data \{)")

# XID 154's labels (NVIDIA's catalogue writes "GPU Reset Required", "Node Reboot Required", ...).
RECOVERY_ACTIONS = {"none": "NONE", "gpu reset": "RESET_GPU", "gpu reset required": "RESET_GPU",
                    "reset": "RESET_GPU", "node reboot": "RESTART_BM", "node reboot required": "RESTART_BM",
                    "reboot": "RESTART_BM", "drain p2p": "DRAIN_P2P", "drain and reset": "DRAIN_AND_RESET"}


@dataclass(frozen=True)
class KernelEvent:
    """One XID or SXid line, parsed."""

    kind: str                    # "xid" or "sxid"
    code: int
    pci_bus_id: str              # 0000:3b:00.0
    message: str                 # the rest of the line after the code (and pid/name)
    pid: int | None = None
    process_name: str = ""
    fatal: bool | None = None    # from "Fatal"/"Nonfatal" in the line (XID 144-150, SXid)
    recovery_action: str = ""    # XID 154: the action the driver now asks for
    time: float | None = None    # epoch seconds when the wrapper says; else None
    monotonic_s: float | None = None   # seconds since boot, when the wrapper says


@dataclass(frozen=True)
class UuidMapping:
    """`NVRM: GPU at PCI:0000:06:00: GPU-604d...`: which UUID a bus id belongs to."""

    pci_bus_id: str
    uuid: str


@dataclass(frozen=True)
class BootBanner:
    """`Linux version ...`: the kernel started; later lines belong to a new boot."""


def parse_line(line: str, year: int | None = None) -> KernelEvent | UuidMapping | BootBanner | None:
    """An XID/SXid event, a bus-id-to-UUID mapping, a boot banner, or None for every other line."""
    if not ("NVRM: Xid" in line or "NVRM: GPU " in line or "SXid (" in line or "Linux version " in line):
        return None                       # (spelled out: a generator here costs a flood 10% more)
    w = _WRAPPER.match(line.rstrip("\r\n"))
    if w is None:
        return None
    kpri, lpri = w["kpri"], w["lpri"]
    if (kpri is not None and int(kpri) >= 8) or (lpri is not None and int(lpri) >= 8):
        return None                       # a facility other than the kernel's (0): written by user space
    msg = w["msg"]
    if msg.startswith("Linux version "):
        return BootBanner()
    if not msg.startswith(("NVRM: ", "nvidia-nvswitch")):
        return None
    event = _parse_message_cached(msg)
    if event is None or isinstance(event, UuidMapping):
        return event
    mono = next((float(v) for v in (w["mono"], w["xmono"], w["smono"], w["rmono"]) if v), None)
    if mono is None and w["kusec"]:
        mono = int(w["kusec"]) / 1e6
    return _with_time(event, _wall_time(w, year), mono)


@lru_cache(maxsize=1024)
def _parse_message_cached(msg: str) -> KernelEvent | UuidMapping | None:
    """In a flood the same message repeats under new timestamps: parse it once (results are frozen)."""
    return parse_message(msg)


def parse_message(msg: str) -> KernelEvent | UuidMapping | None:
    """The kernel's message itself (no wrapper), as /dev/kmsg and journald deliver it."""
    if msg.startswith("NVRM: Xid"):
        m = _XID.match(msg)
        if not m:
            return None
        rest, pid, name = m["rest"] or "", None, ""
        if p := _PID.match(rest):
            pid = int(p["pid"]) if p["pid"].isdigit() else None
            name = "" if p["name"] == "<unknown>" else p["name"]
            rest = p["rest"]
        code = int(m["code"])
        fatal = _fatal(rest) if 144 <= code <= 150 else None
        action = ""
        if code == 154 and (r := _RECOVERY.search(rest)):
            action = RECOVERY_ACTIONS.get(r["to"].strip().lower(), "INSPECT")
        return KernelEvent("xid", code, normalize_bus_id(m["bus"]), rest.strip(), pid, name, fatal, action)
    if msg.startswith("NVRM: GPU"):
        if m := _FELL_OFF.match(msg):
            return KernelEvent("xid", 79, normalize_bus_id(m["bus"]), "GPU has fallen off the bus.")
        if m := _UUID.match(msg):
            return UuidMapping(normalize_bus_id(m["bus"]), "GPU-" + m["uuid"][4:].lower())
        return None
    if "SXid" in msg and (m := _SXID.match(msg)):
        rest = (m["rest"] or "").strip()
        if _SXID_DETAIL.match(rest):
            return None           # a detail line of the SXid reported just before it, not a new event
        return KernelEvent("sxid", int(m["code"]), normalize_bus_id(m["bus"]), rest, fatal=_fatal(rest))
    return None


def _fatal(text: str) -> bool | None:
    m = _FATAL.search(text)
    return None if m is None else m.group(1).lower() == "fatal"


def _wall_time(w: re.Match, year: int | None) -> float | None:
    if w["rtime"] or w["itime"]:
        return _iso_time(w["rtime"] or w["itime"])
    if w["ctime"]:
        return _ctime(w["ctime"])
    if w["stime"]:
        base, _, frac = w["stime"].partition(".")
        second = _syslog_time(base, year or datetime.now(timezone.utc).year)
        return None if second is None else second + (float("0." + frac) if frac else 0.0)
    return None


# Lines of one second share their stamp; floods repeat it thousands of times: parse each once.
@lru_cache(maxsize=4096)
def _iso_time(text: str) -> float | None:
    try:
        dt = datetime.fromisoformat(text.replace(",", ".").replace(" ", "T", 1))
    except ValueError:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


@lru_cache(maxsize=4096)
def _ctime(text: str) -> float | None:
    try:
        return datetime.strptime(text, "%a %b %d %H:%M:%S %Y").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


@lru_cache(maxsize=4096)
def _syslog_time(base: str, year: int) -> float | None:
    try:
        return datetime.strptime(f"{year} {base}", "%Y %b %d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def _with_time(e: KernelEvent, wall: float | None, mono: float | None) -> KernelEvent:
    if wall is None and mono is None:
        return e
    return KernelEvent(e.kind, e.code, e.pci_bus_id, e.message, e.pid, e.process_name, e.fatal,
                       e.recovery_action, wall, mono)
