"""Scan a whole kernel log (a saved file, stdin) at close to memory speed.

Almost no line of a kernel log is an XID. Instead of a Python loop per line, the scanner reads big
chunks and finds the few candidate lines (`NVRM`, `SXid (`, boot banners, journal boot markers,
journal JSON messages stored as byte arrays) in one pass with Hyperscan, a SIMD multi-pattern
matcher; where Hyperscan cannot run (an unsupported CPU or platform) C-level `bytes.find` passes do
the same, more slowly. Only candidate lines are decoded and parsed; line numbers come from `bytes.count`.

A line is held to the live reader's cap (kernlog's MAX_LINE, 1 MiB, where the kernel's own records are
under 1 KiB): a longer one is cut there and the rest of it skipped up to its newline, read a chunk at a
time, so a log of one endless line (binary junk, gzipped zeros) costs time, never memory. It is cut, not
dropped, because a driver's line says XID, bus id and code at its start; and not split into pieces, so
no piece is taken for a line the kernel wrote and the line numbers after it stay true.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import BinaryIO, Callable

from detector.backends.kernlog.driverlines import (
    BURST_LINES,
    BURST_NEEDLES,
    PCIE_AER,
    PROBE_NEEDLES,
    RM_INIT_FAILED,
    DriverEvent,
    parse_driver_line,
)
from detector.backends.kernlog.driverlines import NEEDLES as DRIVER_NEEDLES
from detector.backends.kernlog.logfile import MAX_LINE
from detector.backends.kernlog.wrappers import human_stamp_time
from detector.checks.xid.parser import KernelEvent, Parsed, parse_line

# Every XID, fallen-off-the-bus and UUID line holds NVRM; every NVSwitch line `SXid (`; boots start
# with the kernel's banner or, in journalctl's output, a marker line. A journal exported as JSON keeps
# a message that is not clean UTF-8 as a byte array, which no text needle can see.
NEEDLES = (b"NVRM", b"SXid (", b"Linux version ", b"Command line: ", b"-- Boot ", b"-- Reboot --",
           b'"MESSAGE" : [', b'"MESSAGE": [', b'"MESSAGE":[')
CHUNK = 1024 * 1024              # big enough that per-chunk overhead vanishes; small for RSS
NEWLINE = ord("\n")

OnLine = Callable[[int, Parsed | DriverEvent, str], None]   # (1-based line number, parsed, raw line)
Finder = Callable[[bytearray, int], list[int]]       # (buffer, end) -> sorted starts of candidate lines


@dataclass
class ScanStats:
    bytes: int = 0
    lines: int = 0
    candidates: int = 0
    parsed: int = 0
    long_lines: int = 0              # lines cut at max_line
    drivers: bool = False            # driver lines are read too
    minute: float | None = None      # dmesg -H: the time of the last minute stamp seen
    minute_from: int = 0             # where in the buffer the search for it goes on from
    relative: bool = False           # a delta-stamped (`dmesg -H`) line was read: follow the minute stamps


def scan_stream(stream: BinaryIO, on_line: OnLine, year: int | None = None, chunk_size: int = CHUNK,
                finder: Finder | None = None, max_line: int = MAX_LINE, drivers: bool = False) -> ScanStats:
    """Call `on_line` for every XID/SXid/UUID/boot line, in input order. Memory: one chunk and one line,
    each at most max(chunk_size, max_line) bytes: a line that fills that much is cut a byte short of it.
    `drivers`: also the GPU driver and PCIe AER lines of `driverlines` (DriverEvents), a GPU's AER line
    with the lines of its burst around it, and `dmesg -H` delta lines timed by the minute stamp before them."""
    find = finder or best_finder(drivers)
    stats = ScanStats()
    stats.drivers = drivers
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    held = 0                               # bytes of an unfinished line kept at the front of buf
    lines_before = 0                       # newlines in all buffers already finished
    while True:
        if held == len(buf) < max_line:    # a long line: make room for it, up to max_line
            view.release()
            buf.extend(bytes(min(len(buf), max_line - len(buf))))
            view = memoryview(buf)
        elif held == len(buf):             # longer still: keep its start as the line, skip the rest
            buf[held - 1] = NEWLINE
            stats.bytes += held
            stats.long_lines += 1
            lines_before = _scan_buffer(buf, held, lines_before, on_line, year, stats, find)
            rest = _skip_rest_of_line(stream, buf, view, stats)
            if rest is None:
                break
            held = rest
            continue
        got = _fill(stream, view, held)
        filled = held + (got or 0)
        final = not got
        if final:
            if held == 0:
                break
            if buf[filled - 1:filled] != b"\n":
                buf[filled:filled + 1] = b"\n"  # a last line without its newline still counts
                filled += 1
        end = buf.rfind(b"\n", 0, filled) + 1
        if end == 0:
            held = filled
            continue
        stats.bytes += end
        lines_before = _scan_buffer(buf, end, lines_before, on_line, year, stats, find)
        held = filled - end
        buf[:held] = buf[end:filled]
        if final:
            break
    stats.lines = lines_before
    return stats


def _fill(stream: BinaryIO, view: memoryview, start: int) -> int:
    """Read into view[start:]; how many bytes came (0 at the end)."""
    if hasattr(stream, "readinto"):
        return stream.readinto(view[start:]) or 0
    return _read_into(stream, view, start)


def _skip_rest_of_line(stream: BinaryIO, buf: bytearray, view: memoryview, stats: ScanStats) -> int | None:
    """Read past the rest of a cut line, a buffer at a time: what follows its newline is moved to the front
    of `buf` and its length returned; None when the stream ends first."""
    while got := _fill(stream, view, 0):
        newline = buf.find(b"\n", 0, got)
        if newline < 0:
            stats.bytes += got
            continue
        stats.bytes += newline + 1
        rest = got - newline - 1
        buf[:rest] = buf[newline + 1:got]
        return rest
    return None


def _read_into(stream: BinaryIO, view: memoryview, start: int) -> int:
    data = stream.read(len(view) - start)
    view[start:start + len(data)] = data
    return len(data)


def _scan_buffer(buf: bytearray, end: int, lines_before: int, on_line: OnLine, year: int | None,
                 stats: ScanStats, find: Finder) -> int:
    counted_to, lineno = 0, lines_before
    stats.minute_from = 0
    drivers = stats.drivers
    starts = find(buf, end)
    pending: list[int] = []            # lines read around a driver line, after it, still to read
    done: set[int] = set()             # lines read around a driver line, out of the candidates' order
    last = -1                          # the start of the last line read in order
    i = 0
    while i < len(starts) or pending:
        found = not pending or (i < len(starts) and starts[i] < pending[0])
        if found:
            line_start = starts[i]
            i += 1
        else:
            line_start = pending.pop(0)
            done.discard(line_start)               # read now, in order
        if line_start <= last or (done and line_start in done):
            continue
        line_end = buf.find(b"\n", line_start, end)
        text = buf[line_start:line_end].decode("utf-8", "replace")
        stats.candidates += 1
        parsed = parse_line(text, year)
        if parsed is None and drivers:
            parsed = parse_driver_line(text, year)
        if found and parsed.__class__ is DriverEvent and (needles := _around(parsed)):
            before, after = _burst(buf, line_start, line_end, end, needles)
            for start in before:                       # the lines before it, in order; one before a
                if start in done or _is_candidate(starts, start, i):   # candidate read is numbered apart
                    continue
                done.add(start)
                btext, _ = _line(buf, start, end)
                bparsed = _parse(btext, year, True)
                if start > counted_to:
                    lineno += buf.count(b"\n", counted_to, start)
                    counted_to = last = start
                    number = lineno + 1
                else:
                    number = lineno + 1 - buf.count(b"\n", start, counted_to)
                if bparsed is not None:
                    _emit(buf, start, number, bparsed, btext, on_line, year, stats)
            done.update(after)
            pending = sorted(set(pending) | set(after))
        lineno += buf.count(b"\n", counted_to, line_start)
        counted_to = last = line_start
        if parsed is not None:
            stats.parsed += 1
            if drivers and text[:1] == "[" and "+" in text[1:8]:
                parsed = _delta_timed(buf, line_start, parsed, text, year, stats)
            on_line(lineno + 1, parsed, text)
    if stats.relative:                 # the minute the next buffer's first delta lines belong to
        _minute_before(buf, end, year, stats)
    return lineno + buf.count(b"\n", counted_to, end)


def _is_candidate(starts: list[int], start: int, read: int) -> bool:
    """Whether `start` is one of the candidates already read (the first `read` of `starts`)."""
    k = bisect_left(starts, start, 0, read)
    return k < read and starts[k] == start


def _around(parsed: Parsed | DriverEvent | None) -> tuple[bytes, ...]:
    """The lines a driver line needs read around it: a GPU's AER line its burst's port lines; the driver's
    `probe routine failed for N device(s)` the `nvidia: probe of BUS failed` lines before it."""
    if not isinstance(parsed, DriverEvent):
        return ()
    if parsed.kind == PCIE_AER and not parsed.port:
        return BURST_NEEDLES
    if parsed.kind == RM_INIT_FAILED and "probe routine failed" in parsed.text:
        return PROBE_NEEDLES
    return ()


def _parse(text: str, year: int | None, drivers: bool) -> Parsed | DriverEvent | None:
    parsed = parse_line(text, year)
    if parsed is None and drivers:
        return parse_driver_line(text, year)
    return parsed


def _line(buf: bytearray, start: int, end: int) -> tuple[str, int]:
    line_end = buf.find(b"\n", start, end)
    return buf[start:line_end].decode("utf-8", "replace"), line_end


def _emit(buf: bytearray, start: int, lineno: int, parsed: Parsed | DriverEvent, text: str, on_line: OnLine,
          year: int | None, stats: ScanStats) -> None:
    stats.parsed += 1
    if stats.drivers and text[:1] == "[" and "+" in text[1:8]:
        parsed = _delta_timed(buf, start, parsed, text, year, stats)
    on_line(lineno, parsed, text)


def _delta_timed(buf: bytearray, start: int, parsed: Parsed | DriverEvent, text: str, year: int | None,
                 stats: ScanStats) -> Parsed | DriverEvent:
    """A `dmesg -H` delta line's event, given the time of the minute stamp before it."""
    if not isinstance(parsed, (KernelEvent, DriverEvent)) or parsed.time is not None:
        return parsed
    stats.relative = True
    when = _minute_before(buf, start, year, stats)
    return parsed if when is None else replace(parsed, time=when)


