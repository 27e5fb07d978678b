"""Kernel-log sources: /dev/kmsg records, a (rotating) log file, and the systemd journal. Each hands out
LogLines carrying what the source knows of their time and origin, once each, across restarts (a cursor)."""

from detector.backends.kernlog.cursor import CursorStore
from detector.backends.kernlog.journald import JournaldReader, JournaldStats, parse_entry
from detector.backends.kernlog.kmsg import (
    DevKmsg,
    KmsgDevice,
    KmsgReader,
    KmsgStats,
    KmsgUnavailable,
    boot_time,
    parse_record,
    read_boot_id,
)
from detector.backends.kernlog.logfile import LogFileTail, TailStats
from detector.backends.kernlog.records import LogLine, is_kernel

__all__ = [
    "CursorStore", "DevKmsg", "JournaldReader", "JournaldStats", "KmsgDevice", "KmsgReader", "KmsgStats",
    "KmsgUnavailable", "LogFileTail", "LogLine", "TailStats", "boot_time", "is_kernel", "parse_entry",
    "parse_record", "read_boot_id",
]
