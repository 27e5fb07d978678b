"""7,500 simulated 8-GPU nodes against the API emulator running in another process.

Phases: register the nodes; a rolling start of every agent over --start-spread seconds; a steady
period (--steady seconds, heartbeats only); then a fault hitting --fault-fraction of the nodes at once
(XID 79 on one GPU each: GpuXidError and GpuMissing). Prints what it measures as it goes; the last line
is a JSON object:

  nodes, rss_per_node_kib, cpu_ms_per_node_per_hour, requests_per_node_per_hour (steady state),
  peak_rps / p99_rps (during the start and during the fault), fault_visible_s (until every injected
  fault shows on the API server), lost_conditions, duplicate_conditions, unexpected_conditions.

    .venv/bin/python bench/fleet.py                       # 7,500 nodes (about 12 minutes)
    .venv/bin/python bench/fleet.py --nodes 500 --start-spread 20 --steady 60    # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from detector.cli.main import builtin_rules_dir  # noqa: E402
from detector.core.check import CheckRegistry  # noqa: E402
from detector.kube.api import KubeApi  # noqa: E402
from detector.rules.loader import load_rules  # noqa: E402
from detector.sim.fleet import Fleet, FleetSettings  # noqa: E402
from detector.sim.fleetfile import fleet_from_dict  # noqa: E402
from detector.sim.timeline import plan_faults  # noqa: E402

FAULT_TYPES = ("GpuXidError", "GpuMissing")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=7500)
    p.add_argument("--start-spread", type=float, default=120.0, help="rolling start over S seconds")
    p.add_argument("--settle", type=float, default=30.0, help="seconds after the start before steady state")
    p.add_argument("--steady", type=float, default=330.0, help="steady-state window, seconds (>= one heartbeat)")
    p.add_argument("--fault-fraction", type=float, default=0.10)
    p.add_argument("--qps", type=float, default=100.0, help="the fleet's API rate limit (the simulator's default)")
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--fault-timeout", type=float, default=300.0)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gpu-npd-fleet-bench-"))
    emulator, url, admin = start_emulator(work)
    try:
        return run(args, url, admin, work)
    finally:
        emulator.terminate()
        emulator.wait(10)


def start_emulator(work: Path) -> tuple[subprocess.Popen, str, Path]:
    admin = work / "admin.kubeconfig"
    proc = subprocess.Popen([sys.executable, "-m", "kube_emulator", "--listen", "127.0.0.1:0",
                             "--admin-kubeconfig-out", str(admin), "--rbac", str(REPO / "deploy" / "base"),
                             "--rbac", str(REPO / "deploy" / "kwok")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        raise SystemExit(f"the emulator did not start (it printed {url!r})")
    return proc, url, admin


class EmulatorAdmin:
    """Reads the emulator's request counts and nodes from outside, as an admin."""

    def __init__(self, url: str, kubeconfig: Path):
        self.api = KubeApi.from_kubeconfig(str(kubeconfig), qps=1000, burst=1000)
        self.url = url
        self.own_requests: list[float] = []       # this bench's own reads, taken out of the load figures

    def _get(self, path: str) -> dict:
        self.own_requests.append(time.time())
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.api.connection.bearer()}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def per_second(self) -> dict[int, int]:
        counts = {int(s): n for s, n in self._get("/emulator/stats")["per_second"].items()}
        for t in self.own_requests:
            if int(t) in counts:
                counts[int(t)] -= 1
        return counts

    def nodes(self) -> list[dict]:
        return self._get("/api/v1/nodes")["items"]


def window(per_second: dict[int, int], start: float, end: float) -> list[int]:
    return [per_second.get(s, 0) for s in range(int(start), int(end) + 1)]


