"""Every nvidia-ml-py that pyproject.toml allows must run: diagnose every bundled fake scenario with every
check under other bindings, and compare each run with the current binding's.

    python tools/nvml_compat.py --venv .venv-nvml/12.535.77 --venv .venv-nvml/13.610.43

runs `gpu-npd diagnose --nvml fake:SCENARIO -o json` with every registered check, for each scenario in
fake_nvml/scenarios/, once under this interpreter (the reference) and once under each venv's python, all
scenarios of one binding in one process. A binding passes when every scenario ends with the reference's
exit code, the same problems (rule, reason, GPUs) and the same status for each check. Prints one line
per binding; exits 1 naming scenario, version and difference otherwise.

`scan` (what each process runs) prints that binding's results as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "fake_nvml" / "scenarios"
# A hung fake GPU or nvidia-smi is given up on after this long (not 10 s): the same for every binding.
INVENTORY_TIMEOUT_S = "2"
SETTINGS = "checks:\n  visibility:\n    smi_timeout: 2\n"


@dataclass(frozen=True)
class Outcome:
    """What one diagnose run ended with: all the comparison looks at."""

    exit_code: int
    problems: tuple[tuple[str, str, tuple[int, ...]], ...]     # (rule, reason, GPU indexes), sorted
    checks: tuple[tuple[str, str], ...]                         # (check, status), sorted
    error: str = ""                                             # stderr of a run that printed no JSON

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Outcome":
        return cls(data["exit_code"], tuple((p[0], p[1], tuple(p[2])) for p in data["problems"]),
                   tuple((c[0], c[1]) for c in data["checks"]), data.get("error", ""))


@dataclass(frozen=True)
class Scan:
    """One binding's outcomes, by scenario name."""

    version: str
    outcomes: dict[str, Outcome]


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def diagnose(scenario: str, checks: str, settings: Path) -> dict[str, Any]:
    """One `gpu-npd diagnose` in this process, as the command line runs it."""
    from detector.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["diagnose", "--nvml", f"fake:{scenario}", "--checks", checks, "-o", "json", "-q",
                         "--inventory-timeout", INVENTORY_TIMEOUT_S, "--config", str(settings)])
        except Exception as e:  # noqa: BLE001 - a crash is this binding's result, reported with its scenario
            return {"exit_code": -1, "problems": [], "checks": [], "error": f"{type(e).__name__}: {e}"}
    try:
        report = json.loads(out.getvalue())
    except json.JSONDecodeError:
        return {"exit_code": code, "problems": [], "checks": [], "error": err.getvalue().strip()[-500:]}
    return {"exit_code": code,
            "problems": sorted([p["rule"], p["reason"], sorted(p["gpus"])] for p in report["problems"]),
            "checks": sorted([c["name"], c["status"]] for c in report["checks"])}


def scan() -> dict[str, Any]:
    """Every scenario under this interpreter's binding, every registered check (the opt-in nccl too)."""
    from detector.core.check import CheckRegistry

    checks = ",".join(CheckRegistry.from_entry_points().names())
    with tempfile.TemporaryDirectory(prefix="nvml-compat-") as tmp:
        settings = Path(tmp) / "settings.yaml"
        settings.write_text(SETTINGS)
        outcomes = {name: diagnose(name, checks, settings) for name in scenario_names()}
    return {"version": metadata.version("nvidia-ml-py"), "outcomes": outcomes}


class ScanFailed(Exception):
    """A binding's process died before it could report (an import that fails, say)."""


def run_scan(python: Path) -> Scan:
    """`scan` in a process of its own under `python`."""
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "scan"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ScanFailed(f"{python}: exit {done.returncode}: {last[0]}")
    data = json.loads(done.stdout)
    return Scan(data["version"], {k: Outcome.from_json(v) for k, v in data["outcomes"].items()})


def differences(reference: Scan, other: Scan) -> list[str]:
    """One line per scenario whose outcome under `other` is not the reference's."""
    lines = []
    for name, want in reference.outcomes.items():
        got = other.outcomes.get(name)
        if got is None:
            lines.append(f"{name}: not run under nvidia-ml-py {other.version}")
            continue
        parts = []
        if got.error:
            parts.append(f"error: {got.error}")
        if got.exit_code != want.exit_code:
            parts.append(f"exit code {got.exit_code}, {reference.version} gives {want.exit_code}")
        extra, lost = set(got.problems) - set(want.problems), set(want.problems) - set(got.problems)
        if extra:
            parts.append(f"problems only here: {sorted(extra)}")
        if lost:
            parts.append(f"problems missing here: {sorted(lost)}")
        wanted, have = dict(want.checks), dict(got.checks)
        changed = [f"{check} {have.get(check, 'not run')} (not {wanted.get(check, 'not run')})"
                   for check in sorted(wanted.keys() | have.keys()) if wanted.get(check) != have.get(check)]
        if changed:
            parts.append(f"check status: {', '.join(changed)}")
        if parts:
            lines.append(f"{name} under nvidia-ml-py {other.version}: {'; '.join(parts)}")
    return lines


def summary(scan_: Scan, reference: Scan, failed: list[str], seconds: float) -> str:
    problems = sum(len(o.problems) for o in scan_.outcomes.values())
    verdict = "FAILED" if failed else "ok"
    return (f"nvidia-ml-py {scan_.version}: {verdict}: {len(scan_.outcomes)} scenarios, every check, "
            f"{problems} problems, {len(failed)} differing from {reference.version} ({seconds:.1f} s)")


def compare(venvs: list[Path]) -> int:
    pythons = [v / "bin" / "python" for v in venvs]
    for python in pythons:
        if not python.exists():
            print(f"nvml-compat: {python} does not exist (make nvml-compat builds the venvs)", file=sys.stderr)
            return 2
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pythons) + 1) as pool:
        ref_job = pool.submit(run_scan, Path(sys.executable))
        jobs = [(pool.submit(run_scan, p), p) for p in pythons]
        try:
            reference = ref_job.result()
        except ScanFailed as e:
            print(f"nvml-compat: FAIL the reference binding: {e}", file=sys.stderr)
            return 1
        broken = [f"{name}: {o.error}" for name, o in reference.outcomes.items() if o.error]
        if broken:
            print(f"nvml-compat: FAIL under the reference nvidia-ml-py {reference.version}: {broken}", file=sys.stderr)
            return 1
        print(f"nvml-compat: reference nvidia-ml-py {reference.version} ({sys.executable}): "
              f"{len(reference.outcomes)} scenarios in {time.monotonic() - start:.1f} s")
        failures = []
        for job, python in jobs:
            try:
                scan_ = job.result()
            except ScanFailed as e:
                print(f"nvml-compat: nvidia-ml-py {python.parent.parent.name}: FAILED before any scenario ran")
                failures.append(str(e))
                continue
            failed = differences(reference, scan_)
            print(f"nvml-compat: {summary(scan_, reference, failed, time.monotonic() - start)}")
            failures += failed
    for line in failures:
        print(f"nvml-compat: FAIL {line}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("compare", "scan"), default="compare")
    parser.add_argument("--venv", type=Path, action="append", default=[],
                        help="a virtual environment with gpu-npd and one nvidia-ml-py installed (repeatable)")
    args = parser.parse_args(argv)
    if args.mode == "scan":
        sys.path.insert(0, str(ROOT))          # this checkout's code, whichever copy the venv installed
        print(json.dumps(scan()))
        return 0
    if not args.venv:
        parser.error("name at least one --venv")
    return compare(args.venv)


if __name__ == "__main__":
    sys.exit(main())
