"""Discovery documents, built from the resources the emulator serves: what kubectl and client-go read
before anything else (/api, /apis, each group version's APIResourceList, /version).

Only the legacy (unaggregated) discovery format is answered: a client asking for the aggregated
apidiscovery.k8s.io/v2 format gets plain application/json and falls back to it, as against any
API server that does not aggregate.
"""

from __future__ import annotations

from typing import AbstractSet, Any

from kube_emulator import openapi
from kube_emulator.kinds import GROUP_VERSIONS, Kind
from kube_emulator.routes import HEALTH_PATHS, REVIEWS, group_versions

VERSION = {"major": "1", "minor": "35", "gitVersion": "v1.35.0", "gitCommit": "0" * 40, "gitTreeState": "clean",
           "buildDate": "2025-12-17T12:00:00Z", "goVersion": "go1.25.5", "compiler": "gc",
           "platform": "linux/amd64"}
KIND_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]


def _resources(kind: Kind) -> list[dict[str, Any]]:
    entry: dict[str, Any] = {"name": kind.resource, "singularName": kind.singular, "namespaced": kind.namespaced,
                             "kind": kind.kind, "verbs": KIND_VERBS}
    if kind.short_names:
        entry["shortNames"] = list(kind.short_names)
    entries = [entry]
    if kind.has_status:
        entries.append({"name": f"{kind.resource}/status", "singularName": "", "namespaced": kind.namespaced,
                        "kind": kind.kind, "verbs": STATUS_VERBS})
    return entries


def resource_list(group: str, version: str) -> dict[str, Any]:
    """The APIResourceList of one group version."""
    resources: list[dict[str, Any]] = []
    for kind in GROUP_VERSIONS.get((group, version), {}).values():
        resources += _resources(kind)
    for name, kind_name in REVIEWS.get((group, version), {}).items():
        resources.append({"name": name, "singularName": "", "namespaced": False, "kind": kind_name,
                          "verbs": ["create"]})
    group_version = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": sorted(resources, key=lambda r: r["name"])}


def _group(name: str, hidden: AbstractSet[tuple[str, str]]) -> dict[str, Any]:
    versions = [{"groupVersion": f"{g}/{v}", "version": v} for g, v in group_versions(hidden) if g == name]
    return {"name": name, "versions": versions, "preferredVersion": versions[0]}


def document(key: str, server_address: str, hidden: AbstractSet[tuple[str, str]] = frozenset()) -> dict[str, Any] | None:
    """The discovery document a route's `document` names, less the `hidden` group versions; None for none."""
    groups = sorted({g for g, _ in group_versions(hidden) if g})
    if key == "root":
        paths = ["/api", "/api/v1", "/apis", "/version", *(f"/{h}" for h in HEALTH_PATHS)]
        paths += [f"/apis/{g}" for g in groups] + [f"/apis/{g}/{v}" for g, v in group_versions(hidden) if g]
        return {"paths": sorted(paths)}
    if key == "version":
        return VERSION
    if key == "api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}
    if key == "apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g, hidden) for g in groups]}
    if key.startswith("openapi/"):
        return openapi.document(key, hidden)
    parts = key.split("/")
    if parts[0] == "api" and len(parts) == 2:
        return resource_list("", parts[1])
    if parts[0] == "apis" and len(parts) == 2 and parts[1] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1], hidden)}
    if parts[0] == "apis" and len(parts) == 3 and (parts[1], parts[2]) not in hidden:
        return resource_list(parts[1], parts[2])
    return None
