"""Agent settings from a YAML file: which checks, and each check's own settings.

    checks:
      visibility: {expected_gpus: 8, interval: 60, timeout: 20}
      pcie: {}
      nccl: {enabled: true, interval: 21600}     # opt-in checks run only when enabled
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from detector.core.check import Check, CheckRegistry
from detector.yamlsource import (MappingReader, Mistakes, SourceError, collecting, hint, line_of, load_yaml,
                                 merged)


def load_check_settings(path: Path) -> tuple[str, dict[str, Any]]:
    """The `checks:` mapping of a config file (raw, validated later against each check); every mistake
    in the file's own shape is raised together."""
    with collecting() as mistakes:
        return _read_check_settings(path, mistakes)


def _read_check_settings(path: Path, mistakes: Mistakes) -> tuple[str, dict[str, Any]]:
    doc = load_yaml(path, mistakes)
    top = MappingReader(doc.file, doc.data if doc.data is not None else {}, "", mistakes=mistakes)
    top.attempt(top.reject_unknown, {"checks"})
    return doc.file, top.attempt(top.get, "checks", dict, {}, default={})


def build_checks(registry: CheckRegistry, selected: Sequence[str] | None,
                 settings: Mapping[str, Any] | None = None, file: str = "<settings>",
                 clock: Callable[[], float] = time.monotonic) -> list[Check]:
    """Instantiate checks by name with validated settings. Unknown names or settings raise
    SourceError (from a file: all of its mistakes together) or KeyError (from --checks). Without
    `selected`, every enabled check runs (opt-in checks such as nccl only with `enabled: true`); a named
    check runs whatever `enabled` says."""
    with collecting() as mistakes:
        return _build_checks(registry, selected, settings or {}, file, clock, mistakes)


def _build_checks(registry: CheckRegistry, selected: Sequence[str] | None, settings: Mapping[str, Any],
                  file: str, clock: Callable[[], float], mistakes: Mistakes) -> list[Check]:
    for name in settings:
        if name not in registry.names():
            mistakes.add(SourceError(file, line_of(settings, name), f"checks.{name}",
                                     f"no check named {name!r} ({hint(name, registry.names(), 'available: {}')})"))
    names = list(selected) if selected is not None else registry.names()
    checks = []
    for name in names:
        cls = registry.get(name)
        check = mistakes.attempt(_build_check, cls, settings.get(name) or {}, file, clock, mistakes,
                                 line_of(settings, name))
        if check is not None and (selected is not None or check.enabled):
            checks.append(check)
    return checks


def _build_check(cls: type[Check], raw: Any, file: str, clock: Callable[[], float], mistakes: Mistakes,
                 line: int | None) -> Check | None:
    """The check with its settings, or None when they have mistakes (each recorded)."""
    reader = MappingReader(file, raw, f"checks.{cls.name}", line, mistakes)
    before = reader.recorded()
    reader.attempt(reader.reject_unknown, set(cls.config_fields) | set(cls.schedule_fields()))
    values: dict[str, Any] = {key: reader.attempt(reader.get, key, spec.kind, spec.default)
                              for key, spec in cls.config_fields.items()}
    for key in ("interval", "timeout"):
        if reader.has(key):
            values[key] = reader.attempt(_seconds, reader, key)
    if reader.has("enabled"):
        values["enabled"] = reader.attempt(reader.get, "enabled", bool)
    if reader.recorded() > before:
        return None
    return cls(values, clock)


def _seconds(reader: MappingReader, key: str) -> float:
    value = reader.get(key, float)
    if value <= 0:
        raise reader.error(key, "must be a positive number of seconds")
    return value


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def load_selected_checks(registry: CheckRegistry, checks: str | None, config: Path | None,
                         overrides: dict | None = None, clock: Callable[[], float] = time.monotonic) -> list:
    """`--checks a,b` and `--config FILE` (plus per-check setting overrides) into check instances. Every
    mistake of the config file is raised together (SourceErrors)."""
    selected = [n.strip() for n in checks.split(",") if n.strip()] if checks else None
    with collecting() as mistakes:
        settings: Mapping[str, Any] = {}
        settings_file = "<settings>"
        if config:
            settings_file, settings = _read_check_settings(config, mistakes)
        for name, values in (overrides or {}).items():
            current = settings.get(name) or {}
            if isinstance(current, dict):          # else it is reported as the mistake it is
                settings = merged(settings, {name: merged(current, values)})
        return _build_checks(registry, selected, settings, settings_file, clock, mistakes)
