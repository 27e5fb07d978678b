"""Reading /dev/kmsg: one record per read, sequence numbers that expose every lost record, and a cursor
so a restarted daemon resumes exactly where it stopped within the same boot.

Record format (Documentation/ABI/testing/dev-kmsg): ``PRI,SEQ,USEC,FLAGS[,more...];message\\n`` followed by
optional continuation lines `` KEY=value\\n``. Non-printable bytes and backslash are escaped as ``\\xNN``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from detector.backends.kernlog.cursor import CursorStore, Start, checked_start
from detector.backends.kernlog.records import NO_FIELDS, LogLine

log = logging.getLogger(__name__)


RECORD_MAX = 8192              # the kernel's per-record limit (CONSOLE_EXT_LOG_MAX); a smaller read gets EINVAL
DEFAULT_BATCH_LIMIT = 100_000  # records per read_available when the caller sets no limit: never spin forever
_DRAIN_LIMIT = 2_000_000       # records skipped when starting at "end"; more than any ring buffer holds

_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


class KmsgDevice(Protocol):
    """What /dev/kmsg offers a reader (and what a fake must reproduce).

    A device may also offer ``wait(timeout_s) -> bool`` and ``wake()`` (block until a record may be
    readable, and interrupt that from another thread), and ``boot_id``/``boot_time`` when it can outlive
    a boot (a fake node that reboots); KmsgReader uses them when present.
    """

    def read_record(self) -> bytes:
        """One whole record. BlockingIOError: none left for now. BrokenPipeError: the next record was
        overwritten in the ring buffer; the position has moved to the oldest record still present."""
        ...

    def seek_end(self) -> None: ...

    def seek_beginning(self) -> None: ...


class KmsgUnavailable(OSError):
    """/dev/kmsg (or the given path) cannot be opened; carries errno and the path."""


class DevKmsg:
    """The real device over a non-blocking file descriptor (each instance is its own reader)."""

    def __init__(self, path: str | os.PathLike[str] = "/dev/kmsg"):
        self.path = os.fspath(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise KmsgUnavailable(e.errno, f"cannot open the kernel log: {e.strerror}", self.path) from e
        try:
            # A self-pipe in the same poll set lets wake() end a wait from another thread.
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        except OSError as e:
            os.close(self._fd)
            raise KmsgUnavailable(e.errno, f"cannot wait on the kernel log: {e.strerror}", self.path) from e
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        if not regular:     # a regular file polls as always readable: waiting on it would spin
            self._poller.register(self._fd, select.POLLIN)

    def fileno(self) -> int:
        """For poll/select: /dev/kmsg is readable when a record is waiting."""
        if self._fd is None:
            raise OSError(errno.EBADF, "the kernel log was closed", self.path)
        return self._fd

    def read_record(self) -> bytes:
        # os.read raises BlockingIOError for EAGAIN and BrokenPipeError for EPIPE, as the protocol wants.
        data = os.read(self.fileno(), RECORD_MAX)
        if not data:   # not /dev/kmsg (a regular file, say): treat its end as "no more records"
            raise BlockingIOError(errno.EAGAIN, "no more records", self.path)
        return data

    def seek_end(self) -> None:
        os.lseek(self.fileno(), 0, os.SEEK_END)

    def seek_beginning(self) -> None:
        # SEEK_SET 0 is the oldest record in the buffer; SEEK_DATA would be "after the last syslog clear".
        os.lseek(self.fileno(), 0, os.SEEK_SET)

    def wait(self, timeout_s: float) -> bool:
        """Block until a record is readable, `wake` is called, or `timeout_s` passes (then False)."""
        self.fileno()
        events = self._poller.poll(max(timeout_s, 0.0) * 1000)
        if any(fd == self._wake_r for fd, _ in events):
            try:
                while os.read(self._wake_r, 64):
                    pass
            except BlockingIOError:
                pass
        return bool(events)

    def wake(self) -> None:
        """End a `wait` in another thread now (the daemon shutting down); safe from any thread."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):   # the pipe is full (a wake is pending anyway) or closed
            pass

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> "DevKmsg":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_boot_id(path: str | os.PathLike[str] = "/proc/sys/kernel/random/boot_id") -> str | None:
    """This boot's id, or None when it cannot be read (then no cursor is ever trusted across restarts)."""
    try:
        with open(path, encoding="ascii") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        log.warning("cannot read the boot id from %s: %s", path, e)
        return None
    return value or None


