"""NVML's own answers, kept beside a capture (`nvml.json`), for what `nvidia-smi -q -x` does not print: NVLink
error counters, field values, link states, the recovery action as a field, fabric details. A bundle records
every per-GPU NVML read its own diagnose made (`NvmlRecorder`); the replay answers those same reads from it
(`RecordedNvml`) and everything else from the capture, so diagnosing a bundle gives the problems the node gave.

The file format (version 1): {"version": 1, "gpus": {"<PCI bus id>": {"index": ..., "calls": {KEY: ANSWER}}}},
KEY the call's name and its simple arguments as JSON (`nvmlDeviceGetNvLinkState [3]`), field values one
per field as `field <id> <scope>`; ANSWER {"v": value} or {"e": NVML error code}, a structure as
{"s": {field: ANSWER-value}}. Only reads are recorded (`nvmlDeviceGet*`); a recorded call that fails
now fails the same way on replay. Events are not recorded: a snapshot has none.
"""

from __future__ import annotations

import ctypes
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Hashable

import pynvml

from detector.backends.nvml_timing import device_key
from detector.backends.pciaddr import normalize_bus_id

from detector.backends.replay.limits import MAX_CAPTURE_BYTES
from detector.backends.replay.raw import SnapshotError
from detector.backends.replay.side_files import read_side_file

RECORDING = "nvml.json"
VERSION = 1
MAX_CALLS_PER_GPU = 4096            # a sweep makes about 105 reads per GPU; far more is not a recording
_HANDLES = frozenset({"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2"})
_FILLS = frozenset({"nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV"})   # fill a passed struct


# -- encoding ---------------------------------------------------------------------------------------------


