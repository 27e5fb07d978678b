"""Stored objects (core/v1 Nodes and Events here; Pods and Leases in kinds.py), their validation,
selectors and the errors the API answers with, all behind one lock so concurrent requests see a
single order of changes, which the change log (changes.py) keeps for watches."""

from __future__ import annotations

import base64
import json
import random
import re
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from kube_emulator.changes import (
    ADDED,
    DEFAULT_CAPACITY,
    DELETED,
    MODIFIED,
    Change,
    ChangeLog,
)
from kube_emulator.patch import PRIMITIVE

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects


# --- Errors ---------------------------------------------------------------------------------------

@dataclass
class ApiError(Exception):
    """An error the API server answers with: a metav1.Status body and an HTTP status code."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason}
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(resource: str, name: str, group: str) -> dict[str, Any]:
    return {"name": name, **({"group": group} if group else {}), "kind": resource}


def _qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(resource, group)} "{name}" not found',
                    _details(resource, name, group))


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(409, "AlreadyExists", f'{_qualified(resource, group)} "{name}" already exists',
                    _details(resource, name, group))


def conflict(resource: str, name: str, why: str = "the object has been modified; please apply your changes "
             "to the latest version and try again", group: str = "") -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {_qualified(resource, group)} "{name}": {why}',
                    _details(resource, name, group))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


@dataclass(frozen=True)
class Cause:
    field: str
    message: str
    reason: str = "FieldValueInvalid"


def invalid(kind: str, name: str, causes: list[Cause]) -> ApiError:
    texts = [f"{c.field}: {c.message}" for c in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {summary}',
                    {"name": name, "kind": kind,
                     "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]})


# --- Validation -------------------------------------------------------------------------------------

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                  "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                  "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
CONDITION_STATUSES = ("False", "True", "Unknown")
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "PreferNoSchedule")


def value_invalid(path: str, value: Any, why: str) -> Cause:
    return Cause(path, f"Invalid value: {json.dumps(value)}: {why}")


def required(path: str) -> Cause:
    return Cause(path, "Required value", "FieldValueRequired")


def _unsupported(path: str, value: Any, supported: Iterable[str]) -> Cause:
    options = ", ".join(json.dumps(s) for s in supported)
    return Cause(path, f"Unsupported value: {json.dumps(value)}: supported values: {options}",
                 "FieldValueNotSupported")


def is_subdomain(name: Any) -> bool:
    return isinstance(name, str) and len(name) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(name) is not None


def is_rfc3339(value: Any) -> bool:
    return isinstance(value, str) and _RFC3339.fullmatch(value) is not None


def _validate_labels(labels: Any, path: str) -> list[Cause]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [value_invalid(path, labels, "must be a map of strings")]
    causes = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not is_subdomain(prefix)) or len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
            causes.append(value_invalid(path, key, "name part must consist of alphanumeric characters, '-', '_' "
                                                    "or '.', and must start and end with an alphanumeric character"))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            causes.append(value_invalid(f"{path}", value, "a valid label must be an empty string or consist of "
                                                           "alphanumeric characters, '-', '_' or '.'"))
    return causes


def validate_metadata(obj: dict) -> list[Cause]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return [required("metadata")]
    name = meta.get("name")
    if not name:
        causes = [Cause("metadata.name", "Required value: name or generateName is required", "FieldValueRequired")]
    elif not is_subdomain(name):
        causes = [value_invalid("metadata.name", name, _SUBDOMAIN_MSG)]
    else:
        causes = []
    causes += _validate_labels(meta.get("labels"), "metadata.labels")
    annotations = meta.get("annotations")
    if annotations is not None and (not isinstance(annotations, dict)
                                    or not all(isinstance(v, str) for v in annotations.values())):
        causes.append(value_invalid("metadata.annotations", annotations, "must be a map of strings"))
    return causes


def _validate_times(obj: Mapping[str, Any], names: Iterable[str], path: str) -> list[Cause]:
    return [value_invalid(f"{path}{n}", obj[n], "must be an RFC 3339 timestamp")
            for n in names if obj.get(n) is not None and not is_rfc3339(obj[n])]


def validate_node(node: dict) -> list[Cause]:
    causes = validate_metadata(node)
    spec = node.get("spec") or {}
    for i, taint in enumerate(spec.get("taints") or []):
        if not isinstance(taint, dict) or not taint.get("key"):
            causes.append(required(f"spec.taints[{i}].key"))
        elif taint.get("effect") not in TAINT_EFFECTS:
            causes.append(_unsupported(f"spec.taints[{i}].effect", taint.get("effect"), TAINT_EFFECTS))
    status = node.get("status") or {}
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        return causes + [value_invalid("status.conditions", conditions, "must be a list")]
    seen: set[str] = set()
    for i, cond in enumerate(conditions):
        path = f"status.conditions[{i}]"
        if not isinstance(cond, dict):
            causes.append(value_invalid(path, cond, "must be an object"))
            continue
        kind = cond.get("type")
        if not kind:
            causes.append(required(f"{path}.type"))
        elif kind in seen:
            causes.append(Cause(f"{path}.type", f"Duplicate value: {json.dumps(kind)}", "FieldValueDuplicate"))
        else:
            seen.add(kind)
        if cond.get("status") not in CONDITION_STATUSES:
            causes.append(required(f"{path}.status") if not cond.get("status")
                          else _unsupported(f"{path}.status", cond.get("status"), CONDITION_STATUSES))
        causes += _validate_times(cond, ("lastHeartbeatTime", "lastTransitionTime"), f"{path}.")
    for i, address in enumerate(status.get("addresses") or []):
        if not isinstance(address, dict) or not address.get("type"):
            causes.append(required(f"status.addresses[{i}].type"))
    return causes


def validate_event(event: dict) -> list[Cause]:
    """Legacy core/v1 Event rules, including the namespace agreement Kubernetes insists on."""
    causes = validate_metadata(event)
    involved = event.get("involvedObject")
    if not isinstance(involved, dict):
        causes.append(required("involvedObject"))
        involved = {}
    if not event.get("reason"):
        causes.append(required("reason"))
    count = event.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        causes.append(value_invalid("count", count, "must be greater than or equal to 0"))
    causes += _validate_times(event, ("firstTimestamp", "lastTimestamp", "eventTime"), "")
    namespace = (event.get("metadata") or {}).get("namespace", "")
    involved_ns = involved.get("namespace") or ""
    if event.get("eventTime") is None:
        ok = namespace in ("", "default") if not involved_ns else namespace == involved_ns
    else:
        ok = bool(involved_ns) or namespace in ("default", "kube-system")
        for name in ("reportingComponent", "reportingInstance", "action"):
            if not event.get(name):
                causes.append(required(name))
    if not ok:
        causes.append(value_invalid("involvedObject.namespace", involved_ns, "does not match event.namespace"))
    return causes


# --- Kinds ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """What the store needs to know about one resource type."""

    resource: str
    kind: str
    namespaced: bool
    has_status: bool
    merge_keys: Mapping[str, str]
    field_selectors: frozenset[str]
    validate: Callable[[dict], list[Cause]]
    create_on_update: bool = False
    group: str = ""                  # "" is the core group (/api/v1), else /apis/{group}/{version}
    version: str = "v1"
    singular: str = ""
    short_names: tuple[str, ...] = ()

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """The resource as RBAC messages and Status details name it: `leases.coordination.k8s.io`."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