# `dmesg -H` prints a minute stamp (`[May19 19:57]`) when the minute changes and the delta since the line
# before (`[  +0.000127]`) otherwise: a delta line happened in the minute of the last minute stamp.
_MINUTE = re.compile(rb"(?:^|\n)\[(?![\d.\s]+\])(?P<stamp>[^\s+\]\n\[][^\]\n]{3,14})\] ")


def _minute_before(buf: bytearray, start: int, year: int | None, stats: ScanStats) -> float | None:
    """The minute stamp before `start` (searched once per byte: from where the last search ended). The search
    starts at the first delta line: a minute stamp in an earlier 1 MiB buffer than that line's is not seen."""
    found = None
    for m in _MINUTE.finditer(buf, stats.minute_from, start):
        found = m
    if found is not None:
        when = human_stamp_time(found["stamp"].decode("utf-8", "replace"), year)
        if when is not None:
            stats.minute = when
    stats.minute_from = max(stats.minute_from, start)
    return stats.minute


def _burst(buf: bytearray, start: int, line_end: int, end: int,
           needles: tuple[bytes, ...]) -> tuple[list[int], list[int]]:
    """The lines holding `needles` within BURST_LINES lines of a line (a port's AER report about a GPU, the
    probe failures before the driver's summary), in this buffer: those before it and those after it."""
    lo = start
    for _ in range(BURST_LINES):
        if lo <= 0:
            break
        lo = buf.rfind(b"\n", 0, lo - 1) + 1
    hi = line_end
    for _ in range(BURST_LINES):
        nxt = buf.find(b"\n", hi + 1, end)
        if nxt < 0:
            break
        hi = nxt
    found: set[int] = set()
    for needle in needles:
        pos = buf.find(needle, lo, hi)
        while pos != -1:
            found.add(buf.rfind(b"\n", 0, pos) + 1)
            pos = buf.find(needle, buf.find(b"\n", pos, end) + 1, hi)
    return sorted(s for s in found if s < start), sorted(s for s in found if s > start)


