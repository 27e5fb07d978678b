"""`gpu-npd demo`: the daemon on a fake 8x H100 node against an in-process Kubernetes API emulator.

1. GPU 3 gets XID 79 (fallen off the bus) after a few seconds: that GPU is fenced with a DRA device taint
   (the emulator plays the NVIDIA DRA driver's ResourceSlice) and the node is not asked to reboot
   (GpuNodeNeedsRemediation stays False: 1 of 8 GPUs failed). The node is then rebooted, and all clears
   once every check has passed three rounds since the reboot (the cure is verified, not assumed).
2. GPUs 5 and 6 fall off the bus: two failed GPUs ask for the node (GpuNodeNeedsRemediation); a
   remediator reboots it, which cures it.
3. A remediation loop: nvidia_uvm fails to load at every boot. The node asks for remediation, a
   remediator reboots it, and the problem comes back, three times; then GpuRemediationLoop turns True
   and gpu-npd stops asking.
The story is printed with the changes that matter as the API server sees them: a condition turning True or
clearing, events, device taints; -v prints every change (each condition as first written, the readiness
countdown after each reboot, the messages that count a cure's verified rounds). The demo exits by itself.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from detector.daemon.run import DaemonSettings
from detector.kube.conditions import MARKER
from detector.kube.device_taints import DeviceTaintSettings

NODE = "demo-node"
# Every check runs every 0.5 s here (pcie every 1 s), so that a cure is verified (every check passing
# --verify-sweeps rounds, 3) within seconds instead of the minutes the daemon's 60 s intervals take: the
# whole story, six reboots included, takes under 20 s.
FAST_CHECKS = ("visibility", "xid", "driver", "memory", "nvlink", "fabric", "imex", "thermal", "performance", "infiniband")


def add_demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="watch the daemon catch XID 79 on a fake node (no GPU, no cluster needed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n"
                              "  gpu-npd demo                       # the story and the changes that matter\n"
                              "  gpu-npd demo -v                    # every condition and event update too\n"
                              "  gpu-npd demo --fault-after 0.5     # break GPU 3 sooner")
    d.add_argument("--scenario", default="h100-sxm-8", help="fake node to start from (default h100-sxm-8)")
    d.add_argument("--fault-after", type=float, default=3.0, metavar="S", help="inject XID 79 after S seconds")
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="give up after S seconds per step")
    d.add_argument("-v", "--verbose", action="store_true",
                   help="print every change of the node's conditions and events, not only those that matter")
    d.set_defaults(func=cmd_demo)


# The readiness countdown: GpuNodeUnverified=True, reason ChecksPending, rewritten as each check first runs after
# every start and reboot (rules/readiness.yaml), with its Event and its clearing. It says the node is starting.
COUNTDOWN_TYPE, COUNTDOWN_REASONS = "GpuNodeUnverified", ("ChecksPending", "NoGpuNodeUnverified")


class Watcher:
    """Prints what changed on the node since the last look: conditions, events and device taints. Unless
    `verbose`, only what matters to the story: a gpu-npd condition turning True, changing its reason or
    clearing (not its first False, nor a message that only counts verified rounds), and the events that are
    not a condition's echo (turned True, or cleared) or the readiness countdown."""

    def __init__(self, local: Any, verbose: bool = False):
        self.local = local
        self.verbose = verbose
        self.seen_conditions: dict[str, tuple[str, str, str]] = {}
        self.told: dict[str, tuple[str, str]] = {}          # type -> (status, reason) last told (or first False)
        self.seen_events: dict[str, int] = {}
        self.seen_taints: dict[str, str] = {}
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] {text}", flush=True)

    def look(self) -> None:
        conditions = self.local.conditions()
        for type_, c in sorted(conditions.items()):
            now = (c.get("status", ""), c.get("reason", ""), c.get("message", ""))
            if self.seen_conditions.get(type_) != now:
                self.seen_conditions[type_] = now
                if self.verbose or self._matters(type_, now):
                    self.say(f"condition {type_}={now[0]} reason={now[1]}\n{'':9}{now[2]}")
        reasons = {c.get("reason") for c in conditions.values()}
        for e in self.local.events():
            name, count = e["metadata"]["name"], int(e.get("count") or 1)
            if self.seen_events.get(name) != count:
                self.seen_events[name] = count
                if self.verbose or self._event_matters(e, reasons):
                    self.say(f"event {e.get('type')} {e.get('reason')} (count {count}): {e.get('message')}")
        taints = {r["metadata"]["name"]: _taint_text(r) for r in self.local.emulator.device_taint_rules()}
        for name in sorted(set(taints) | set(self.seen_taints)):
            if name not in taints:
                self.say(f"DeviceTaintRule {name} deleted")
            elif self.seen_taints.get(name) != taints[name]:
                self.say(f"DeviceTaintRule {name}: {taints[name]}")
        self.seen_taints = taints

    def _matters(self, type_: str, now: tuple[str, str, str]) -> bool:
        """A gpu-npd condition's (status, reason) moving from what was last told; its first False is noted, not
        told, and the countdown is neither."""
        status, reason, message = now
        if not message.startswith(MARKER) or (type_ == COUNTDOWN_TYPE and reason in COUNTDOWN_REASONS):
            return False
        before = self.told.get(type_)
        self.told[type_] = (status, reason)
        return before != (status, reason) and not (before is None and status == "False")

    def _event_matters(self, event: dict, reasons: set[Any]) -> bool:
        """Not the countdown's, nor the echo of a condition flip the condition lines already tell."""
        reason, message = event.get("reason"), str(event.get("message", ""))
        return (reason not in COUNTDOWN_REASONS and reason not in reasons
                and not message.startswith(tuple(f"{t} cleared:" for t in self.seen_conditions)))

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
    from detector.daemon.local import DRA_TAINTS_RBAC, REPO_DEPLOY, local_daemon, publish_gpu_slice
    from fake_nvml import device_plugin as fake_device_plugin
    from fake_nvml.faults import Fault
    from fake_nvml.scenario import load_scenario
    from kube_emulator import Emulator

    logging.getLogger("gpu_npd").setLevel(logging.ERROR)
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.5
    settings.dra_taints = DeviceTaintSettings(start_grace_s=0.0)
    emulator = Emulator(rbac_paths=(REPO_DEPLOY, DRA_TAINTS_RBAC))
    emulator.start()
    node = load_scenario(args.scenario).build(NODE)
    local = local_daemon(args.scenario, NODE, settings=settings, emulator=emulator, node=node,
                         check_settings={**{name: {"interval": 0.5} for name in FAST_CHECKS}, "pcie": {"interval": 1},
                                         "allocatable": {"settle": 0}})
    publish_gpu_slice(emulator, node)
    w = Watcher(local, verbose=args.verbose)

    def device_plugin() -> None:
        """The fake device plugin's counts, as kubelet writes them on the node (they follow its GPUs)."""
        advertised = node.read(fake_device_plugin.advertised)
        emulator.set_node_resources(NODE, advertised["capacity"], advertised["allocatable"])
        w.say(f"    node status: nvidia.com/gpu capacity {advertised['capacity']['nvidia.com/gpu']}, allocatable "
              f"{advertised['allocatable']['nvidia.com/gpu']} (the device plugin; the allocatable check compares "
              "them with the GPUs NVML sees)")

    ok = True
    try:
        w.say(f"Kubernetes API emulator at {emulator.url}; node {NODE}: fake {args.scenario}, and the NVIDIA "
              "DRA driver's ResourceSlice for its GPUs")
        device_plugin()
        w.say(f"starting gpu-npd run --dra-taints (metrics on http://{local.daemon.endpoints.address}/metrics)")
        if not w.verbose:
            w.say("    below: the changes that matter (gpu-npd demo -v prints every condition and event update)")
        local.start()

        def has(type_: str, status: str) -> Any:
            return lambda: local.conditions().get(type_, {}).get("status") == status

        # Every check ran in this boot and nothing asks for the node: it is verified, ready for work.
        ok &= w.until(has("GpuNodeUnverified", "False"), args.timeout)
        w.say("    every check ran: GpuNodeUnverified=False, the node takes work")
        w.until(lambda: False, max(0.0, args.fault_after - (time.monotonic() - w.t0)))
        w.say(">>> injecting XID 79 on GPU 3 (kernel log line and NVML event)")
        node.inject(Fault("xid", gpu=3, params={"code": 79}))
        injected = time.monotonic()
        ok &= w.until(lambda: has("GpuXidError", "True")() and has("GpuMissing", "True")()
                      and len(emulator.device_taint_rules()) == 1, args.timeout)
        w.say(f"    both conditions and one device taint visible {time.monotonic() - injected:.2f}s after the "
              "injection; GpuNodeNeedsRemediation="
              f"{local.conditions().get('GpuNodeNeedsRemediation', {}).get('status')}: one GPU is fenced, the "
              "node is not asked to reboot")
        ok &= has("GpuNodeNeedsRemediation", "False")()
        device_plugin()
        w.say(">>> rebooting the node (XID conditions hold until a reboot, then until every check passed 3 rounds)")
        node.inject(Fault("reboot"))
        device_plugin()
        ok &= w.until(lambda: has("GpuXidError", "False")() and has("GpuMissing", "False")()
                      and not emulator.device_taint_rules(), args.timeout)

        w.say(">>> GPUs 5 and 6 fall off the bus: two failed GPUs ask for the node")
        for gpu in (5, 6):
            node.inject(Fault("xid", gpu=gpu, params={"code": 79}))
        ok &= w.until(has("GpuNodeNeedsRemediation", "True"), args.timeout)
        w.say(">>> remediator: reboot (GpuNodeNeedsRemediation=True); the reboot cures it")
        node.inject(Fault("reboot"))
        ok &= w.until(lambda: has("GpuNodeNeedsRemediation", "False")() and has("GpuMissing", "False")(),
                      args.timeout)

        w.say(">>> a remediation loop: nvidia_uvm fails to load at every boot (a node-wide problem); the "
              "remediator reboots, and it comes back")
        for attempt in range(1, 4):
            node.inject(Fault("module_unloaded", params={"module": "nvidia_uvm"}))
            ok &= w.until(has("GpuNodeNeedsRemediation", "True"), args.timeout)
            w.say(f">>> remediator: reboot {attempt} (GpuNodeNeedsRemediation=True)")
            node.inject(Fault("reboot"))
            ok &= w.until(has("GpuNodeNeedsRemediation", "False"), args.timeout)
        node.inject(Fault("module_unloaded", params={"module": "nvidia_uvm"}))
        ok &= w.until(lambda: has("GpuRemediationLoop", "True")() and has("GpuDriverUnhealthy", "True")(),
                      args.timeout)
        ok &= has("GpuNodeNeedsRemediation", "False")()
        w.say("    GpuRemediationLoop=True and GpuNodeNeedsRemediation=False: remediators stop, a person looks")
        w.say("kubelet's own conditions, never touched by gpu-npd: " + ", ".join(
            f"{t}={c['status']}" for t, c in sorted(local.conditions().items())
            if not c.get("message", "").startswith(MARKER)))
        stats = emulator.stats()
        w.say(f"API requests: {stats['total']} in all")
    finally:
        local.stop()
        emulator.stop()
    w.say("demo finished" + ("" if ok else " (an expected change did not happen in time)"))
    return 0 if ok else 1


def _taint_text(rule: dict) -> str:
    spec = rule.get("spec", {})
    taint, selector = spec.get("taint", {}), spec.get("deviceSelector", {})
    return (f"{taint.get('key')}={taint.get('value')}:{taint.get('effect')} on {selector.get('driver')} "
            f"{selector.get('pool')}/{selector.get('device')}")
