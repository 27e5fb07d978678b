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

Every mistake of every file is reported in one run (RuleErrors), each with file, line and field; a rule
with a mistake is left out of the set, and the others are still checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from detector.core.types import ACTIONS, Severity
from detector.rules.expr import ExpressionError, Predicate, compile_predicate
from detector.rules.model import Rule, template_columns
from detector.yamlsource import MappingReader, Mistakes, SourceError, SourceErrors, hint, line_of, load_yaml

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
SEVERITIES = {s.value for s in Severity}
REPORTS = {"condition", "event"}


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


class RuleErrors(SourceErrors):
    """Every mistake found in a rule set, not only the first: one `file:line: field: problem` a line.
    Located like its first error, so callers that show one error still show a precise one."""


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
    mistakes = Mistakes()
    files: list[Path] = []
    for path in paths:
        files.extend(mistakes.attempt(rule_files, [path], default=[]))
    rules: list[Rule] = []
    seen: dict[str, Rule] = {}
    for path in files:
        for rule in _load_file(path, known_fields, mistakes):
            if rule.name in seen:
                first = seen[rule.name]
                mistakes.add(SourceError(rule.file, rule.line, f"{rule.path}.name",
                                         f"rule {rule.name!r} is already defined at {first.file}:{first.line}"))
                continue
            seen[rule.name] = rule
            rules.append(rule)
    if not rules and not mistakes:
        named = ", ".join(str(p) for p in paths) or "--rules"
        mistakes.add(SourceError(named, None, None, "no rules: the rule files named hold none, and a rule "
                                                    "set must hold at least one (use '+PATH' to add to the "
                                                    "bundled rules)"))
    mistakes.raise_all(RuleErrors)
    return RuleSet(rules, [str(f) for f in files])


def _load_file(path: Path, known_fields: Mapping[str, set[str]] | None, mistakes: Mistakes) -> list[Rule]:
    """The file's valid rules; every one of its mistakes is added to `mistakes`."""
    doc = mistakes.attempt(load_yaml, path, mistakes)
    if doc is None:
        return []
    if doc.data is None:
        mistakes.add(SourceError(doc.file, None, None, "empty rule file: expected 'version: 1' and 'rules:'"))
        return []
    top = mistakes.attempt(MappingReader, doc.file, doc.data, "", None, mistakes)
    if top is None:
        return []
    top.attempt(top.reject_unknown, {"version", "rules", "defaults"})
    top.attempt(_version, top)
    defaults = top.attempt(_defaults, top, default={}) if top.has("defaults") else {}
    rules = []
    for _, reader in top.attempt(top.each, "rules", default=[]):
        rule = _rule(reader, known_fields, defaults)
        if rule is not None:
            rules.append(rule)
    return rules


def _version(top: MappingReader) -> None:
    version = top.get("version", int)
    if version not in SUPPORTED_VERSIONS:
        raise top.error("version", f"unsupported version {version}; this gpu-npd reads version "
                        f"{', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}")


def _defaults(top: MappingReader) -> dict[str, Any]:
    """`defaults:` as validated values, where it is written: {"recovery": ..., "ttl_s": ...}."""
    r = top.child("defaults")
    before = r.recorded()
    r.attempt(r.reject_unknown, _DEFAULTABLE)
    recovery, ttl_s = _recovery(r, "condition", {})
    return {"recovery": recovery, "ttl_s": ttl_s} if r.recorded() == before else {}


def _rule(r: MappingReader, known_fields: Mapping[str, set[str]] | None, defaults: Mapping[str, Any]) -> Rule | None:
    """The rule, or None when it has mistakes: every one of them is recorded (in r.mistakes), each field
    checked on its own so that one wrong field does not hide the next."""
    before = r.recorded()
    r.attempt(r.reject_unknown, _RULE_FIELDS)
    name = r.attempt(_name, r)
    checks, allowed = r.attempt(_checks, r, known_fields, default=(None, None))
    when = r.attempt(_when, r)
    type_ = r.attempt(_type, r)
    reason = r.attempt(_camel, r, "reason")
    severity = r.attempt(r.choice, "severity", SEVERITIES)
    action = r.attempt(r.choice, "action", set(ACTIONS))
    message = r.attempt(r.get, "message", str)
    report = r.attempt(r.choice, "report", REPORTS, "condition")
    recovery, ttl_s = _recovery(r, report, defaults)
    scope = r.attempt(r.choice, "scope", SCOPES, "gpu")
    description = r.attempt(r.get, "description", str, "")
    fallback = r.attempt(r.get, "fallback", bool, False)
    action_field = r.attempt(_action_field, r, checks, allowed)
    count, window_s, boots = _escalation(r, fallback)
    if allowed is not None:
        _unknown_names(r, checks, allowed, when, message, count is not None or boots is not None)
    if r.recorded() > before:
        return None
    return Rule(
        name=name, checks=checks, when=when, type=type_, reason=reason, severity=Severity(severity),
        action=action, report=report, message=message, description=description, file=r.file,
        line=line_of(r.data, "name") or 0, path=r.path, fallback=fallback, action_field=action_field,
        count=count, window_s=window_s, boots=boots, recovery=recovery, ttl_s=ttl_s, scope=scope,
    )


