"""The layers docs/architecture.md draws point down (cli -> daemon/sim -> kube/agent -> checks/rules -> core ->
backends) and the packages of detector/ form no import circle. Read with `ast`, so a lazy import inside a
function counts as much as one at the top, and a relative import as much as an absolute one."""

from __future__ import annotations

import ast
from pathlib import Path

DETECTOR = Path(__file__).resolve().parent.parent / "detector"


# Each package of detector/ (a top-level module counts as one) and its layer: a package imports only its own
# layer and those below it. config.py is the small setup module the daemon, the simulator and the CLI share.
LAYERS = {"cli": 0, "daemon": 1, "sim": 1, "kube": 2, "agent": 2, "config": 2, "checks": 3, "rules": 3,
          "core": 4, "backends": 5, "yamlsource": 5}


def imports(path: Path) -> set[str]:
    """Dotted names `path` imports; `from .x import y` resolved against the module's own package."""
    package = path.relative_to(DETECTOR.parent).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


def package_of(name: str) -> str | None:
    """detector.kube.api -> kube; detector.config -> config; anything outside detector -> None."""
    parts = name.split(".")
    return parts[1] if parts[0] == "detector" and len(parts) > 1 else None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in DETECTOR.rglob("*.py"):
        own = path.relative_to(DETECTOR).with_suffix("").parts[0]
        if own == "__init__":
            continue
        targets = {package_of(name) for name in imports(path)} - {None, own}
        graph.setdefault(own, set()).update(targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as the path that closes it (depth-first, each circle once per start)."""
    found: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_the_packages_form_no_import_circle():
    assert cycles(package_graph()) == []


def test_each_package_imports_only_its_layer_and_below():
    graph = package_graph()
    assert set(graph) <= set(LAYERS), f"a new package needs a layer in LAYERS: {sorted(set(graph) - set(LAYERS))}"
    upward = sorted(f"{src} imports {dst}" for src, targets in graph.items() for dst in targets
                    if LAYERS[dst] < LAYERS[src])
    assert not upward, upward


def test_the_circle_finder_finds_circles():
    """The two tests above are only as good as this: a circle through three packages is found once."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


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


def test_the_agent_imports_no_check():
    """Checks reach the agent through what it holds (the Check, its runs); the agent names none of them."""
    agent = DETECTOR / "agent"
    offenders = sorted(f"{p.relative_to(DETECTOR.parent)} imports {name}" for p in agent.rglob("*.py")
                       for name in imports(p) if name == "detector.checks" or name.startswith("detector.checks."))
    assert not offenders, offenders
