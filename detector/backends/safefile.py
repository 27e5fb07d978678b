"""Reading and writing files that someone else may have planted: bounded, regular files only, no links.

gpu-npd runs as root on the node and reads files that are not its own: a replay capture, a saved kernel
log, its state directory on a hostPath where another pod may have written. A FIFO there must not hang a
read, /dev/zero must not be read until memory runs out, and a symlink planted at a state file's name (or
its temporary name) must not make root write through it to anywhere else.

- `read_bounded` opens without following a final symlink and without blocking (a FIFO opens at once),
  refuses anything but a regular file, and reads at most `limit` bytes: more is an error, never a
  truncated read taken as whole.
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

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFile(OSError):
    """A file refused before (or while) reading it: not a regular file, a symlink, or larger than allowed.
    An OSError, so callers that already survive an unreadable file survive this one too."""

    def __str__(self) -> str:
        return str(self.strerror)


def read_bounded(path: Path | str, limit: int, what: str = "file") -> bytes:
    """The whole content of the regular file at `path`, at most `limit` bytes.

    Raises FileNotFoundError when it is absent, UnsafeFile (with one line for a person) when it is a link,
    a FIFO, a device, a directory or larger than `limit`, and OSError for other failures."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, f"{what} {path} is a symbolic link; gpu-npd reads only regular "
                                          "files it does not have to follow a link to") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{what} {path} is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UnsafeFile(errno.EFBIG, f"{what} {path} is {info.st_size:,} bytes, over the "
                                          f"{limit:,}-byte limit")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:          # it grew while being read
                raise UnsafeFile(errno.EFBIG, f"{what} {path} is over the {limit:,}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text_bounded(path: Path | str, limit: int, what: str = "file") -> str:
    """As read_bounded, decoded as UTF-8 (UnicodeDecodeError, a ValueError, when it is not)."""
    return read_bounded(path, limit, what).decode("utf-8")


def write_atomic(path: Path | str, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data`: a fresh temporary file beside it (never a fixed, guessable name), fsync,
    rename. A symlink planted at `path` is replaced, never written through. Raises OSError."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


__all__ = ["UnsafeFile", "read_bounded", "read_text_bounded", "write_atomic"]
