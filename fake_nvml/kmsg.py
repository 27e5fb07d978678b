"""A fake /dev/kmsg over a FakeNode's kernel log, with the real device's semantics: one record per read,
records formatted and escaped as the kernel does, a ring buffer that keeps only the newest `ring_size`
records, EAGAIN when caught up, and EPIPE once when the reader's next record was overwritten (after which
reading goes on from the oldest record still present). Each instance is its own reader, like an open().

Unlike the real device, one can outlive a reboot of its node (a `reboot` fault): its next read raises EPIPE
once, then it reads the new boot's records from the first; `boot_id` tells the boots apart. `wait` blocks
until the node logs, as poll(2) on /dev/kmsg does."""

from __future__ import annotations

import errno
import re
import time

from fake_nvml.node import FakeNode, KernelRecord, NodeState

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
        self._boot: str | None = None            # the boot those records belong to
        self._woken = False                      # wake() was called since the last wait()
        self.boot_time = 0.0                     # set by _refresh for each boot
        self._refresh()
        self._pos = self._oldest()               # like open(): the first read returns the oldest record

    @property
    def boot_id(self) -> str:
        """The node's live boot id (it may have moved past the records this device has read)."""
        return self.node.boot_id

    # -- the device -----------------------------------------------------------------------------

    def read_record(self) -> bytes:
        if self._refresh():
            raise BrokenPipeError(errno.EPIPE, "the node rebooted: reading goes on with the new boot's records")
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

    def wait(self, timeout_s: float) -> bool:
        """Block until a record is waiting to be read (or the node reboots, or `wake` is called); False
        when `timeout_s` passes first."""
        def ready() -> bool:
            if self._woken:
                self._woken = False
                return True
            boot, newest = self.node.kernel_head()
            return boot != self._boot or newest > self._newest or self._pos <= self._newest

        return self.node.wait_kernel(ready, timeout_s)

    def wake(self) -> None:
        """End a `wait` in another thread now (a reader shutting down)."""
        self._woken = True
        self.node.notify_kernel()

    # -- the ring buffer ------------------------------------------------------------------------

    def _oldest(self) -> int:
        return max(self._newest - self.ring_size + 1, self._window[0].seq if self._window else 0)

    def _refresh(self) -> bool:
        """Take in the records logged since the last look; True when the node has rebooted since, and
        this device has moved on to the new boot's first record."""
        def look(state: NodeState) -> tuple[str | None, list[KernelRecord], float]:
            if state.boot_id == self._boot:
                return None, self.node.kernel_records(self._newest), 0.0
            # Epoch seconds of the new boot, so that boot_time + USEC lands on the wall clock.
            return state.boot_id, self.node.kernel_records(), time.time() - self.node.uptime_usec() / 1e6

        boot, new, boot_time = self.node.read(look)
        first = self._boot is None
        if boot is not None:
            self._boot, self._window, self._newest, self.boot_time = boot, [], -1, boot_time
        if new:
            self._append(new)
        if boot is not None:
            self._pos = self._oldest()
        return boot is not None and not first

    def _append(self, new: list[KernelRecord]) -> None:
        self._window.extend(new)
        self._newest = new[-1].seq
        if len(self._window) > 2 * self.ring_size:   # trim in steps, not on every record
            del self._window[: len(self._window) - self.ring_size]
