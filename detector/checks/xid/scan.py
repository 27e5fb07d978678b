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

from dataclasses import dataclass
from typing import BinaryIO, Callable

from detector.backends.kernlog.logfile import MAX_LINE
from detector.checks.xid.parser import Parsed, parse_line

# Every XID, fallen-off-the-bus and UUID line holds NVRM; every NVSwitch line `SXid (`; boots start
# with the kernel's banner or, in journalctl's output, a marker line. A journal exported as JSON keeps
# a message that is not clean UTF-8 as a byte array, which no text needle can see.
NEEDLES = (b"NVRM", b"SXid (", b"Linux version ", b"Command line: ", b"-- Boot ", b"-- Reboot --",
           b'"MESSAGE" : [', b'"MESSAGE": [', b'"MESSAGE":[')
CHUNK = 1024 * 1024              # big enough that per-chunk overhead vanishes; small for RSS
NEWLINE = ord("\n")

OnLine = Callable[[int, Parsed, str], None]          # (1-based line number, parsed, raw line)
Finder = Callable[[bytearray, int], list[int]]       # (buffer, end) -> sorted starts of candidate lines


@dataclass
class ScanStats:
    bytes: int = 0
    lines: int = 0
    candidates: int = 0
    parsed: int = 0
    long_lines: int = 0              # lines cut at max_line


def scan_stream(stream: BinaryIO, on_line: OnLine, year: int | None = None, chunk_size: int = CHUNK,
                finder: Finder | None = None, max_line: int = MAX_LINE) -> ScanStats:
    """Call `on_line` for every XID/SXid/UUID/boot line, in input order. Memory: one chunk and one line,
    each at most max(chunk_size, max_line) bytes: a line that fills that much is cut a byte short of it."""
    find = finder or best_finder()
    stats = ScanStats()
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
    for line_start in find(buf, end):
        lineno += buf.count(b"\n", counted_to, line_start)
        counted_to = line_start
        line_end = buf.find(b"\n", line_start, end)
        stats.candidates += 1
        text = buf[line_start:line_end].decode("utf-8", "replace")
        parsed = parse_line(text, year)
        if parsed is not None:
            stats.parsed += 1
            on_line(lineno + 1, parsed, text)
    return lineno + buf.count(b"\n", counted_to, end)


def find_passes(buf: bytearray, end: int) -> list[int]:
    """One C-level `find` pass per needle: no dependency, a pass each."""
    starts = set()
    for needle in NEEDLES:
        pos = buf.find(needle, 0, end)
        while pos != -1:
            starts.add(buf.rfind(b"\n", 0, pos) + 1)
            pos = buf.find(needle, buf.find(b"\n", pos, end) + 1, end)
    return sorted(starts)


def hyperscan_finder() -> Finder | None:
    """All needles in one SIMD pass; None where Hyperscan is not installed or cannot run here."""
    try:
        import hyperscan
    except ImportError:
        return None
    try:
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        expressions = [n.replace(b"(", rb"\(").replace(b"[", rb"\[") for n in NEEDLES]
        db.compile(expressions=expressions, ids=list(range(len(NEEDLES))), elements=len(NEEDLES),
                   flags=[0] * len(NEEDLES))
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


def best_finder() -> Finder:
    """Hyperscan's one pass when it is available (a fresh database: not shared between threads)."""
    return hyperscan_finder() or find_passes
