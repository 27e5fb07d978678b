"""Tailing a kernel log file (kern.log, messages, a dmesg dump) the way logrotate leaves it: across renames
(the old file's last lines first, then the new file from its start), copytruncate, a file that does not
exist yet, and restarts of the reader (a cursor of inode and offset)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from io import FileIO
from typing import Callable

from detector.backends.kernlog.cursor import CursorStore, Start, checked_start
from detector.backends.kernlog.records import LogLine

log = logging.getLogger(__name__)


CHUNK = 1 << 20                 # bytes per read
MAX_LINE = 1 << 20              # a line this long without a newline is handed out as it is (binary junk)
HEAD_BYTES = 64                 # fingerprint of a file's start: an inode number alone is reused quickly
COUNT_LINES_UP_TO = 256 << 20   # starting at the end of a bigger file leaves its line numbers unknown
DEFAULT_BATCH_LIMIT = 50_000    # lines per read_available when the caller sets no limit (memory stays flat)
WAIT_POLL_S = 0.05              # how often wait() looks at the file: cheap stats, and no inotify dependency


@dataclass
class TailStats:
    lines: int = 0          # handed out
    rotations: int = 0      # the path came to name another file
    truncations: int = 0    # the file shrank below what was read (copytruncate)
    long_lines: int = 0     # lines cut at MAX_LINE
    errors: int = 0         # I/O errors (the reader keeps going)


@dataclass
class _OpenFile:
    f: FileIO
    inode: int
    dev: int
    pos: int                  # file offset just past the bytes in `buf`
    lineno: int | None        # lines handed out from this file so far; None: unknown
    last_activity: float
    buf: bytes = b""          # read but not yet handed out: a partial line, or lines held back by a limit
    head: str = ""
    head_len: int = 0

    @property
    def offset(self) -> int:
        """Where the first line not yet handed out starts: what a cursor must hold."""
        return self.pos - len(self.buf)


def _fingerprint(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class LogFileTail:
    """Complete lines appended to `path`, each handed out once. Never raises on I/O errors.

    After a rotation (the path names a new inode), the old file is still drained for `rotate_wait_s`
    seconds, because a writer keeps appending to it until it reopens the path (rsyslog after its HUP).
    """

    def __init__(self, path: Path | str, cursor: CursorStore, start: Start = "end",
                 rotate_wait_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 batch_limit: int = DEFAULT_BATCH_LIMIT, chunk_size: int = CHUNK):
        checked_start(start)
        self.path = Path(path)
        self.name = str(self.path)
        self.cursor = cursor
        self.start = start
        self.rotate_wait_s = rotate_wait_s
        self.clock = clock
        self.batch_limit = batch_limit
        self.chunk_size = chunk_size
        self.stats = TailStats()
        self._cur: _OpenFile | None = None
        self._old: _OpenFile | None = None          # the file before the last rotation, drained until quiet
        self._saved = cursor.load()                 # consulted once, for the first file opened
        self._wake = threading.Event()
        self._open_current(initial=True)

    # -- reading --------------------------------------------------------------------------------

    def read_available(self, max_lines: int | None = None) -> list[LogLine]:
        """The complete lines available now, oldest first (at most `max_lines`, else `batch_limit`)."""
        limit = self.batch_limit if max_lines is None else max_lines
        out: list[LogLine] = []
        if self._old is not None and not self._drain(self._old, out, limit):
            if self.clock() - self._old.last_activity >= self.rotate_wait_s:
                self._retire_old(out, limit)
        if len(out) < limit and (self._cur is not None or self._open_current(initial=False)):
            assert self._cur is not None
            self._check_truncation(self._cur)
            if not self._drain(self._cur, out, limit):
                self._check_rotation(out, limit)
        self.stats.lines += len(out)
        self._save()
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until the file may hold new lines (True) or `timeout_s` passes (False), looking at its
        size and inode every WAIT_POLL_S seconds. `wake` ends it early (True)."""
        deadline = time.monotonic() + timeout_s
        while not self._changed():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._wake.wait(min(WAIT_POLL_S, left)):
                break
        self._wake.clear()
        return True

    def wake(self) -> None:
        """End a `wait` in another thread now (shutting down)."""
        self._wake.set()

    def _changed(self) -> bool:
        """Whether read_available has something to do: bytes past what was read (or a shrunk file), lines
        held back by a limit, a rotation, the path appearing, or a rotated file due to be retired."""
        try:
            for of in (self._old, self._cur):
                if of is not None and (b"\n" in of.buf or os.fstat(of.f.fileno()).st_size != of.pos):
                    return True
            if self._old is not None and self.clock() - self._old.last_activity >= self.rotate_wait_s:
                return True
            cur = self._cur
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        except OSError:
            return False          # read_available reports the error; waiting goes on
        return cur is None or (st.st_ino, st.st_dev) != (cur.inode, cur.dev)

    def close(self) -> None:
        for of in (self._old, self._cur):
            if of is not None:
                self._close(of)
        self._old = self._cur = None

    def _drain(self, of: _OpenFile, out: list[LogLine], limit: int) -> bool:
        """Append `of`'s complete lines to `out`; True when stopped by the limit, False at end of file."""
        while len(out) < limit:
            if b"\n" in of.buf:
                self._take_lines(of, out, limit - len(out))
                continue
            try:
                data = of.f.read(self.chunk_size)
            except OSError as e:
                self._error(f"cannot read {self.path}", e)
                return False
            if not data:
                return False
            of.pos += len(data)
            of.last_activity = self.clock()
            of.buf = of.buf + data if of.buf else data
            if len(of.buf) > MAX_LINE and b"\n" not in of.buf:
                self.stats.long_lines += 1
                self._emit(of, of.buf, out)
                of.buf = b""
        return True

    def _take_lines(self, of: _OpenFile, out: list[LogLine], room: int) -> None:
        buf = of.buf
        end = buf.rfind(b"\n")
        parts = buf[:end].split(b"\n")
        if room < len(parts):
            parts = parts[:room]
            consumed = sum(len(p) for p in parts) + len(parts)
        else:
            consumed = end + 1
        of.buf = buf[consumed:]
        for raw in parts:
            self._emit(of, raw, out)

    def _emit(self, of: _OpenFile, raw: bytes, out: list[LogLine]) -> None:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if of.lineno is not None:
            of.lineno += 1
        out.append(LogLine(raw.decode("utf-8", "replace"), lineno=of.lineno))

    # -- following the path ---------------------------------------------------------------------

    def _check_truncation(self, of: _OpenFile) -> None:
        """Shrunk below what was read, or its first bytes replaced (truncated, then rewritten past the old
        offset before this check): either way the file starts over."""
        try:
            size = os.fstat(of.f.fileno()).st_size
            replaced = size >= of.pos and of.head_len > 0 and (
                _fingerprint(os.pread(of.f.fileno(), of.head_len, 0)) != of.head)
        except OSError as e:
            self._error(f"cannot stat {self.path}", e)
            return
        if size >= of.pos and not replaced:
            return
        self.stats.truncations += 1
        try:
            of.f.seek(0)
        except OSError as e:
            self._error(f"cannot rewind {self.path}", e)
            return
        of.pos, of.buf, of.lineno, of.head, of.head_len = 0, b"", 0, "", 0

    def _check_rotation(self, out: list[LogLine], limit: int) -> None:
        cur = self._cur
        assert cur is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return              # renamed away and not yet recreated: the open file is still the one
        except OSError as e:
            self._error(f"cannot stat {self.path}", e)
            return
        if (st.st_ino, st.st_dev) == (cur.inode, cur.dev):
            return
        self.stats.rotations += 1
        if self._old is not None:                   # rotated again while the previous one drained
            self._retire_old(out, limit, force=True)
        cur.last_activity = self.clock()
        self._old, self._cur = cur, None
        if self.rotate_wait_s <= 0:
            self._retire_old(out, limit)
        if self._open_current(initial=False):
            assert self._cur is not None
            self._drain(self._cur, out, limit)

    def _retire_old(self, out: list[LogLine], limit: int, force: bool = False) -> None:
        """Close the rotated file; its unterminated last line, if any, is complete now."""
        old = self._old
        if old is None:
            return
        if old.buf and (force or len(out) < limit):
            self._emit(old, old.buf, out)
            old.buf = b""
        elif old.buf:
            return              # no room for the last line now: retire on the next read
        self._close(old)
        self._old = None

    def _open_current(self, initial: bool) -> bool:
        try:
            f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._error(f"cannot open {self.path}", e)
            return False
        try:
            st = os.fstat(f.fileno())
            pos, lineno, head, head_len = self._start_position(f.fileno(), st, initial)
            f.seek(pos)
        except OSError as e:
            f.close()
            self._error(f"cannot open {self.path}", e)
            return False
        self._cur = _OpenFile(f, st.st_ino, st.st_dev, pos, lineno, self.clock(), head=head, head_len=head_len)
        self._saved = None
        return True

    def _start_position(self, fd: int, st: os.stat_result, initial: bool) -> tuple[int, int | None, str, int]:
        saved = self._saved
        if saved and saved.get("inode") == st.st_ino and self._same_head(fd, saved):
            offset, lineno = saved.get("offset"), saved.get("lineno")
            if type(offset) is int and 0 <= offset <= st.st_size:
                return offset, lineno if type(lineno) is int else None, saved["head"], saved["head_len"]
            if type(offset) is int and offset > st.st_size:
                self.stats.truncations += 1         # truncated while the reader was down
                return 0, 0, "", 0
        if initial and self.start == "end":
            offset = self._last_line_end(fd, st.st_size)
            return offset, self._count_lines(fd, offset), "", 0
        return 0, 0, "", 0

    @staticmethod
    def _same_head(fd: int, saved: dict) -> bool:
        head, head_len = saved.get("head"), saved.get("head_len")
        if type(head_len) is not int or not isinstance(head, str):
            return False
        return head_len == 0 or _fingerprint(os.pread(fd, head_len, 0)) == head

    @staticmethod
    def _last_line_end(fd: int, size: int) -> int:
        """Just past the file's last newline: a partial last line is handed out once it is complete."""
        end = size
        while end > 0:
            begin = max(0, end - (64 << 10))
            i = os.pread(fd, end - begin, begin).rfind(b"\n")
            if i >= 0:
                return begin + i + 1
            end = begin
        return 0

    @staticmethod
    def _count_lines(fd: int, upto: int) -> int | None:
        if upto > COUNT_LINES_UP_TO:
            return None
        count, pos = 0, 0
        while pos < upto:
            data = os.pread(fd, min(CHUNK, upto - pos), pos)
            if not data:
                break
            count += data.count(b"\n")
            pos += len(data)
        return count

    # -- cursor and housekeeping ----------------------------------------------------------------

    def _save(self) -> None:
        cur = self._cur
        if cur is None:
            return
        offset = cur.offset
        if cur.head_len < HEAD_BYTES and offset > cur.head_len:
            try:
                data = os.pread(cur.f.fileno(), min(HEAD_BYTES, offset), 0)
                cur.head, cur.head_len = _fingerprint(data), len(data)
            except OSError as e:
                self._error(f"cannot read {self.path}", e)
        self.cursor.save({"inode": cur.inode, "offset": offset, "lineno": cur.lineno,
                          "head": cur.head, "head_len": cur.head_len})

    def _close(self, of: _OpenFile) -> None:
        try:
            of.f.close()
        except OSError:
            pass

    def _error(self, what: str, e: OSError) -> None:
        self.stats.errors += 1
        log.warning("%s: %s", what, e)
