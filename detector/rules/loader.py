"""Rule files: load, validate, and report every mistake with file, line and field.

Format (version 1):

    version: 1
    rules:
      - name: pcie-width-degraded          # unique, lower-case-with-dashes
        check: pcie                        # a check name, a list of them, or "*"
        when: current_width < max_width    # a predicate over the check's fields
        type: GpuPcieDegraded              # the NodeCondition type (CamelCase)
        reason: PcieLinkWidthDegraded      # CamelCase
        severity: warning                  # info | warning | critical
        action: RESET_GPU                  # see detector.core.types.ACTIONS
        message: "link trained at x{current_width}, expected x{max_width}"
        report: condition                  # condition (default) | event
        recovery: observation              # conditions: how they clear (below)
        ttl: 24h                           # optional: also clear this long after the last match
        scope: gpu                         # gpu (default) | node: see below
        description: optional free text

A condition clears by its rule's `recovery`:
    observation   the first run of its check in which the rule no longer matches (the default)
    reboot        the node boots again, or an operator clears it (`gpu-npd clear`)
    manual        only an operator clears it; it survives reboots
A problem's `scope` says what it asks remediation for. `gpu` (the default): the GPUs it names, which
are fenced one by one (per-GPU health, DRA device taints); it asks for the node only when enough GPUs
fail (the node check's rules). `node`: the whole node, even when it names one GPU (a fatal NVSwitch
error stops every GPU's NVLink traffic). A problem that names no GPU is the node's either way.

A top-level `defaults:` mapping may set `recovery` and `ttl` for every rule of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from detector.core.types import ACTIONS, Severity
from detector.rules.expr import ExpressionError, compile_predicate
from detector.rules.model import Rule, template_names
from detector.yamlsource import MappingReader, SourceError, line_of, load_yaml

SUPPORTED_VERSIONS = {1}
KUBELET_CONDITIONS = {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
_RULE_FIELDS = {"name", "check", "when", "type", "reason", "severity", "action", "report", "message",
                "description", "fallback", "action_field", "count", "window", "boots", "recovery", "ttl", "scope"}
_DEFAULTABLE = {"recovery", "ttl"}
RECOVERIES = {"observation", "reboot", "manual"}
SCOPES = {"gpu", "node"}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
ESCALATION_FIELDS = {"matches": "matches added up in the window", "boots_seen": "distinct boots seen"}


@dataclass(frozen=True)
class RuleSet:
    rules: list[Rule]
    files: list[str]

    def types(self) -> set[str]:
        return {r.type for r in self.rules if r.report == "condition"}

    def counts_by_file(self) -> dict[str, int]:
        """How many rules each file gave, in load order."""
        counts = {f: 0 for f in self.files}
        for rule in self.rules:
            counts[rule.file] = counts.get(rule.file, 0) + 1
        return counts


class RuleErrors(SourceError):
    """Every mistake found in a rule set, not only the first: one `file:line: field: problem` a line.
    Located like its first error, so callers that show one error still show a precise one."""

    def __init__(self, errors: list[SourceError]):
        first = errors[0]
        super().__init__(first.file, first.line, first.field, first.problem)
        self.errors = errors
        self.args = ("\n".join(str(e) for e in errors),)

    def __str__(self) -> str:
        return self.args[0]


def rule_files(paths: Iterable[Path]) -> list[Path]:
    """Expand directories into their *.yaml / *.yml files, in name order. A directory without any is
    a mistake (a typo in a mount path would otherwise leave a node without rules)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
            if not found:
                raise SourceError(str(path), None, None, "no rule files (*.yaml, *.yml) in this directory")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise SourceError(str(path), None, None, "no such rule file or directory")
    return files


