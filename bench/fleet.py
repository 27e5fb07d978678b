"""A simulated fleet of 8-GPU nodes against the API emulator, broken and healed by node annotation.

The emulator runs in its own process; `gpu-npd simulate` runs as --shards processes, each playing its
block of the fleet (`--shard K/N`), exactly as the KWOK StatefulSet does. Phases: register the nodes; a
rolling start of every agent over --start-spread seconds; a steady period (--steady seconds, heartbeats
only); then XID 79 on --fault-gpus GPUs (default 1) of --fault-fraction of the nodes at once, injected
the KWOK way (the bench, as an admin, annotates each node with gpu-npd.io/inject-fault); then every
annotation removed again (the simulator reboots those nodes). One failed GPU is fenced (no node asks for
remediation); two ask for it (GpuNodeNeedsRemediation), and the figures say what the NodeHealthCheck in
deploy/remediation/ would do with that many unhealthy nodes at once. Prints what it measures as it goes;
the last line is a JSON object:

  nodes, shards, rss_per_node_kib (the simulators' whole RSS over the nodes they play),
  cpu_ms_per_node_per_hour and requests_per_node_per_hour (steady state), peak_rps / p99_rps (during
  the start and during the fault), fault_visible_s (from the first annotation until every fault shows
  on the API server), heal_visible_s (from the first removal until every node is clear again: the reboot,
  then every check passing --verify-sweeps rounds, as the daemon verifies a cure; one by default),
  lost_conditions, duplicate_conditions, unexpected_conditions, uncleared_conditions,
  remediation_asked (nodes with GpuNodeNeedsRemediation=True at the fault), nhc_max_unhealthy and
  nhc_allowed_unhealthy (deploy/remediation's circuit breaker for this fleet), nhc_remediates;
  fleet_view_s, fleet_view_pages, fleet_view_nodes, fleet_view_failed_gpus, fleet_view_matches (`gpu-npd
  fleet -o json` over the broken fleet: its time, its LIST pages of 500, and whether it lists exactly the
  GPUs the fault broke).

    .venv/bin/python bench/fleet.py                                  # 7,500 nodes (about 12 minutes)
    .venv/bin/python bench/fleet.py --nodes 30000 --shards 4         # 4 simulators of 7,500
    .venv/bin/python bench/fleet.py --nodes 500 --start-spread 20 --steady 60    # a quick look
    .venv/bin/python bench/fleet.py --fault-gpus 2                   # a correlated fault: the breaker
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from detector.kube.api import KubeApi  # noqa: E402
NHC = REPO / "deploy" / "remediation" / "nodehealthcheck.yaml"
from detector.sim.annotations import INJECT_ANNOTATION, STATUS_ANNOTATION  # noqa: E402

FAULT_TYPES = ("GpuXidError", "GpuMissing")
REMEDIATION = "GpuNodeNeedsRemediation"        # asked for when 2 GPUs of a node failed (rules/node.yaml)
STARTED = "nodes starting over"          # what `gpu-npd simulate` prints once its nodes are registered


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=7500, help="nodes in the whole fleet (default 7500)")
    p.add_argument("--shards", type=int, default=1, help="simulator processes sharing the fleet (default 1)")
    p.add_argument("--start-spread", type=float, default=120.0, help="rolling start over S seconds")
    p.add_argument("--settle", type=float, default=30.0, help="seconds after the start before steady state")
    p.add_argument("--steady", type=float, default=330.0, help="steady-state window, seconds (>= one heartbeat)")
    p.add_argument("--fault-fraction", type=float, default=0.10)
    p.add_argument("--fault-gpus", type=int, default=1, choices=range(1, 9), metavar="{1..8}",
                   help="GPUs per broken node that fall off the bus (default 1: fenced; 2: the node asks for "
                        "remediation)")
    p.add_argument("--qps", type=float, default=100.0, help="each simulator's API rate limit (its default)")
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--workers", type=int, default=8, help="scheduler threads per simulator")
    p.add_argument("--fault-timeout", type=float, default=300.0)
    p.add_argument("--verify-sweeps", type=int, default=1,
                   help="the simulators' --verify-sweeps: a healed node clears once every check passed that many "
                        "rounds since its reboot. Default 1: a reboot makes every check due at once (round one), "
                        "but a fleet's checks poll every 5 minutes, so the daemon's 3 rounds would add 10 minutes "
                        "that measure the fleet file's intervals, not the API server (tests/test_lifecycle.py "
                        "verifies the daemon's 3)")
    args = p.parse_args()
    if args.shards < 1 or args.nodes < args.shards:
        p.error("--shards must be at least 1 and at most --nodes")

    work = Path(tempfile.mkdtemp(prefix="gpu-npd-fleet-bench-"))
    emulator, url, admin = start_emulator(work)
    simulators: list[Simulator] = []
    try:
        return run(args, url, admin, work, simulators)
    finally:
        for sim in simulators:
            sim.stop()
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


class Simulator:
    """One `gpu-npd simulate --shard K/N` process; its progress lines are kept to see when it started, and
    its log (warnings and errors) goes to `log`, beside the fleet file."""

    def __init__(self, args: argparse.Namespace, fleet: Path, kubeconfig: Path, shard: int):
        self.log = fleet.parent / f"simulator-{shard}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "detector.cli.main", "simulate", "--fleet", str(fleet), "--kubeconfig",
             str(kubeconfig), "--shard", f"{shard}/{args.shards}", "--listen", "127.0.0.1:0",
             "--start-spread", str(args.start_spread), "--qps", str(args.qps), "--burst", str(args.burst),
             "--workers", str(args.workers), "--verify-sweeps", str(args.verify_sweeps), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
        self.process = psutil.Process(self.proc.pid)
        self.started = threading.Event()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.log.open("w") as log:
            for line in self.proc.stderr:
                log.write(line)
                log.flush()
                self.lines.append(line.rstrip())
                if STARTED in line:
                    self.started.set()

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def rss(self) -> int:
        return self.process.memory_info().rss

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class EmulatorAdmin:
    """Reads the emulator's request counts and nodes, and annotates nodes, as an admin."""

    def __init__(self, url: str, kubeconfig: Path):
        self.api = KubeApi.from_kubeconfig(str(kubeconfig), qps=1000, burst=1000, pool_size=8)
        self.url = url
        self.own_requests: list[float] = []       # this bench's own requests, taken out of the load figures

    def _get(self, path: str) -> dict:
        self.own_requests.append(time.time())
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.api.connection.bearer()}"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def per_second(self) -> dict[int, int]:
        counts = {int(s): n for s, n in self._get("/emulator/stats")["per_second"].items()}
        for t in self.own_requests:
            if int(t) in counts:
                counts[int(t)] -= 1
        return counts

    def nodes(self) -> list[dict]:
        return self._get("/api/v1/nodes")["items"]

    def annotate(self, name: str, value: str | None) -> None:
        self.own_requests.append(time.time())
        self.api.patch_node_annotations(name, {INJECT_ANNOTATION: value})


