"""Shape checks for JSON from the API server, where it enters: a field of the wrong type reads as absent.

Any gpu-npd pod may patch any node's status, proxies rewrite answers, and a broken server sends what it
likes: a list where an object belongs, a number where a string does. Reading every field through these
means such a reply costs what it says (nothing), never an exception per event.
"""

from __future__ import annotations

from typing import Any


def obj(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one (a field of the wrong type reads as absent)."""
    return value if isinstance(value, dict) else {}


def objects(value: Any) -> list[dict[str, Any]]:
    """The JSON objects of a list; anything else in it (or a value that is no list) is left out."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def text(value: Any, default: str = "") -> str:
    """A string field: a string as it is, a number as written; any other shape (a boolean too) is `default`."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return default


__all__ = ["obj", "objects", "text"]