def _name(r: MappingReader) -> str:
    name = r.get("name", str)
    if not _NAME.fullmatch(name):
        raise r.error("name", f"{name!r}: use lower-case letters, digits and dashes")
    return name


def _when(r: MappingReader) -> Predicate:
    try:
        return compile_predicate(r.get("when", str))
    except ExpressionError as e:
        raise r.error("when", str(e)) from None


def _unknown_names(r: MappingReader, checks: frozenset[str] | None, allowed: set[str], when: Predicate | None,
                   message: str | None, escalates: bool) -> None:
    """Each name in `when` and each placeholder in `message` that the rule's checks do not have: one
    mistake each, with where it stands and the near miss it likely means."""
    unknown: list[tuple[str, str, str, int | None, set[str]]] = []
    if when is not None:
        unknown += [("when", when.source, name, when.column_of(name), allowed) for name in sorted(when.names - allowed)]
    if message is not None:
        known = allowed | (set(ESCALATION_FIELDS) if escalates else set())
        unknown += [("message", message, name, column, known)
                    for name, column in template_columns(message).items() if name not in known]
    for key, text, name, column, known in unknown:
        r.report(key, f"unknown field {name!r}{_located(text, column)} for check {_describe(checks)} "
                      f"({hint(name, known, 'known: {}')})")


def _action_field(r: MappingReader, checks: frozenset[str] | None, allowed: set[str] | None) -> str | None:
    action_field = r.get("action_field", str, None)
    if action_field is not None and allowed is not None and action_field not in allowed:
        raise r.error("action_field", f"unknown field {action_field!r} for check {_describe(checks)} "
                                      f"({hint(action_field, allowed, 'known: {}')})")
    return action_field


def _type(r: MappingReader) -> str:
    type_ = _camel(r, "type")
    if type_ in KUBELET_CONDITIONS:
        raise r.error("type", f"{type_!r} belongs to the kubelet; gpu-npd never writes it")
    return type_


def _recovery(r: MappingReader, report: str | None, defaults: Mapping[str, Any]) -> tuple[str, float | None]:
    """A condition's recovery and ttl: its own, else its file's `defaults`. Events have none."""
    own = sorted(k for k in _DEFAULTABLE if r.has(k))
    if report == "event":
        if own:
            r.report(own[0], "events do not recover; recovery and ttl are for conditions")
        return "observation", None
    recovery = r.attempt(r.choice, "recovery", RECOVERIES, defaults.get("recovery", "observation"))
    ttl_s = r.attempt(_duration, r, "ttl") if r.has("ttl") else defaults.get("ttl_s")
    if ttl_s is not None and recovery == "observation":
        r.report("ttl" if r.has("ttl") else "recovery",
                 "a ttl needs recovery reboot or manual (observation recovers by itself)")
    return recovery or "observation", ttl_s


def _duration(r: MappingReader, key: str) -> float:
    m = _DURATION.match(str(r.get(key, (str, int))).strip())
    if not m:
        raise r.error(key, "expected a duration like 90s, 10m, 24h or 7d")
    return float(m[1]) * _UNITS[m[2]]


def _escalation(r: MappingReader, fallback: bool | None) -> tuple[int | None, float | None, int | None]:
    """`count`, `window` and `boots`, each checked on its own, then how they combine."""
    count = r.attempt(_at_least, r, "count", 1, "must be at least 1")
    boots = r.attempt(_at_least, r, "boots", 2, "must be at least 2 (one boot is every match)")
    window_s = r.attempt(_duration, r, "window") if r.has("window") else None
    if r.has("window") and r.data.get("count") is None and r.data.get("boots") is None:
        r.report("window", "a window needs 'count' or 'boots'")
    if fallback and (count or boots):
        r.report("fallback", "a fallback rule cannot also count or span boots")
    return count, window_s, boots


def _at_least(r: MappingReader, key: str, least: int, problem: str) -> int | None:
    value = r.get(key, int, None)
    if value is not None and value < least:
        raise r.error(key, problem)
    return value


def _checks(r: MappingReader, known_fields: Mapping[str, set[str]] | None
            ) -> tuple[frozenset[str] | None, set[str] | None]:
    """The rule's checks (None: any) and the fields they have (None: unknown, so names go unchecked).
    Every unknown check name is a mistake of its own."""
    value = r.get("check", (str, list))
    names = [value] if isinstance(value, str) else value
    if not names:
        raise r.error("check", "expected a check name, a list of them, or \"*\"")
    if names == ["*"]:
        return None, _allowed_fields(None, known_fields)
    errors = [r.error("check", f"expected check names, got {n!r}") for n in names if not isinstance(n, str)]
    if known_fields is not None:
        errors += [r.error("check", f"no check named {n!r} ({hint(n, known_fields, 'available: {}')})")
                   for n in names if isinstance(n, str) and n not in known_fields]
    if errors:
        raise SourceErrors.of(errors)
    checks = frozenset(names)
    return checks, _allowed_fields(checks, known_fields)


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
