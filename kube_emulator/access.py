"""Who a request acts as, and what a user may ask about their own access.

Impersonation (`Impersonate-User`, `Impersonate-Group`, `Impersonate-Uid`, `Impersonate-Extra-*`
headers, what `kubectl --as`/`--as-group` send) is allowed only where RBAC grants the `impersonate`
verb on users, groups, serviceaccounts, uids or userextras, as the API server's impersonation
filter checks; system:masters may. SelfSubjectAccessReview (`kubectl auth can-i`) and
SelfSubjectReview (`kubectl auth whoami`) are open to every authenticated user, as the
system:basic-user role makes them on a real cluster.
"""

from __future__ import annotations

from typing import Any, Mapping

from kube_emulator.rbac import (
    AUTHENTICATED,
    SA_PREFIX,
    Attributes,
    Authorizer,
    User,
    default_groups,
)
from kube_emulator.errors import ApiError, bad_request

USER, GROUP, UID = "impersonate-user", "impersonate-group", "impersonate-uid"
EXTRA_PREFIX = "impersonate-extra-"


def _header(headers: Mapping[str, str], name: str) -> str:
    return (headers.get(name) or "").strip()


def _forbidden(user: User, attrs: Attributes, value: str) -> ApiError:
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    qualified = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    return ApiError(403, "Forbidden", f'{qualified} "{value}" is forbidden: User "{user.name}" cannot impersonate '
                                      f'resource "{attrs.resource}" in API group "{attrs.api_group}" {scope}',
                    {"name": value, "kind": attrs.resource})


def impersonate(headers: Mapping[str, str], user: User, authorizer: Authorizer) -> User:
    """The user the request acts as: `user` itself without impersonation headers, else the user
    impersonated, once every impersonation it asks for is authorized (403 otherwise)."""
    name = _header(headers, USER)
    groups = [g.strip() for g in _header(headers, GROUP).split(",") if g.strip()]
    uid = _header(headers, UID)
    extras = [k[len(EXTRA_PREFIX):] for k in headers if k.lower().startswith(EXTRA_PREFIX)]
    if not (name or groups or uid or extras):
        return user
    if not name:
        raise bad_request("requested impersonation of groups, uid or extra fields without impersonating a user")
    checks: list[tuple[Attributes, str]] = []
    if name.startswith(SA_PREFIX):
        namespace, _, sa = name[len(SA_PREFIX):].partition(":")
        checks.append((Attributes(user, "impersonate", "serviceaccounts", namespace=namespace, name=sa), sa))
    else:
        checks.append((Attributes(user, "impersonate", "users", name=name), name))
    checks += [(Attributes(user, "impersonate", "groups", name=g), g) for g in groups]
    if uid:
        checks.append((Attributes(user, "impersonate", "uids", name=uid, api_group="authentication.k8s.io"), uid))
    checks += [(Attributes(user, "impersonate", "userextras", subresource=key.lower(), name="",
                           api_group="authentication.k8s.io"), key) for key in extras]
    for attrs, value in checks:
        if not authorizer.authorize(attrs)[0]:
            raise _forbidden(user, attrs, value)
    if not groups:
        return User(name, default_groups(name) if name.startswith(SA_PREFIX) else (AUTHENTICATED,))
    return User(name, tuple(dict.fromkeys([*groups, AUTHENTICATED])))


def review(resource: str, body: Any, user: User, authorizer: Authorizer) -> dict[str, Any]:
    """The answer to a SelfSubjectAccessReview or SelfSubjectReview body, as `user`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if resource == "selfsubjectreviews":
        return {"kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": None},
                "status": {"userInfo": {"username": user.name, "groups": list(user.groups)}}}
    spec = body.get("spec") if isinstance(body.get("spec"), dict) else {}
    resource_attrs, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
    if isinstance(resource_attrs, dict) == isinstance(non_resource, dict):
        raise ApiError(422, "Invalid", "SelfSubjectAccessReview.authorization.k8s.io is invalid: spec: Invalid "
                                       "value: exactly one of nonResourceAttributes or resourceAttributes must be "
                                       "specified", {"kind": "SelfSubjectAccessReview",
                                                     "group": "authorization.k8s.io"})
    if isinstance(non_resource, dict):
        attrs = Attributes(user, str(non_resource.get("verb") or ""), path=str(non_resource.get("path") or "/"))
    else:
        r = resource_attrs
        attrs = Attributes(user, str(r.get("verb") or ""), str(r.get("resource") or ""),
                           str(r.get("subresource") or ""), str(r.get("namespace") or ""),
                           str(r.get("name") or ""), str(r.get("group") or ""))
    allowed, reason = authorizer.authorize(attrs)
    status: dict[str, Any] = {"allowed": allowed}
    if reason:
        status["reason"] = reason
    return {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
