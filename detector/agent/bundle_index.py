"""The evidence bundles the daemon kept in its state directory, as read back: by `gpu-npd history --rma`, and
by a restarted daemon (which incident it already kept in this boot).

Each bundle is a folder `<state-dir>/bundles/<UTC time>-<reason>/` whose `manifest.json` says what it holds
and which GPUs it names:

    {"version": 1, "created": "2026-03-02T10:41:07Z", "node": "gpu-1", "boot_id": "…", "reason": "…",
     "incident": …, "gpus": [{"index": 3, "serial": "1650…", "uuid": "GPU-…", "pci_bus_id": "0000:5d:00.0"}],
     "files": [{"name": "kernel.log", "bytes": 1234}], "bytes": 5678, "redacted": true, "truncated": []}

(`truncated` names the files the bundle's size cap cut or left out.)

The state directory is a hostPath other pods may write to, so nothing here is trusted: at most MAX_BUNDLES
folders are looked at (the newest names first), a manifest is read only as a regular file no larger than
MANIFEST_LIMIT (no link followed, a FIFO never waited on), and one that cannot be read or has the wrong
shape is skipped with a note saying which and why. Reading never moves, writes or deletes anything.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector.backends.pciaddr import normalize_bus_id
from detector.backends.safefile import UnsafeFile, read_text_bounded

BUNDLES_DIR = "bundles"
MANIFEST = "manifest.json"
MANIFEST_LIMIT = 256 << 10       # a manifest lists a few dozen files and at most 64 GPUs: a few KiB
MAX_BUNDLES = 256                # folders looked at; the daemon keeps a few
MAX_GPUS = 64                    # GPUs taken from one manifest (a node has at most 64)
TEXT_MAX = 256                   # each text kept from a manifest
MAX_NAMES = 64                   # file names taken from a manifest's truncated list (a bundle holds a dozen)


@dataclass(frozen=True)
class BundleGpu:
    index: int | None
    serial: str | None
    uuid: str | None
    pci_bus_id: str | None
    model: str | None = None

    def same(self, serial: str | None, uuid: str | None, pci_bus_id: str | None) -> bool:
        """Whether this is the GPU of these identities: by serial when both know one, else by UUID when both
        know one, else by bus id (a bus id alone matches only a GPU known by nothing better, since another
        board may sit in that slot now)."""
        if serial and self.serial:
            return serial == self.serial
        if uuid and self.uuid:
            return uuid == self.uuid
        return bool(pci_bus_id and self.pci_bus_id and bus_id(pci_bus_id) == bus_id(self.pci_bus_id))


@dataclass(frozen=True)
class Bundle:
    path: Path                   # the bundle's folder
    created: str                 # RFC 3339, as written ("" when the manifest has none)
    bytes: int | None            # its size as the manifest says it
    node: str
    reason: str
    gpus: tuple[BundleGpu, ...]
    redacted: bool | None
    truncated: tuple[str, ...]   # files the size cap cut or left out
    boot_id: str = ""            # the boot it was taken in
    incident: str = ""           # the daemon's incident it belongs to

    def names(self, serial: str | None, uuid: str | None, pci_bus_id: str | None) -> BundleGpu | None:
        """The entry of this bundle that is the GPU of these identities (BundleGpu.same), None if none is."""
        return next((g for g in self.gpus if g.same(serial, uuid, pci_bus_id)), None)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "created": self.created or None, "bytes": self.bytes,
                "reason": self.reason or None, "redacted": self.redacted, "truncated": list(self.truncated)}


def bus_id(text: str) -> str:
    """A PCI bus id in one spelling (NVML's `00000000:5D:00.0` and the kernel's `0000:5d:00.0` alike); a text
    that is no bus id stays as written, lower case."""
    try:
        return normalize_bus_id(text)
    except ValueError:
        return text.strip().lower()


def read_bundles(state_dir: Path) -> tuple[list[Bundle], list[str]]:
    """The bundles under `state_dir`/bundles, newest first, and a note for each one skipped (and for a
    bundles folder that cannot be listed). No bundles folder: none, and no note."""
    root = state_dir / BUNDLES_DIR
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [f"cannot read {root}: {e.strerror or e}"]
    if not stat.S_ISDIR(mode):
        return [], [f"{root} is not a directory: no bundles read"]
    try:
        names = sorted((e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)), reverse=True)
    except OSError as e:
        return [], [f"cannot list {root}: {e.strerror or e}"]
    notes = [f"{len(names) - MAX_BUNDLES} older bundle folder(s) in {root} not read (only the newest "
             f"{MAX_BUNDLES})"] if len(names) > MAX_BUNDLES else []
    bundles = []
    for name in names[:MAX_BUNDLES]:
        path = root / name
        try:
            bundles.append(parse_manifest(path, json.loads(read_text_bounded(path / MANIFEST, MANIFEST_LIMIT,
                                                                             "bundle manifest"))))
        except FileNotFoundError:
            notes.append(f"skipped {path}: no {MANIFEST} (a bundle still being written, or not one)")
        except UnsafeFile as e:
            notes.append(f"skipped {path}: {e}")
        except (OSError, ValueError, RecursionError) as e:
            notes.append(f"skipped {path}: {MANIFEST} unreadable ({type(e).__name__}: {str(e)[:TEXT_MAX]})")
    bundles.sort(key=lambda b: (b.created, str(b.path)), reverse=True)
    return bundles, notes


def parse_manifest(path: Path, data: Any) -> Bundle:
    """A manifest as read; ValueError naming the first field of the wrong shape."""
    if not isinstance(data, dict):
        raise ValueError(f"the manifest is {_kind(data)}, not an object")
    if data.get("version") != 1:
        raise ValueError(f"version {data.get('version')!r}, this gpu-npd reads 1")
    gpus = data.get("gpus", [])
    if not isinstance(gpus, list):
        raise ValueError(f"gpus is {_kind(gpus)}, not a list")
    if len(gpus) > MAX_GPUS:
        raise ValueError(f"gpus lists {len(gpus)} GPUs, more than a node has ({MAX_GPUS})")
    size = data.get("bytes")
    if size is not None and (type(size) is not int or size < 0):
        raise ValueError(f"bytes is {size!r}, not a size")
    return Bundle(path, _text(data, "created"), size, _text(data, "node"), _text(data, "reason"),
                  tuple(_gpu(g, i) for i, g in enumerate(gpus)), _flag(data, "redacted"), _names(data, "truncated"),
                  _text(data, "boot_id"), _text(data, "incident"))


def _gpu(g: Any, i: int) -> BundleGpu:
    if not isinstance(g, dict):
        raise ValueError(f"gpus[{i}] is {_kind(g)}, not an object")
    index = g.get("index")
    if index is not None and (type(index) is not int or not 0 <= index < 1024):
        raise ValueError(f"gpus[{i}].index is {index!r}, not a GPU index")
    return BundleGpu(index, _text(g, "serial", f"gpus[{i}].") or None, _text(g, "uuid", f"gpus[{i}].") or None,
                     _text(g, "pci_bus_id", f"gpus[{i}].") or None,
                     (_text(g, "model", f"gpus[{i}].") or _text(g, "name", f"gpus[{i}].")) or None)


def _text(d: dict[str, Any], key: str, where: str = "") -> str:
    value = d.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}{key} is {_kind(value)}, not a string")
    return value[:TEXT_MAX]


def _names(d: dict[str, Any], key: str) -> tuple[str, ...]:
    value = d.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_NAMES or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} is {_kind(value)}, not a list of file names")
    return tuple(v[:TEXT_MAX] for v in value)


def _flag(d: dict[str, Any], key: str) -> bool | None:
    value = d.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key} is {_kind(value)}, not true or false")
    return value


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
