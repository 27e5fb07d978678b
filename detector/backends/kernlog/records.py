"""One kernel-log line as every source (kmsg, a log file, journald) hands it over, with whatever is known
of its time and origin. Sources differ in what they know, so everything but the text is optional."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

# Shared, immutable: most lines carry no continuation fields, so they need not each own an empty dict.
NO_FIELDS: Mapping[str, str] = MappingProxyType({})

KERNEL_FACILITY = 0   # LOG_KERN; userland can never write a record with it to /dev/kmsg


@dataclass(slots=True)      # not frozen: frozen dataclasses cost several times more to build, per line
class LogLine:
    text: str                          # kmsg: the part after ';'; files: the whole line without its newline
    lineno: int | None = None          # 1-based line number within the file it came from
    seq: int | None = None             # kmsg sequence number
    boot_id: str | None = None
    monotonic_us: int | None = None    # microseconds since boot (kmsg USEC)
    realtime: float | None = None      # epoch seconds, when known
    priority: int | None = None        # syslog PRI = facility * 8 + level, when known
    fields: Mapping[str, str] = field(default_factory=lambda: NO_FIELDS)   # kmsg " KEY=value" lines

    @property
    def facility(self) -> int | None:
        return None if self.priority is None else self.priority >> 3

    @property
    def level(self) -> int | None:
        return None if self.priority is None else self.priority & 7


def is_kernel(line: LogLine) -> bool:
    """Whether the line may have come from the kernel: userland writes to /dev/kmsg always carry a
    non-kernel facility (1 = user by default), so a known non-zero facility rules the line out."""
    return line.priority is None or (line.priority >> 3) == KERNEL_FACILITY
