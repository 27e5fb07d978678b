"""A loaded rule and how it turns matching observations into one Problem."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from detector.core.types import ACTIONS, GpuRef, Observation, Problem, Severity
from detector.rules.expr import Predicate

MESSAGE_LIMIT = 1024           # Kubernetes shows condition messages whole; peers cap them at 1,024
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_names(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


def template_columns(template: str) -> dict[str, int]:
    """Each placeholder's name and the 1-based column of its first `{`, in order of first use: where a
    mistake in it is pointed at (the plain word `width` before `{width}` is not the placeholder)."""
    columns: dict[str, int] = {}
    for m in _PLACEHOLDER.finditer(template):
        columns.setdefault(m.group(1), m.start() + 1)
    return columns


def render(template: str, fields: Mapping[str, Any]) -> str:
    """Substitute `{field}`; plain names only, so a template can never reach into objects."""
    return _PLACEHOLDER.sub(lambda m: _show(fields.get(m.group(1))), template)


def _show(value: Any) -> str:
    if value is None:
        return "unknown"
    if value == "":
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Rule:
    name: str
    checks: frozenset[str] | None       # None: observations of any check
    when: Predicate
    type: str
    reason: str
    severity: Severity
    action: str
    report: str                         # "condition" or "event"
    message: str
    description: str
    file: str
    line: int                           # of its `name:`
    path: str = ""                      # its field path in the file: rules[3]
    fallback: bool = False              # matches only what no other rule of its check matched
    action_field: str | None = None     # take the action from this observation field when valid
    count: int | None = None            # fire when one GPU's matches in `window_s` add up to this
    window_s: float | None = None
    boots: int | None = None            # fire when one GPU's matches span this many boots
    recovery: str = "observation"       # conditions: observation | reboot | manual
    ttl_s: float | None = None          # conditions: also clear this long after the last match
    scope: str = "gpu"                  # gpu: fences the GPUs it names; node: asks for the whole node

    @property
    def escalates(self) -> bool:
        return self.count is not None or self.boots is not None

    def applies_to(self, check: str) -> bool:
        return self.checks is None or check in self.checks

    def problem(self, hits: Sequence[Observation], extra: Mapping[str, Any] | None = None) -> Problem:
        """One problem for all of this rule's hits in a sweep: one condition, many GPUs."""
        gpus: list[GpuRef] = []
        parts: list[str] = []
        for obs in hits:
            text = _without_echo(render(self.message, {**obs.fields, **(extra or {})}))
            if obs.gpu is not None:
                text = f"{obs.gpu.label()}: {text}"
                if obs.gpu not in gpus:
                    gpus.append(obs.gpu)
            if text not in parts:
                parts.append(text)
        action = self._action(hits)
        return Problem(
            rule=self.name, check=hits[0].check, type=self.type, reason=self.reason,
            message=compose_message(parts, action), severity=self.severity, action=action,
            report=self.report, gpus=tuple(gpus), time=max(o.time for o in hits),
            occurrences=sum(_count(o) for o in hits),
        )


    def _action(self, hits: Sequence[Observation]) -> str:
        if self.action_field:
            for obs in hits:
                value = obs.fields.get(self.action_field)
                if isinstance(value, str) and value in ACTIONS:
                    return value
        return self.action


def _count(obs: Observation) -> int:
    """How many times it happened: its `faults` where the check tells faults from lines, else its `count`."""
    count = obs.fields.get("faults", obs.fields.get("count"))
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1


_ACTION_LEAD = " Recommended action: "


def _without_echo(text: str) -> str:
    """`XID 79, GPU has fallen off the bus: GPU has fallen off the bus.` says it once: a template's
    `{message}` that repeats what the template already said is dropped."""
    head, sep, tail = text.rpartition(": ")
    said = tail.strip().rstrip(".").lower()
    return head if sep and len(said) >= 4 and head.lower().rstrip(". ").endswith(said) else text


def finding_of(message: str) -> tuple[str, bool]:
    """A problem's message without its closing recommended action (to join it with others), and
    whether it had one."""
    body, lead, _ = message.partition(_ACTION_LEAD)
    return body.rstrip().rstrip("."), bool(lead)


def compose_message(parts: Sequence[str], action: str, limit: int = MESSAGE_LIMIT, sep: str = "; ") -> str:
    """Join findings with `sep` and end with the recommended action, within `limit` characters.
    Findings that do not fit are counted ("+3 more"), never cut off mid-way, except a lone one."""
    suffix = f"{_ACTION_LEAD}{action} ({ACTIONS[action]})." if action not in ("NONE", "IGNORE") else ""
    budget = limit - len(suffix) - 1                  # room for the body's closing period

    def more(n: int) -> str:
        return f" (+{n} more)" if n else ""

    kept: list[str] = []
    for i, part in enumerate(parts):
        if len(sep.join([*kept, part])) + len(more(len(parts) - i - 1)) > budget:
            break
        kept.append(part)
    omitted = len(parts) - len(kept)
    if not kept and parts:                            # even the first finding is too long: shorten it
        omitted -= 1
        kept = [parts[0][: budget - len(more(omitted)) - 1] + "…"]
    body = sep.join(kept) + more(omitted)
    if not body.endswith("."):
        body += "."
    return body + suffix
