"""Just enough of Kubernetes' protobuf encoding to read an access review.

kubectl sends SelfSubjectAccessReview (`kubectl auth can-i`) and SelfSubjectReview (`kubectl auth
whoami`) as application/vnd.kubernetes.protobuf and does not retry as JSON. The body is the magic
bytes `k8s\\0` and a runtime.Unknown (field 2 holding the object's own bytes); the fields read here
are those of authorization/v1's generated.proto. The answer goes back as JSON, which kubectl accepts.
"""

from __future__ import annotations

from typing import Any

MAGIC = b"k8s\x00"
PROTOBUF = "application/vnd.kubernetes.protobuf"

_RESOURCE_ATTRIBUTES = {1: "namespace", 2: "verb", 3: "group", 4: "version", 5: "resource", 6: "subresource",
                        7: "name"}
_NON_RESOURCE_ATTRIBUTES = {1: "path", 2: "verb"}


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ProtobufError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def fields(data: bytes) -> dict[int, list[bytes | int]]:
    """A message's fields by number: length-delimited ones as bytes, varints as ints (in order)."""
    out: dict[int, list[bytes | int]] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            out.setdefault(number, []).append(value)
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ProtobufError("truncated field")
            out.setdefault(number, []).append(data[i:i + size])
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _first(message: dict[int, list[bytes | int]], number: int) -> bytes | None:
    values = [v for v in message.get(number, []) if isinstance(v, bytes)]
    return values[0] if values else None


def _strings(data: bytes, names: dict[int, str]) -> dict[str, str]:
    message = fields(data)
    return {name: value.decode() for number, name in names.items()
            if (value := _first(message, number)) is not None and value}


def decode_access_review(body: bytes) -> dict[str, Any]:
    """A SelfSubjectAccessReview (or SelfSubjectReview: no spec) as its JSON form."""
    if not body.startswith(MAGIC):
        raise ProtobufError("no k8s protobuf magic bytes")
    raw = _first(fields(body[len(MAGIC):]), 2)
    spec_bytes = _first(fields(raw), 2) if raw else None
    if spec_bytes is None:
        return {}
    spec_message = fields(spec_bytes)
    spec: dict[str, Any] = {}
    resource = _first(spec_message, 1)
    if resource is not None:
        spec["resourceAttributes"] = _strings(resource, _RESOURCE_ATTRIBUTES)
    non_resource = _first(spec_message, 2)
    if non_resource is not None:
        spec["nonResourceAttributes"] = _strings(non_resource, _NON_RESOURCE_ATTRIBUTES)
    return {"spec": spec}
