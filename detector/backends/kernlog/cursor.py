"""Where a log reader stopped, persisted so a restarted daemon neither re-reports nor misses lines."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal, get_args

from detector.backends.quarantine import kept_at
from detector.backends.safefile import UnsafeFile, read_text_bounded, write_atomic

log = logging.getLogger(__name__)

# Where a reader with no cursor of this boot begins: at the end (only what comes next) or the beginning.
Start = Literal["end", "beginning"]


def checked_start(start: str) -> Start:
    """`start` as given, or a ValueError naming what is allowed (a typo must not read as "end")."""
    if start not in get_args(Start):
        raise ValueError(f"start must be 'end' or 'beginning', not {start!r}")
    return start  # type: ignore[return-value]


# A cursor is a boot id and a sequence number (kmsg), a journal cursor string (journald) or a file's
# identity and offset (a log file): under 1 KiB. 64 KiB is far beyond any of them, and small enough to read.
CURSOR_LIMIT = 64 << 10


class CursorStore:
    """A small JSON document in one file, replaced atomically through a fresh temporary name
    (write_atomic), so a crash leaves either the old cursor or the new one and a planted link is never
    written through. `path=None` keeps it in memory only (tests, fake nodes).

    Never raises: an unreadable or corrupt file reads as "no cursor" (with a warning), and a failed save is
    logged and reported by the return value, since losing a cursor costs at most duplicates or a gap.
    """

    def __init__(self, path: Path | str | None):
        self.path = Path(path) if path is not None else None
        self._memory: dict[str, Any] | None = None
        self._last_saved: dict[str, Any] | None = None
        self._save_failing = False

    def load(self) -> dict[str, Any] | None:
        if self.path is None:
            return dict(self._memory) if self._memory is not None else None
        try:
            text = read_text_bounded(self.path, CURSOR_LIMIT, "cursor file")
        except FileNotFoundError:
            return None
        except UnsafeFile as e:        # a link, a FIFO (never opened), a directory, a huge file
            log.warning("%s; %s; starting without it", e, kept_at(self.path))
            return None
        except UnicodeDecodeError as e:
            log.warning("cursor file %s is corrupt (%s); %s; starting without it", self.path, e, kept_at(self.path))
            return None
        except OSError as e:
            log.warning("cannot read cursor file %s (%s); starting without it", self.path, e)
            return None
        try:
            data = json.loads(text)
        except ValueError as e:
            log.warning("cursor file %s is corrupt (%s); %s; starting without it", self.path, e, kept_at(self.path))
            return None
        if not isinstance(data, dict):
            log.warning("cursor file %s does not hold a JSON object; %s; starting without it", self.path,
                        kept_at(self.path))
            return None
        self._last_saved = data
        return dict(data)

    def save(self, state: dict[str, Any]) -> bool:
        """Persist `state`; True when it is stored (an unchanged state is not rewritten)."""
        if state == self._last_saved:
            return True
        if self.path is None:
            self._memory = dict(state)
            self._last_saved = dict(state)
            return True
        try:
            text = json.dumps(state, separators=(",", ":"))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, text, durable=False)   # saved at every read: losing one costs a repeat
        except (OSError, TypeError, ValueError) as e:
            if not self._save_failing:     # once per failing spell, not once per read
                log.warning("cannot save cursor to %s: %s", self.path, e)
            self._save_failing = True
            return False
        self._save_failing = False
        self._last_saved = dict(state)
        return True