META_MERGE_KEYS = {"metadata.finalizers": PRIMITIVE, "metadata.ownerReferences": "uid"}

NODES = Kind(
    resource="nodes", kind="Node", namespaced=False, has_status=True,
    merge_keys={**META_MERGE_KEYS, "spec.taints": "key", "spec.podCIDRs": PRIMITIVE,
                "status.conditions": "type", "status.addresses": "type"},
    field_selectors=frozenset({"metadata.name", "spec.unschedulable"}),
    validate=validate_node, singular="node", short_names=("no",))

EVENTS = Kind(
    resource="events", kind="Event", namespaced=True, has_status=False, merge_keys=dict(META_MERGE_KEYS),
    field_selectors=frozenset({
        "metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
        "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion",
        "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason", "reportingComponent",
        "source", "type"}),
    validate=validate_event, create_on_update=True, singular="event", short_names=("ev",))

KINDS: dict[str, Kind] = {k.resource: k for k in (NODES, EVENTS)}


# --- Selectors --------------------------------------------------------------------------------------

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


# --- The store --------------------------------------------------------------------------------------

def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def clone(obj: Any) -> Any:
    """Deep copy of a JSON value (faster than copy.deepcopy for plain JSON data)."""
    return json.loads(json.dumps(obj))


def to_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


_NAME_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"


