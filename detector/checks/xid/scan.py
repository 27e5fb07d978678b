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
NEEDLES = (b"NVRM", b"SXid")
CHUNK = 8 * 1024 * 1024

Parsed = KernelEvent | UuidMapping | BootBanner
OnLine = Callable[[int, Parsed, str], None]          # (1-based line number, parsed, raw line)


@dataclass
class ScanStats:
    bytes: int = 0
    lines: int = 0
    candidates: int = 0


def scan_stream(stream: BinaryIO, on_line: OnLine, year: int | None = None, chunk_size: int = CHUNK) -> ScanStats:
    """Call `on_line` for every XID/SXid/UUID line, in input order. Memory: about two chunks."""
    stats = ScanStats()
    carry = b""
    lines_before = 0                       # newlines in all buffers already finished
    while True:
        data = stream.read(chunk_size)
        final = not data
        buf = carry + data if carry else data
        if final:
            if not carry:
                break
            buf += b"\n"                   # a last line without its newline still counts
        end = buf.rfind(b"\n") + 1
        if end == 0:                       # one enormous line so far: keep reading
            carry = buf
            continue
        stats.bytes += end - (1 if final else 0)
        lines_before = _scan_buffer(buf, end, lines_before, on_line, year, stats)
        carry = buf[end:]
        if final:
            break
    stats.lines = lines_before
    return stats


def _scan_buffer(buf: bytes, end: int, lines_before: int, on_line: OnLine, year: int | None,
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
