"""Scan a whole kernel log (a saved file, stdin) at close to memory speed.

Almost no line of a kernel log is an XID. Instead of a Python loop per line, the scanner reads big
chunks and lets C-level `bytes.find` jump from one candidate (`NVRM`, `SXid`) to the
next; only candidate lines are decoded and parsed, and line numbers come from `bytes.count`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Callable

from detector.checks.xid.parser import BootBanner, KernelEvent, UuidMapping, parse_line

# Every XID, fallen-off-the-bus and UUID line holds NVRM; every NVSwitch line SXid. (Boot banners are
# not searched for: a third pass costs a third more time; boots show as monotonic time going back.)
NEEDLES = (b"NVRM", b"SXid (")
CHUNK = 1024 * 1024              # big enough that per-chunk overhead vanishes; small for RSS

Parsed = KernelEvent | UuidMapping | BootBanner
OnLine = Callable[[int, Parsed, str], None]          # (1-based line number, parsed, raw line)


@dataclass
class ScanStats:
    bytes: int = 0
    lines: int = 0
    candidates: int = 0


def scan_stream(stream: BinaryIO, on_line: OnLine, year: int | None = None, chunk_size: int = CHUNK) -> ScanStats:
    """Call `on_line` for every XID/SXid/UUID line, in input order. Memory: one chunk plus one line."""
    stats = ScanStats()
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    held = 0                               # bytes of an unfinished line kept at the front of buf
    lines_before = 0                       # newlines in all buffers already finished
    while True:
        if held == len(buf):               # one enormous line: make room rather than lose it
            view.release()
            buf.extend(bytes(len(buf)))
            view = memoryview(buf)
        got = stream.readinto(view[held:]) if hasattr(stream, "readinto") else _read_into(stream, view, held)
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
        lines_before = _scan_buffer(buf, end, lines_before, on_line, year, stats)
        held = filled - end
        buf[:held] = buf[end:filled]
        if final:
            break
    stats.lines = lines_before
    return stats


def _read_into(stream: BinaryIO, view: memoryview, start: int) -> int:
    data = stream.read(len(view) - start)
    view[start:start + len(data)] = data
    return len(data)


def _scan_buffer(buf: bytearray, end: int, lines_before: int, on_line: OnLine, year: int | None,
                 stats: ScanStats) -> int:
    starts = set()
    for needle in NEEDLES:
        pos = buf.find(needle, 0, end)
        while pos != -1:
            line_start = buf.rfind(b"\n", 0, pos) + 1
            starts.add(line_start)
            next_nl = buf.find(b"\n", pos, end)
            pos = buf.find(needle, next_nl + 1, end)
    counted_to, lineno = 0, lines_before
    for line_start in sorted(starts):
        lineno += buf.count(b"\n", counted_to, line_start)
        counted_to = line_start
        line_end = buf.find(b"\n", line_start, end)
        stats.candidates += 1
        text = buf[line_start:line_end].decode("utf-8", "replace")
        parsed = parse_line(text, year)
        if parsed is not None:
            on_line(lineno + 1, parsed, text)
    return lineno + buf.count(b"\n", counted_to, end)