def load_rules(paths: Iterable[Path], known_fields: Mapping[str, set[str]] | None = None) -> RuleSet:
    """Load and validate rule files. `known_fields` (check -> its fields) enables name checking.
    Every file and every rule is checked; all mistakes are raised together (RuleErrors). A set
    without a single rule is refused: a detector that checks nothing would report every node healthy.
    One empty file among others is allowed (a site file kept for later) and shows as 0 rules."""
    paths = list(paths)
    errors: list[SourceError] = []
    files: list[Path] = []
    for path in paths:
        try:
            files.extend(rule_files([path]))
        except SourceError as e:
            errors.append(e)
    rules: list[Rule] = []
    seen: dict[str, Rule] = {}
    for path in files:
        loaded = _load_file(path, known_fields, errors)
        for rule in loaded:
            if rule.name in seen:
                first = seen[rule.name]
                errors.append(SourceError(rule.file, rule.line, f"{rule.path}.name",
                                          f"rule {rule.name!r} is already defined at {first.file}:{first.line}"))
                continue
            seen[rule.name] = rule
            rules.append(rule)
    if not rules and not errors:
        named = ", ".join(str(p) for p in paths) or "--rules"
        errors.append(SourceError(named, None, None, "no rules: the rule files named hold none, and a rule "
                                                     "set must hold at least one (use '+PATH' to add to the "
                                                     "bundled rules)"))
    if errors:
        raise RuleErrors(errors)
    return RuleSet(rules, [str(f) for f in files])


def _load_file(path: Path, known_fields: Mapping[str, set[str]] | None, errors: list[SourceError]) -> list[Rule]:
    """The file's valid rules; its mistakes are added to `errors`."""
    try:
        doc = load_yaml(path)
        if doc.data is None:
            raise SourceError(doc.file, None, None, "empty rule file: expected 'version: 1' and 'rules:'")
        top = MappingReader(doc.file, doc.data, "")
        top.reject_unknown({"version", "rules", "defaults"})
        version = top.get("version", int)
        if version not in SUPPORTED_VERSIONS:
            raise top.error("version", f"unsupported version {version}; this gpu-npd reads version "
                            f"{', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}")
        defaults: dict = {}
        if top.has("defaults"):
            reader = top.child("defaults")
            reader.reject_unknown(_DEFAULTABLE)
            _recovery(reader)                           # validate once, where it is written
            defaults = dict(reader.data)
        items = list(top.items("rules"))
    except SourceError as e:
        errors.append(e)
        return []
    rules = []
    for field, line, item in items:
        try:
            rules.append(_rule(MappingReader(doc.file, item, field, line), known_fields, defaults))
        except SourceError as e:
            errors.append(e)
    return rules


def _rule(r: MappingReader, known_fields: Mapping[str, set[str]] | None, defaults: Mapping) -> Rule:
    r.reject_unknown(_RULE_FIELDS)
    name = r.get("name", str)
    if not _NAME.fullmatch(name):
        raise r.error("name", f"{name!r}: use lower-case letters, digits and dashes")
    checks = _checks(r, known_fields)
    when_text = r.get("when", str)
    try:
        when = compile_predicate(when_text)
    except ExpressionError as e:
        raise r.error("when", str(e)) from None
    count, window_s, boots = _escalation(r)
    allowed = _allowed_fields(checks, known_fields)
    if allowed is not None:
        template_allowed = allowed | (set(ESCALATION_FIELDS) if count or boots else set())
        message = r.get("message", str)
        for field_name, used, known in (("when", when.names, allowed),
                                        ("message", template_names(message), template_allowed)):
            unknown = sorted(used - known)
            if unknown:
                name = unknown[0]
                if field_name == "when":
                    where = _located(when_text, when.column_of(name))
                else:
                    where = _located(message, message.find(f"{{{name}}}") + 1 or None)
                raise r.error(field_name, f"unknown field {name!r}{where} for check {_describe(checks)} "
                              f"(known: {', '.join(sorted(known))})")
    action_field = r.get("action_field", str, None)
    if action_field is not None and allowed is not None and action_field not in allowed:
        raise r.error("action_field", f"unknown field {action_field!r} for check {_describe(checks)}")
    type_ = _camel(r, "type")
    if type_ in KUBELET_CONDITIONS:
        raise r.error("type", f"{type_!r} belongs to the kubelet; gpu-npd never writes it")
    action = r.choice("action", set(ACTIONS))
    report = r.choice("report", {"condition", "event"}, "condition")
    own = {k for k in _DEFAULTABLE if r.has(k)}
    if report == "event" and own:
        raise r.error(sorted(own)[0], "events do not recover; recovery and ttl are for conditions")
    inherited = {k: v for k, v in defaults.items() if k not in own} if report == "condition" else {}
    merged = MappingReader(r.file, {**inherited, **r.data}, r.path, line_of(r.data, "name")) if inherited else r
    recovery, ttl_s = _recovery(merged)
    return Rule(
        name=name, checks=checks, when=when, type=type_, reason=_camel(r, "reason"),
        severity=Severity(r.choice("severity", {s.value for s in Severity})), action=action,
        report=report, message=r.get("message", str),
        description=r.get("description", str, ""), file=r.file, line=line_of(r.data, "name") or 0, path=r.path,
        fallback=r.get("fallback", bool, False), action_field=action_field, count=count, window_s=window_s,
        boots=boots, recovery=recovery, ttl_s=ttl_s, scope=r.choice("scope", SCOPES, "gpu"),
    )


