"""The three PATCH formats the API server accepts, as pure functions on JSON values.

Strategic merge follows what Kubernetes does for built-in types: lists that have a merge key in the
type's schema merge element by element, every other list is replaced. The schema is passed in as a
map from dotted field path (list indices left out) to merge key, so the functions know no types.
None of these functions changes its arguments.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE, STRATEGIC)

# A merge-key value meaning "a list of scalars merged as a set" (patchStrategy: merge, no key).
PRIMITIVE = ""

_DIRECTIVE = "$patch"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"
_ELEMENT_ORDER = "$setElementOrder/"
_RETAIN_KEYS = "$retainKeys"


class PatchError(ValueError):
    """A patch that cannot be applied; `code` is the HTTP status the API server answers with."""

    def __init__(self, message: str, code: int = 422):
        super().__init__(message)
        self.code = code


class UnsupportedPatchType(PatchError):
    def __init__(self, content_type: str):
        super().__init__(
            "the body of the request was in an unknown format - accepted media types include: "
            + ", ".join(PATCH_TYPES), 415)
        self.content_type = content_type


def apply_patch(content_type: str, original: dict, patch: Any, merge_keys: Mapping[str, str]) -> Any:
    """Apply a PATCH body of the given Content-Type (parameters such as charset are ignored)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == STRATEGIC:
        if not isinstance(patch, dict):
            raise PatchError("strategic merge patch body must be a JSON object", 400)
        return strategic_merge_patch(original, patch, merge_keys)
    if media == MERGE:
        return merge_patch(original, patch)
    if media == JSON_PATCH:
        return json_patch(original, patch)
    raise UnsupportedPatchType(content_type)


# --- RFC 7386 -------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- RFC 6902 -------------------------------------------------------------------------------------

def json_patch(document: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch: the operations apply in order, and all or none take effect."""
    if not isinstance(operations, list):
        raise PatchError("json patch must be a JSON array of operations", 400)
    doc = copy.deepcopy(document)
    for index, op in enumerate(operations):
        if not isinstance(op, dict) or not isinstance(op.get("op"), str) or not isinstance(op.get("path"), str):
            raise PatchError(f"json patch operation {index} needs string 'op' and 'path'", 400)
        doc = _apply_op(doc, op)
    return doc


def _apply_op(doc: Any, op: dict) -> Any:
    name, path = op["op"], op["path"]
    if name == "add":
        return _add(doc, path, copy.deepcopy(_required(op, "value")))
    if name == "remove":
        doc, _ = _remove(doc, path)
        return doc
    if name == "replace":
        doc, _ = _remove(doc, path)
        return _add(doc, path, copy.deepcopy(_required(op, "value")))
    if name == "move":
        source = _required(op, "from")
        if path != source and path.startswith(source + "/"):
            raise PatchError(f"json patch: cannot move {source!r} into its own child {path!r}")
        doc, value = _remove(doc, source)
        return _add(doc, path, value)
    if name == "copy":
        return _add(doc, path, copy.deepcopy(_get(doc, _required(op, "from"))))
    if name == "test":
        actual = _get(doc, path)
        if not json_equal(actual, _required(op, "value")):
            raise PatchError(f"json patch: test failed at {path!r}")
        return doc
    raise PatchError(f"json patch: unknown operation {name!r}", 400)


def _required(op: dict, key: str) -> Any:
    if key not in op:
        raise PatchError(f"json patch: operation {op['op']!r} needs {key!r}", 400)
    return op[key]


def parse_pointer(pointer: str) -> list[str]:
    """RFC 6901 JSON pointer to its reference tokens ('' is the whole document)."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"json pointer {pointer!r} must start with '/'", 400)
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _index(container: list, token: str, pointer: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"json pointer {pointer!r}: {token!r} is not an array index")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"json pointer {pointer!r}: index {index} out of range")
    return index


def _parent(doc: Any, pointer: str) -> tuple[Any, str]:
    tokens = parse_pointer(pointer)
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, pointer)
    return node, tokens[-1]


def _child(node: Any, token: str, pointer: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise PatchError(f"json pointer {pointer!r}: no member {token!r}")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, pointer, allow_end=False)]
    raise PatchError(f"json pointer {pointer!r}: cannot descend into a {type(node).__name__}")


def _get(doc: Any, pointer: str) -> Any:
    node = doc
    for token in parse_pointer(pointer):
        node = _child(node, token, pointer)
    return node


def _add(doc: Any, pointer: str, value: Any) -> Any:
    if pointer == "":
        return value
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict):
        parent[token] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, token, pointer, allow_end=True), value)
    else:
        raise PatchError(f"json pointer {pointer!r}: parent is not an object or array")
    return doc


def _remove(doc: Any, pointer: str) -> tuple[Any, Any]:
    if pointer == "":
        return None, doc
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict):
        if token not in parent:
            raise PatchError(f"json pointer {pointer!r}: no member {token!r} to remove")
        return doc, parent.pop(token)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, token, pointer, allow_end=False))
    raise PatchError(f"json pointer {pointer!r}: parent is not an object or array")


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: unlike Python's ==, true is not 1 and 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return a == b


