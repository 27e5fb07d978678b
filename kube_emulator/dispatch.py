"""The API behind the transport: one request in, one response out. Injected faults come first, then
authentication, impersonation and authorization as the API server does them, then the resource verbs
on the store, discovery documents, access reviews and watches."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable

from kube_emulator import discovery
from kube_emulator.access import impersonate, review
from kube_emulator.errors import ApiError, bad_request
from kube_emulator.faults import Decision, Faults
from kube_emulator.kinds import Kind
from kube_emulator.patch import PATCH_TYPES, PatchError, UnsupportedPatchType, apply_patch
from kube_emulator.protobuf import PROTOBUF, ProtobufError, decode_access_review
from kube_emulator.rbac import Attributes, Authorizer, Tokens, User, forbidden_message
from kube_emulator.routes import HEALTH_PATHS, Route, allowed, route_for, verb_for
from kube_emulator.stats import Stats
from kube_emulator.store import Store
from kube_emulator.table import to_table, wants_table
from kube_emulator.transport import Request, Response
from kube_emulator.watch import open_watch

log = logging.getLogger("kube_emulator")

_FAIL_TEXT = {
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: the server failed to handle the request"),
    503: ("ServiceUnavailable", "The server is currently unable to handle the request"),
    504: ("Timeout", "The server was unable to return a response in the time allotted, but may still be "
                     "processing the request"),
}


@dataclass
class Dispatcher:
    """Answers API requests for one emulator, over its store, credentials, RBAC, faults and stats."""

    store: Store
    tokens: Tokens
    authorizer: Authorizer
    faults: Faults
    stats: Stats
    clock: Callable[[], float]
    hidden: AbstractSet[tuple[str, str]]     # the (group, version)s this emulator does not serve
    bookmark_interval_s: float
    serving: Callable[[], object | None]     # the HTTP server listening now (None while down): a watch
                                             # opened through one ends when it is gone
    authority: Callable[[], str]             # "host:port", as discovery documents name the server

    def handle(self, request: Request) -> Response:
        """Answer one API request: faults, authentication, authorization, then the API itself."""
        route = route_for(request.path, self.hidden)
        verb = verb_for(request.method, route, request.query)
        user = self.tokens.user(request.bearer_token())
        decision = self.faults.decide(verb, request.method, request.path)
        if decision.delay_s:
            time.sleep(decision.delay_s)
        if decision.drop:
            response = Response(0, drop=True)
        elif decision.status is not None:
            response = _fault_response(decision)
        else:
            response = guard(lambda: self._serve(request, route, verb, user))
        self.stats.record(user.name if user else "", verb, route.template if route else "unknown",
                          response.code, self.clock())
        return response

    def _serve(self, request: Request, route: Route | None, verb: str, user: User | None) -> Response:
        if route is not None and route.document in HEALTH_PATHS:
            return Response(200, b"ok", "text/plain; charset=utf-8")
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        user = impersonate(request.headers, user, self.authorizer)
        if route is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if route.review:
            if verb != "create":
                raise _method_not_allowed()
            return Response.of(201, review(route.review, _review_body(request), user, self.authorizer))
        if route.kind is None:
            attrs = Attributes(user, verb, path=request.path)
        else:
            if not allowed(route, verb):
                raise _method_not_allowed()
            attrs = Attributes(user, verb, route.kind.resource, route.subresource, route.namespace, route.name,
                               route.group)
        permitted, reason = self.authorizer.authorize(attrs)
        if not permitted:
            details: dict[str, Any] = {"kind": attrs.resource} if attrs.resource else {}
            if attrs.api_group:
                details = {"group": attrs.api_group, **details}
            if attrs.name:
                details = {"name": attrs.name, **details}
            raise ApiError(403, "Forbidden", forbidden_message(attrs, reason), details)
        if route.kind is None:
            return self._document(route, request)
        return self._resource(request, route, route.kind, verb)

    def _document(self, route: Route, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise _method_not_allowed()
        doc = discovery.document(route.document, self.authority(), self.hidden)
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return Response.of(200, doc)

    def _resource(self, request: Request, route: Route, kind: Kind, verb: str) -> Response:
        namespace = route.namespace or None
        q = request.query
        if verb == "watch":
            return self._watch(request, route, kind)
        if verb == "list":
            try:
                limit = int(q.get("limit") or 0)
            except ValueError:
                raise bad_request(f"invalid limit {q.get('limit')!r}") from None
            found = self.store.list(kind, namespace, q.get("labelSelector", ""), q.get("fieldSelector", ""), limit,
                                    q.get("continue", ""))
            if wants_table(request.headers):
                return Response.of(200, to_table(kind, found["items"], self.clock(), q, found["metadata"]))
            return Response.of(200, found)
        if verb == "get":
            obj = self.store.get(kind, namespace, route.name)
            if wants_table(request.headers):
                meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
                return Response.of(200, to_table(kind, [obj], self.clock(), q, meta))
            return Response.raw(200, self.store.encode(kind, obj))
        dry_run = _dry_run(q.get("dryRun"))
        if verb == "create":
            obj = self.store.create(kind, namespace, request.json(), dry_run)
            return Response.raw(201, self.store.encode(kind, obj))
        if verb == "update":
            body = request.json()
            obj, created = self.store.update(kind, namespace, route.name, lambda _: body, route.subresource,
                                             allow_create=kind.create_on_update and not route.subresource,
                                             dry_run=dry_run)
            return Response.raw(201 if created else 200, self.store.encode(kind, obj))
        if verb == "patch":
            content_type = request.headers.get("Content-Type") or ""
            if content_type.split(";", 1)[0].strip().lower() not in PATCH_TYPES:
                raise UnsupportedPatchType(content_type)
            patch = request.json()
            obj, _ = self.store.update(
                kind, namespace, route.name,
                lambda current: apply_patch(content_type, current, patch, kind.merge_keys), route.subresource,
                dry_run=dry_run)
            return Response.raw(200, self.store.encode(kind, obj))
        options = request.json() if request.body.strip() else {}
        options = options if isinstance(options, dict) else {}
        if options.get("dryRun"):
            dry_run = _dry_run(options["dryRun"]) or dry_run
        deleted = self.store.delete(kind, namespace, route.name, options.get("preconditions"), dry_run)
        meta = deleted["metadata"]
        return Response.of(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                 "details": {"name": meta["name"], **({"group": kind.group} if kind.group else {}),
                                             "kind": kind.resource, "uid": meta["uid"]}})

    def _watch(self, request: Request, route: Route, kind: Kind) -> Response:
        query = dict(request.query)
        if route.name:   # GET .../nodes/{name}?watch=1: a watch of that one object
            by_name = f"metadata.name={route.name}"
            query["fieldSelector"] = f"{query['fieldSelector']},{by_name}" if query.get("fieldSelector") else by_name
        render: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        if wants_table(request.headers):   # kubectl get -w: each event's object is a one-row Table
            to_table(kind, [], self.clock(), query)    # a bad includeObject answers 400 before the stream starts

            def as_row(obj: dict[str, Any]) -> dict[str, Any]:
                meta = {"resourceVersion": (obj.get("metadata") or {}).get("resourceVersion", "")}
                return to_table(kind, [obj], self.clock(), query, meta)
            render = as_row
        server = self.serving()
        stream = open_watch(self.store, kind, route.namespace or None, query, lambda: self.serving() is server,
                            self.bookmark_interval_s, render)
        return Response(200, stream=stream)


def guard(serve: Callable[[], Response]) -> Response:
    """`serve()`, with an error it raises answered as the API server answers it."""
    try:
        return serve()
    except ApiError as e:
        return Response.error(e)
    except PatchError as e:
        reason = {400: "BadRequest", 415: "UnsupportedMediaType"}.get(e.code, "Invalid")
        return Response.error(ApiError(e.code, reason, str(e)))
    except Exception as e:  # noqa: BLE001 - a bug must answer 500, not kill the connection
        log.exception("kube-emulator: internal error")
        return Response.error(ApiError(500, "InternalError", f"Internal error occurred: {e}"))


def _review_body(request: Request) -> Any:
    """An access review's body: JSON, or the protobuf kubectl sends."""
    if (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower() != PROTOBUF:
        return request.json()
    try:
        return decode_access_review(request.body)
    except ProtobufError as e:
        raise bad_request(f"the request body is not a valid protobuf access review: {e}") from None


def _method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def _dry_run(value: Any) -> bool:
    """The dryRun parameter (query string or DeleteOptions): absent, or "All" (the one value Kubernetes
    knows); anything else is refused, never taken for a real write."""
    values = value if isinstance(value, list) else [value] if value not in (None, "") else []
    if not values:
        return False
    if values == ["All"]:
        return True
    raise ApiError(400, "BadRequest", f'dryRun: Unsupported value: {json.dumps(values[0] if len(values) == 1 else values)}: '
                                      'supported values: "All"')


def _fault_response(decision: Decision) -> Response:
    assert decision.status is not None
    reason, message = _FAIL_TEXT[decision.status]
    details: dict[str, Any] = {}
    headers: dict[str, str] = {}
    if decision.retry_after is not None:
        details["retryAfterSeconds"] = decision.retry_after
        headers["Retry-After"] = str(decision.retry_after)
    return Response.error(ApiError(decision.status, reason, message, details, headers))
