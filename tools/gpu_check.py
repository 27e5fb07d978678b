#!/usr/bin/env python3
"""`make gpu-check`: everything gpu-npd can tell about a real GPU machine, in one folder.

1. conformance: the NVML conformance tests against the real library (`pytest -m gpu tests/conformance`),
   which check that the fake NVML answers as the real one does;
2. diagnose: `gpu-npd diagnose -o json` with every registered check (the opt-in NCCL probe included),
   plus the table a person reads;
3. nccl: the NCCL all-reduce probe on its own, so its figures (bus bandwidth, wrong values) stand apart;
4. raw: what the machine itself says (nvidia-smi -q, nvidia-smi topo -m, /proc/driver/nvidia/version,
   the InfiniBand ports in sysfs), kept as real text for parser fixtures and post-mortems.

Each step's output, exit code and duration go to DIR, and summary.txt says what each step found.
Exit 0 when every step ran (problems that diagnose found are findings, not failures), 1 when a step
failed (a conformance test failed, diagnose could not run), 2 when there is no GPU to check.

    python tools/gpu_check.py --out gpu-check          # on a GPU machine
    python tools/gpu_check.py --nvml fake:h100-sxm-8   # a dry run of the whole thing on a fake node
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 900.0
RAW_COMMANDS = {
    "nvidia-smi-q.txt": ["nvidia-smi", "-q"],
    "nvidia-smi-topo.txt": ["nvidia-smi", "topo", "-m"],
    "nvidia-smi-nvlink.txt": ["nvidia-smi", "nvlink", "-s"],
}
RAW_FILES = {"nvidia-version.txt": Path("/proc/driver/nvidia/version")}


@dataclass
class Step:
    name: str
    exit_code: int | None       # None: could not start (or timed out)
    seconds: float
    outcome: str                # one line for summary.txt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Output: DIR/summary.txt first; every step's files beside it.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for the results "
                        "(default: ./gpu-check; made if missing, files in it replaced)")
    parser.add_argument("--nvml", default="real", help="real (default), or fake:SCENARIO for a dry run")
    parser.add_argument("--nccl-size", default=None, help="bytes the NCCL probe all-reduces (gpu-npd's "
                        "default when not given)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    real = args.nvml == "real"
    if real and not _has_gpu():
        print("gpu-check: no NVIDIA GPU or driver here (nvmlInit failed or no devices): run it on a GPU machine, "
              "or try `--nvml fake:h100-sxm-8` for a dry run", file=sys.stderr)
        return 2

    steps = [_conformance(out, real), *_diagnose(out, args.nvml, args.nccl_size), _raw(out)]
    summary = "\n".join(f"{s.name:<12} {_code(s.exit_code):>4}  {s.seconds:7.1f} s  {s.outcome}" for s in steps)
    (out / "summary.txt").write_text(f"gpu-check of {os.uname().nodename} ({args.nvml})\n{summary}\n",
                                     encoding="utf-8")
    print(summary)
    print(f"gpu-check: results in {out}/")
    return 1 if any(s.outcome.startswith("FAILED") for s in steps) else 0


def _has_gpu() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def _run(name: str, cmd: list[str], stdout: Path, stderr: Path | None = None,
         env: dict[str, str] | None = None) -> tuple[int | None, float]:
    print(f"gpu-check: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with stdout.open("w", encoding="utf-8") as out, (stderr or stdout).open("a", encoding="utf-8") as err:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=err if stderr else subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, **(env or {})}, timeout=STEP_TIMEOUT_S).returncode
        except (OSError, subprocess.TimeoutExpired) as e:
            out.write(f"\ngpu-check: {name} did not complete: {e}\n")
            code = None
    return code, time.monotonic() - t0


def _conformance(out: Path, real: bool) -> Step:
    """On a GPU machine only the real-NVML half runs (-m gpu); a dry run runs the fake half."""
    marker = ["-m", "gpu"] if real else ["-m", "not gpu"]
    code, seconds = _run("conformance", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                         *marker, "tests/conformance", f"--junitxml={out.resolve()}/conformance.xml"],
                         out / "conformance.txt")
    last = _last_line(out / "conformance.txt")
    if code == 0:
        return Step("conformance", code, seconds, f"ok: {last}")
    if code == 5:
        return Step("conformance", code, seconds, "FAILED: no test ran (pytest exit 5)")
    return Step("conformance", code, seconds, f"FAILED: {last} (see conformance.txt)")


def _diagnose(out: Path, nvml: str, nccl_size: str | None) -> list[Step]:
    from detector.core.check import CheckRegistry
    every = ",".join(CheckRegistry.from_entry_points().names())
    gpu_npd = [sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", nvml, "-q"]
    size = ["--nccl-size", nccl_size] if nccl_size else []
    steps = []
    for name, checks, stem in (("diagnose", every, "diagnose"), ("nccl", "nccl", "nccl")):
        code, seconds = _run(name, [*gpu_npd, "--checks", checks, *size, "-o", "json"], out / f"{stem}.json",
                             out / f"{stem}.stderr.txt")
        steps.append(Step(name, code, seconds, _judge_diagnose(out / f"{stem}.json", code)))
    _run("diagnose table", [*gpu_npd, "--checks", every, *size], out / "diagnose.txt")
    return steps


def _judge_diagnose(report: Path, code: int | None) -> str:
    if code not in (0, 1):
        return f"FAILED: exit {_code(code)} (see {report.stem}.stderr.txt)"
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except ValueError as e:
        return f"FAILED: output is not JSON ({e})"
    runs = ", ".join(f"{c['name']} {c['status']}" for c in data.get("checks", []))
    problems = ", ".join(sorted({p["reason"] for p in data.get("problems", [])})) or "none"
    return f"ok: {len(data.get('gpus', []))} GPUs; checks: {runs}; problems: {problems}"


def _raw(out: Path) -> Step:
    """What the machine says in its own words; a missing tool or file is noted, never a failure."""
    t0 = time.monotonic()
    raw = out / "raw"
    raw.mkdir(exist_ok=True)
    kept = []
    for name, cmd in RAW_COMMANDS.items():
        if shutil.which(cmd[0]):
            code, _ = _run(name, cmd, raw / name)
            kept.append(name if code == 0 else f"{name} (exit {_code(code)})")
    for name, path in RAW_FILES.items():
        if path.is_file():
            shutil.copyfile(path, raw / name)
            kept.append(name)
    ib = Path("/sys/class/infiniband")
    if ib.is_dir():
        lines = []
        for port in sorted(ib.glob("*/ports/*")):
            for attr in ("state", "phys_state", "rate", "link_layer"):
                try:
                    lines.append(f"{port}/{attr}: {(port / attr).read_text().strip()}")
                except OSError as e:
                    lines.append(f"{port}/{attr}: unreadable ({e.strerror})")
        (raw / "infiniband-ports.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        kept.append("infiniband-ports.txt")
    return Step("raw", 0, time.monotonic() - t0, "kept: " + (", ".join(kept) or "nothing (no nvidia-smi, no driver)"))


def _last_line(path: Path) -> str:
    lines = [l for l in path.read_text(encoding="utf-8", errors="replace").splitlines() if l.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def _code(code: int | None) -> str:
    return "-" if code is None else str(code)


if __name__ == "__main__":
    sys.exit(main())
