"""Boots and times in a saved log, taken from the log itself, never from the time of the scan.

A saved log may span several boots: a boot banner (`Linux version ...`, then `Command line: ...`),
journalctl's `-- Boot ID --` / `-- Reboot --` markers, a change of journal `_BOOT_ID`, or the kernel's
monotonic clock going back starts a new one. Each event is judged at its wall-clock time when the
wrapper has one; with only seconds since boot (dmesg), at that offset within its boot, the boots laid
end to end (the least time they can have spanned); with neither, all lines are one instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detector.checks.xid.parser import BootBanner, KernelEvent

WALL, MONOTONIC, NONE = "wall clock", "seconds since boot", "none"


@dataclass
class SavedLogTimeline:
    ordinal: int = 0
    labels_seen: set[str] = field(default_factory=set)
    time_sources: set[str] = field(default_factory=set)
    _last_mono: float | None = None
    _boot_id: str | None = None
    _after_banner: bool = False            # `Command line:` right after `Linux version` is one boot
    _offset: float = 0.0                   # where this boot starts on the monotonic time line
    _max_mono: float = 0.0

    @property
    def boot(self) -> str:
        return f"boot-{self.ordinal}"

    @property
    def boots(self) -> int:
        return len(self.labels_seen)

    def see(self, parsed: KernelEvent | BootBanner) -> str:
        """The boot `parsed` belongs to; a banner opens a new one."""
        if isinstance(parsed, BootBanner):
            if not self._after_banner or (parsed.boot_id and parsed.boot_id != self._boot_id):
                self._new_boot(parsed.boot_id)
            self._after_banner = True
        else:
            self._after_banner = False
            if parsed.boot_id and parsed.boot_id != self._boot_id and self._boot_id is not None:
                self._new_boot(parsed.boot_id)
            elif parsed.boot_id:
                self._boot_id = parsed.boot_id
            mono = parsed.monotonic_s
            if mono is not None:
                if self._last_mono is not None and mono + 1.0 < self._last_mono and not parsed.boot_id:
                    self._new_boot(None)
                self._last_mono = mono
                self._max_mono = max(self._max_mono, mono)
        self.labels_seen.add(self.boot)
        return self.boot

    def judged_time(self, event: KernelEvent) -> float | None:
        """When the event happened, for windows: wall clock, else boot offset + seconds since boot."""
        if event.time is not None:
            self.time_sources.add(WALL)
            return event.time
        if event.monotonic_s is not None:
            self.time_sources.add(MONOTONIC)
            return self._offset + event.monotonic_s
        self.time_sources.add(NONE)
        return None

    def _new_boot(self, boot_id: str | None) -> None:
        self.ordinal += 1
        self._offset += self._max_mono + 1.0
        self._max_mono = 0.0
        self._last_mono = None
        self._boot_id = boot_id

    def describe_times(self) -> str:
        if not self.time_sources:
            return "no events"
        if self.time_sources == {NONE}:
            return "none in the log: every line judged as one instant"
        if self.time_sources == {WALL}:
            return "wall clock from the log"
        if self.time_sources == {MONOTONIC}:
            return "seconds since boot from the log (boots laid end to end)"
        return "mixed: " + ", ".join(sorted(self.time_sources)) + " (lines without a time judged as one instant)"
