#!/usr/bin/env python3
"""API requests per node-hour with the node watch on and off: the real daemon, in this process, on a fake
8x H100 node (`fake:h100-sxm-8`) against the Kubernetes API emulator, with the default checks.

Time is scaled, and said so: `--hour-s` seconds of real time stand for one hour, and every period that
makes requests is scaled with it (the conditions' heartbeat, 300 s; the node watch's timeoutSeconds, 300 s,
whole seconds at least), so each request counted in the window is one request per node-hour. A kubelet
is played too: it updates the node's Ready condition every 10 s (scaled), which the watch receives (no
request) and must not act upon. Checks keep their real intervals; on a healthy node they make no request.
The window starts after `--settle` scaled seconds, so the start's own requests (read the node, first
status PATCH, discovery, the first list) are counted apart. The last line is a JSON object of the figures.

    .venv/bin/python bench/node_watch.py                 # one hour as 60 s, twice (watch on, then off)
    .venv/bin/python bench/node_watch.py --hour-s 360    # one hour as 6 minutes: closer to real timing
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from detector.daemon.local import local_daemon  # noqa: E402
from detector.daemon.run import DaemonSettings  # noqa: E402
from detector.kube.nodewatch import NodeWatchSettings  # noqa: E402
from kube_emulator import Emulator  # noqa: E402

NODE = "watch-node"
HOUR_S = 3600.0
HEARTBEAT_S = 300.0
WATCH_TIMEOUT_S = 300
KUBELET_EVERY_S = 10.0


def measure(watch: bool, hour_s: float, settle_s: float, read_slices: bool) -> dict:
    scale = hour_s / HOUR_S
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    settings.reporter.heartbeat_s = HEARTBEAT_S * scale
    timeout = max(1, round(WATCH_TIMEOUT_S * scale))
    settings.node_watch = NodeWatchSettings(timeout_s=timeout, read_slices=read_slices) if watch else None
    emulator = Emulator(bookmark_interval_s=max(0.05, 60 * scale))
    emulator.start()
    local = local_daemon("h100-sxm-8", NODE, settings=settings, emulator=emulator,
                         workdir=Path(tempfile.mkdtemp(prefix="gpu-npd-node-watch-")))
    stop = threading.Event()

    def kubelet() -> None:
        while not stop.wait(KUBELET_EVERY_S * scale):
            emulator.set_node_condition(NODE, {"type": "Ready", "status": "True", "reason": "KubeletReady",
                                               "message": "kubelet is posting ready status"})

    counts = local.daemon.reporter.api.counts if local.daemon.reporter else None
    assert counts is not None
    threading.Thread(target=kubelet, daemon=True).start()
    local.start()
    try:
        time.sleep(settle_s * scale)
        with counts.lock:
            start = Counter(counts.counts)
        t0 = time.monotonic()
        time.sleep(hour_s)
        with counts.lock:
            end = Counter(counts.counts)
        elapsed = time.monotonic() - t0
        changes = local.daemon.node_watch.changes if local.daemon.node_watch else 0
    finally:
        stop.set()
        local.daemon.stop.set()
        if local.thread is not None:
            local.thread.join(10)
        emulator.stop()
    per_hour: Counter = Counter()
    for (verb, resource, _code), n in (end - start).items():
        per_hour[f"{verb} {resource}"] += n * hour_s / elapsed
    startup: Counter = Counter()
    for (verb, resource, _code), n in start.items():
        startup[f"{verb} {resource}"] += n
    return {"node_watch": watch, "requests_per_node_hour": round(sum(per_hour.values()), 1),
            "by_verb_resource": {k: round(v, 1) for k, v in sorted(per_hour.items())},
            "startup_requests": dict(sorted(startup.items())), "on_change_calls": changes,
            "watch_timeout_s": timeout if watch else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hour-s", type=float, default=60.0,
                        help="real seconds that stand for one hour (default 60: heartbeat 5 s, watch timeout 5 s)")
    parser.add_argument("--settle", type=float, default=120.0,
                        help="scaled seconds before the window (default 120: two scaled minutes)")
    parser.add_argument("--slices", action="store_true",
                        help="watch the node's ResourceSlices too (as the allocatable check or --dra-taints does)")
    args = parser.parse_args()
    on = measure(True, args.hour_s, args.settle, args.slices)
    off = measure(False, args.hour_s, args.settle, args.slices)
    result = {"hour_s": args.hour_s, "scale": round(args.hour_s / HOUR_S, 5), "watch_on": on, "watch_off": off,
              "added_by_watch_per_node_hour": round(on["requests_per_node_hour"] - off["requests_per_node_hour"], 1),
              "npd_requests_per_node_hour": 12}
    for r in (on, off):
        print(f"node watch {'on ' if r['node_watch'] else 'off'}: {r['requests_per_node_hour']} requests per "
              f"node-hour {r['by_verb_resource']}; at start {r['startup_requests']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
