"""Reading and writing files that someone else may have planted: bounded, regular files only, no links.

gpu-npd runs as root on the node and reads files that are not its own: a replay capture, a saved kernel
log, its state directory on a hostPath where another pod may have written. A FIFO there must not hang a
read, /dev/zero must not be read until memory runs out, and a symlink planted at a state file's name (or
its temporary name) must not make root write through it to anywhere else.

- `open_regular` opens without following a final symlink and without blocking (a FIFO opens at once) and
  refuses anything but a regular file; `read_bounded` reads such a file whole, at most `limit` bytes:
  more is an error, never a truncated read taken as whole.
- `write_atomic` writes a fresh, unpredictable temporary name in the same directory (O_EXCL: it never
  opens what is already there), fsyncs it and renames it over the target, which replaces a link rather
  than writing through it; a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFile(OSError):
    """A file refused before (or while) reading it: not a regular file, a symlink, or larger than allowed.
    An OSError, so callers that already survive an unreadable file survive this one too."""

    def __str__(self) -> str:
        return str(self.strerror)


def open_regular(path: Path | str, what: str = "file", follow_links: bool = False) -> BinaryIO:
    """`path` opened for reading as a stream, when it is a regular file: opened without blocking (a FIFO
    would wait for a writer) and, unless `follow_links` (a path a person typed is theirs to link), without
    following a final symlink. FileNotFoundError when absent; UnsafeFile when it is a link or not a regular
    file."""
    flags = os.O_RDONLY | _NONBLOCK | (0 if follow_links else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise UnsafeFile(errno.ELOOP, f"{what} {path} is a symbolic link; gpu-npd reads only regular "
                                          "files it does not have to follow a link to") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeFile(errno.EINVAL, f"{what} {path} is {not_regular(mode)}")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path | str, limit: int, what: str = "file") -> bytes:
    """The whole content of the regular file at `path` (open_regular, no link followed), at most `limit`
    bytes: UnsafeFile when it is larger, or grows past the limit while being read; never a truncated read
    taken as whole."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise UnsafeFile(errno.EFBIG, f"{what} {path} is {size:,} bytes, over the {limit:,}-byte limit")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(errno.EFBIG, f"{what} {path} is over the {limit:,}-byte limit")
    return data


def read_text_bounded(path: Path | str, limit: int, what: str = "file") -> str:
    """As read_bounded, decoded as UTF-8 (UnicodeDecodeError, a ValueError, when it is not)."""
    return read_bounded(path, limit, what).decode("utf-8")


def write_atomic(path: Path | str, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data`: a fresh temporary file beside it (never a fixed, guessable name), fsync
    (unless not `durable`: a file rewritten at every read, whose loss costs little, such as a log cursor),
    rename. A symlink planted at `path` is replaced, never written through. Raises OSError."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def not_regular(mode: int) -> str:
    """What a file of this mode is, for a refusal: "a FIFO, not a regular file"."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"{name}, not a regular file"
    return "not a regular file"


__all__ = ["UnsafeFile", "not_regular", "open_regular", "read_bounded", "read_text_bounded", "write_atomic"]
