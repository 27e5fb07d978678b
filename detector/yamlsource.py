"""YAML loading that remembers line numbers, so every config error can name file, line and field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class SourceError(ValueError):
    """A problem in a user-written file, located as precisely as we can."""

    def __init__(self, file: str, line: int | None, field: str | None, problem: str):
        self.file, self.line, self.field, self.problem = file, line, field, problem
        where = file if line is None else f"{file}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class LineDict(dict):
    """A mapping from YAML that knows the line of itself and of each of its keys (1-based)."""

    line: int = 0
    key_lines: dict[Any, int]

    def line_of(self, key: Any) -> int:
        return self.key_lines.get(key, self.line)


class LineList(list):
    line: int = 0
    item_lines: list[int]

    def line_of(self, index: int) -> int:
        return self.item_lines[index] if index < len(self.item_lines) else self.line


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> LineDict:  # type: ignore[override]
        self.flatten_mapping(node)
        result = LineDict()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise SourceError(self.name, key_node.start_mark.line + 1, None,
                                  "a mapping key must be a plain value, not a list or mapping") from None
            if key in result:
                raise SourceError(self.name, key_node.start_mark.line + 1, str(key), "duplicate key")
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_sequence(self, node: yaml.SequenceNode, deep: bool = False) -> LineList:  # type: ignore[override]
        result = LineList(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        result.item_lines = [child.start_mark.line + 1 for child in node.value]
        return result


_LineLoader.add_constructor("tag:yaml.org,2002:map", _LineLoader.construct_mapping)
_LineLoader.add_constructor("tag:yaml.org,2002:seq", _LineLoader.construct_sequence)


@dataclass(frozen=True)
class Document:
    """One parsed YAML file: its name (for messages) and its top-level value."""

    file: str
    data: Any


def parse_yaml(text: str, file: str) -> Document:
    """Parse YAML text; syntax errors become SourceError with the line."""
    loader = _LineLoader(text)
    loader.name = file
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise SourceError(file, line, None, f"invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise SourceError(file, None, None, f"invalid YAML: {e}") from None
    finally:
        loader.dispose()
    return Document(file, data)


def load_yaml(path: Path) -> Document:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SourceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SourceError(str(path), None, None, f"not UTF-8 text: {e.reason}") from None
    return parse_yaml(text, str(path))


def line_of(container: Any, key: Any) -> int | None:
    """The line of `key` in a LineDict/LineList, or of the container itself."""
    if isinstance(container, (LineDict, LineList)):
        return container.line_of(key)
    return None


_MISSING = object()


class MappingReader:
    """Typed, validated access to one YAML mapping; every failure names file, line and field path."""

    def __init__(self, file: str, data: Any, path: str, line: int | None = None):
        self.file, self.path = file, path
        if not isinstance(data, dict):
            raise SourceError(file, line if line is not None else line_of(data, 0), path or None,
                              f"expected a mapping, got {_kind(data)}")
        self.data = data

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: Any, problem: str) -> SourceError:
        line = line_of(self.data, key)
        return SourceError(self.file, line, self.field(str(key)) if key is not None else (self.path or None), problem)

    def has(self, key: str) -> bool:
        return key in self.data

    def reject_unknown(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                raise self.error(key, f"unknown field; expected one of: {', '.join(sorted(allowed))}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise self.error(None, f"missing required field '{key}'")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            value_ok = False
        else:
            value_ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int))
        if not value_ok:
            expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise self.error(key, f"expected {expected}, got {_kind(value)} {value!r}")
        return value

    def choice(self, key: str, choices: set[str] | list[str], default: Any = _MISSING) -> Any:
        value = self.get(key, str, default)
        if value is not default and value not in choices:
            raise self.error(key, f"{value!r} is not one of: {', '.join(sorted(choices))}")
        return value

    def child(self, key: str) -> "MappingReader":
        return MappingReader(self.file, self.get(key, dict), self.field(key), line_of(self.data, key))

    def items(self, key: str, default: Any = _MISSING) -> list[tuple[str, int | None, Any]]:
        """The elements of a list field as (field path, line, value)."""
        values = self.get(key, list, default)
        return [(f"{self.field(key)}[{i}]", line_of(values, i), v) for i, v in enumerate(values)]


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list", dict: "a mapping"}


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    for t in (bool, int, float, str, list, dict):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    return type(value).__name__
