"""Where a request path leads and which authorization verb it is, as the API server's request info
resolver decides: /api/v1/... for the core group, /apis/{group}/{version}/... for the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Mapping
from urllib.parse import unquote

from kube_emulator.kinds import GROUP_VERSIONS, Kind

HEALTH_PATHS = ("healthz", "livez", "readyz")
TOP_DOCUMENTS = HEALTH_PATHS + ("version", "api", "apis")

# Create-only resources that are answered and never stored: (group, version) -> resource -> kind
REVIEWS: dict[tuple[str, str], dict[str, str]] = {
    ("authorization.k8s.io", "v1"): {"selfsubjectaccessreviews": "SelfSubjectAccessReview"},
    ("authentication.k8s.io", "v1"): {"selfsubjectreviews": "SelfSubjectReview"},
}


def group_versions(hidden: AbstractSet[tuple[str, str]] = frozenset()) -> list[tuple[str, str]]:
    """Every (group, version) served, less `hidden` (those one emulator does not serve, such as the
    resource.k8s.io versions other than its own); ("", "v1") is the core group."""
    return [gv for gv in list(GROUP_VERSIONS) + [gv for gv in REVIEWS if gv not in GROUP_VERSIONS]
            if gv not in hidden]


@dataclass(frozen=True)
class Route:
    """Where a path leads: a stored resource (kind, namespace, name, subresource), a review
    (create-only, answered and never stored) or a fixed document (discovery, health)."""

    template: str
    kind: Kind | None = None
    namespace: str = ""
    name: str = ""
    subresource: str = ""
    document: str = ""      # "root", a TOP_DOCUMENTS name, or the path: "api/v1", "apis/{group}[/{version}]",
                            # "openapi/v3[/...]"
    review: str = ""        # a REVIEWS resource
    group: str = ""

    @property
    def resource(self) -> str:
        return self.kind.resource if self.kind is not None else self.review


def route_for(path: str, hidden: AbstractSet[tuple[str, str]] = frozenset()) -> Route | None:
    """The route of a path, or None for a path the server does not serve (404), `hidden` group
    versions included."""
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts:
        return Route("/", document="root")
    if len(parts) == 1 and parts[0] in TOP_DOCUMENTS:
        return Route("/" + parts[0], document=parts[0])
    if parts[0] == "openapi" and len(parts) >= 2 and parts[1] == "v3":
        return Route("/openapi/v3", document="/".join(parts))
    if parts[0] == "api" and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis" and len(parts) >= 2:
        group, version, rest = parts[1], (parts[2] if len(parts) > 2 else ""), parts[3:]
        if not version:
            known = any(g == group for g, _ in group_versions(hidden))
            return Route("/apis/" + group, document="apis/" + group, group=group) if known else None
    else:
        return None
    if (group, version) not in group_versions(hidden):
        return None
    prefix = f"apis/{group}/{version}" if group else f"api/{version}"
    if not rest:
        return Route("/" + prefix, document=prefix, group=group)
    review = REVIEWS.get((group, version), {})
    if len(rest) == 1 and rest[0] in review:
        return Route(f"{rest[0]}.{group}", review=rest[0], group=group)
    return _resource_route(group, version, rest)


def _resource_route(group: str, version: str, rest: list[str]) -> Route | None:
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    kind = GROUP_VERSIONS.get((group, version), {}).get(rest[0])
    if kind is None or len(rest) > 3:
        return None
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    if kind.namespaced and not namespace and name:
        return None   # /api/v1/events/{name}: only the cross-namespace list exists
    if not kind.namespaced and namespace:
        return None
    if sub and (sub != "status" or not kind.has_status):
        return None
    template = kind.resource if not group else kind.qualified
    return Route(template + (f"/{sub}" if sub else ""), kind, namespace, name, sub, group=group)


def verb_for(method: str, route: Route | None, query: Mapping[str, str]) -> str:
    """The Kubernetes authorization verb of a request."""
    if route is None or route.kind is None:
        if route is not None and route.review:
            return "create" if method == "POST" else method.lower()
        return method.lower()
    if method in ("GET", "HEAD"):
        if query.get("watch", "").lower() in ("1", "true") and not route.subresource:
            return "watch"
        return "get" if route.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if route.name else "deletecollection"}.get(method, method.lower())


def allowed(route: Route, verb: str) -> bool:
    """Whether the route serves this verb at all (else 405)."""
    if route.review:
        return verb == "create"
    if route.subresource:
        return verb in ("get", "update", "patch")
    if route.name:
        return verb in ("get", "update", "patch", "delete", "watch")
    if verb == "create":
        return route.kind is not None and (not route.kind.namespaced or bool(route.namespace))
    return verb in ("list", "watch")