def boot_time(stat: str = "/proc/stat") -> float:
    """Epoch seconds of this boot: /proc/stat's btime (whole seconds, as psutil.boot_time reads it);
    kmsg USEC counts from it. Read here, not through psutil, which the daemon would import for this one
    number (about 1 MiB of its resident memory)."""
    try:
        with open(stat, "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(int(line.split()[1]))
    except (OSError, ValueError, IndexError):
        pass
    return time.time() - time.monotonic()     # the monotonic clock also starts at boot


def _unescape(raw: bytes) -> str:
    if b"\\" in raw:
        raw = _ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), raw)
    return raw.decode("utf-8", "replace")


def parse_record(raw: bytes, boot_id: str | None = None, boot_time_s: float | None = None) -> LogLine | None:
    """One /dev/kmsg record as a LogLine; None when the record is malformed."""
    semi = raw.find(b";")
    if semi < 0:
        return None
    header = raw[:semi].split(b",")
    if len(header) < 4:      # PRI,SEQ,USEC,FLAGS; later kernels may append more fields (ignored)
        return None
    try:
        pri, seq, usec = int(header[0]), int(header[1]), int(header[2])
    except ValueError:
        return None
    if pri < 0 or seq < 0 or usec < 0:
        return None
    body = raw[semi + 1:]
    nl = body.find(b"\n")
    if nl < 0:
        message, rest = body, b""
    else:
        message, rest = body[:nl], body[nl + 1:]
    fields = NO_FIELDS
    if rest:
        found: dict[str, str] = {}
        for cont in rest.split(b"\n"):
            if cont.startswith(b" "):
                key, sep, value = cont[1:].partition(b"=")
                if sep and key:
                    found[_unescape(key)] = _unescape(value)
        if found:
            fields = found
    return LogLine(
        text=_unescape(message), seq=seq, boot_id=boot_id, monotonic_us=usec,
        realtime=None if boot_time_s is None else boot_time_s + usec / 1e6,
        priority=pri, fields=fields,
    )


def _record_seq(raw: bytes) -> int | None:
    """Just the sequence number (cheap: used to skip a whole ring buffer at start)."""
    parts = raw.split(b",", 2)
    if len(parts) < 3:
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None


@dataclass
class KmsgStats:
    records: int = 0        # handed out
    skipped: int = 0        # already handed out before a restart (seq <= cursor), or skipped at an "end" start
    malformed: int = 0      # records that could not be parsed
    overruns: int = 0       # EPIPE: the reader fell behind the ring buffer
    lost_records: int = 0   # records overwritten before they could be read (sequence gaps)
    errors: int = 0         # other device errors
    reboots: int = 0        # the device moved on to a new boot (a fake node only: a real reboot ends us)
    cursor_resets: int = 0  # a saved cursor beyond the kernel's newest record was dropped (the ring read whole)


