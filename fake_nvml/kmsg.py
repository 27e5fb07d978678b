"""A fake /dev/kmsg over a FakeNode's kernel log, with the real device's semantics: one record per read,
records formatted and escaped as the kernel does, a ring buffer that keeps only the newest `ring_size`
records, EAGAIN when caught up, and EPIPE once when the reader's next record was overwritten (after which
reading goes on from the oldest record still present). Each instance is its own reader, like an open()."""

from __future__ import annotations

import errno
import re
import time

from fake_nvml.node import FakeNode, KernelRecord

_PRINTABLE = re.compile(rb"[^\x20-\x5b\x5d-\x7e]")   # what the kernel escapes: controls, DEL, >= 0x80, '\'
_PREFIX = re.compile(r"<(\d+)>")
LOG_USER = 1
DEFAULT_LEVEL = 4     # the kernel's default_message_loglevel, used for writes without a <N> prefix


def escape_message(message: str) -> bytes:
    raw = message.encode("utf-8", "replace")
    if message.isascii() and message.isprintable() and "\\" not in message:
        return raw
    return _PRINTABLE.sub(lambda m: b"\\x%02x" % m.group(0)[0], raw)


def format_record(record: KernelRecord) -> bytes:
    """The record exactly as read(2) on /dev/kmsg returns it."""
    return b"%d,%d,%d,-;%s\n" % (record.priority, record.seq, record.usec, escape_message(record.message))


class FakeKmsgDevice:
    """Implements detector.backends.kernlog.kmsg.KmsgDevice for one FakeNode."""

    def __init__(self, node: FakeNode, ring_size: int = 1024):
        if ring_size < 1:
            raise ValueError("ring_size must be at least 1")
        self.node = node
        self.ring_size = ring_size
        self._window: list[KernelRecord] = []   # the newest records seen (at least the ring's worth)
        self._newest = -1                        # highest seq the node has logged, as last seen
        self._refresh()
        self._pos = self._oldest()               # like open(): the first read returns the oldest record
        # Epoch seconds of the fake boot, so that boot_time + USEC lands on the wall clock.
        self.boot_time = time.time() - node.uptime_usec() / 1e6

    @property
    def boot_id(self) -> str:
        return self.node.read(lambda state: state.boot_id)

    # -- the device -----------------------------------------------------------------------------

    def read_record(self) -> bytes:
        self._refresh()
        if self._pos > self._newest:
            raise BlockingIOError(errno.EAGAIN, "no more kernel log records")
        oldest = self._oldest()
        if self._pos < oldest:
            self._pos = oldest
            raise BrokenPipeError(errno.EPIPE, "kernel log records overwritten")
        record = self._window[self._pos - self._window[0].seq]
        self._pos += 1
        return format_record(record)

    def seek_end(self) -> None:
        self._refresh()
        self._pos = self._newest + 1

    def seek_beginning(self) -> None:
        self._refresh()
        self._pos = self._oldest()

    def write(self, data: str) -> None:
        """A userland write(2) to /dev/kmsg: an optional <N> prefix sets level and facility, but the
        facility can never be the kernel's (0): without one it is LOG_USER. Each line becomes a record
        of its own (what Linux 6.x does with a multi-line write), later lines at the default level."""
        level, facility = DEFAULT_LEVEL, LOG_USER
        m = _PREFIX.match(data)
        if m:
            n = int(m.group(1))
            level = n & 7
            if n >> 3:
                facility = n >> 3
            data = data[m.end():]
        lines = data.split("\n")
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()
        records = [(text, facility * 8 + (level if i == 0 else DEFAULT_LEVEL)) for i, text in enumerate(lines)]
        # log_kernel expects the node's lock held (faults call it under the lock); read() holds it.
        self.node.read(lambda _state: [self.node.log_kernel(t, p) for t, p in records])

    # -- the ring buffer ------------------------------------------------------------------------

    def _oldest(self) -> int:
        return max(self._newest - self.ring_size + 1, self._window[0].seq if self._window else 0)

    def _refresh(self) -> None:
        new = self.node.kernel_records(self._newest)
        if not new:
            return
        self._window.extend(new)
        self._newest = new[-1].seq
        if len(self._window) > 2 * self.ring_size:   # trim in steps, not on every record
            del self._window[: len(self._window) - self.ring_size]