# --- Strategic merge --------------------------------------------------------------------------------

def strategic_merge_patch(original: dict, patch: dict, merge_keys: Mapping[str, str]) -> dict:
    """Kubernetes strategic merge patch of `original` with `patch`.

    `merge_keys` maps a dotted path such as "status.conditions" to the merge key of that list
    ("type"), or to PRIMITIVE for a list of scalars merged as a set. Supported directives:
    `$patch: replace|delete|merge` on maps and list elements, `$deleteFromPrimitiveList/<f>`,
    `$setElementOrder/<f>` and `$retainKeys`.
    """
    result = _merge_map(original if isinstance(original, dict) else {}, patch, "", merge_keys)
    return result


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _merge_map(original: dict, patch: dict, path: str, keys: Mapping[str, str]) -> dict:
    directive = patch.get(_DIRECTIVE)
    if directive == "replace":
        return strip_directives({k: v for k, v in patch.items() if k != _DIRECTIVE})
    if directive == "delete":
        return {}
    if directive not in (None, "merge"):
        raise PatchError(f"strategic merge patch: unknown directive {_DIRECTIVE}: {directive!r}", 400)

    result = dict(original)
    orders: dict[str, list] = {}
    deletions: dict[str, list] = {}
    for key, value in patch.items():
        if key in (_DIRECTIVE, _RETAIN_KEYS):
            continue
        if key.startswith(_ELEMENT_ORDER):
            orders[key[len(_ELEMENT_ORDER):]] = _as_list(value, key)
            continue
        if key.startswith(_DELETE_PRIMITIVE):
            deletions[key[len(_DELETE_PRIMITIVE):]] = _as_list(value, key)
            continue
        if value is None:
            result.pop(key, None)
            continue
        sub = _join(path, key)
        current = result.get(key)
        if isinstance(value, dict):
            result[key] = _merge_map(current if isinstance(current, dict) else {}, value, sub, keys)
        elif isinstance(value, list) and sub in keys:
            result[key] = _merge_list(current if isinstance(current, list) else [], value, sub, keys)
        else:
            result[key] = strip_directives(value)

    for field, doomed in deletions.items():
        if isinstance(result.get(field), list):
            result[field] = [item for item in result[field] if not any(json_equal(item, d) for d in doomed)]
    for field, order in orders.items():
        if isinstance(result.get(field), list):
            result[field] = _reorder(result[field], order, keys.get(_join(path, field), PRIMITIVE))
    retain = patch.get(_RETAIN_KEYS)
    if retain is not None:
        kept = set(_as_list(retain, _RETAIN_KEYS))
        result = {k: v for k, v in result.items() if k in kept}
    return result


def _as_list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        raise PatchError(f"strategic merge patch: {key} must be a list", 400)
    return value


def _merge_list(original: list, patch: list, path: str, keys: Mapping[str, str]) -> list:
    merge_key = keys[path]
    if merge_key == PRIMITIVE:
        result = list(original)
        for item in patch:
            if not any(json_equal(item, existing) for existing in result):
                result.append(copy.deepcopy(item))
        return result

    if any(isinstance(item, dict) and item.get(_DIRECTIVE) == "replace" for item in patch):
        return [strip_directives(item) for item in patch
                if not (isinstance(item, dict) and item.get(_DIRECTIVE) == "replace")]

    result = list(original)
    for item in patch:
        if not isinstance(item, dict):
            raise PatchError(f"strategic merge patch: {path} elements must be objects")
        if merge_key not in item:
            raise PatchError(f"map: {json.dumps(item)} does not contain declared merge key: {merge_key}")
        position = next((i for i, existing in enumerate(result)
                         if isinstance(existing, dict) and existing.get(merge_key) == item[merge_key]), None)
        directive = item.get(_DIRECTIVE)
        if directive == "delete":
            if position is not None:
                del result[position]
            continue
        if position is None:
            result.append(strip_directives({k: v for k, v in item.items() if v is not None}))
        else:
            result[position] = _merge_map(result[position], item, path, keys)
    return result


def _reorder(items: list, order: list, merge_key: str) -> list:
    """Put the elements named in a $setElementOrder list first, in that order; others keep theirs."""
    def ident(item: Any) -> Any:
        return item.get(merge_key) if merge_key and isinstance(item, dict) else item

    wanted = [ident(o) for o in order]
    placed = [item for w in wanted for item in items if ident(item) == w]
    rest = [item for item in items if ident(item) not in wanted]
    return placed + rest


def strip_directives(value: Any) -> Any:
    """A copy of `value` without `$`-directives, for patch content taken over as a whole."""
    if isinstance(value, dict):
        return {k: strip_directives(v) for k, v in value.items()
                if not (k == _DIRECTIVE or k == _RETAIN_KEYS or k.startswith(_DELETE_PRIMITIVE)
                        or k.startswith(_ELEMENT_ORDER))}
    if isinstance(value, list):
        return [strip_directives(v) for v in value]
    return value
