"""Reading back what gpu-npd saved (problems.json, history.json, a clear request): strict field readers.

A state file may have been hand-edited or planted by another pod on the same hostPath. Each field is
checked as it is read, and one of the wrong type is a ValueError naming it (the caller moves the file
aside with one warning), never a number where a message is later formatted. Unlike kube/shapes.py, which
reads the API server's objects leniently (a wrong field reads as absent), nothing here is guessed: a file
gpu-npd wrote never holds a wrong type.
"""

from __future__ import annotations

from typing import Any

REQUIRED: Any = object()


def record(value: Any, what: str = "a record") -> dict[str, Any]:
    """`value` as a JSON object; ValueError when it is another shape."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {type(value).__name__}, not an object")
    return value


def listed(d: Any, key: str, default: Any = REQUIRED) -> list[Any]:
    """The list at `key`; `default` when absent (required when none is given)."""
    value = _get(d, key, default)
    if not isinstance(value, list):
        raise ValueError(f"{key} is {type(value).__name__}, not a list")
    return value


def text(d: Any, key: str, default: Any = REQUIRED) -> Any:
    """The string at `key`; `default` when absent (required when none is given)."""
    value = _get(d, key, default)
    if value is not default and not isinstance(value, str):
        raise ValueError(f"{key} is {value!r}, not a string")
    return value


def number(d: Any, key: str, default: Any = REQUIRED) -> float:
    """The finite-or-infinite, non-NaN number at `key` (a boolean is not one)."""
    value = _get(d, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{key} is {value!r}, not a number")
    return float(value)


def whole_or_none(value: Any, what: str) -> int | None:
    """An optional whole number (a GPU index)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{what} {value!r} is not a whole number")
    return value


def _get(d: Any, key: str, default: Any) -> Any:
    found = record(d)
    if key not in found:
        if default is REQUIRED:
            raise ValueError(f"{key} is missing")
        return default
    return found[key]


__all__ = ["REQUIRED", "listed", "number", "record", "text", "whole_or_none"]
