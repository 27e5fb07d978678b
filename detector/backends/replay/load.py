"""Find and read a capture: a `nvidia-smi -q` text or `-q -x` XML file, or a folder holding one.

Only regular files are read, and at most limits.MAX_CAPTURE_BYTES of one: a FIFO, a device or an oversize
file is refused at once (detector/backends/safefile.py). The path the user typed may be a link (it is
theirs); inside a folder nothing is followed, so a capture cannot point out of its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from detector.backends.safefile import UnsafeFile, read_bounded
from detector.backends.replay.fields import read_snapshot
from detector.backends.replay.limits import MAX_CAPTURE_BYTES
from detector.backends.replay.raw import SnapshotError
from detector.backends.replay.snapshot import Snapshot
from detector.backends.replay.text_form import parse_text
from detector.backends.replay.xml_form import parse_xml

SNAPSHOT_NAMES = ("nvidia-smi-q.xml", "nvidia-smi-q.txt")     # in a folder, XML first: it names every field


def snapshot_file(path: Path) -> Path:
    """The snapshot file PATH names, directly or as the folder holding one. In a folder the name is taken
    as it is (a link there is refused when read, not followed out of the folder)."""
    if path.is_dir():
        for name in SNAPSHOT_NAMES:
            if os.path.lexists(path / name):
                return path / name
        raise SnapshotError(f"{path}: folder holds neither {' nor '.join(SNAPSHOT_NAMES)} "
                            "(nvidia-smi -q -x / nvidia-smi -q output)")
    if not path.exists():
        raise SnapshotError(f"{path}: no such file or folder (expected nvidia-smi -q output, or a folder holding "
                            f"{' or '.join(SNAPSHOT_NAMES)})")
    return path


def read_capture(file: Path, limit: int, what: str) -> bytes:
    """A capture file's bytes: a regular file, not a link, at most `limit` bytes; else SnapshotError."""
    try:
        return read_bounded(file, limit, what)
    except UnsafeFile as e:
        raise SnapshotError(str(e)) from None
    except OSError as e:
        raise SnapshotError(f"{file}: cannot read it: {e.strerror or e}") from None


def load_snapshot(path: Path) -> Snapshot:
    file = snapshot_file(path)
    # The file the user named may be their own link; one found in a folder is not followed.
    data = read_capture(file.resolve() if file == path else file, MAX_CAPTURE_BYTES, "replay capture")
    text = data.decode("utf-8", errors="replace").lstrip("\ufeff")
    del data
    if not text.strip():
        raise SnapshotError(f"{file}: empty file (expected nvidia-smi -q or nvidia-smi -q -x output)")
    if "\x00" in text:
        raise SnapshotError(f"{file}: binary data, not nvidia-smi -q output")
    raw = parse_xml(text, str(file)) if text.lstrip().startswith("<") else parse_text(text, str(file))
    return read_snapshot(raw, str(file))
