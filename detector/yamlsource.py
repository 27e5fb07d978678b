"""YAML loading that remembers line numbers, so every config error can name file, line and field.

Every mistake of a file is reported at once, not only the first: a loader reads its file inside
`collecting()`, records each field's mistake (`MappingReader.attempt`, `.report`) and reads on, and at
the end all of them are raised together as one SourceErrors. A mistake that stops the reading (a file
that is not YAML, a value that is not the mapping the rest depends on) is raised as before and joins them.
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import yaml


class SourceError(ValueError):
    """A problem in a user-written file, located as precisely as we can."""

    def __init__(self, file: str, line: int | None, field: str | None, problem: str):
        self.file, self.line, self.field, self.problem = file, line, field, problem
        where = file if line is None else f"{file}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class SourceErrors(SourceError):
    """Several mistakes, in one or more files: one `file:line: field 'x': problem` a line. Located like
    its first, so a caller that shows one error still shows a precise one."""

    def __init__(self, errors: Sequence[SourceError]):
        flat = [e for error in errors for e in (error.errors if isinstance(error, SourceErrors) else [error])]
        first = flat[0]
        super().__init__(first.file, first.line, first.field, first.problem)
        self.errors = flat
        self.args = ("\n".join(str(e) for e in flat),)

    def __str__(self) -> str:
        return self.args[0]

    @classmethod
    def of(cls, errors: Sequence[SourceError]) -> SourceError:
        """One error as itself, several as one SourceErrors: what to raise for a list of mistakes."""
        return errors[0] if len(errors) == 1 else cls(errors)


class _Misspelt(SourceError):
    """A field that is missing because it is misspelt: the misspelling is reported already ("unknown
    field; did you mean `when`?"), so this one is not reported again."""


class Mistakes:
    """The mistakes found so far, so that one run reports every one of them rather than the first."""

    def __init__(self) -> None:
        self.errors: list[SourceError] = []

    def __len__(self) -> int:
        return len(self.errors)

    def add(self, error: SourceError) -> None:
        if isinstance(error, SourceErrors):
            self.errors.extend(error.errors)
        elif not isinstance(error, _Misspelt):
            self.errors.append(error)

    def attempt(self, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """fn(*args); if it raises a SourceError, the mistake is recorded and `default` returned, so one
        wrong field does not hide the next."""
        try:
            return fn(*args)
        except SourceError as e:
            self.add(e)
            return default

    def raise_all(self, aggregate: type[SourceErrors] = SourceErrors) -> None:
        """Raise every recorded mistake together, each file's in line order (files in the order first met)."""
        if not self.errors:
            return
        files = list(dict.fromkeys(e.file for e in self.errors))
        raise aggregate(sorted(self.errors, key=lambda e: (files.index(e.file), e.line or 0)))


@contextmanager
def collecting(aggregate: type[SourceErrors] = SourceErrors) -> Iterator[Mistakes]:
    """Read a file (or several) recording its mistakes, then raise them all together when the block ends;
    a SourceError raised out of the block (a mistake that stops the reading) joins them."""
    mistakes = Mistakes()
    try:
        yield mistakes
    except SourceError as e:
        mistakes.add(e)
    mistakes.raise_all(aggregate)


def did_you_mean(name: Any, known: Iterable[str]) -> str | None:
    """The known name `name` most likely misspells, if one is close (difflib, as Python's own
    "Did you mean" hints): `whn` is `when`."""
    close = difflib.get_close_matches(str(name), sorted(known), n=1)
    return close[0] if close else None


def hint(name: Any, known: Iterable[str], listing: str = "expected one of: {}") -> str:
    """The hint for an unknown name: "did you mean `when`?" for a near miss of a known one, else `listing`
    naming every known one."""
    known = sorted(known)
    guess = did_you_mean(name, known)
    return f"did you mean `{guess}`?" if guess else listing.format(", ".join(known))


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


class _LineLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):   # libyaml's parser where built: 10x faster
    """Builds LineDict/LineList; a duplicate or unusable key is recorded in `problems` and left out, so
    the rest of the file is still read and checked."""

    problems: list[SourceError]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> LineDict:  # type: ignore[override]
        self.flatten_mapping(node)
        result = LineDict()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                self.problems.append(SourceError(self.name, line, None,
                                                 "a mapping key must be a plain value, not a list or mapping"))
                continue
            if key in result:
                self.problems.append(SourceError(self.name, line, str(key), "duplicate key"))
                continue
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = line
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


def parse_yaml(text: str, file: str, mistakes: Mistakes | None = None) -> Document:
    """Parse YAML text; syntax errors become SourceError with the line. Duplicate keys are recorded in
    `mistakes` when given (the rest is still read), else raised together once the whole text is read."""
    loader = _LineLoader(text)
    loader.name = file
    loader.problems = []
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
    if loader.problems:
        if mistakes is None:
            raise SourceErrors.of(loader.problems)
        for problem in loader.problems:
            mistakes.add(problem)
    return Document(file, data)


def load_yaml(path: Path, mistakes: Mistakes | None = None) -> Document:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SourceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SourceError(str(path), None, None, f"not UTF-8 text: {e.reason}") from None
    return parse_yaml(text, str(path), mistakes)


def merged(base: Any, extra: Mapping[Any, Any]) -> dict:
    """`base` (a mapping) updated with `extra`, keeping the lines `base` was read from: settings given on the
    command line on top of a file's still point at the file's lines."""
    result = LineDict({**base, **extra})
    result.line = getattr(base, "line", 0)
    result.key_lines = dict(getattr(base, "key_lines", {}))
    return result


def line_of(container: Any, key: Any) -> int | None:
    """The line of `key` in a LineDict/LineList, or of the container itself."""
    if isinstance(container, (LineDict, LineList)):
        return container.line_of(key)
    return None


_MISSING = object()


class MappingReader:
    """Typed, validated access to one YAML mapping; every failure names file, line and field path.

    With `mistakes` (from `collecting()`), `attempt` and `report` record a field's mistake and read on, so
    every mistake of the file is reported; the readers it makes (`child`, `each`) share them. Without, the
    first mistake is raised at once, as every method that finds one does."""

    def __init__(self, file: str, data: Any, path: str, line: int | None = None, mistakes: Mistakes | None = None):
        self.file, self.path, self.mistakes = file, path, mistakes
        self.line = line if line is not None else line_of(data, 0)
        if not isinstance(data, dict):
            raise SourceError(file, self.line, path or None, f"expected a mapping, got {_kind(data)}")
        self.data = data
        self._misspelt: set[str] = set()        # known keys that an unknown key here is a near miss of

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: Any, problem: str) -> SourceError:
        line = line_of(self.data, key)
        return SourceError(self.file, line, self.field(str(key)) if key is not None else (self.path or None), problem)

    def report(self, key: Any, problem: str) -> None:
        """Record a mistake at `key` and read on (raise it when nothing collects)."""
        if self.mistakes is None:
            raise self.error(key, problem)
        self.mistakes.add(self.error(key, problem))

    def attempt(self, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """fn(*args), or `default` with its mistake recorded (raised when nothing collects)."""
        if self.mistakes is None:
            return fn(*args)
        return self.mistakes.attempt(fn, *args, default=default)

    def recorded(self) -> int:
        """Mistakes recorded so far: more after reading an entry than before means it is not whole."""
        return len(self.mistakes) if self.mistakes is not None else 0

    def has(self, key: str) -> bool:
        return key in self.data

    def reject_unknown(self, allowed: Iterable[str]) -> None:
        """Every unknown key, each a mistake of its own: "did you mean `when`?" for a near miss of an
        allowed one, else the allowed ones listed."""
        allowed = set(allowed)
        errors = []
        for key in self.data:
            if key not in allowed:
                guess = did_you_mean(key, allowed)
                if guess is not None:
                    self._misspelt.add(guess)
                errors.append(self.error(key, f"unknown field; {hint(key, allowed)}"))
        if errors:
            raise SourceErrors.of(errors)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        """The value of `key`, of `kind`; `default` when it is left out. A key that is left out because it
        is misspelt (reject_unknown said so) has no value at all: what depends on it goes unchecked, rather
        than judged by a default the file never meant."""
        if key not in self.data or self.data[key] is None:
            if key in self._misspelt:
                raise _Misspelt(self.file, line_of(self.data, key), self.field(key), f"missing field '{key}'")
            if default is _MISSING:
                raise self.error(key, f"missing required field '{key}'")
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

    def choice(self, key: str, choices: Iterable[str], default: Any = _MISSING) -> Any:
        value = self.get(key, str, default)
        choices = set(choices)
        if value is not default and value not in choices:
            guess = did_you_mean(value, choices)
            raise self.error(key, f"{value!r}: did you mean `{guess}`?" if guess
                             else f"{value!r} is not one of: {', '.join(sorted(choices))}")
        return value

    def child(self, key: str) -> "MappingReader":
        return MappingReader(self.file, self.get(key, dict), self.field(key), line_of(self.data, key), self.mistakes)

    def items(self, key: str, default: Any = _MISSING) -> list[tuple[str, int | None, Any]]:
        """The elements of a list field as (field path, line, value)."""
        values = self.get(key, list, default)
        return [(f"{self.field(key)}[{i}]", line_of(values, i), v) for i, v in enumerate(values)]

    def each(self, key: str, default: Any = _MISSING) -> list[tuple[int, "MappingReader"]]:
        """The elements of a list of mappings as (index, reader); an element that is not a mapping is a
        mistake, recorded (or raised) and left out."""
        readers = []
        for index, (path, line, value) in enumerate(self.items(key, default)):
            reader = self.attempt(MappingReader, self.file, value, path, line, self.mistakes)
            if reader is not None:
                readers.append((index, reader))
        return readers


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list", dict: "a mapping"}


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    for t in (bool, int, float, str, list, dict):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    return type(value).__name__