def find_passes(buf: bytearray, end: int, needles: tuple[bytes, ...] = NEEDLES) -> list[int]:
    """One C-level `find` pass per needle: no dependency, a pass each."""
    starts = set()
    for needle in needles:
        pos = buf.find(needle, 0, end)
        while pos != -1:
            starts.add(buf.rfind(b"\n", 0, pos) + 1)
            pos = buf.find(needle, buf.find(b"\n", pos, end) + 1, end)
    return sorted(starts)


def hyperscan_finder(needles: tuple[bytes, ...] = NEEDLES) -> Finder | None:
    """All needles in one SIMD pass; None where Hyperscan is not installed or cannot run here."""
    try:
        import hyperscan
    except ImportError:
        return None
    try:
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        expressions = [n.replace(b"(", rb"\(").replace(b"[", rb"\[") for n in needles]
        db.compile(expressions=expressions, ids=list(range(len(needles))), elements=len(needles),
                   flags=[0] * len(needles))
    except Exception:  # noqa: BLE001 - an unsupported CPU (no SSSE3) fails here: fall back
        return None

    def find(buf: bytearray, end: int) -> list[int]:
        ends: list[int] = []
        with memoryview(buf) as whole, whole[:end] as part:      # released before the buffer grows
            db.scan(part, match_event_handler=lambda _id, _from, to, _flags, _ctx: ends.append(to))
        starts: list[int] = []
        for to in ends:                     # reported in order of their end offset
            start = buf.rfind(b"\n", 0, to) + 1
            if not starts or start > starts[-1]:
                starts.append(start)
        return starts

    return find


def best_finder(drivers: bool = False) -> Finder:
    """Hyperscan's one pass when it is available (a fresh database: not shared between threads).
    `drivers`: the driver lines' needles too."""
    needles = NEEDLES + DRIVER_NEEDLES if drivers else NEEDLES
    return hyperscan_finder(needles) or (lambda buf, end: find_passes(buf, end, needles))
