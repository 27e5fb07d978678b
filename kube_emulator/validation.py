"""What every kind's validation shares: object metadata (name, labels, annotations), timestamps, and
the causes a field's fault is reported with, worded as the API server words them."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

from kube_emulator.errors import Cause

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                  "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                  "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def value_invalid(path: str, value: Any, why: str) -> Cause:
    return Cause(path, f"Invalid value: {json.dumps(value)}: {why}")


def required(path: str) -> Cause:
    return Cause(path, "Required value", "FieldValueRequired")


def unsupported(path: str, value: Any, supported: Iterable[str]) -> Cause:
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


def validate_times(obj: Mapping[str, Any], names: Iterable[str], path: str) -> list[Cause]:
    return [value_invalid(f"{path}{n}", obj[n], "must be an RFC 3339 timestamp")
            for n in names if obj.get(n) is not None and not is_rfc3339(obj[n])]
