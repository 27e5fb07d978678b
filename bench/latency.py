#!/usr/bin/env python3
"""XID line in the kernel log -> NodeCondition on the API server: how long it takes.

Runs the real daemon (the same `Daemon` as `gpu-npd run`) on a fake 8x H100 node against the Kubernetes
API emulator on loopback, with the default rules and intervals. Each injection writes one XID 79 line
to the fake node's kernel log (nothing through NVML) and times until the emulator holds
GpuXidError=True; the node is then rebooted with an operator's clear (`gpu-npd clear`: repeated XIDs
on one GPU escalate to conditions only an operator clears) and the condition awaited back at False
before the next one. Budget (DESIGN section 8): p99 <= 200 ms. The last line
printed is a JSON object of the figures.

    .venv/bin/python bench/latency.py              # 100 injections
    .venv/bin/python bench/latency.py -n 20
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from detector.agent.agent import write_clear_request  # noqa: E402
from detector.daemon.local import local_daemon  # noqa: E402
from detector.daemon.run import DaemonSettings  # noqa: E402
from fake_nvml.faults import Fault  # noqa: E402

CONDITION = "GpuXidError"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--injections", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each change")
    args = parser.parse_args()
    logging.getLogger("gpu_npd").setLevel(logging.ERROR)

    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    state_dir = Path(tempfile.mkdtemp(prefix="gpu-npd-latency-"))
    local = local_daemon("h100-sxm-8", "latency-node", settings=settings, state_dir=state_dir).start()
    status = lambda: local.conditions().get(CONDITION, {}).get("status")  # noqa: E731
    latencies: list[float] = []
    misses = 0
    try:
        if not local.wait_for(lambda: local.settled(CONDITION) and status() is None, 30.0):
            raise SystemExit("the daemon never judged the node (a healthy node shows no such condition)")
        for i in range(args.injections):
            gpu = i % 8
            t0 = time.perf_counter()
            local.node.inject(Fault("xid", gpu=gpu, params={"code": 79, "via": "kernel"}))
            if local.wait_for(lambda: status() == "True", args.timeout, poll_s=0.001):
                latencies.append((time.perf_counter() - t0) * 1000)
            else:
                misses += 1
            write_clear_request(state_dir, [CONDITION], time.time())
            local.node.inject(Fault("reboot"))
            if not local.wait_for(lambda: status() == "False", args.timeout):
                raise SystemExit(f"injection {i}: the condition did not clear after the reboot")
            if (i + 1) % 20 == 0:
                print(f"  {i + 1}/{args.injections} injections, p50 so far "
                      f"{statistics.median(latencies):.1f} ms", file=sys.stderr, flush=True)
        requests = local.emulator.stats()["total"]
    finally:
        local.stop()

    result = {
        "injections": args.injections, "missed": misses,
        "p50_ms": round(percentile(latencies, 50), 1), "p90_ms": round(percentile(latencies, 90), 1),
        "p99_ms": round(percentile(latencies, 99), 1), "max_ms": round(max(latencies), 1),
        "mean_ms": round(statistics.fmean(latencies), 1), "budget_p99_ms": 200, "api_requests": requests,
    }
    print(f"XID line -> {CONDITION}=True on the API server, {len(latencies)} injections: "
          f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms")
    print(json.dumps(result))
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
