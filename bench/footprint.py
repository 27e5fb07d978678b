#!/usr/bin/env python3
"""The daemon's footprint at steady state: memory, CPU and API requests.

Starts the Kubernetes API emulator in this process and `gpu-npd run` (this checkout's) in a child
process, on a fake 8x H100 node (`--nvml fake:h100-sxm-8`, the default) or on this machine's GPUs
(`--nvml real`), with default rules, intervals and heartbeat; lets it settle, then measures the child
over the steady window: RSS (peak of samples taken each second; its anonymous and file-backed parts,
since a real node adds libnvidia-ml's pages), CPU time as millicores, and the API requests the emulator
received. The first line says which backend was measured: real NVML costs more memory than the fake
(the library and its allocations), so the DaemonSet is sized from real figures. Budgets (DESIGN section
8): RSS <= 60 MiB, CPU <= 5 millicores, API requests at or below node-problem-detector's one PATCH per
node per 5 min. The last line printed is a JSON object of the figures.

    .venv/bin/python bench/footprint.py                 # 60 s window after 15 s of settling, fake node
    .venv/bin/python bench/footprint.py --nvml real     # the same on this machine's GPUs
    .venv/bin/python bench/footprint.py --duration 600  # long enough to include heartbeats
    .venv/bin/python bench/footprint.py --checks all    # every registered check, the opt-in NCCL probe too
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kube_emulator import Emulator  # noqa: E402

NODE = "footprint-node"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="steady window, seconds (default 60)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds before the window (default 15)")
    parser.add_argument("--heartbeat", type=float, default=300.0, help="the daemon's --heartbeat (default 300)")
    parser.add_argument("--nvml", default="fake:h100-sxm-8", metavar="BACKEND",
                        help="the daemon's --nvml: fake:SCENARIO (default fake:h100-sxm-8) or real")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the daemon's environment, repeatable (e.g. MALLOC_ARENA_MAX=2 to compare)")
    parser.add_argument("--checks", default="", help="the daemon's --checks: A,B, or 'all' for every registered "
                        "check (default: the daemon's default, every enabled one)")
    args = parser.parse_args()
    checks = _expand_checks(args.checks)
    env = dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    backend = _describe_backend(args.nvml)
    print(f"backend: {backend}", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="gpu-npd-footprint-"))
    with Emulator(rbac_paths=(ROOT / "deploy" / "base",)) as emulator:
        emulator.create_node(NODE, labels={"nvidia.com/gpu.present": "true"})
        kubeconfig = emulator.write_kubeconfig(workdir / "kubeconfig")
        command = [sys.executable, "-m", "detector.cli.main", "run", "--nvml", args.nvml, "--node-name", NODE,
                   "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0", "--state-dir", str(workdir / "state"),
                   "--heartbeat", str(args.heartbeat), "--log-format", "json"] + (["--checks", checks] if checks else [])
        child = subprocess.Popen(command, stderr=open(workdir / "daemon.log", "wb"), cwd=ROOT, env=env)
        proc = psutil.Process(child.pid)
        try:
            startup_peak = _sample_until(proc, time.monotonic() + args.settle)
            startup_requests = emulator.stats()["total"]
            cpu0, t0 = _cpu_s(proc), time.monotonic()
            steady_peak = _sample_until(proc, t0 + args.duration)
            cpu1, t1 = _cpu_s(proc), time.monotonic()
            parts = _rss_parts(child.pid)
            window_requests = emulator.stats()["total"] - startup_requests
            conditions = [c["type"] for c in emulator.node(NODE)["status"]["conditions"]]
        finally:
            child.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            code = child.wait(timeout=30)
            stop_s = time.monotonic() - stopped_at

    per_hour = window_requests * 3600 / (t1 - t0)
    result = {
        "backend": backend, "nvml": args.nvml, "env": args.env,
        "rss_mib": round(steady_peak / 2**20, 1), **parts, "startup_rss_mib": round(startup_peak / 2**20, 1),
        "cpu_millicores": round((cpu1 - cpu0) / (t1 - t0) * 1000, 2),
        "api_requests_per_hour": round(per_hour, 1), "window_requests": window_requests,
        "startup_requests": startup_requests, "window_s": round(t1 - t0, 1), "heartbeat_s": args.heartbeat,
        "npd_requests_per_hour": 12, "sigterm_exit_code": code, "sigterm_stop_s": round(stop_s, 2),
        "conditions_on_node": conditions, "budget_rss_mib": 60, "budget_cpu_millicores": 5,
        "checks": checks or "default",
    }
    print(f"gpu-npd run, {backend}, checks {result['checks']}, {result['window_s']} s steady: RSS {result['rss_mib']} MiB "
          f"(startup peak {result['startup_rss_mib']}; anonymous {parts['rss_anon_mib']}, files {parts['rss_file_mib']}, "
          f"{parts['threads']} threads), CPU {result['cpu_millicores']} millicores, "
          f"{window_requests} API requests in the window ({result['api_requests_per_hour']}/h); "
          f"SIGTERM -> exit {code} in {result['sigterm_stop_s']} s")
    print(json.dumps(result))
    return 0


def _describe_backend(nvml: str) -> str:
    """'fake (fake:SCENARIO)' or 'real NVML, N x MODEL, driver V': what the figures are figures of."""
    if nvml != "real":
        return f"fake ({nvml})"
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise SystemExit(f"footprint: --nvml real: NVML cannot start here ({e}); use --nvml fake:h100-sxm-8") from None
    try:
        names = {_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(pynvml.nvmlDeviceGetCount())}
        return (f"real NVML, {pynvml.nvmlDeviceGetCount()} x {', '.join(sorted(names))}, "
                f"driver {_text(pynvml.nvmlSystemGetDriverVersion())}")
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _rss_parts(pid: int) -> dict[str, float | int | None]:
    """/proc/PID/status: the RSS that is the program's own (anonymous) and mapped files (libraries)."""
    fields: dict[str, float | int | None] = {"rss_anon_mib": None, "rss_file_mib": None, "threads": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "RssAnon":
                fields["rss_anon_mib"] = round(int(value.split()[0]) / 1024, 1)
            elif key == "RssFile":
                fields["rss_file_mib"] = round(int(value.split()[0]) / 1024, 1)
            elif key == "Threads":
                fields["threads"] = int(value)
    except OSError:
        pass
    return fields


def _expand_checks(checks: str) -> str:
    if checks != "all":
        return checks
    from detector.core.check import CheckRegistry
    return ",".join(CheckRegistry.from_entry_points().names())


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _sample_until(proc: psutil.Process, deadline: float) -> int:
    peak = 0
    while time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return max(peak, proc.memory_info().rss)


if __name__ == "__main__":
    sys.exit(main())
