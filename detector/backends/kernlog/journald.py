"""Kernel lines from the systemd journal through `journalctl -k -o json`, run as an argument list with a
timeout, resumed from the journal's own cursor. For nodes where /dev/kmsg is not readable but the journal is
(journald keeps the kernel log of past boots too)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Callable

from detector.backends.kernlog.cursor import CursorStore, Start, checked_start
from detector.backends.kernlog.records import NO_FIELDS, LogLine

log = logging.getLogger(__name__)

Runner = Callable[..., "subprocess.CompletedProcess[bytes]"]

DEFAULT_MAX_ENTRIES = 5_000    # per run, so a flood costs several runs, not one unbounded JSON dump
MAX_ENTRIES_PER_READ = 50_000   # runs per read_available go on while each comes back full, up to this (memory stays flat)
RESET_AFTER_FAILURES = 3       # a cursor journalctl keeps refusing is dropped (start again at the end)
WAIT_MAX_S = 1.0               # the longest wait(): each look costs a journalctl run, so no faster than this


@dataclass
class JournaldStats:
    runs: int = 0
    entries: int = 0          # lines handed out
    malformed: int = 0        # output lines that are not a usable journal entry
    timeouts: int = 0
    failures: int = 0         # journalctl could not be run, or exited non-zero
    cursor_resets: int = 0    # the saved cursor was dropped after repeated failures


def normalize_boot_id(value: str | None) -> str | None:
    """journald writes boot ids as 32 hex digits; /proc writes the dashed UUID form. Use the latter."""
    if not value:
        return None
    known = _BOOT_IDS.get(value)
    if known is not None:
        return known
    normal = _normalize_boot_id(value)
    if len(_BOOT_IDS) >= 64:           # a node has a handful of boots; never grow without bound
        _BOOT_IDS.clear()
    _BOOT_IDS[value] = normal
    return normal


_BOOT_IDS: dict[str, str] = {}       # every entry carries _BOOT_ID: normalise each value once


def _normalize_boot_id(value: str) -> str:
    h = value.replace("-", "").lower()
    if len(h) != 32:
        return value
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _text(value: Any) -> str | None:
    """A journal field as JSON output gives it: a string, a list of byte values (binary or invalid
    UTF-8), or a list of values (a field set more than once; the first is taken); null when too long."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(type(b) is int for b in value):
            try:
                return bytes(value).decode("utf-8", "replace")
            except ValueError:
                return None
        return _text(value[0])
    return None


def _int(value: Any) -> int | None:
    if type(value) is str:            # what journalctl writes for every field: the fast path
        try:
            return int(value)
        except ValueError:
            return None
    text = _text(value) if not isinstance(value, int) else str(value)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def parse_entry(entry: dict[str, Any], kernel_fields: bool = True) -> LogLine | None:
    """One `journalctl -o json` entry as a LogLine; None when it has no usable MESSAGE.
    `kernel_fields` False: the caller knows no key starts with _KERNEL_ (its raw line has no such text)."""
    text = _text(entry.get("MESSAGE"))
    if text is None:
        return None
    level = _int(entry.get("PRIORITY"))
    facility = _int(entry.get("SYSLOG_FACILITY"))
    if facility is None and _text(entry.get("_TRANSPORT")) == "kernel":
        facility = 0      # journald records SYSLOG_FACILITY only for non-kernel records read from kmsg
    priority = None if level is None or facility is None else facility * 8 + level
    realtime = _int(entry.get("__REALTIME_TIMESTAMP"))
    monotonic = _int(entry.get("_SOURCE_MONOTONIC_TIMESTAMP"))   # the kmsg USEC, when from the kernel
    if monotonic is None:
        monotonic = _int(entry.get("__MONOTONIC_TIMESTAMP"))
    fields = NO_FIELDS
    kernel = {k[len("_KERNEL_"):]: v for k, v in entry.items() if k.startswith("_KERNEL_")} if kernel_fields else None
    if kernel:   # kmsg continuation lines, stored by journald as _KERNEL_SUBSYSTEM, _KERNEL_DEVICE, ...
        fields = {k: t for k, v in kernel.items() if (t := _text(v)) is not None}
    return LogLine(text=text, boot_id=normalize_boot_id(_text(entry.get("_BOOT_ID"))),
                   monotonic_us=monotonic, realtime=None if realtime is None else realtime / 1e6,
                   priority=priority, fields=fields)


