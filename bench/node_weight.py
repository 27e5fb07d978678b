#!/usr/bin/env python3
"""How much gpu-npd weighs on its Node object, and how often it writes it: the real daemon, in this process,
with its default checks and rules, on fake 8x H100 nodes against the Kubernetes API emulator.

Every Node update goes to every watcher of Nodes (the scheduler, controllers, node-problem-detector's
peers...), so what gpu-npd adds to a Node is paid again at each of its writes, times every watcher, times
every node. For each node this prints:

- the Node's JSON as `kubectl get node -o json` prints it (4-space indent), before the daemon and once every
  check has run and what it decided is on the API server;
- gpu-npd's conditions (the types its rules produce) as compact JSON (`separators=(",", ":")`): bytes, how
  many, how many False;
- the steady API requests per node-hour, by verb and resource, over one scaled hour after the start:
  `--hour-s` seconds of real time stand for one hour, and every period that makes requests is scaled with
  it (the conditions' heartbeat, 300 s; the node watch's timeoutSeconds, 300 s), as in bench/node_watch.py;
  and the bytes of Node object the API server sends each Node watcher per node-hour for gpu-npd's writes
  (its `patch nodes/status` requests times the Node's compact JSON; protobuf clients receive less).

Nodes: `healthy` (fake:h100-sxm-8), `fault` (fake:h100-sxm-8-xid79: GPU 3 fell off the bus before the daemon
started), and `upgrade` (fake:h100-sxm-8 whose Node still carries an older gpu-npd's False condition of
every type, as it wrote them before issue 34; bytes only, no window). The last line is a JSON object.

    .venv/bin/python bench/node_weight.py                 # one hour as 60 s for each of healthy and fault
    .venv/bin/python bench/node_weight.py --hour-s 360    # one hour as 6 minutes: closer to real timing
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from detector.daemon.local import LocalDaemon, local_daemon  # noqa: E402
from detector.daemon.run import DaemonSettings  # noqa: E402
from detector.kube.conditions import MARKER  # noqa: E402
from detector.kube.nodewatch import NodeWatchSettings  # noqa: E402
from detector.kube.stamps import rfc3339  # noqa: E402
from kube_emulator import Emulator  # noqa: E402

NODE = "weight-node"
HOUR_S = 3600.0
HEARTBEAT_S = 300.0
WATCH_TIMEOUT_S = 300
SETTLE_TIMEOUT_S = 60.0
SCENARIOS = {"healthy": "h100-sxm-8", "fault": "h100-sxm-8-xid79", "upgrade": "h100-sxm-8"}


def kubectl_json_bytes(node: dict[str, Any]) -> int:
    """The size of `kubectl get node -o json`'s output: 4-space indent, UTF-8, a final newline."""
    return len((json.dumps(node, indent=4, ensure_ascii=False) + "\n").encode())


def compact_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def older_conditions(types: list[str], now: float) -> list[dict[str, str]]:
    """What gpu-npd wrote before issue 34 on a healthy node: every type it judged, False, whether or not its
    problem was ever seen there."""
    stamp = rfc3339(now - 86400)
    return [{"type": t, "status": "False", "reason": f"No{t}", "message": f"{MARKER}no {t} problem found",
             "lastHeartbeatTime": rfc3339(now), "lastTransitionTime": stamp} for t in types]


def settled(local: LocalDaemon) -> bool:
    """Every check has run (the readiness check says so) and nothing waits to be sent."""
    unverified = local.conditions().get("GpuNodeUnverified", {})
    reporter = local.daemon.reporter
    if unverified.get("reason", "ChecksPending") == "ChecksPending" or reporter is None:
        return False
    due = reporter.due_at()
    return due is None or due > time.time()


