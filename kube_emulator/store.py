"""Stored objects of every kind (kinds.py), behind one lock so concurrent requests see a single order
of changes, which the change log (changes.py) keeps for watches."""

from __future__ import annotations

import base64
import json
import random
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Callable, Mapping

from kube_emulator.changes import (
    ADDED,
    DEFAULT_CAPACITY,
    DELETED,
    MODIFIED,
    Change,
    ChangeLog,
)
from kube_emulator.errors import ApiError, already_exists, bad_request, conflict, invalid, not_found
from kube_emulator.kinds import Kind
from kube_emulator.matchers import field_matcher, label_matcher
from kube_emulator.values import clone, rfc3339, to_json

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
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