def encode(value: Any, depth: int = 0) -> Any:
    """A JSON form of what an NVML read returned; None for what cannot be kept (then it is not recorded)."""
    if depth > 8:
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if isinstance(value, ctypes.Array):
        if value._type_ is ctypes.c_char:
            return {"b": bytes(value).hex()}
        items = [encode(v, depth + 1) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        fields = {}
        for name, *_ in value._fields_:
            fields[name] = encode(getattr(value, name), depth + 1)
        return {"s": fields}
    if isinstance(value, ctypes._SimpleCData):
        return encode(value.value, depth + 1)
    if isinstance(value, (list, tuple)):
        items = [encode(v, depth + 1) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if hasattr(value, "__dict__"):           # pynvml's friendly objects (running processes)
        return {"o": {k: encode(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}}
    return None


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "b" in value:
            return bytes.fromhex(value["b"])
        inner = value.get("s", value.get("o", {}))
        return SimpleNamespace(**{k: decode(v) for k, v in inner.items()})
    return value


def _fill(target: Any, fields: dict[str, Any]) -> None:
    """Write recorded struct fields into the struct a fill call was handed (fabric info)."""
    for name, value in fields.items():
        if name == "version" or not hasattr(target, name):
            continue
        current = getattr(target, name)
        if isinstance(value, dict) and "b" in value and isinstance(current, ctypes.Array):
            data = bytes.fromhex(value["b"])[:ctypes.sizeof(current)]
            ctypes.memmove(ctypes.addressof(current), data, len(data))
        elif isinstance(value, dict) and "s" in value and isinstance(current, (ctypes.Structure, ctypes.Union)):
            _fill(current, value["s"])
        elif isinstance(value, (int, float)):
            setattr(target, name, value)


def _key(name: str, args: tuple) -> str | None:
    simple = [a for a in args if isinstance(a, (int, str, float, bool))]
    if len(simple) != len(args):
        return None
    return f"{name} {json.dumps(simple)}"


def _struct_of(arg: Any) -> Any:
    return getattr(arg, "_obj", arg)         # ctypes.byref(...) hands the struct as _obj


# -- recording --------------------------------------------------------------------------------------------


class NvmlRecorder:
    """Stands where NVML stands (as TimedNvml does) and passes every call through, keeping the answer of each
    per-GPU read, by the index the GPU was opened by."""

    def __init__(self, nvml: Any):
        self.wrapped = nvml
        self._lock = threading.Lock()
        self._index: dict[Hashable, int] = {}
        self.gpus: dict[int, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not (name.startswith("nvmlDeviceGet") and callable(value) and not isinstance(value, type)):
            return value
        wrapped = self._opener(name, value) if name in _HANDLES else self._reader(name, value)
        self.__dict__[name] = wrapped
        return wrapped

    def _opener(self, name: str, fn: Any) -> Any:
        def opened(*args: Any) -> Any:
            handle = fn(*args)
            if args and isinstance(args[0], int):
                key = device_key(handle)
                if key is not None:
                    with self._lock:
                        self._index[key] = args[0]
            return handle
        return opened

    def _reader(self, name: str, fn: Any) -> Any:
        def read(*args: Any) -> Any:
            handle = args[0] if args else None
            key = f"{name} []" if name in _FILLS else _key(name, args[1:])
            if name == "nvmlDeviceGetFieldValues":
                key = None
            try:
                result = fn(*args)
            except pynvml.NVMLError as e:
                self._keep(handle, key, {"e": e.value})
                raise
            if name == "nvmlDeviceGetFieldValues" and len(args) > 1:
                for slot in result:
                    answer = ({"e": slot.nvmlReturn} if slot.nvmlReturn != pynvml.NVML_SUCCESS else
                              {"t": slot.valueType, "v": encode(slot.value)})
                    self._keep(handle, f"field {slot.fieldId} {slot.scopeId}", answer)
            elif name in _FILLS and len(args) > 1:
                self._keep(handle, key, {"v": encode(_struct_of(args[1]))})
            else:
                encoded = encode(result)
                if encoded is not None or result is None:
                    self._keep(handle, key, {"v": encoded})
            return result
        return read

    def _keep(self, handle: Any, key: str | None, answer: dict) -> None:
        if key is None:
            return
        with self._lock:
            handle_key = device_key(handle)
            index = self._index.get(handle_key) if handle_key is not None else None
            if index is None:
                return
            calls = self.gpus.setdefault(index, {})
            if key in calls or len(calls) < MAX_CALLS_PER_GPU:
                calls[key] = answer

    def to_json(self, bus_ids: dict[int, str | None]) -> dict[str, Any]:
        """By bus id (an index shifts when a GPU is lost); a GPU whose bus id is unknown is left out."""
        with self._lock:
            return {"version": VERSION,
                    "gpus": {bus_ids[i]: {"index": i, "calls": dict(calls)}
                             for i, calls in sorted(self.gpus.items()) if bus_ids.get(i)}}


# -- answering from a recording ---------------------------------------------------------------------------


class RecordedNvml:
    """A replay's NVML (ReplayNvml) that answers the reads a recording holds as NVML answered them at capture,
    and passes everything else to the capture's answers."""

    def __init__(self, replay: Any, recording: dict[str, dict[str, Any]]):
        self.wrapped = replay
        self.recording = recording              # by normalised bus id

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not (name.startswith("nvmlDeviceGet") and callable(value)) or name in _HANDLES:
            return value

        def read(*args: Any) -> Any:
            calls = self.recording.get(self._bus(args[0])) if args else None
            if calls is None:
                return value(*args)
            if name == "nvmlDeviceGetFieldValues":
                return self._fields(calls, value(*args))
            key = f"{name} []" if name in _FILLS else _key(name, args[1:])
            answer = calls.get(key) if key is not None else None
            if answer is None:
                return value(*args)
            if "e" in answer:
                raise pynvml.NVMLError(answer["e"])
            if name in _FILLS:
                struct = _struct_of(args[1])
                _fill(struct, (answer.get("v") or {}).get("s", {}))
                return pynvml.NVML_SUCCESS
            return decode(answer["v"])
        self.__dict__[name] = read
        return read

    def _bus(self, handle: Any) -> str | None:
        index = getattr(handle, "index", None)
        gpus = self.wrapped.gpus
        return gpus[index].bus_id if isinstance(index, int) and 0 <= index < len(gpus) else None

    @staticmethod
    def _fields(calls: dict[str, Any], values: Any) -> Any:
        """The capture's field values, each overwritten by the recorded one where there is one."""
        for slot in values:
            answer = calls.get(f"field {slot.fieldId} {slot.scopeId}")
            if answer is None:
                continue
            if "e" in answer:
                slot.nvmlReturn = answer["e"]
                continue
            slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, answer.get("t", 0)
            _fill(slot.value, (answer.get("v") or {}).get("s", {}))
        return values


def read_recording(folder: Path) -> dict[str, dict[str, Any]] | None:
    """`folder/nvml.json` by GPU bus id (normalised); None when absent. SnapshotError when it is there but not a recording."""
    text = read_side_file(folder, RECORDING, MAX_CAPTURE_BYTES)
    if text is None:
        return None
    where = folder / RECORDING
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SnapshotError(f"{where}: line {e.lineno}: not JSON ({e.msg})") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("gpus"), dict):
        raise SnapshotError(f"{where}: expected {{\"version\": {VERSION}, \"gpus\": {{BUS_ID: {{\"calls\": ...}}}}}} "
                            "(an NVML recording written by gpu-npd bundle)")
    out: dict[str, dict[str, Any]] = {}
    for bus, gpu in data["gpus"].items():
        calls = gpu.get("calls") if isinstance(gpu, dict) else None
        try:
            key = normalize_bus_id(bus)
        except ValueError:
            key = None
        if key is None or not isinstance(calls, dict):
            raise SnapshotError(f"{where}: gpus.{bus}: expected a GPU's PCI bus id with a \"calls\" object")
        out[key] = {k: v for k, v in calls.items() if isinstance(v, dict)}
    return out