def measure(name: str, hour_s: float, window: bool) -> dict[str, Any]:
    scale = hour_s / HOUR_S
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    settings.reporter.heartbeat_s = HEARTBEAT_S * scale
    timeout = max(1, round(WATCH_TIMEOUT_S * scale))
    settings.node_watch = NodeWatchSettings(timeout_s=timeout)
    emulator = Emulator(bookmark_interval_s=max(0.05, 60 * scale))
    emulator.start()
    local = local_daemon(SCENARIOS[name], NODE, settings=settings, emulator=emulator,
                         workdir=Path(tempfile.mkdtemp(prefix="gpu-npd-node-weight-")))
    owned = set(local.daemon.agent.owned_types)
    if name == "upgrade":
        old = older_conditions(sorted(owned), time.time())
        for condition in old:
            emulator.set_node_condition(NODE, condition)

    def ours(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [c for c in node.get("status", {}).get("conditions", []) if c.get("type") in owned]

    before = emulator.node(NODE)
    counts = local.daemon.reporter.api.counts if local.daemon.reporter else None
    assert counts is not None
    local.start()
    try:
        t0 = time.monotonic()
        if not local.wait_for(lambda: settled(local), SETTLE_TIMEOUT_S, poll_s=0.05):
            raise SystemExit(f"{name}: the daemon did not settle within {SETTLE_TIMEOUT_S:g}s: {local.conditions()}")
        settle_s = time.monotonic() - t0
        after = emulator.node(NODE)
        per_hour: Counter[str] = Counter()
        if window:
            with counts.lock:
                start = Counter(counts.counts)
            w0 = time.monotonic()
            time.sleep(hour_s)
            with counts.lock:
                end = Counter(counts.counts)
            elapsed = time.monotonic() - w0
            for (verb, resource, _code), n in (end - start).items():
                per_hour[f"{verb} {resource}"] += n * hour_s / elapsed
            after = emulator.node(NODE)
    finally:
        local.daemon.stop.set()
        if local.thread is not None:
            local.thread.join(10)
        emulator.stop()
    conditions = ours(after)
    result: dict[str, Any] = {
        "node": name, "scenario": f"fake:{SCENARIOS[name]}", "settle_s": round(settle_s, 1),
        "node_json_bytes_before": kubectl_json_bytes(before), "node_json_bytes_after": kubectl_json_bytes(after),
        "conditions_bytes_before": compact_bytes(ours(before)), "conditions_bytes": compact_bytes(conditions),
        "conditions": len(conditions), "conditions_false": sum(c.get("status") == "False" for c in conditions),
        "types": sorted(f"{c['type']}={c.get('status')}" for c in conditions)}
    if window:
        patches = per_hour.get("patch nodes/status", 0.0)
        result.update({
            "requests_per_node_hour": round(sum(per_hour.values()), 1),
            "by_verb_resource": {k: round(v, 1) for k, v in sorted(per_hour.items())},
            "watch_bytes_per_node_hour": round(patches * compact_bytes(after))})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hour-s", type=float, default=60.0,
                        help="real seconds that stand for one hour (default 60: heartbeat 5 s, watch timeout 5 s)")
    args = parser.parse_args()
    results = [measure("healthy", args.hour_s, window=True), measure("fault", args.hour_s, window=True),
               measure("upgrade", args.hour_s, window=False)]
    for r in results:
        print(f"{r['node']:8} {r['scenario']}: Node {r['node_json_bytes_before']:,} -> {r['node_json_bytes_after']:,} "
              f"bytes (kubectl -o json); gpu-npd's conditions {r['conditions_bytes_before']:,} -> "
              f"{r['conditions_bytes']:,} bytes compact, {r['conditions']} ({r['conditions_false']} False): "
              + ", ".join(r["types"]))
        if "requests_per_node_hour" in r:
            print(f"{'':9}{r['requests_per_node_hour']} requests per node-hour {r['by_verb_resource']}; "
                  f"{r['watch_bytes_per_node_hour']:,} bytes of Node per watcher per node-hour")
    print(json.dumps({"hour_s": args.hour_s, "scale": round(args.hour_s / HOUR_S, 5),
                      "nodes": {r["node"]: r for r in results}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
