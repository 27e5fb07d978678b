"""Faults by node annotation: the KWOK way to break a simulated GPU node with `kubectl` and heal it again.

    kubectl annotate node gpu-0017 gpu-npd.io/inject-fault='{"kind": "xid", "gpu": 3, "params": {"code": 79}}'
    kubectl annotate node gpu-0017 gpu-npd.io/inject-fault-        # heal

The value is one fault or a JSON list of them, each as `POST /faults` and the fleet file take it: `kind`,
`gpu` (for the kinds that need one) and `params`. The annotation says which faults the node has now:
a fault that appears is injected; one that goes away is healed, by a GPU reset (`recover` on its GPU, or
on the node for node-wide faults) or, for kernel-log XIDs, whose conditions hold until the node boots
again, by a reboot. Faults still listed that the healing undid are injected again, so the node keeps
exactly what the annotation says. What was applied, and when, is written back in
`gpu-npd.io/fault-status`; a value that cannot be read changes nothing and is reported (an Event on the
node and the status annotation), so a typo never heals a fault by accident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from detector.core.domain import key
from fake_nvml.faults import FAULT_KINDS, Fault

INJECT_ANNOTATION = key("inject-fault")
STATUS_ANNOTATION = key("fault-status")
_FIELDS = ("kind", "gpu", "params")
REBOOT_TO_HEAL = frozenset({"xid"})       # a kernel-log XID's condition holds until the node boots again


class AnnotationError(ValueError):
    """What is wrong with an annotation's value, said so that a person can fix it."""


def parse_faults(value: str) -> tuple[Fault, ...]:
    """The faults an inject-fault annotation names (an empty value: none)."""
    if not value.strip():
        return ()
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as e:
        raise AnnotationError(f"{INJECT_ANNOTATION}: not JSON ({e.msg} at character {e.pos}); expected "
                              '{"kind": "xid", "gpu": 3, "params": {"code": 79}} or a list of such') from None
    entries = doc if isinstance(doc, list) else [doc]
    faults = []
    for i, entry in enumerate(entries):
        where = f"{INJECT_ANNOTATION}[{i}]" if isinstance(doc, list) else INJECT_ANNOTATION
        faults.append(_fault(entry, where))
    if any(f in faults[:i] for i, f in enumerate(faults)):
        raise AnnotationError(f"{INJECT_ANNOTATION}: the same fault is listed twice")
    return tuple(faults)


def _fault(entry: Any, where: str) -> Fault:
    if not isinstance(entry, dict):
        raise AnnotationError(f"{where}: expected an object with kind, gpu and params, got {json.dumps(entry)}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise AnnotationError(f"{where}: unknown field {unknown[0]!r} (a fault has: {', '.join(_FIELDS)})")
    kind, gpu, params = entry.get("kind"), entry.get("gpu"), entry.get("params") or {}
    if not isinstance(kind, str):
        raise AnnotationError(f"{where}.kind: expected one of {', '.join(sorted(FAULT_KINDS))}")
    if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0):
        raise AnnotationError(f"{where}.gpu: expected a GPU index (0 or more), got {json.dumps(gpu)}")
    if not isinstance(params, dict):
        raise AnnotationError(f"{where}.params: expected an object, got {json.dumps(params)}")
    if kind in ("recover", "reboot"):
        raise AnnotationError(f"{where}.kind: {kind!r} is how faults heal; remove the annotation instead")
    try:
        return Fault(kind, gpu, dict(params))
    except ValueError as e:
        raise AnnotationError(f"{where}: {e}") from None


@dataclass
class Step:
    """What to do to a node so that it has the faults an annotation now names."""

    heal: list[Fault] = field(default_factory=list)      # recover/reboot faults, in order
    inject: list[Fault] = field(default_factory=list)


def plan(applied: tuple[Fault, ...], wanted: tuple[Fault, ...]) -> Step:
    """From the faults applied to the ones wanted: heal what went, then inject what is new and what the
    healing undid (a reboot undoes everything; a node repair every node-wide and GPU fault; a GPU reset
    that GPU's faults)."""
    gone = [f for f in applied if f not in wanted]
    if not gone:
        return Step(inject=[f for f in wanted if f not in applied])
    if any(f.kind in REBOOT_TO_HEAL for f in gone):
        return Step(heal=[Fault("reboot")], inject=list(wanted))
    if any(f.gpu is None for f in gone):
        return Step(heal=[Fault("recover")], inject=list(wanted))
    gpus = sorted({f.gpu for f in gone if f.gpu is not None})
    undone = [f for f in applied if f in wanted and f.gpu in gpus]
    return Step(heal=[Fault("recover", g) for g in gpus], inject=undone + [f for f in wanted if f not in applied])


def status_value(applied: tuple[Fault, ...], at: str, error: str | None = None) -> str:
    """The fault-status annotation: what the node has now, since when, and what was wrong, if anything."""
    doc: dict[str, Any] = {"applied": [f.describe() for f in applied], "time": at}
    if error:
        doc["error"] = error
    return json.dumps(doc, separators=(",", ":"))