class Store:
    """Objects by kind and (namespace, name), with a global resourceVersion counter.

    Stored objects are never changed in place: every write stores a new dict (which may share
    unchanged parts with the old one), so readers may serialize what `get` and `list` return
    without copying, and the JSON of an object is cached until it is replaced. Callers must not
    modify what the store returns.
    """

    def __init__(self, clock: Callable[[], float] = time.time, history: int = DEFAULT_CAPACITY):
        """`history`: how many changes the change log keeps for watches starting from a resourceVersion."""
        self._clock = clock
        self._lock = threading.RLock()
        self._rv = 0
        self._objects: dict[str, dict[Key, dict]] = defaultdict(dict)
        self._json: dict[tuple[str, Key], tuple[dict, bytes]] = {}
        self.changes = ChangeLog(history)

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, kind: Kind, type_: str, old: dict | None, new: dict) -> None:
        """Called under the lock, right after the _bump() that gave `new` its resourceVersion."""
        self.changes.record(Change(self._rv, kind.resource, type_, old, new))

    def snapshot(self, kind: Kind) -> tuple[list[dict], int]:
        """Every object of a kind and the resourceVersion they are current at, taken together (a
        watch's initial ADDED events, then the changes after that resourceVersion)."""
        with self._lock:
            return [obj for _, obj in sorted(self._objects[kind.resource].items(), key=lambda i: i[0])], self._rv

    @staticmethod
    def _key(kind: Kind, namespace: str | None, name: str) -> Key:
        return (namespace or "") if kind.namespaced else "", name

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict:
        with self._lock:
            obj = self._objects[kind.resource].get(self._key(kind, namespace, name))
        if obj is None:
            raise not_found(kind.resource, name, kind.group)
        return obj

    def encode(self, kind: Kind, obj: dict) -> bytes:
        """The JSON of an object `get`, `create` or `update` returned, cached while it is current."""
        meta = obj["metadata"]
        key = (kind.resource, self._key(kind, meta.get("namespace"), meta["name"]))
        hit = self._json.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        data = to_json(obj)
        with self._lock:
            if self._objects[kind.resource].get(key[1]) is obj:
                self._json[key] = (obj, data)
        return data

    def list(self, kind: Kind, namespace: str | None = None, label_selector: str = "", field_selector: str = "",
             limit: int = 0, continue_token: str = "") -> dict:
        """A List object; `namespace` None lists across namespaces."""
        labels = label_matcher(label_selector) if label_selector else None
        fields = field_matcher(field_selector, kind) if field_selector else None
        start = _decode_continue(continue_token) if continue_token else None
        with self._lock:
            rv = self.resource_version
            items = sorted(self._objects[kind.resource].items(), key=lambda item: item[0])
        selected = [obj for key, obj in items
                    if (namespace is None or not kind.namespaced or key[0] == namespace)
                    and (start is None or list(key) > start)
                    and (labels is None or labels((obj.get("metadata") or {}).get("labels") or {}))
                    and (fields is None or fields(obj))]
        meta: dict[str, Any] = {"resourceVersion": rv}
        if limit and len(selected) > limit:
            last = selected[limit - 1]["metadata"]
            meta["continue"] = _encode_continue(rv, [last.get("namespace", ""), last["name"]])
            meta["remainingItemCount"] = len(selected) - limit
            selected = selected[:limit]
        return {"kind": kind.list_kind, "apiVersion": kind.api_version, "metadata": meta,
                "items": [{k: v for k, v in obj.items() if k not in ("apiVersion", "kind")} for obj in selected]}

    def create(self, kind: Kind, namespace: str | None, body: Any, dry_run: bool = False) -> dict:
        """Store a new object; with `dry_run`, validate it and return what would be stored, storing
        nothing (no resourceVersion, as the API server answers a dry run)."""
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request must be a {kind.kind} object")
        obj = clone(body)
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if kind.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise bad_request("the namespace of the provided object does not match the namespace sent on "
                                  "the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        for server_set in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "selfLink"):
            meta.pop(server_set, None)
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = self._generated_name(kind, namespace, str(meta["generateName"]))
            causes = kind.validate(obj)
            if causes:
                raise invalid(kind.kind, str(meta.get("name") or ""), causes)
            key = self._key(kind, namespace, meta["name"])
            table = self._objects[kind.resource]
            if key in table:
                raise already_exists(kind.resource, meta["name"], kind.group)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = rfc3339(self._clock())
            if dry_run:
                return obj
            meta["resourceVersion"] = self._bump()
            table[key] = obj
            self._record(kind, ADDED, None, obj)
        return obj

    def _generated_name(self, kind: Kind, namespace: str | None, prefix: str) -> str:
        table = self._objects[kind.resource]
        while True:
            name = prefix + "".join(random.choices(_NAME_SUFFIX_CHARS, k=5))
            if self._key(kind, namespace, name) not in table:
                return name

    def update(self, kind: Kind, namespace: str | None, name: str, build: Callable[[dict], Any],
               subresource: str = "", allow_create: bool = False, dry_run: bool = False) -> tuple[dict, bool]:
        """Replace an object with `build(current)`; returns (stored object, created). `build` must
        return a new object and leave its argument as it is.

        `.status` only changes through the status subresource, and the status subresource changes
        nothing else but labels and annotations (the Node and Pod status strategies reset only spec and
        a few system fields, so a strategic-merge patch of nodes/<name>/status may set or, with null,
        remove a node's annotations). A body carrying a resourceVersion other than the stored one is a
        conflict. An update that changes nothing keeps the resourceVersion, as Kubernetes does. With
        `dry_run` everything is checked and the result returned, and nothing is stored.
        """
        with self._lock:
            key = self._key(kind, namespace, name)
            current = self._objects[kind.resource].get(key)
            if current is None:
                if not allow_create:
                    raise not_found(kind.resource, name, kind.group)
                body = build({})
                if isinstance(body, dict) and isinstance(body.get("metadata"), dict):
                    body["metadata"].pop("resourceVersion", None)
                    if body["metadata"].get("name") not in (None, name):
                        raise _name_mismatch(body["metadata"]["name"], name)
                    body["metadata"]["name"] = name
                return self.create(kind, namespace, body, dry_run), True
            new = build(current)
            if not isinstance(new, dict):
                raise bad_request(f"the result must be a {kind.kind} object")
            meta = new.get("metadata") if isinstance(new.get("metadata"), dict) else {}
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise conflict(kind.resource, name, group=kind.group)
            if meta.get("name") not in (None, name):
                raise _name_mismatch(meta["name"], name)
            if kind.namespaced and meta.get("namespace") not in (None, namespace):
                raise bad_request("the namespace of the provided object does not match the namespace sent on "
                                  "the request")
            result = self._carry_over(kind, current, new, subresource)
            causes = kind.validate(result)
            if causes:
                raise invalid(kind.kind, name, causes)
            if result == current or dry_run:
                return (current if result == current else result), False
            result["metadata"]["resourceVersion"] = self._bump()
            self._objects[kind.resource][key] = result
            self._record(kind, MODIFIED, current, result)
            return result, False

    @staticmethod
    def _carry_over(kind: Kind, current: dict, new: dict, subresource: str) -> dict:
        if subresource == "status":
            meta = dict(current["metadata"])
            sent = new.get("metadata")
            for name in _STATUS_META_FIELDS if isinstance(sent, dict) else ():
                if name in sent:
                    meta[name] = sent[name]
                else:
                    meta.pop(name, None)
            return {**current, "metadata": meta, "status": new.get("status") or {}}
        result = dict(new)
        result["apiVersion"], result["kind"] = kind.api_version, kind.kind
        meta = dict(new.get("metadata") or {})
        for kept in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
            if kept in current["metadata"]:
                meta[kept] = current["metadata"][kept]
        meta.pop("selfLink", None)
        result["metadata"] = meta
        if kind.has_status:
            if "status" in current:
                result["status"] = current["status"]
            else:
                result.pop("status", None)
        return result

    def delete(self, kind: Kind, namespace: str | None, name: str, preconditions: Mapping[str, Any] | None = None,
               dry_run: bool = False) -> dict:
        with self._lock:
            key = self._key(kind, namespace, name)
            current = self._objects[kind.resource].get(key)
            if current is None:
                raise not_found(kind.resource, name, kind.group)
            meta = current["metadata"]
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise conflict(kind.resource, name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                                                    f"UID in object meta: {meta['uid']}", kind.group)
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise conflict(kind.resource, name,
                               f"the ResourceVersion in the precondition ({pre['resourceVersion']}) does not match "
                               f"the ResourceVersion in record ({meta['resourceVersion']}). "
                               "The object might have been modified", kind.group)
            if dry_run:
                return current
            del self._objects[kind.resource][key]
            self._json.pop((kind.resource, key), None)
            rv = self._bump()
            self._record(kind, DELETED, current, {**current, "metadata": {**meta, "resourceVersion": rv}})
            return current


# What an update through the status subresource may change in metadata besides status itself.
_STATUS_META_FIELDS = ("labels", "annotations")


def _name_mismatch(body_name: str, url_name: str) -> ApiError:
    return bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({url_name})")


def _encode_continue(rv: str, start: list[str]) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": int(rv), "start": start}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_continue(token: str) -> list[str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        start = data["start"]
        if not (isinstance(start, list) and len(start) == 2 and all(isinstance(s, str) for s in start)):
            raise ValueError(start)
        return start
    except (ValueError, KeyError, TypeError) as e:
        raise bad_request(f"continue key is not valid: {e}") from None
