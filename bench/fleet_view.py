"""`gpu-npd fleet` over a large fleet: 7,500 GPU nodes in the emulator, as the daemons leave them, read by
the command as a person runs it (its own process, the read-only RBAC of deploy/fleet-viewer).

Every node carries what a daemon writes: each condition type of the bundled rules (False, with the
daemon's message marker and a recent heartbeat) through the daemon's own ConditionReporter, kubelet's
conditions, and a list of container images as a kubelet reports them (node objects of a real cluster
are mostly that). A seeded share is broken the way the fleet simulator breaks nodes: a GPU fallen off
the bus (GpuXidError and GpuMissing True, the GPU failed in gpu-npd.io/unhealthy-gpus, written by the
annotation code the agent's reporter uses), a PCIe link degraded (GpuPcieDegraded True, the GPU
degraded), and daemons that stopped reporting (heartbeats 20 minutes old) or never did. Then `gpu-npd
fleet -o json` runs --runs times per page size, and its answer is checked against what was planted.

The last line is a JSON object: nodes, pages, list_requests, seconds (median), peak_rss_mib (the
command's), listed / failed / degraded / not_reporting (as it found them), and the same for an unpaged
LIST (`--chunk-size` = the fleet) to show what the pages save.

    .venv/bin/python bench/fleet_view.py                  # 7,500 nodes
    .venv/bin/python bench/fleet_view.py --nodes 30000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from detector.agent.active import ConditionStatus  # noqa: E402
from detector.rules.sources import builtin_rules_dir  # noqa: E402
from detector.core.gpu_health import DEGRADED, FAILED, GpuHealth  # noqa: E402
from detector.core.types import GpuRef  # noqa: E402
from detector.kube.annotations import UNHEALTHY_GPUS, unhealthy_gpus_annotation  # noqa: E402
from detector.kube.reporter import ALWAYS_WRITTEN  # noqa: E402
from detector.kube.conditions import ConditionReporter  # noqa: E402
from detector.rules.loader import load_rules  # noqa: E402
from kube_emulator import Emulator  # noqa: E402
from kube_emulator.kinds import NODES  # noqa: E402
from kube_emulator.rbac import deploy_rbac  # noqa: E402

VIEWER, VIEWERS = "fleet-bench", "gpu-npd:fleet-viewers"
BUSES = ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
         "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0")
PROBLEMS = {"GpuXidError": ("Xid79GpuFellOffBus", FAILED, "RESTART_BM"),
            "GpuPcieDegraded": ("PcieLinkWidthDegraded", DEGRADED, "CHECK_PCIE")}


class Capture:
    """The API the ConditionReporter talks to: it keeps the PATCH body instead of sending it."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = {}

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.body = body
        return {}


def daemon_patch(name: str, types: list[str], broken: str | None, gpu: int, now: float) -> dict[str, Any]:
    """The status PATCH the daemon sends for this node: its conditions and annotation."""
    api = Capture()
    out = ConditionReporter(api, name, types, clock=lambda: now,      # type: ignore[arg-type] - one call
                            always=ALWAYS_WRITTEN)      # as the daemon: a healthy node shows these two
    out.adopt({"status": {"conditions": []}})
    statuses = []
    for t in types:
        reason, _, action = PROBLEMS.get(t, (f"No{t}", "", ""))
        active = t == broken or (broken == "GpuXidError" and t == "GpuMissing")
        message = f"GPU {gpu} ({BUSES[gpu]}): recommended action {action}" if active else "no problem found"
        statuses.append(ConditionStatus(t, active, reason if active else f"No{t}", message, names_gpu=active))
    out.update(statuses)
    if broken:
        _, state, action = PROBLEMS[broken]
        ref = GpuRef(gpu, f"GPU-{name}-{gpu}", BUSES[gpu])
        out.annotate(unhealthy_gpus_annotation([GpuHealth(ref, state, action, serial=f"16505669{gpu:05d}",
                                                          since=now - 600)]))
    out.flush()
    return api.body