class JournaldReader:
    """Kernel lines of the journal, each handed out once, resumed across restarts by the journal cursor.

    The cursor store holds ``{"cursor", "boot_id"}``. With no cursor, `start` "end" first asks for the
    newest kernel entry (``-n 1``) only to learn its cursor; "beginning" hands out this boot's kernel log.
    A cursor from another boot than `boot_id` (when given) is ignored, as for /dev/kmsg.
    """

    def __init__(self, cursor: CursorStore, journalctl: str = "journalctl", timeout_s: float = 10,
                 runner: Runner = subprocess.run, start: Start = "end", boot_id: str | None = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES, which: Callable[[str], str | None] = shutil.which):
        checked_start(start)
        self.cursor_store = cursor
        self.name = "journald"
        self.journalctl = journalctl
        self.timeout_s = timeout_s
        self.runner = runner
        self.start = start
        self.boot_id = normalize_boot_id(boot_id)
        self.max_entries = max_entries
        self._which = which
        self.stats = JournaldStats()
        self._wake = threading.Event()
        self.cursor: str | None = None        # the journal cursor of the last entry dealt with
        self._cursor_boot: str | None = None
        self._end_known = start == "beginning"   # "end": not yet learnt where the journal ends
        self._failures_in_a_row = 0
        self._last_run_full = False
        self._records_in_run = 0
        saved = cursor.load()
        if saved and isinstance(saved.get("cursor"), str):
            saved_boot = normalize_boot_id(saved.get("boot_id")) if isinstance(saved.get("boot_id"), str) else None
            if self.boot_id is None or saved_boot == self.boot_id:
                self.cursor, self._cursor_boot = saved["cursor"], saved_boot

    def available(self) -> bool:
        """Whether journalctl can be found (on PATH, or at the path given)."""
        try:
            return self._which(self.journalctl) is not None
        except OSError:
            return False

    def command(self) -> list[str]:
        """The argument list the next read_available will run."""
        argv = [self.journalctl, "-k", "-o", "json", "--no-pager", "--quiet"]
        if self.cursor is not None:
            return argv + ["--after-cursor", self.cursor, "-n", str(self.max_entries)]
        if not self._end_known:
            return argv + ["-n", "1"]    # only to learn where the journal ends now
        return argv                      # -k implies this boot only

    def read_available(self) -> list[LogLine]:
        """Entries logged since the last call. Never raises: failures leave the cursor where it was.
        A run that comes back full (max_entries) is followed by another at once, up to
        MAX_ENTRIES_PER_READ in all, so a flood is read at journalctl's speed, not one run per interval."""
        lines = self._read_once()
        while self._last_run_full and len(lines) < MAX_ENTRIES_PER_READ:
            lines += self._read_once()
        return lines

    def _read_once(self) -> list[LogLine]:
        used_cursor = self.cursor is not None
        self._last_run_full = False
        learning_end = not used_cursor and not self._end_known
        stdout, status = self._run(self.command())
        lines = self._parse(stdout)
        if learning_end:
            if status == "ok":
                self._end_known = True    # with no kernel entry at all, everything from now on is new
            lines = []
        if used_cursor and status == "exit" and not stdout:
            self._failures_in_a_row += 1  # e.g. "Failed to seek to cursor": retrying it forever gets nowhere
            if self._failures_in_a_row >= RESET_AFTER_FAILURES:
                self._reset_cursor()
        elif status == "ok":
            self._failures_in_a_row = 0
            self._last_run_full = used_cursor and self._records_in_run >= self.max_entries
        self._save()
        self.stats.entries += len(lines)
        return lines

    wait_is_cheap = False       # the daemon leaves journald to the xid check's interval instead

    def wait(self, timeout_s: float) -> bool:
        """Sleep min(timeout_s, WAIT_MAX_S), then True: the reader runs journalctl once per read and has no
        descriptor to block on (`journalctl -f` would need a process kept alive), so every wait ends in a
        look. `wake` ends it early."""
        if self._wake.wait(min(timeout_s, WAIT_MAX_S)):
            self._wake.clear()
        return True

    def wake(self) -> None:
        """End a `wait` in another thread now (shutting down)."""
        self._wake.set()

    def _run(self, argv: list[str]) -> tuple[bytes, str]:
        """(stdout, status): "ok"; "exit" (ran, exited non-zero); "timeout" (stdout: the whole lines
        written before it); "not_run" (missing binary, no permission)."""
        self.stats.runs += 1
        try:
            proc = self.runner(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout_s,
                               check=False)
        except subprocess.TimeoutExpired as e:
            self.stats.timeouts += 1
            log.warning("%s did not finish in %ss", self.journalctl, self.timeout_s)
            partial = _bytes(e.stdout)
            return partial[: partial.rfind(b"\n") + 1], "timeout"
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            self.stats.failures += 1
            log.warning("cannot run %s: %s", self.journalctl, e)
            return b"", "not_run"
        stdout = _bytes(proc.stdout)
        if proc.returncode != 0:
            self.stats.failures += 1
            err = _bytes(proc.stderr).decode("utf-8", "replace").strip()[:300]
            log.warning("%s exited with %s: %s", self.journalctl, proc.returncode, err)
            return stdout, "exit"
        return stdout, "ok"

    def _parse(self, stdout: bytes) -> list[LogLine]:
        out: list[LogLine] = []
        self._records_in_run = 0
        for raw in stdout.split(b"\n"):
            raw = raw.strip()
            if not raw or raw.startswith(b"-- "):     # blank, or an informational line such as "-- No entries --"
                continue
            self._records_in_run += 1
            try:
                entry = _loads(raw)
            except ValueError:
                self.stats.malformed += 1
                continue
            if not isinstance(entry, dict):
                self.stats.malformed += 1
                continue
            cursor = entry.get("__CURSOR")
            if isinstance(cursor, str) and cursor:
                self.cursor = cursor
                self._cursor_boot = normalize_boot_id(_text(entry.get("_BOOT_ID")))
            line = parse_entry(entry, b'"_KERNEL_' in raw)
            if line is None:
                self.stats.malformed += 1
                continue
            out.append(line)
        return out

    def _reset_cursor(self) -> None:
        log.warning("%s keeps failing with the saved cursor; starting again at the end of the journal",
                    self.journalctl)
        self.stats.cursor_resets += 1
        self.cursor, self._cursor_boot = None, None
        self._end_known = False
        self._failures_in_a_row = 0

    def _save(self) -> None:
        if self.cursor is not None:
            self.cursor_store.save({"cursor": self.cursor, "boot_id": self._cursor_boot})


_decode = json.JSONDecoder().raw_decode


def _loads(raw: bytes) -> Any:
    """json.loads(raw) for one output line, without its per-call overhead when the line starts with '{"'
    (what json.loads would then decode as UTF-8 anyway); any other line goes to json.loads itself."""
    if raw[:2] != b'{"':
        return json.loads(raw)
    s = raw.decode("utf-8", "surrogatepass")
    value, end = _decode(s)
    if end != len(s) and s[end:].strip(" \t\n\r"):
        raise ValueError("extra data after the JSON value")
    return value


def _bytes(value: bytes | str | None) -> bytes:
    if value is None:
        return b""
    return value.encode("utf-8", "replace") if isinstance(value, str) else value
