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
from detector.yamlsource import MappingReader, SourceError, load_yaml


def load_check_settings(path: Path) -> tuple[str, dict[str, Any]]:
    """The `checks:` mapping of a config file (raw, validated later against each check)."""
    doc = load_yaml(path)
    top = MappingReader(doc.file, doc.data if doc.data is not None else {}, "")
    top.reject_unknown({"checks"})
    return doc.file, (top.get("checks", dict, {}))


def build_checks(registry: CheckRegistry, selected: Sequence[str] | None,
                 settings: Mapping[str, Any] | None = None, file: str = "<settings>",
                 clock: Callable[[], float] = time.monotonic) -> list[Check]:
    """Instantiate checks by name with validated settings. Unknown names or settings raise
    SourceError (from a file) or KeyError (from --checks). Without `selected`, every enabled check runs
    (opt-in checks such as nccl only with `enabled: true`); a named check runs whatever `enabled` says."""
    settings = settings or {}
    for name in settings:
        if name not in registry.names():
            raise SourceError(file, getattr(settings, "line_of", lambda k: None)(name), f"checks.{name}",
                              f"no check named {name!r} (available: {', '.join(registry.names())})")
    names = list(selected) if selected is not None else registry.names()
    checks = []
    for name in names:
        check = _build_check(registry.get(name), settings.get(name) or {}, file, clock)
        if selected is not None or check.enabled:
            checks.append(check)
    return checks


def _build_check(cls: type[Check], raw: Mapping[str, Any], file: str, clock: Callable[[], float]) -> Check:
    reader = MappingReader(file, raw, f"checks.{cls.name}")
    reader.reject_unknown(set(cls.config_fields) | set(cls.schedule_fields()))
    values: dict[str, Any] = {key: reader.get(key, spec.kind, spec.default) for key, spec in cls.config_fields.items()}
    for key in ("interval", "timeout"):
        if reader.has(key):
            value = reader.get(key, float)
            if value <= 0:
                raise reader.error(key, "must be a positive number of seconds")
            values[key] = value
    if reader.has("enabled"):
        values["enabled"] = reader.get("enabled", bool)
    return cls(values, clock)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def load_selected_checks(registry: CheckRegistry, checks: str | None, config: Path | None,
                         overrides: dict | None = None, clock: Callable[[], float] = time.monotonic) -> list:
    """`--checks a,b` and `--config FILE` (plus per-check setting overrides) into check instances."""
    settings, settings_file = {}, "<settings>"
    if config:
        settings_file, settings = load_check_settings(config)
    for name, values in (overrides or {}).items():
        settings = {**settings, name: {**(settings.get(name) or {}), **values}}
    selected = [n.strip() for n in checks.split(",") if n.strip()] if checks else None
    return build_checks(registry, selected, settings, settings_file, clock)