class KmsgReader:
    """Kernel records from a KmsgDevice, each handed out once, in order, across restarts of the reader.

    The cursor holds ``{"boot_id", "seq"}``: every record of that boot with seq <= cursor has been dealt
    with. In the same boot a new reader resumes right after it; in another boot (or with no cursor) it
    honours `start`: "end" skips what is in the buffer now, "beginning" hands out all of it.

    A device with a ``boot_id`` can change boots under the reader (a fake node's `reboot` fault): the
    reader then starts over at the new boot's first record, with a cursor of the new boot.
    """

    def __init__(self, device: KmsgDevice, boot_id: str | None, boot_time: float, cursor: CursorStore,
                 start: Start = "end", batch_limit: int = DEFAULT_BATCH_LIMIT):
        checked_start(start)
        self.device = device
        self.name = "kmsg"
        self.boot_id = boot_id
        self.boot_time = boot_time
        self.cursor = cursor
        self.batch_limit = batch_limit
        self.stats = KmsgStats()
        self._last_seq: int | None = None     # the newest seq dealt with; None: nothing yet
        self.resumed = False                  # True when a saved cursor of this boot was honoured
        self._device_boot: str | None = getattr(device, "boot_id", None)   # None: the device cannot tell
        self._wake = threading.Event()        # ends the sleep of a device that cannot wait itself

        saved = cursor.load()
        saved_seq = saved.get("seq") if saved else None
        if (saved and boot_id and saved.get("boot_id") == boot_id
                and (saved_seq is None or (isinstance(saved_seq, int) and not isinstance(saved_seq, bool)))):
            self.resumed = True
            self._last_seq = saved_seq
            if saved_seq is not None:
                self._check_cursor(saved_seq)
            self._seek(device.seek_beginning)
        elif start == "beginning":
            self._seek(device.seek_beginning)
        else:
            self._skip_to_end()

    def _seek(self, how: Callable[[], None]) -> bool:
        try:
            how()
            return True
        except OSError as e:
            self.stats.errors += 1
            log.warning("cannot seek the kernel log: %s", e)
            return False

    def _skip_to_end(self) -> None:
        """Start after the newest record present, knowing its seq, so that the cursor saved now lets a
        restart in this boot pick up exactly the records that arrived after this start."""
        if not self._seek(self.device.seek_beginning):
            self._seek(self.device.seek_end)
            return
        drained, last = self._drain()
        if not drained:
            self._seek(self.device.seek_end)
            return
        self._last_seq = last
        self._save()   # seq None here means "the buffer was empty: every record of this boot is new"

    def _drain(self) -> tuple[bool, int | None]:
        """Read from the current position to the end: (whether the end was reached without a device error,
        the newest seq read). Each record read counts as skipped."""
        last: int | None = None
        for _ in range(_DRAIN_LIMIT):
            try:
                raw = self.device.read_record()
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
            except OSError as e:
                self.stats.errors += 1
                log.warning("cannot read the kernel log: %s", e)
                return False, last
            seq = _record_seq(raw)
            if seq is not None:
                last = seq
                self.stats.skipped += 1
        return True, last

    def _check_cursor(self, saved_seq: int) -> None:
        """A cursor of this boot says every record up to `saved_seq` was dealt with; one beyond the newest
        record the kernel has (a boot id mixed up, a planted or hand-edited file) would skip every record
        of the boot, an XID 79 already in the ring among them. Then it is dropped and the whole ring read
        from this boot's start. Sequence numbers only grow within a boot, so a real cursor is never beyond
        the newest record."""
        if not self._seek(self.device.seek_beginning):
            return
        skipped = self.stats.skipped
        drained, newest = self._drain()
        self.stats.skipped = skipped          # looking is not skipping
        if drained and (newest is None or saved_seq > newest):
            have = f"its newest is {newest}" if newest is not None else "it has no record yet"
            log.warning("the kernel-log cursor (boot %s, seq %d) is beyond what the kernel has (%s): it is not "
                        "this boot's; reading the kernel log from this boot's first record", self.boot_id,
                        saved_seq, have)
            self.resumed = False
            self._last_seq = None
            self.stats.cursor_resets += 1

    def read_available(self, max_records: int | None = None) -> list[LogLine]:
        """Every record available now (at most `max_records`, else at most `batch_limit`). Never raises."""
        limit = self.batch_limit if max_records is None else max_records
        out: list[LogLine] = []
        read = self.device.read_record
        self._follow_boot()
        while len(out) < limit:
            try:
                raw = read()
            except BlockingIOError:
                break
            except BrokenPipeError:
                if not self._follow_boot():
                    self.stats.overruns += 1    # the position moved to the oldest record; the gap counts the loss
                continue
            except OSError as e:
                self.stats.errors += 1
                log.warning("cannot read the kernel log: %s", e)
                break
            last = self._last_seq
            if last is not None:
                seq = _record_seq(raw)       # cheap check first: after a restart most records are old
                if seq is not None and seq <= last:
                    self.stats.skipped += 1
                    continue
            line = parse_record(raw, self.boot_id, self.boot_time)
            if line is None:
                self.stats.malformed += 1
                continue
            seq = line.seq
            assert seq is not None
            if last is not None and seq > last + 1:
                self.stats.lost_records += seq - last - 1
            self._last_seq = seq
            out.append(line)
        self.stats.records += len(out)
        self._save()
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until records may be available (True; it may be spurious) or `timeout_s` passes (False),
        so a caller reacts to a new line at once without polling fast. Never raises."""
        wait = getattr(self.device, "wait", None)
        if wait is not None:
            try:
                return bool(wait(timeout_s))
            except OSError as e:
                self.stats.errors += 1
                log.warning("cannot wait on the kernel log: %s", e)
        if self._wake.wait(timeout_s):          # no way to block on the device: sleep, then look anyway
            self._wake.clear()
        return True

    def wake(self) -> None:
        """End a `wait` in another thread now (shutting down)."""
        self._wake.set()
        wake = getattr(self.device, "wake", None)
        if wake is not None:
            wake()

    def _follow_boot(self) -> bool:
        """True when the device has moved on to another boot: the cursor restarts at that boot's first
        record. A real daemon never sees this (a reboot ends it); one reading a fake node does."""
        if self._device_boot is None:
            return False
        boot = getattr(self.device, "boot_id", None)
        if boot is None or boot == self._device_boot:
            return False
        log.info("the kernel log moved from boot %s to %s: reading the new boot from its start",
                 self._device_boot, boot)
        self.stats.reboots += 1
        self._device_boot = self.boot_id = boot
        self._last_seq = None
        self._seek(self.device.seek_beginning)
        self.boot_time = getattr(self.device, "boot_time", self.boot_time)   # the device's, once it follows
        self._save()
        return True

    def _save(self) -> None:
        if self.boot_id:
            self.cursor.save({"boot_id": self.boot_id, "seq": self._last_seq})
