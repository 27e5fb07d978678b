"""Find and read a capture: a `nvidia-smi -q` text or `-q -x` XML file, or a folder holding one."""

from __future__ import annotations

from pathlib import Path

from fake_nvml.replay.fields import read_snapshot
from fake_nvml.replay.raw import SnapshotError
from fake_nvml.replay.snapshot import Snapshot
from fake_nvml.replay.text_form import parse_text
from fake_nvml.replay.xml_form import parse_xml

SNAPSHOT_NAMES = ("nvidia-smi-q.xml", "nvidia-smi-q.txt")     # in a folder, XML first: it names every field


def snapshot_file(path: Path) -> Path:
    """The snapshot file PATH names, directly or as the folder holding one."""
    if path.is_dir():
        for name in SNAPSHOT_NAMES:
            if (path / name).is_file():
                return path / name
        raise SnapshotError(f"{path}: folder holds neither {' nor '.join(SNAPSHOT_NAMES)} "
                            "(nvidia-smi -q -x / nvidia-smi -q output)")
    if not path.exists():
        raise SnapshotError(f"{path}: no such file or folder (expected nvidia-smi -q output, or a folder holding "
                            f"{' or '.join(SNAPSHOT_NAMES)})")
    return path


def load_snapshot(path: Path) -> Snapshot:
    file = snapshot_file(path)
    try:
        data = file.read_bytes()
    except OSError as e:
        raise SnapshotError(f"{file}: cannot read it: {e.strerror or e}") from None
    text = data.decode("utf-8", errors="replace").lstrip("\ufeff")
    if not text.strip():
        raise SnapshotError(f"{file}: empty file (expected nvidia-smi -q or nvidia-smi -q -x output)")
    if "\x00" in text:
        raise SnapshotError(f"{file}: binary data, not nvidia-smi -q output")
    raw = parse_xml(text, str(file)) if text.lstrip().startswith("<") else parse_text(text, str(file))
    return read_snapshot(raw, str(file))