def _recovery(r: MappingReader) -> tuple[str, float | None]:
    recovery = r.choice("recovery", RECOVERIES, "observation")
    ttl_s = _duration(r, "ttl") if r.has("ttl") else None
    if ttl_s is not None and recovery == "observation":
        raise r.error("ttl", "a ttl needs recovery reboot or manual (observation recovers by itself)")
    return recovery, ttl_s


def _duration(r: MappingReader, key: str) -> float:
    m = _DURATION.match(str(r.get(key, (str, int))).strip())
    if not m:
        raise r.error(key, "expected a duration like 90s, 10m, 24h or 7d")
    return float(m[1]) * _UNITS[m[2]]


def _escalation(r: MappingReader) -> tuple[int | None, float | None, int | None]:
    count = r.get("count", int, None)
    if count is not None and count < 1:
        raise r.error("count", "must be at least 1")
    boots = r.get("boots", int, None)
    if boots is not None and boots < 2:
        raise r.error("boots", "must be at least 2 (one boot is every match)")
    window_s = None
    if r.has("window"):
        window_s = _duration(r, "window")
        if count is None and boots is None:
            raise r.error("window", "a window needs 'count' or 'boots'")
    if r.get("fallback", bool, False) and (count or boots):
        raise r.error("fallback", "a fallback rule cannot also count or span boots")
    return count, window_s, boots


def _checks(r: MappingReader, known_fields: Mapping[str, set[str]] | None) -> frozenset[str] | None:
    value = r.get("check", (str, list))
    names = [value] if isinstance(value, str) else value
    if not names:
        raise r.error("check", "expected a check name, a list of them, or \"*\"")
    if names == ["*"]:
        return None
    for n in names:
        if not isinstance(n, str):
            raise r.error("check", f"expected check names, got {n!r}")
        if known_fields is not None and n not in known_fields:
            raise r.error("check", f"no check named {n!r} (available: {', '.join(sorted(known_fields))})")
    return frozenset(names)


def _allowed_fields(checks: frozenset[str] | None, known_fields: Mapping[str, set[str]] | None) -> set[str] | None:
    if known_fields is None:
        return None
    if checks is None:      # any check: only the fields every check has
        return set.intersection(*known_fields.values()) if known_fields else set()
    return set().union(*(known_fields[c] for c in checks))


def _camel(r: MappingReader, key: str) -> str:
    value = r.get(key, str)
    if not _CAMEL.fullmatch(value):
        raise r.error(key, f"{value!r}: expected CamelCase, like GpuPcieDegraded")
    return value


def _located(text: str, column: int | None) -> str:
    """` at column N in 'TEXT'`: where a name stands in the expression or message that uses it."""
    return f" at column {column} in {text!r}" if column else f" in {text!r}"


def _describe(checks: frozenset[str] | None) -> str:
    return "'*'" if checks is None else ", ".join(repr(c) for c in sorted(checks))