def window(per_second: dict[int, int], start: float, end: float) -> list[int]:
    return [per_second.get(s, 0) for s in range(int(start), int(end) + 1)]


def p99(values: list[int]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)])


def true_types(node: dict) -> set[str]:
    return {c["type"] for c in node.get("status", {}).get("conditions", [])
            if c.get("type", "").startswith("Gpu") and c.get("status") == "True"}


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_until(admin: EmulatorAdmin, done, timeout_s: float, poll_s: float) -> tuple[float | None, list[dict]]:
    """Poll the nodes until done(nodes); (when, the nodes last seen)."""
    deadline = time.time() + timeout_s
    nodes: list[dict] = []
    while time.time() < deadline:
        nodes = admin.nodes()
        if done(nodes):
            return time.time(), nodes
        time.sleep(poll_s)
    return None, nodes


def run(args: argparse.Namespace, url: str, admin_kubeconfig: Path, work: Path, simulators: list[Simulator]) -> int:
    admin = EmulatorAdmin(url, admin_kubeconfig)
    fleet = work / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"version": 1, "seed": 1, "nodes": [
        {"scenario": "h100-sxm-8", "count": args.nodes, "name": "sim-gpu-{index:05d}", "racks": max(1, args.nodes // 32)}]}))
    poll_s = max(1.0, args.nodes / 7500)          # listing 30,000 nodes is itself a load
    t0 = time.time()
    simulators.extend(Simulator(args, fleet, admin_kubeconfig, k) for k in range(args.shards))
    for sim in simulators:
        while not sim.started.wait(1.0):
            if sim.proc.poll() is not None:
                raise SystemExit("a simulator exited:\n" + "\n".join(sim.lines[-20:]))
    started_at = time.time()
    say(f"{args.shards} simulator(s) registered {args.nodes} nodes in {started_at - t0:.0f}s; rolling start")

    start_end = started_at + args.start_spread + args.settle
    time.sleep(max(0.0, start_end - time.time()))
    reported = sum(1 for n in admin.nodes() if any(c["type"].startswith("Gpu") for c in n["status"].get("conditions", [])))
    say(f"rolling start done: {reported} of {args.nodes} nodes report conditions")

    steady_begin, cpu_begin = time.time(), sum(s.cpu_s() for s in simulators)
    time.sleep(args.steady)
    steady_end, cpu_end = time.time(), sum(s.cpu_s() for s in simulators)
    rss = [s.rss() for s in simulators]
    say(f"steady state: {steady_end - steady_begin:.0f}s measured; simulators' RSS "
        + ", ".join(f"{r / 2**20:.0f} MiB" for r in rss))

    rng = random.Random(7)
    names = [f"sim-gpu-{i:05d}" for i in range(args.nodes)]
    broken = {name: rng.sample(range(8), args.fault_gpus)
              for name in rng.sample(names, max(1, round(args.fault_fraction * args.nodes)))}
    fault_types = {*FAULT_TYPES, *([REMEDIATION] if args.fault_gpus >= 2 else [])}
    fault_time = time.time()
    for name, gpus in broken.items():
        admin.annotate(name, json.dumps([{"kind": "xid", "gpu": gpu, "params": {"code": 79}} for gpu in gpus]))
    say(f"fault: XID 79 on {args.fault_gpus} GPU(s) annotated on {len(broken)} nodes in "
        f"{time.time() - fault_time:.1f}s")

    def all_showing(nodes: list[dict]) -> bool:
        return all(fault_types <= true_types(n) for n in nodes if n["metadata"]["name"] in broken)
    visible_at, at_fault = wait_until(admin, all_showing, args.fault_timeout, poll_s)
    say(f"every fault visible after {visible_at - fault_time:.1f}s" if visible_at else "faults NOT all visible")
    time.sleep(5)
    at_fault = admin.nodes()
    fault_end = time.time()
    fleet_view = view_fleet(admin_kubeconfig, broken)
    say(f"gpu-npd fleet: {fleet_view['fleet_view_s']:.2f}s, {fleet_view['fleet_view_pages']} LIST page(s) of 500; "
        f"{fleet_view['fleet_view_failed_gpus']} failed GPUs on {fleet_view['fleet_view_nodes']} nodes listed "
        f"({'exactly the broken ones' if fleet_view['fleet_view_matches'] else 'NOT the broken ones'})")

    heal_time = time.time()
    for name in broken:
        admin.annotate(name, None)
    healed_at, after = wait_until(admin, lambda nodes: not any(true_types(n) for n in nodes), args.fault_timeout, poll_s)
    say(f"every node clear after {healed_at - heal_time:.1f}s" if healed_at else "nodes NOT all clear")
    time.sleep(2)
    per_second = admin.per_second()

    lost = duplicate = unexpected = unrecorded = 0
    for node in at_fault:
        name = node["metadata"]["name"]
        types = [c["type"] for c in node["status"].get("conditions", [])]
        duplicate += len(types) - len(set(types))
        expected = fault_types if name in broken else set()
        lost += len(expected - true_types(node))
        unexpected += len(true_types(node) - expected)
        if name in broken and STATUS_ANNOTATION not in (node["metadata"].get("annotations") or {}):
            unrecorded += 1
    uncleared = sum(len(true_types(n)) for n in after)
    asked = sum(REMEDIATION in true_types(n) for n in at_fault)
    max_unhealthy = yaml.safe_load(NHC.read_text())["spec"]["maxUnhealthy"]
    allowed = nhc_allowed_unhealthy(max_unhealthy, args.nodes)
    say(f"circuit breaker: {asked} of {args.nodes} nodes ask for remediation; deploy/remediation's NodeHealthCheck "
        f"(maxUnhealthy {max_unhealthy}) starts remediations while at most {allowed} are unhealthy: "
        + ("it remediates" if asked <= allowed else "it stops, nothing is drained"))
    steady_s = steady_end - steady_begin
    steady_requests = sum(window(per_second, steady_begin + 1, steady_end - 1))
    start_rps = window(per_second, started_at, start_end)
    fault_rps = window(per_second, fault_time, fault_end)
    figures = {
        "nodes": args.nodes, "shards": args.shards,
        "rss_per_node_kib": round(sum(rss) / 1024 / args.nodes, 1),
        "rss_per_shard_mib": [round(r / 2**20, 1) for r in rss],
        "cpu_ms_per_node_per_hour": round((cpu_end - cpu_begin) * 1000 / args.nodes * 3600 / steady_s, 1),
        "requests_per_node_per_hour": round(steady_requests / args.nodes * 3600 / max(steady_s - 2, 1), 2),
        "peak_rps": max(start_rps + fault_rps, default=0), "p99_rps": p99(start_rps + fault_rps),
        "start_peak_rps": max(start_rps, default=0), "start_p99_rps": p99(start_rps),
        "fault_peak_rps": max(fault_rps, default=0), "fault_p99_rps": p99(fault_rps),
        "fault_nodes": len(broken),
        "fault_visible_s": round(visible_at - fault_time, 2) if visible_at else None,
        "heal_visible_s": round(healed_at - heal_time, 2) if healed_at else None,
        "lost_conditions": lost, "duplicate_conditions": duplicate, "unexpected_conditions": unexpected,
        "uncleared_conditions": uncleared, "fault_status_missing": unrecorded,
        "steady_window_s": round(steady_s, 1), "qps_limit_per_shard": args.qps,
        "remediation_asked": asked, "nhc_max_unhealthy": max_unhealthy, "nhc_allowed_unhealthy": allowed,
        "nhc_remediates": asked <= allowed, **fleet_view,
    }
    print(json.dumps(figures))
    ok = visible_at and healed_at and fleet_view["fleet_view_matches"] and not (
        lost or duplicate or unexpected or uncleared or unrecorded)
    if not ok:
        for sim in simulators:
            say(f"{sim.log} ({len(sim.lines)} lines), its last ones:\n  " + "\n  ".join(sim.lines[-15:]))
    return 0 if ok else 1


def view_fleet(kubeconfig: Path, broken: dict[str, list[int]]) -> dict[str, Any]:
    """`gpu-npd fleet -o json` over the broken fleet, as an operator would run it: its time, its LIST pages
    (its only requests), and whether it lists exactly the GPUs the fault broke."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "detector.cli.main", "fleet", "--kubeconfig", str(kubeconfig),
                           "-o", "json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    took = time.monotonic() - t0
    try:
        report = json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"gpu-npd fleet printed no JSON (exit {done.returncode}): {done.stderr[-2000:]}") from None
    listed = {n["name"]: sorted(g["index"] for g in n["unhealthyGpus"] if g["state"] == "failed")
              for n in report["nodes"]}
    return {"fleet_view_s": round(took, 2), "fleet_view_pages": report["summary"]["pages"],
            "fleet_view_nodes": len(listed), "fleet_view_failed_gpus": report["summary"]["failed"],
            "fleet_view_matches": {k: v for k, v in listed.items() if v} == {k: sorted(v) for k, v in broken.items()}}


def nhc_allowed_unhealthy(max_unhealthy: int | str, nodes: int) -> int:
    """Unhealthy nodes the NodeHealthCheck tolerates and still remediates: a percentage scales rounding up
    (NHC's getMinHealthy); tests/test_remediation.py pins the same model."""
    if isinstance(max_unhealthy, str) and max_unhealthy.endswith("%"):
        return math.ceil(int(max_unhealthy[:-1]) * nodes / 100)
    return int(max_unhealthy)


if __name__ == "__main__":
    sys.exit(main())
