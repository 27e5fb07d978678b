"""A minimal OpenAPI v3 (/openapi/v3 and one document per group version): the operations on each
served resource, tagged with its group/version/kind and listing the query parameters the emulator
honours (dryRun, fieldValidation, fieldManager, ...).

kubectl create/apply/replace read it to learn that the server validates fields itself (the
fieldValidation parameter), and then leave validation to the server instead of downloading schemas.
There are no schemas here: `kubectl explain` has nothing to explain.
"""

from __future__ import annotations

import hashlib
import json
from typing import AbstractSet, Any

from kube_emulator.kinds import GROUP_VERSIONS, Kind

_WRITE_PARAMS = ("dryRun", "fieldManager", "fieldValidation", "pretty")
_READ_PARAMS = ("pretty",)
_LIST_PARAMS = ("allowWatchBookmarks", "continue", "fieldSelector", "labelSelector", "limit", "resourceVersion",
                "resourceVersionMatch", "sendInitialEvents", "timeoutSeconds", "watch", "pretty")


def _prefix(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _operation(kind: Kind, action: str, params: tuple[str, ...]) -> dict[str, Any]:
    return {"operationId": f"{action}{kind.kind}", "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": {"group": kind.group, "version": kind.version, "kind": kind.kind},
            "parameters": [{"name": p, "in": "query", "schema": {"type": "string"}} for p in params],
            "responses": {"200": {"description": "OK"}}}


def _paths(kind: Kind) -> dict[str, Any]:
    base = "/" + _prefix(kind.group, kind.version)
    scope = f"{base}/namespaces/{{namespace}}" if kind.namespaced else base
    collection = f"{scope}/{kind.resource}"
    item = f"{collection}/{{name}}"
    paths: dict[str, Any] = {
        collection: {"get": _operation(kind, "list", _LIST_PARAMS), "post": _operation(kind, "post", _WRITE_PARAMS)},
        item: {"get": _operation(kind, "get", _READ_PARAMS), "put": _operation(kind, "put", _WRITE_PARAMS),
               "patch": _operation(kind, "patch", _WRITE_PARAMS),
               "delete": _operation(kind, "delete", ("dryRun", "gracePeriodSeconds", "pretty"))},
    }
    if kind.has_status:
        paths[f"{item}/status"] = {"get": _operation(kind, "get", _READ_PARAMS),
                                   "put": _operation(kind, "put", _WRITE_PARAMS),
                                   "patch": _operation(kind, "patch", _WRITE_PARAMS)}
    return paths


def group_version_document(group: str, version: str) -> dict[str, Any] | None:
    kinds = GROUP_VERSIONS.get((group, version))
    if kinds is None:
        return None
    paths: dict[str, Any] = {}
    for kind in kinds.values():
        paths.update(_paths(kind))
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "unversioned"}, "paths": paths}


def _hash(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()


def document(key: str, hidden: AbstractSet[tuple[str, str]] = frozenset()) -> dict[str, Any] | None:
    """`openapi/v3` (the index) or `openapi/v3/<api/v1 | apis/group/version>`; None for anything else."""
    if key == "openapi/v3":
        index = {}
        for group, version in GROUP_VERSIONS:
            if (group, version) in hidden:
                continue
            prefix = _prefix(group, version)
            doc = group_version_document(group, version)
            assert doc is not None
            index[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={_hash(doc)}"}
        return {"paths": index}
    if key.startswith("openapi/v3/"):
        parts = key[len("openapi/v3/"):].split("/")
        if parts[0] == "api" and len(parts) == 2:
            return group_version_document("", parts[1])
        if parts[0] == "apis" and len(parts) == 3 and (parts[1], parts[2]) not in hidden:
            return group_version_document(parts[1], parts[2])
    return None
