"""Label and field selectors, as list and watch requests filter objects with them."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from kube_emulator.errors import bad_request
from kube_emulator.kinds import Kind

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside a `key in (a,b)` value set."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms if t.strip()]


def label_matcher(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """Parse a label selector: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector):
        set_term = _SET_TERM.match(term)
        if set_term:
            key, op, values = set_term.group(1), set_term.group(2), {v.strip() for v in set_term.group(3).split(",")}
            tests.append((lambda ls, k=key, vs=values: ls.get(k) in vs) if op == "in"
                         else (lambda ls, k=key, vs=values: ls.get(k) not in vs))
            continue
        for op in ("!=", "==", "="):
            if op in term:
                key, value = (s.strip() for s in term.split(op, 1))
                if not key:
                    raise bad_request(f"unable to parse requirement: {term!r}")
                tests.append((lambda ls, k=key, v=value: ls.get(k) != v) if op == "!="
                             else (lambda ls, k=key, v=value: ls.get(k) == v))
                break
        else:
            key = term[1:].strip() if term.startswith("!") else term
            if not key or any(c in key for c in " ()"):
                raise bad_request(f"unable to parse requirement: {term!r}")
            tests.append((lambda ls, k=key: k not in ls) if term.startswith("!") else (lambda ls, k=key: k in ls))
    return lambda labels: all(test(labels) for test in tests)


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if path == "source" and isinstance(value, dict):
        value = value.get("component")
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def field_matcher(selector: str, kind: Kind) -> Callable[[Mapping[str, Any]], bool]:
    """Parse a field selector of `f=v`, `f==v`, `f!=v` terms over the kind's selectable fields."""
    tests: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(selector):
        op = next((o for o in ("!=", "==", "=") if o in term), None)
        if op is None:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{term}'")
        name, value = (s.strip() for s in term.split(op, 1))
        if name not in kind.field_selectors:
            raise bad_request(f'"{name}" is not a known field selector: only "metadata.name", "metadata.namespace"')
        tests.append((lambda o, n=name, v=value: _field_value(o, n) != v) if op == "!="
                     else (lambda o, n=name, v=value: _field_value(o, n) == v))
    return lambda obj: all(test(obj) for test in tests)
