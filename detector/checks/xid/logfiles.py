"""Which saved kernel logs to read for a post-mortem, in which order, and how to open them.

`--kernel-log` takes a file, `-` (stdin), a directory, or a glob. A directory or glob is read as one
log rotated into pieces, oldest first (`kern.log.3.gz`, `kern.log.2.gz`, `kern.log.1`, `kern.log`;
dated pieces `kern.log-20251001.gz` by date), so boots and times run forward. Compressed pieces
(gzip, bzip2, xz) are recognised by their first bytes, not their names.

Only regular files are read (stdin aside): a FIFO or a device named as a log is refused, never waited on
or read without end. A file is read as a stream, and scan.py holds each line to the live reader's cap,
so a huge log, or a small compressed one that inflates without end, costs time and never memory.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from detector.backends.safefile import not_regular, open_regular
from detector.backends.kernlog.wrappers import peel

_NUMBERED = re.compile(r"^(?P<base>.+?)\.(?P<n>\d+)(?:\.(?:gz|bz2|xz))?$")
_DATED = re.compile(r"^(?P<base>.+?)-(?P<date>\d{8}(?:\d{2,6})?)(?:\.(?:gz|bz2|xz))?$")
_MAGIC: list[tuple[bytes, Callable[[BinaryIO], BinaryIO]]] = [
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),                        # type: ignore[list-item]
    (b"BZh", lambda f: bz2.BZ2File(f)),                                        # type: ignore[list-item]
    (b"\xfd7zXZ\x00", lambda f: lzma.LZMAFile(f)),                             # type: ignore[list-item]
]
SNIFF_BYTES = 64 * 1024


class LogNotFound(ValueError):
    """Nothing to read where the user pointed."""


@dataclass(frozen=True)
class SavedLog:
    name: str                       # what the user sees: the path, or "stdin"
    path: Path | None               # None: stdin

    def open(self) -> BinaryIO:
        """The log's bytes, decompressed when it is compressed."""
        if self.path is None:
            return _Peekable(sys.stdin.buffer)
        # A regular file only, checked on the open file (it may have been swapped since saved_logs looked);
        # the user's own link is followed: they named it.
        raw = open_regular(self.path, "saved kernel log", follow_links=True)
        head = raw.read(6)
        raw.seek(0)
        for magic, opener in _MAGIC:
            if head.startswith(magic):
                return opener(raw)
        return raw


def saved_logs(spec: str) -> list[SavedLog]:
    """The pieces `spec` names, oldest first. LogNotFound when it names nothing readable."""
    if spec == "-":
        return [SavedLog("stdin", None)]
    path = Path(spec)
    if path.is_dir():
        files = [p for p in path.iterdir() if p.is_file()]
        if not files:
            raise LogNotFound(f"{spec}: the directory holds no files")
    elif path.is_file():
        return [SavedLog(spec, path)]
    elif path.exists():
        raise LogNotFound(f"{spec}: {not_regular(path.stat().st_mode)}; name a saved kernel log, or - for stdin")
    elif glob.has_magic(spec):
        files = [Path(p) for p in glob.glob(spec) if Path(p).is_file()]
        if not files:
            raise LogNotFound(f"{spec}: no file matches")
    else:
        raise LogNotFound(f"{spec}: no such file or directory")
    return [SavedLog(str(p), p) for p in sorted(files, key=rotation_key)]


def rotation_key(path: Path) -> tuple:
    """Oldest piece first: higher rotation numbers and earlier dates before the live file."""
    name = path.name
    if m := _NUMBERED.match(name):
        return (m["base"], 0, -int(m["n"]), "")
    if m := _DATED.match(name):
        return (m["base"], 1, 0, m["date"])
    return (name, 2, 0, "")


def looks_like_kernel_log(head: bytes) -> bool:
    """Whether any of the first lines is in a format the scanner knows (a stamp, a kmsg record, a
    journal entry, or a bare device message as `journalctl -k -o cat` prints it: `pcieport 0000:00:1c.5: ...`):
    what tells a kernel log from some other file named by mistake."""
    text = head.decode("utf-8", "replace")
    lines = text.splitlines()[:-1] if len(head) >= SNIFF_BYTES else text.splitlines()
    return any(peel(line).wrapped or _DEVICE_MESSAGE.match(line) for line in lines[:200] if line.strip())


# The kernel's dev_printk shape: driver name, the device's PCI address, then the message.
_DEVICE_MESSAGE = re.compile(r"^\s*[\w.-]+ [0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]: \S")


class _Peekable:
    """stdin cannot seek: keep what was read to sniff it, then hand it out again."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._head = b""

    def peek_head(self) -> bytes:
        if not self._head:
            self._head = self._stream.read(SNIFF_BYTES)
        return self._head

    def read(self, n: int = -1) -> bytes:
        if self._head:
            data, self._head = self._head[:n] if n >= 0 else self._head, self._head[n:] if n >= 0 else b""
            return data
        return self._stream.read(n)

    def close(self) -> None:
        pass                                   # stdin is not ours to close

    def __enter__(self) -> "_Peekable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_head(stream: BinaryIO) -> bytes:
    """The first bytes of an opened log, without losing them for the scan that follows."""
    if isinstance(stream, _Peekable):
        return stream.peek_head()
    head = stream.read(SNIFF_BYTES)
    stream.seek(0)
    return head