def p99(values: list[int]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)])


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def gpu_npd_conditions(node: dict) -> list[dict]:
    return [c for c in node.get("status", {}).get("conditions", []) if c.get("type", "").startswith("Gpu")]


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(args: argparse.Namespace, url: str, admin_kubeconfig: Path, work: Path) -> int:
    admin = EmulatorAdmin(url, admin_kubeconfig)
    fault_at = args.start_spread + args.settle + args.steady
    spec = fleet_from_dict({
        "version": 1, "seed": 1,
        "nodes": [{"scenario": "h100-sxm-8", "count": args.nodes, "name": "sim-gpu-{index:05d}",
                   "racks": max(1, args.nodes // 32)}],
        "faults": [{"at": fault_at, "fraction": args.fault_fraction, "kind": "xid", "gpu": "random", "code": 79}],
    }, file="<bench>")
    registry = CheckRegistry.from_entry_points()
    ruleset = load_rules([builtin_rules_dir()], registry.fields_by_check())
    api = KubeApi.from_kubeconfig(str(admin_kubeconfig), qps=args.qps, burst=args.burst, pool_size=args.workers)
    process = psutil.Process(os.getpid())
    rss_before = process.memory_info().rss
    fleet = Fleet(spec, api, ruleset, registry, FleetSettings(workers=args.workers, start_spread_s=args.start_spread))
    t0 = time.time()
    fleet.start(progress=say)
    rss_after = process.memory_info().rss
    say(f"registered and built {args.nodes} nodes in {fleet.started_at - t0:.0f}s; "
        f"RSS +{(rss_after - rss_before) / 2**20:.0f} MiB")

    start_end = fleet.started_at + args.start_spread + args.settle
    time.sleep(max(0.0, start_end - time.time()))
    reported = sum(1 for n in admin.nodes() if gpu_npd_conditions(n))
    say(f"rolling start done: {reported} of {args.nodes} nodes report conditions")

    steady_begin, cpu_begin = time.time(), cpu_s()
    time.sleep(max(0.0, fleet.started_at + fault_at - 1 - time.time()))
    steady_end, cpu_end = time.time(), cpu_s()
    rss_steady = process.memory_info().rss
    say(f"steady state: {steady_end - steady_begin:.0f}s measured")

    planned = len([p for p in plan_faults(spec, fault_at + 1) if p.at_s == fault_at])
    while len(fleet.fault_log.records()) < planned:          # injecting 750 faults takes a moment
        time.sleep(0.1)
    injected = {r["node"] for r in fleet.fault_log.records()}
    fault_time = min((r["time"] for r in fleet.fault_log.records()), default=time.time())
    injecting_s = max(r["time"] for r in fleet.fault_log.records()) - fault_time
    say(f"fault: XID 79 on {len(injected)} nodes, injected over {injecting_s:.1f}s")
    visible_at = None
    deadline = fault_time + args.fault_timeout
    while time.time() < deadline:
        nodes = admin.nodes()
        showing = {n["metadata"]["name"] for n in nodes
                   if all(any(c["type"] == t and c["status"] == "True" for c in gpu_npd_conditions(n))
                          for t in FAULT_TYPES)}
        if injected <= showing:
            visible_at = time.time()
            break
        time.sleep(1.0)
    say(f"every fault visible after {visible_at - fault_time:.1f}s" if visible_at else "faults NOT all visible")
    time.sleep(5)
    per_second = admin.per_second()
    final = admin.nodes()
    fleet.stop()

    lost = duplicate = unexpected = 0
    for node in final:
        name = node["metadata"]["name"]
        types = [c["type"] for c in gpu_npd_conditions(node)]
        duplicate += len(types) - len(set(types))
        true = {c["type"] for c in gpu_npd_conditions(node) if c["status"] == "True"}
        expected = set(FAULT_TYPES) if name in injected else set()
        lost += len(expected - true)
        unexpected += len(true - expected)
    steady_s = steady_end - steady_begin
    steady_requests = sum(window(per_second, steady_begin + 1, steady_end - 1))
    start_rps = window(per_second, fleet.started_at, start_end)
    fault_rps = window(per_second, fault_time, (visible_at or deadline) + 5)
    figures = {
        "nodes": args.nodes,
        "rss_per_node_kib": round((rss_steady - rss_before) / 1024 / args.nodes, 1),
        "cpu_ms_per_node_per_hour": round((cpu_end - cpu_begin) * 1000 / args.nodes * 3600 / steady_s, 1),
        "requests_per_node_per_hour": round(steady_requests / args.nodes * 3600 / max(steady_s - 2, 1), 2),
        "peak_rps": max(start_rps + fault_rps, default=0),
        "p99_rps": p99(start_rps + fault_rps),
        "start_peak_rps": max(start_rps, default=0), "start_p99_rps": p99(start_rps),
        "fault_peak_rps": max(fault_rps, default=0), "fault_p99_rps": p99(fault_rps),
        "fault_nodes": len(injected), "fault_injection_s": round(injecting_s, 2),
        "fault_visible_s": round(visible_at - fault_time, 2) if visible_at else None,
        "lost_conditions": lost, "duplicate_conditions": duplicate, "unexpected_conditions": unexpected,
        "steady_window_s": round(steady_s, 1), "qps_limit": args.qps,
        "rss_total_mib": round(rss_steady / 2**20, 1),
    }
    print(json.dumps(figures))
    return 0 if visible_at and not lost and not duplicate and not unexpected else 1


if __name__ == "__main__":
    sys.exit(main())
