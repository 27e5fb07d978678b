"""`gpu-npd demo`: the daemon on a fake 8x H100 node against an in-process Kubernetes API emulator.

GPU 3 gets XID 79 (fallen off the bus) after a few seconds; the node is then rebooted. The node's
conditions and events are printed as the API server sees them change; the demo exits by itself.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from detector.daemon.run import DaemonSettings
from fake_nvml.faults import Fault

NODE = "demo-node"


def add_demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="watch the daemon catch XID 79 on a fake node (no GPU, no cluster needed)",
                       description=__doc__)
    d.add_argument("--scenario", default="h100-sxm-8", help="fake node to start from (default h100-sxm-8)")
    d.add_argument("--fault-after", type=float, default=3.0, metavar="S", help="inject XID 79 after S seconds")
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="give up after S seconds per step")
    d.set_defaults(func=cmd_demo)


class Watcher:
    """Prints what changed on the node since the last look: conditions and events."""

    def __init__(self, local: Any):
        self.local = local
        self.seen_conditions: dict[str, tuple[str, str, str]] = {}
        self.seen_events: dict[str, int] = {}
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] {text}", flush=True)

    def look(self) -> None:
        for type_, c in sorted(self.local.conditions().items()):
            now = (c.get("status", ""), c.get("reason", ""), c.get("message", ""))
            if self.seen_conditions.get(type_) != now:
                self.seen_conditions[type_] = now
                self.say(f"condition {type_}={now[0]} reason={now[1]}\n{'':9}{now[2]}")
        for e in self.local.events():
            name, count = e["metadata"]["name"], int(e.get("count") or 1)
            if self.seen_events.get(name) != count:
                self.seen_events[name] = count
                self.say(f"event {e.get('type')} {e.get('reason')} (count {count}): {e.get('message')}")

    def until(self, predicate: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.look()
            if predicate():
                return True
            time.sleep(0.05)
        self.look()
        return False


def cmd_demo(args: argparse.Namespace) -> int:
    from detector.daemon.local import local_daemon

    logging.getLogger("gpu_npd").setLevel(logging.ERROR)
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.5
    local = local_daemon(args.scenario, NODE, settings=settings,
                         check_settings={"visibility": {"interval": 2}, "pcie": {"interval": 10}})
    w = Watcher(local)
    ok = True
    try:
        w.say(f"Kubernetes API emulator at {local.emulator.url}; node {NODE}: fake {args.scenario}")
        w.say(f"starting gpu-npd run (metrics on http://{local.daemon.endpoints.address}/metrics)")
        local.start()

        def has(type_: str, status: str) -> Any:
            return lambda: local.conditions().get(type_, {}).get("status") == status

        ok &= w.until(has("GpuXidError", "False"), args.timeout)
        w.until(lambda: False, max(0.0, args.fault_after - (time.monotonic() - w.t0)))
        w.say(">>> injecting XID 79 on GPU 3 (kernel log line and NVML event)")
        local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
        injected = time.monotonic()
        ok &= w.until(lambda: has("GpuXidError", "True")() and has("GpuMissing", "True")(), args.timeout)
        w.say(f"    both conditions visible {time.monotonic() - injected:.2f}s after the injection")
        w.say(">>> rebooting the node (XID conditions hold until a reboot)")
        local.node.inject(Fault("reboot"))
        ok &= w.until(lambda: has("GpuXidError", "False")() and has("GpuMissing", "False")(), args.timeout)
        w.say("kubelet's own conditions, never touched by gpu-npd: " + ", ".join(
            f"{t}={c['status']}" for t, c in sorted(local.conditions().items()) if not t.startswith("Gpu")))
        stats = local.emulator.stats()
        w.say(f"API requests: {stats['total']} in all")
    finally:
        local.stop()
    w.say("demo finished" + ("" if ok else " (an expected change did not happen in time)"))
    return 0 if ok else 1
