"""The layers docs/architecture.md draws point down: nothing below the command line imports it. Read with `ast`, so
a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

DETECTOR = Path(__file__).resolve().parent.parent / "detector"


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_below_the_command_line_imports_it():
    offenders = sorted(f"{p.relative_to(DETECTOR.parent)} imports {name}"
                       for p in DETECTOR.rglob("*.py") if "cli" not in p.relative_to(DETECTOR).parts[:1]
                       for name in imports(p) if name == "detector.cli" or name.startswith("detector.cli."))
    assert not offenders, offenders


def test_the_check_of_a_check_folder_is_in_check_py():
    """A check that is a folder keeps the check itself in check.py; __init__ only re-exports it."""
    for folder in (DETECTOR / "checks").iterdir():
        if (folder / "__init__.py").exists():
            assert (folder / "check.py").exists(), folder.name


def test_backends_are_the_bottom_layer():
    """Backends read the machine; they import nothing of gpu-npd above them, and no fake."""
    backends = DETECTOR / "backends"
    offenders = sorted(f"{p.relative_to(DETECTOR.parent)} imports {name}" for p in backends.rglob("*.py")
                       for name in imports(p)
                       if name.split(".")[0] == "fake_nvml"
                       or (name.startswith("detector") and not name.startswith("detector.backends")))
    assert not offenders, offenders
