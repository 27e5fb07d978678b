"""Peel the wrapper a log tool put around a kernel message, and say what the wrapper proves.

Kernel lines reach a saved log through many tools, each with its own prefix:

    /dev/kmsg record         6,1234,5678901,-;MSG          (facility in PRI)
    dmesg                    [  123.456789] MSG            (also [T1234] caller ids, <PRI> with -r)
    dmesg -T                 [Mon Oct  6 17:59:27 2025] MSG
    dmesg --time-format iso  2025-10-06T17:59:27,123456+00:00 MSG
    dmesg -x (any of above)  kern  :err   : ...            (facility and level columns, padded)
    syslog, journalctl       Oct  6 17:59:27 host kernel: MSG   (host optional; -o short-precise adds .usec)
    RFC 3339 syslog          2025-10-06T17:59:27.123456+00:00 host kernel: MSG
    journalctl -o short-iso  2025-10-06T17:59:27+0000 host kernel: MSG
    journalctl -o short-monotonic  [  123.456789] host kernel: MSG
    journalctl -o json       {"MESSAGE" : "MSG", "_TRANSPORT" : "kernel", ...}  (MESSAGE may be a byte array)
    journalctl -o cat, bare  MSG,  kernel: MSG
    Talos (talosctl dmesg)   172.20.0.2: kern:    info: [2021-11-04T17:01:20.123456789Z]: MSG

`origin` is "kernel" when the wrapper proves the kernel wrote the line (a kernel facility, a syslog tag
`kernel`, journald's `_TRANSPORT=kernel`); "user space" when the wrapper shows a facility and it is not
the kernel's (`dmesg -x` `user`, a kmsg record or `<PRI>` with another facility, a journal entry of
another transport): a program wrote it to /dev/kmsg or syslog, so it is never an XID; else "unverified":
the format cannot tell (a bare line, another syslog tag, and plain `dmesg`/`dmesg -T`, which print lines
that user space wrote to /dev/kmsg exactly like the kernel's). Whether an unverified line counts is the
caller's choice: a saved log reports it for a human and acts on none; the live path drops it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

KERNEL, UNVERIFIED, USER_SPACE = "kernel", "unverified", "user space"

_KMSG = re.compile(r"(?P<pri>\d{1,4}),(?P<seq>\d+),(?P<usec>\d+),[^;]*;")
_PRI = re.compile(r"<(?P<pri>\d{1,3})>")
_FACILITIES = r"kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|res[0-3]|local[0-7]"
_LEVELS = r"emerg|alert|crit|err|warn|warning|notice|info|debug"
_DMESG_X = re.compile(rf"(?P<fac>{_FACILITIES})\s*:\s*(?P<level>{_LEVELS})\s*:\s?")
_TALOS = re.compile(rf"(?:\S+: )?(?P<fac>{_FACILITIES}):\s*(?P<level>{_LEVELS}):\s*\[(?P<iso>[^\]]+)\]:\s?")
_ISO = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
# A month as strftime's %b prints it in any locale: `Oct`, `Okt`, `août`, `déc.`, `févr.`, `ene`, `11月`.
_MON = r"(?:[^\W\d_]{3,5}\.?|\d{1,2}[月월])"
_STAMP = re.compile(
    r"(?:\[\s*(?P<mono>\d+(?:\.\d+)?)\]"                                        # dmesg, short-monotonic
    r"|\[\.\.\.\]"                                                               # a stamp the source elided
    r"|\[\s*(?P<rel>\+\d+\.\d+)\]"                                                      # dmesg -H: since the last line
    rf"|\[(?P<human>{_MON} ?\d{{1,2}} \d\d:\d\d)\]"                                  # dmesg -H: a new minute
    rf"|\[(?P<ctime>[^\W\d_]{{1,5}}\.? {_MON} [ \d]?\d \d\d:\d\d:\d\d \d{{4}})\]"     # dmesg -T
    rf"|(?P<bsd>{_MON} {{1,2}}\d{{1,2}} \d\d:\d\d:\d\d(?:\.\d+)?)"                   # syslog, journalctl
    rf"|(?P<iso>{_ISO}))"                                                       # RFC 3339, dmesg iso
    r"\s+"
)
_CALLER = re.compile(r"\[\s*[TC]\d+\]\s")
# `host tag[pid]: `; a host never holds ':' (so `kernel: NVRM: ...` is read as tag `kernel`).
_TAG = re.compile(r"(?:(?P<host>[^\s:\[\]]+) )?(?P<tag>[^\s:\[\]]+)(?:\[\d+\])?: ")
_INNER_MONO = re.compile(r"\[\s*(?P<mono>\d+\.\d+)\]\s(?:\[\s*[TC]\d+\]\s)?")
# Words that start a kernel message and look like a `tag:` (`NVRM: Xid`, `Command line: ...`).
_NOT_TAGS = ("NVRM", "nvidia-nvswitch", "line")
# Kernel modules whose messages start `name: ` (`nvidia: probe of ...`, `nvidia_peermem: Unknown symbol ...`):
# after a stamp and with no host before them, they are the message, not a syslog tag.
_MODULE_PREFIXES = frozenset({"nvidia", "nvidia_peermem", "nv_peer_mem", "nvidia-peermem"})


@dataclass(frozen=True, slots=True)
class Wrapped:
    """A kernel message with what its wrapper said about it."""

    message: str
    origin: str                       # KERNEL, UNVERIFIED or USER_SPACE
    time: float | None = None         # epoch seconds
    monotonic_s: float | None = None  # seconds since boot
    boot_id: str | None = None        # journalctl -o json's _BOOT_ID
    wrapped: bool = False             # a known wrapper was recognised (not a bare line)
    ring_buffer: bool = False         # dmesg's own stamp: the kernel's ring buffer, whoever wrote the line


def peel(line: str, year: int | None = None) -> Wrapped:
    """The message inside `line`, its origin and its times. Never raises."""
    line = line.rstrip("\r\n")
    if line.startswith("{"):
        return _peel_json(line) or Wrapped(line, UNVERIFIED)
    if m := _KMSG.match(line):
        kernel = int(m["pri"]) >> 3 == 0
        return Wrapped(line[m.end():], KERNEL if kernel else USER_SPACE, None, int(m["usec"]) / 1e6, wrapped=True,
                       ring_buffer=True)
    pos, facility_kernel, mono = 0, None, None
    if m := _PRI.match(line):
        facility_kernel, pos = int(m["pri"]) >> 3 == 0, m.end()
    if m := _TALOS.match(line, pos):
        return _finish(line, m.end(), m["fac"] == "kern", None, _iso_time(m["iso"]), None, True)
    if m := _DMESG_X.match(line, pos):
        facility_kernel, pos = m["fac"] == "kern", m.end()
    ring_buffer = False                     # dmesg's own stamps: the kernel's ring buffer
    if m := _STAMP.match(line, pos):
        pos = m.end()
        mono = float(m["mono"]) if m["mono"] else None
        ring_buffer = bool(m["mono"] or m["ctime"] or m["iso"] or m["human"] or m["rel"])
        wall = _ctime(m["ctime"]) if m["ctime"] else _iso_time(m["iso"]) if m["iso"] else None
        if m["bsd"] or m["human"]:
            wall = _syslog_time(m["bsd"] or m["human"], year)
        if c := _CALLER.match(line, pos):
            pos = c.end()
        tag_allowed = True
    else:
        wall, tag_allowed = None, line.startswith("kernel:", pos)
    stamped = m is not None or facility_kernel is not None
    tagged = False
    if tag_allowed and (t := _TAG.match(line, pos)) and not t["tag"].startswith(_NOT_TAGS) \
            and not (t["host"] is None and t["tag"] in _MODULE_PREFIXES):
        if m is not None and (m["mono"] or m["human"] or m["rel"]) and not (t["host"] and (t["tag"] == "kernel" or "[" in t[0])):
            pass                            # `[ 1.2] usb 1-1: ...`: dmesg's, not journalctl's `host tag:`
        else:
            pos, tagged = t.end(), True
            ring_buffer = False
            if facility_kernel is None and t["tag"] == "kernel":
                facility_kernel = True
            if i := _INNER_MONO.match(line, pos):
                pos, mono = i.end(), float(i["mono"])
    elif tag_allowed and t is not None and t["host"] is not None and t["tag"].startswith(_NOT_TAGS[:2]):
        pos += len(t["host"]) + 1           # `Oct 6 17:59:27 host NVRM: ...`: a host, no tag
        tagged = True
    return _finish(line, pos, facility_kernel, None, wall, mono, stamped or tagged, ring_buffer)


def _finish(line: str, pos: int, kernel: bool | None, boot_id: str | None, wall: float | None, mono: float | None,
            wrapped: bool, ring_buffer: bool = False) -> Wrapped:
    """`kernel`: True (proven), False (a facility shown, not the kernel's) or None (the format cannot tell)."""
    origin = UNVERIFIED if kernel is None else KERNEL if kernel else USER_SPACE
    return Wrapped(line[pos:], origin, wall, mono, boot_id, wrapped, ring_buffer)


def _peel_json(line: str) -> Wrapped | None:
    """`journalctl -o json`: journald's trusted `_TRANSPORT=kernel` proves the origin."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict) or "MESSAGE" not in entry:
        return None
    message = entry["MESSAGE"]
    if isinstance(message, list):                     # not valid UTF-8, or control characters
        try:
            message = bytes(message).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(message, str):
        return None
    transport = entry.get("_TRANSPORT")           # trusted: set by journald, never by the sender
    origin = UNVERIFIED if not isinstance(transport, str) else KERNEL if transport == "kernel" else USER_SPACE
    wall = _micros(entry.get("__REALTIME_TIMESTAMP"))
    mono = _micros(entry.get("__MONOTONIC_TIMESTAMP"))
    boot = entry.get("_BOOT_ID") if isinstance(entry.get("_BOOT_ID"), str) else None
    return Wrapped(message.rstrip("\n"), origin, wall, mono, boot, True)


def _micros(value: object) -> float | None:
    try:
        return int(value) / 1e6 if value is not None else None
    except (TypeError, ValueError):
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
    """dmesg -T prints local time without a zone, in the locale's names; it is read as UTC."""
    _weekday, month, day, hms, year = text.split()
    return _syslog_second(f"{month} {day} {hms}", int(year))


def _syslog_time(text: str, year: int | None) -> float | None:
    base, _, frac = text.rpartition(".")
    if not frac.isdigit():                    # no fraction; a dot ends some months' names (`déc.`)
        base, frac = text, ""
    second = _syslog_second(" ".join(base.split()), year)
    return None if second is None else second + (float("0." + frac) if frac else 0.0)


# strftime's %b in the locales a node is likely to run (journalctl, dmesg -T and -H print the local one);
# the keys are lowercased and without a trailing dot. Names that several languages share mean the same month.
_MONTHS: dict[str, int] = {}
for _names in (
    "jan feb mar apr may jun jul aug sep oct nov dec",                  # C, English
    "janv févr mars avr mai juin juil août sept oct nov déc",           # French
    "jan feb mär apr mai jun jul aug sep okt nov dez",                  # German
    "ene feb mar abr may jun jul ago sep oct nov dic",                  # Spanish
    "gen feb mar apr mag giu lug ago set ott nov dic",                  # Italian
    "jan fev mar abr mai jun jul ago set out nov dez",                  # Portuguese
    "янв фев мар апр мая июн июл авг сен окт ноя дек",                  # Russian
):
    for _number, _name in enumerate(_names.split(), 1):
        _MONTHS[_name] = _number
_MONTHS["sept"] = _MONTHS["set"] = 9
_MONTHS["май"] = 5


def _month(name: str) -> int | None:
    """A month number from %b in any of the locales above, or CJK `11月`/`11월`; None when unknown."""
    if name[-1] in "月월" and name[:-1].isdigit():
        return int(name[:-1]) if 1 <= int(name[:-1]) <= 12 else None
    return _MONTHS.get(name.rstrip(".").lower())


@lru_cache(maxsize=4096)
def _syslog_second(base: str, year: int | None) -> float | None:
    """Syslog stamps have no year: `year`, or else the latest year that does not put the line in the
    future (a December line read in January is last year's). dmesg -H's minute stamps (`May19 19:57`,
    `4月21 11:15`) are read the same way, to the minute."""
    m = _DATE.fullmatch(base)
    month = _month(m["mon"]) if m else None
    if m is None or month is None:
        return None
    hms = [int(x) for x in m["hms"].split(":")] + [0]
    now = datetime.now(timezone.utc)
    for y in ((year,) if year else (now.year, now.year - 1)):
        try:
            t = datetime(y, month, int(m["day"]), hms[0], hms[1], hms[2], tzinfo=timezone.utc)
        except ValueError:
            continue                  # Feb 29 in a year without one
        if year or t.timestamp() <= now.timestamp() + 86400:
            return t.timestamp()
    return None


_DATE = re.compile(r"(?P<mon>[^\d\s]+|\d{1,2}[月월]) ?(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d(?::\d\d)?)")


_HUMAN = re.compile(rf"{_MON} ?\d{{1,2}} \d\d:\d\d")


def human_stamp_time(stamp: str, year: int | None = None) -> float | None:
    """The time of a `dmesg -H` minute stamp's text (`May19 19:57`, `4月21 11:15`), or None when it is none:
    the `[  +0.000127]` delta lines after it happened within that minute (dmesg prints a new minute stamp
    when the minute changes)."""
    return _syslog_time(stamp, year) if _HUMAN.fullmatch(stamp) else None