def populate(emu: Emulator, nodes: int, images: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    types = sorted(load_rules([builtin_rules_dir()]).types())
    planted = {"failed": 0, "degraded": 0, "not_reporting": 0}
    now = time.time()
    image_list = [{"names": [f"nvcr.io/nvidia/pytorch@sha256:{rng.getrandbits(256):064x}",
                             f"nvcr.io/nvidia/pytorch:24.{i % 12 + 1:02d}-py3"], "sizeBytes": 9_000_000_000 + i}
                  for i in range(images)]
    for i in range(nodes):
        name = f"gpu-{i:05d}"
        emu.create_node(name, labels={"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
                                      "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                        capacity={"nvidia.com/gpu": "8"})
        roll = rng.random()
        broken = "GpuXidError" if roll < 0.02 else "GpuPcieDegraded" if roll < 0.03 else None
        silent = 0.03 <= roll < 0.035            # stopped reporting 20 minutes ago
        never = 0.035 <= roll < 0.037            # gpu-npd never ran there
        planted["failed"] += broken == "GpuXidError"
        planted["degraded"] += broken == "GpuPcieDegraded"
        planted["not_reporting"] += silent or never
        body = {} if never else daemon_patch(name, types, broken, rng.randrange(8), now - (1200 if silent else 0))

        def build(node: dict, body: dict = body) -> dict:
            status = {**node["status"], "images": image_list,
                      "conditions": node["status"]["conditions"] + (body.get("status") or {}).get("conditions", [])}
            annotations = {**(node["metadata"].get("annotations") or {}),
                           **((body.get("metadata") or {}).get("annotations") or {})}
            return {**node, "metadata": {**node["metadata"], "annotations": annotations}, "status": status}
        emu.store.update(NODES, None, name, build, subresource="status")
    return planted


def run_fleet(kubeconfig: Path, chunk: int) -> tuple[float, float, dict[str, Any]]:
    """One `gpu-npd fleet -o json` in a process of its own: (seconds, its peak RSS in MiB, its answer)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", REPORTING_PEAK, "fleet", "--kubeconfig", str(kubeconfig),
                           "--chunk-size", str(chunk), "-o", "json"], capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - t0
    if done.returncode not in (0, 1) or "peak_kib" not in done.stderr:
        raise SystemExit(f"gpu-npd fleet exited {done.returncode}: {done.stderr}")
    peak_kib = int(done.stderr.rsplit("peak_kib ", 1)[1].split()[0])
    return seconds, peak_kib / 1024, json.loads(done.stdout)


# gpu-npd's main, then the process's own peak RSS on stderr: VmHWM, which starts afresh at exec (ru_maxrss
# would count the bench's own RSS, that the child had for an instant between fork and exec)
REPORTING_PEAK = ("import re, sys\nfrom detector.cli.main import main\ncode = main(sys.argv[1:])\n"
                  "status = open('/proc/self/status').read()\n"
                  "print('peak_kib', re.search(r'VmHWM:\\s+(\\d+)', status).group(1), file=sys.stderr)\n"
                  "sys.exit(code)")


def measure(emu: Emulator, kubeconfig: Path, chunk: int, runs: int) -> dict[str, Any]:
    times, peaks, requests = [], [], 0
    answer: dict[str, Any] = {}
    for _ in range(runs):
        emu.reset_stats()
        seconds, peak, answer = run_fleet(kubeconfig, chunk)
        times.append(seconds)
        peaks.append(peak)
        requests = emu.request_count(user=VIEWER)
    s = answer["summary"]
    return {"seconds": round(statistics.median(times), 3), "seconds_min": round(min(times), 3),
            "pages": s["pages"], "list_requests": requests, "peak_rss_mib": round(max(peaks), 1),
            "listed": s["listed"], "failed": s["failed"], "degraded": s["degraded"],
            "not_reporting": s["notReporting"], "nodes_with_problems": s["nodesWithProblems"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=7500)
    p.add_argument("--images", type=int, default=40, help="container images each node lists (default 40)")
    p.add_argument("--chunk-size", type=int, default=500, help="the command's page size (default 500)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    with Emulator(rbac_paths=(deploy_rbac("base"), REPO / "deploy" / "fleet-viewer")) as emu:
        t0 = time.perf_counter()
        planted = populate(emu, args.nodes, args.images, args.seed)
        print(f"{args.nodes} nodes in the emulator in {time.perf_counter() - t0:.1f}s; planted {planted}", flush=True)
        kubeconfig = emu.write_kubeconfig(Path(tempfile.mkdtemp(prefix="gpu-npd-fleet-view-")) / "kc", user=VIEWER)
        emu.token_for(VIEWER, groups=[VIEWERS, "system:authenticated"])
        paged = measure(emu, kubeconfig, args.chunk_size, args.runs)
        print(f"gpu-npd fleet, pages of {args.chunk_size}: {paged}", flush=True)
        unpaged = measure(emu, kubeconfig, args.nodes, 1)
        print(f"gpu-npd fleet, one unpaged LIST: {unpaged}", flush=True)
    found = {k: paged[k] for k in planted}
    figures = {"nodes": args.nodes, "chunk_size": args.chunk_size, **paged,
               "unpaged_seconds": unpaged["seconds"], "unpaged_peak_rss_mib": unpaged["peak_rss_mib"],
               "planted": planted, "all_found": found == planted and paged["listed"] == args.nodes}
    print(json.dumps(figures))
    return 0 if figures["all_found"] else 1


if __name__ == "__main__":
    sys.exit(main())
