"""The errors the API answers with: a metav1.Status body and an HTTP status code, worded as the
API server words them (clients and kubectl match on reason and details, people on the message)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """One field's fault in an object that fails validation (a StatusCause)."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"


def invalid(kind: str, name: str, causes: list[Cause]) -> ApiError:
    texts = [f"{c.field}: {c.message}" for c in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {summary}',
                    {"name": name, "kind": kind,
                     "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]})
