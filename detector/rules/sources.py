"""Where rules come from: the bundled rule files, and the `--rules` values that add to or replace them.

Shared by every command that loads rules (diagnose, run, simulate, validate-rules) and by the local daemon
harness, below the command line so none of them imports the CLI.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Sequence

from detector.core.check import CheckRegistry
from detector.rules.loader import RuleSet, load_rules

BUILTIN_RULES = "builtin"


def builtin_rules_dir() -> Path:
    return Path(str(resources.files("detector") / "rules" / "builtin"))


def rule_paths(given: Sequence[Path | str] | None) -> list[Path]:
    """`--rules` values: `builtin` names the bundled rules, `+PATH` adds PATH to them, a plain PATH
    replaces them (with `builtin` beside it, extends them). Nothing given: the bundled rules."""
    names = [str(p) for p in given or []] or [BUILTIN_RULES]
    if any(n.startswith("+") for n in names) and BUILTIN_RULES not in names:
        names.insert(0, BUILTIN_RULES)
    resolved: list[Path] = []
    for given_name in names:
        name = given_name[1:] if given_name.startswith("+") else given_name
        if not name.strip():                 # Path("") would quietly be the current directory
            raise ValueError(f"--rules {given_name!r}: name a rule file or directory (a leading '+' adds it "
                             "to the bundled rules)")
        path = builtin_rules_dir() if name == BUILTIN_RULES else Path(name)
        if path not in resolved:
            resolved.append(path)
    return resolved


def load_ruleset(paths: Sequence[Path | str] | None, registry: CheckRegistry) -> RuleSet:
    return load_rules(rule_paths(paths), registry.fields_by_check())


def rule_sources(ruleset: RuleSet) -> list[dict]:
    """Which rule sets are active and how many rules each gave: the bundled ones as one `builtin`."""
    builtin = str(builtin_rules_dir())
    sources: dict[str, int] = {}
    for file, count in ruleset.counts_by_file().items():
        name = BUILTIN_RULES if file.startswith(builtin) else file
        sources[name] = sources.get(name, 0) + count
    return [{"source": name, "rules": count} for name, count in sources.items()]


def describe_rules(ruleset: RuleSet) -> str:
    """`rules: builtin (120 rules) + site.yaml (3 rules)`, and says so when the built-ins are left out."""
    sources = rule_sources(ruleset)
    text = " + ".join(f"{s['source']} ({s['rules']} rule{'s' if s['rules'] != 1 else ''})" for s in sources)
    if all(s["source"] != BUILTIN_RULES for s in sources):
        text += "; the built-in rules are NOT loaded (use --rules +PATH to add to them)"
    return f"rules: {text}"
