"""The fake's modules import one way: no module of fake_nvml/ reaches itself through its imports, and each
fault kind is declared by the one module that applies it. Read with `ast`, so a lazy import inside a
function and one only for type checking count as much as one at the top."""

from __future__ import annotations

import ast
import importlib
from collections import Counter
from pathlib import Path

from fake_nvml.faults import FAULT_KINDS

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "fake_nvml"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(FAKE.rglob("*.py"))}


def imported(source: str, name: str, is_package: bool = False) -> set[str]:
    """The fake_nvml modules that module `name` (its text `source`) imports, wherever the import stands:
    `from fake_nvml import x` names module x where there is one; relative imports resolve against the
    importing module's package."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            origin = ".".join([*base, *([node.module] if node.module else [])])
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def module_imports(name: str) -> set[str]:
    path = MODULES[name]
    return imported(path.read_text(), name, path.name == "__init__.py")


def test_the_reader_sees_every_form_of_import():
    """What the cycle test relies on: lazy and type-only imports, relative ones and the package form."""
    source = """
from typing import TYPE_CHECKING
from fake_nvml import device_plugin
from . import node
from .identity import board_of
if TYPE_CHECKING:
    from fake_nvml.models import GpuModel
def later():
    import fake_nvml.pci
"""
    assert imported(source, "fake_nvml.faults") == {
        "fake_nvml", "fake_nvml.device_plugin", "fake_nvml.node", "fake_nvml.identity", "fake_nvml.models",
        "fake_nvml.pci"}
    assert imported("from .node import FakeGpu\nfrom . import pci\n", "fake_nvml.faults") == {
        "fake_nvml.node", "fake_nvml", "fake_nvml.pci"}


def test_the_fake_modules_import_without_a_cycle():
    graph = {name: module_imports(name) for name in MODULES}
    done: set[str] = set()

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            found = cycle_from(target, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = cycle_from(name, [])
        assert found is None, " -> ".join(found)


def test_every_fault_kind_is_applied_by_exactly_one_module():
    """The kinds users see (`gpu-npd scenarios --faults` lists FAULT_KINDS) are the union of the modules'
    FAULTS declarations, each kind in exactly one, and the catalogue holds the declared kind itself."""
    declaring = [name for name, path in MODULES.items()
                 if any(isinstance(n, (ast.Assign, ast.AnnAssign)) and "FAULTS" in _targets(n)
                        for n in ast.parse(path.read_text()).body)]
    declared = {name: importlib.import_module(name).FAULTS for name in declaring}
    counts = Counter(kind.name for kinds in declared.values() for kind in kinds)
    assert {kind for kind, n in counts.items() if n > 1} == set()
    assert set(counts) == set(FAULT_KINDS)
    for kinds in declared.values():
        for kind in kinds:
            assert FAULT_KINDS[kind.name] is kind
    assert len(declaring) > 1          # the modules declare their own kinds, not one table


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def test_replaying_a_real_machine_is_production_code_not_a_fake():
    """A replay judges what a real machine printed (post-mortems, bundles, support cases): it lives beside the
    NVML it stands in for (detector/backends/replay) and the CLI that builds its host, and leans on nothing of
    the fake node."""
    assert not (FAKE / "replay").exists()
    replay = sorted((ROOT / "detector" / "backends" / "replay").glob("*.py")) + [
        ROOT / "detector" / "cli" / "replay_host.py", ROOT / "detector" / "backends" / "nvml_standin.py"]
    assert len(replay) > 10
    for path in replay:
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
                {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n == "fake_nvml" or n.startswith("fake_nvml.")}, path
