"""`gpu-npd simulate`: one process acting as the gpu-npd agent of a whole fleet of fake GPU nodes."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as MetricCounter

if TYPE_CHECKING:                 # every command builds this parser: `gpu-npd run` must not load the simulator
    from detector.sim.tally import TallySnapshot


DEFAULT_LISTEN = "127.0.0.1:9809"
SIMULATOR_USER = "system:serviceaccount:gpu-npd:gpu-npd-simulator"
SIMULATOR_RBAC = ("deploy/kwok/rbac.yaml does (get, list, watch, create and patch nodes, patch nodes/status, "
                  "create and patch events)")


def add_simulate_parser(sub: Any) -> None:
    s = sub.add_parser(
        "simulate", help="act as gpu-npd for a fleet of fake GPU nodes (KWOK or the emulator)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs the daemon's checks, rules and reporters for every node of a fleet file, each node\n"
                    "with its own fake GPUs and fault timeline, against a real API server (KWOK nodes) or the\n"
                    "bundled emulator. Injected faults are logged with their time; more can be injected while\n"
                    "it runs:  curl -X POST http://LISTEN/faults -d '{\"node\": \"gpu-0017\", \"kind\": \"xid\",\n"
                    "\"gpu\": 3, \"params\": {\"code\": 79}}'.  GET /faults lists every fault injected so far.\n"
                    "Or, the KWOK way, annotate the node (it watches its nodes) and remove the annotation to heal:\n"
                    "  kubectl annotate node gpu-0017 gpu-npd.io/inject-fault='{\"kind\": \"xid\", \"gpu\": 3, "
                    "\"params\": {\"code\": 79}}'\n"
                    "  kubectl annotate node gpu-0017 gpu-npd.io/inject-fault-\n"
                    "What was applied is in the node's gpu-npd.io/fault-status annotation; a bad value gets an Event.",
        epilog="examples:\n"
               "  gpu-npd simulate --fleet fleet.yaml --emulator --duration 120    # all in one process\n"
               "  gpu-npd simulate --fleet fleet.yaml --emulator --kubeconfig-out kc.yaml --duration 300\n"
               "  kubectl --kubeconfig kc.yaml get nodes                          # ... and watch it, meanwhile\n"
               "  gpu-npd fleet --kubeconfig kc.yaml                              # the fleet view of it\n"
               "  gpu-npd simulate --fleet fleet.yaml --kubeconfig ~/.kube/config # creates KWOK nodes\n"
               "  gpu-npd simulate --fleet fleet.yaml --adopt type=kwok           # existing KWOK nodes\n"
               "  gpu-npd simulate --fleet fleet.yaml --kubeconfig KC --shard 1/4 # one of 4 simulators\n"
               "  kubectl apply -k deploy/kwok                                    # in a cluster with KWOK")
    s.add_argument("--fleet", type=Path, required=True, metavar="FILE", help="the fleet file (YAML; see docs/simulation.md)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                       help="kubeconfig [KUBECONFIG] (default: the pod's in-cluster service account)")
    where.add_argument("--emulator", action="store_true",
                       help="start the bundled Kubernetes API emulator in this process and use it")
    s.add_argument("--kubeconfig-out", type=Path, metavar="FILE",
                   help="with --emulator: write a kubeconfig for it here (an admin, the current context), so "
                        "kubectl --kubeconfig FILE get nodes and gpu-npd fleet --kubeconfig FILE watch the drill; "
                        "valid while this runs")
    s.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                   help="play only shard K (0 to N-1) of N: a contiguous block of the fleet file's nodes, so N "
                        "simulators (the StatefulSet in deploy/kwok: K is the pod's ordinal) share one fleet "
                        "without overlap (default 0/1: every node)")
    s.add_argument("--adopt", metavar="SELECTOR",
                   help="take existing nodes matching this label selector (sorted by name) instead of creating them")
    s.add_argument("--rules", action="append", metavar="PATH",
                   help="rule file or directory, repeatable; '+PATH' adds to the bundled rules, a plain PATH "
                        "replaces them; 'builtin' names them (default: builtin). Logged at start")
    s.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"/metrics, /healthz and /faults (default {DEFAULT_LISTEN})")
    s.add_argument("--fault-log", type=Path, metavar="FILE", help="append every injected fault here (JSON lines)")
    s.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (default: run until SIGTERM)")
    s.add_argument("--progress-every", type=float, default=60.0, metavar="S",
                   help="a progress line on stderr every S seconds: nodes reporting, faults injected, conditions "
                        "True, nodes asking for remediation (default 60; 0: none). A summary ends every run")
    s.add_argument("--workers", type=int, default=8, help="scheduler threads shared by every node (default 8)")
    s.add_argument("--qps", type=float, default=100.0, help="API requests per second, whole fleet (default 100)")
    s.add_argument("--burst", type=int, default=200, help="API burst, whole fleet (default 200)")
    s.add_argument("--start-spread", type=float, default=60.0, metavar="S",
                   help="start the nodes over S seconds (default 60)")
    s.add_argument("--verify-sweeps", type=int, default=3, metavar="N",
                   help="as gpu-npd run's: a cure is trusted once every check passed N rounds since (default 3; "
                        "a drill heals that much later; 0 or 1 for quick drills)")
    s.add_argument("--heartbeat", type=float, default=300.0, metavar="S",
                   help="each node's condition heartbeat, +-10%% jitter (default 300)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from detector.config import UsageError
    from detector.core.check import CheckRegistry
    from detector.rules.sources import BUILTIN_RULES, describe_rules, load_ruleset, rule_sources
    from detector.sim.fleetfile import load_fleet

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1 or args.qps <= 0 or args.burst < 1:
        raise UsageError("--workers, --qps and --burst must be positive")
    if args.kubeconfig_out is not None and not args.emulator:
        raise UsageError("--kubeconfig-out needs --emulator: it writes a kubeconfig for the emulator this process "
                         "starts (with --kubeconfig, kubectl reads that cluster's own)")
    if args.progress_every < 0:
        raise UsageError(f"--progress-every {args.progress_every:g}: expected 0 (none) or more seconds")
    spec = load_fleet(args.fleet)
    registry = CheckRegistry.from_entry_points()
    ruleset = load_ruleset(args.rules, registry)
    replaced = all(s["source"] != BUILTIN_RULES for s in rule_sources(ruleset))   # a warning: said aloud
    logging.getLogger("gpu_npd").log(logging.WARNING if replaced else logging.INFO, describe_rules(ruleset))
    with tempfile.TemporaryDirectory(prefix="gpu-npd-sim-") as private:
        with _api_server(args, Path(private)) as kubeconfig:
            return _simulate(args, spec, registry, ruleset, kubeconfig)


@contextlib.contextmanager
def _api_server(args: argparse.Namespace, private: Path) -> Iterator[str | None]:
    """The kubeconfig the fleet uses: the cluster's (--kubeconfig), or the emulator's, started here for as long
    as the run lasts; with --kubeconfig-out, an admin's kubeconfig for the emulator too, for kubectl."""
    from detector.config import UsageError

    if not args.emulator:
        yield args.kubeconfig
        return
    from kube_emulator import Emulator
    from kube_emulator.rbac import ADMIN, deploy_rbac

    # deploy/'s RBAC, as packaged. HTTPS for kubectl's sake: it sends no bearer token over plain HTTP.
    emulator = Emulator(rbac_paths=(deploy_rbac("base"), deploy_rbac("kwok")), https=args.kubeconfig_out is not None)
    try:
        emulator.start()
    except RuntimeError as e:             # HTTPS without the trustme package
        raise UsageError(f"--kubeconfig-out: {e}") from None
    try:
        kubeconfig = emulator.write_kubeconfig(private / "simulator.kubeconfig", user=SIMULATOR_USER)
        say(f"emulator at {emulator.url}")
        if args.kubeconfig_out is not None:
            try:
                emulator.write_kubeconfig(args.kubeconfig_out, user=ADMIN)
            except OSError as e:
                raise UsageError(f"--kubeconfig-out {args.kubeconfig_out}: {e.strerror or e}") from None
            say(f"kubeconfig for kubectl (admin, while this runs): {args.kubeconfig_out}; kubectl --kubeconfig "
                f"{args.kubeconfig_out} get nodes")
        yield str(kubeconfig)
    finally:
        emulator.stop()


def _simulate(args: argparse.Namespace, spec: Any, registry: Any, ruleset: Any, kubeconfig: str | None) -> int:
    from detector.config import UsageError
    from detector.cli.signals import on_stop_signals
    from detector.daemon.endpoints import Endpoints
    from detector.kube.api import ApiError, ConfigError, KubeApi
    from detector.kube.health import ApiHealth
    from detector.sim.faultlog import FaultLog
    from detector.sim.fleet import Fleet, FleetSettings

    metrics = FleetMetrics()
    try:
        api = KubeApi.from_kubeconfig(kubeconfig, qps=args.qps, burst=args.burst, pool_size=args.workers)
    except (ConfigError, OSError, ValueError) as e:
        raise UsageError(f"cannot configure the Kubernetes client: {e}") from None
    api.counts.listener = metrics.api_request
    settings = FleetSettings(workers=args.workers, start_spread_s=args.start_spread,
                             create_nodes=args.adopt is None, adopt_selector=args.adopt or "",
                             shard=args.shard[0], shards=args.shard[1])
    settings.reporter.heartbeat_s = args.heartbeat
    if args.verify_sweeps < 0:
        raise UsageError(f"--verify-sweeps {args.verify_sweeps}: expected 0 (trust a cure at once) or more rounds")
    settings.agent.verify_sweeps = args.verify_sweeps
    fault_log = FaultLog(args.fault_log)
    fleet = Fleet(spec, api, ruleset, registry, settings, fault_log)
    metrics.watch(fleet)
    endpoints = Endpoints(args.listen, metrics.registry, lambda: (True, "ok"),
                          routes={("GET", "/faults"): lambda body: _json(200, fault_log.records()),
                                  ("POST", "/faults"): lambda body: _inject(fleet, body)})
    stop = threading.Event()
    on_stop_signals(lambda signum: stop.set())              # a second one exits at once
    endpoints.start()
    say(f"/metrics, /healthz and /faults on http://{endpoints.address}")      # the address ends the line
    if args.fault_log:
        say(f"every injected fault is logged in {args.fault_log}")
    began = time.monotonic()
    try:
        try:
            fleet.start(progress=say)
        except ApiError as e:             # registering or adopting nodes: nothing to simulate without them
            raise UsageError(f"cannot register the fleet's nodes: {e.explain(SIMULATOR_RBAC)}") from None
        began = time.monotonic()          # the timeline's zero: registering thousands of nodes takes a while
        # From here on the API server's troubles are said once for the whole fleet, and never stop it.
        api.health = ApiHealth(logging.getLogger("gpu_npd.sim"), rbac_hint=SIMULATOR_RBAC)
        say(timeline_line(fleet.planned, args.duration))
        _wait(stop, args.duration, args.progress_every,
              lambda: say(progress_line(time.monotonic() - began, len(fleet.nodes), fault_log.records(),
                                        fleet.tally.snapshot())))
    finally:
        fleet.stop()
        endpoints.stop()
    print(summary(time.monotonic() - began, len(fleet.nodes), fault_log.records(), fleet.tally.snapshot()),
          file=sys.stderr, flush=True)
    return 0


def say(message: str) -> None:
    print(f"gpu-npd simulate: {message}", file=sys.stderr, flush=True)


def _wait(stop: threading.Event, duration: float | None, every: float, progress: Callable[[], None]) -> None:
    """Until `stop` or `duration` seconds, calling `progress` every `every` seconds (0: never) in between."""
    deadline = None if duration is None else time.monotonic() + duration
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        step = left if not every else every if left is None else min(every, left)
        if stop.wait(step):
            return
        if every and (left is None or left > every):
            progress()


# -- what a person reads: the timeline, progress, the summary -----------------------------------------

def _span(seconds: float) -> str:
    """90 -> 1m30s; 3725 -> 1h02m05s; 12 -> 12s."""
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _by_kind(records: list[dict[str, Any]], key: str = "kind") -> Counter[str]:
    return Counter(str(r.get(key)) for r in records)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def timeline_line(planned: list[Any], duration: float | None) -> str:
    """How the fleet file's timeline fits the run: a fault after --duration never happens, and one in its last
    fifth (or minute) leaves the fleet too little time to show it."""
    if not planned:
        return "the fleet file plans no faults: inject them with POST /faults or the node annotation"
    if duration is None:
        return f"{_n(len(planned), 'fault')} planned, the first at {_span(planned[0].at_s)}"
    within = [p for p in planned if p.at_s <= duration]
    text = f"{len(within)} of the {_n(len(planned), 'planned fault')} fall within --duration {_span(duration)}"
    if within:
        first, last = _span(within[0].at_s), _span(within[-1].at_s)
        text += f", at {first}" + (f" to {last}" if last != first else "")
    margin = min(60.0, duration / 5)
    late = [p for p in within if duration - p.at_s < margin]
    if late:
        text += f"; {len(late)} of them in its last {_span(margin)}, too late for the fleet to show much"
    return text


def progress_line(elapsed: float, nodes: int, records: list[dict[str, Any]], tally: TallySnapshot) -> str:
    from detector.sim.tally import counted
    faults = _n(len(records), "fault") + " injected" + (f" ({counted(_by_kind(records))})" if records else "")
    return (f"{_span(elapsed)}: {tally.nodes_reporting} of {nodes} nodes reporting; {faults}; conditions True: "
            f"{counted(tally.true_now)}; {_n(len(tally.asking_now), 'node')} asking for remediation")


def summary(elapsed: float, nodes: int, records: list[dict[str, Any]], tally: TallySnapshot) -> str:
    """The run in a few lines: what was done to the fleet, and what it showed."""
    from detector.sim.tally import counted
    asking = tally.asking_now
    named = ", ".join(asking[:10]) + (f", {len(asking) - 10} more" if len(asking) > 10 else "")
    rows = [
        ("nodes", f"{nodes}, {tally.nodes_reporting} of them reporting"),
        ("faults injected", f"{len(records)}" + (f": {counted(_by_kind(records), 20)} (by source: "
                                                 f"{counted(_by_kind(records, 'source'))})" if records else "")),
        ("conditions turned True", counted(tally.turned_true, 20)),
        ("True at the end", counted(tally.true_now, 20)),
        ("asking for remediation", f"{_n(len(asking), 'node')} at the end" + (f" ({named})" if asking else "")
         + f"; {tally.ever_asked} asked during the run"),
    ]
    return "\n".join([f"gpu-npd simulate: stopped after {_span(elapsed)}; what the fleet showed:",
                      *(f"  {label + ':':<24} {value}" for label, value in rows)])


def _shard(value: str) -> tuple[int, int]:
    """`K/N` -> (K, N), with 0 <= K < N."""
    k, slash, n = value.partition("/")
    if not (slash and k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N (shard K of N, such as 2/4), got {value!r}")
    return int(k), int(n)


def _json(code: int, obj: Any) -> tuple[int, bytes, str]:
    return code, (json.dumps(obj, indent=1) + "\n").encode(), "application/json"


def _inject(fleet: Any, body: bytes) -> tuple[int, bytes, str]:
    """POST /faults {"node", "kind", "gpu"?, "params"?}: a fault now, logged with source "command"."""
    from fake_nvml.faults import Fault

    try:
        request = json.loads(body or b"{}")
        if not isinstance(request, dict) or not isinstance(request.get("node"), str):
            raise ValueError('expected a JSON object with "node", "kind" and optionally "gpu" and "params"')
        fault = Fault(request.get("kind", ""), request.get("gpu"), dict(request.get("params") or {}))
        record = fleet.inject(request["node"], fault, "command")
    except (ValueError, TypeError) as e:
        return _json(400, {"error": str(e)})
    except KeyError as e:
        return _json(404, {"error": e.args[0]})
    return _json(200, record)


class FleetMetrics:
    """The simulator's own figures (each node's conditions are on the API server, not here)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.nodes = Gauge("gpu_npd_sim_nodes", "Simulated nodes", registry=r)
        self.faults = Gauge("gpu_npd_sim_faults_injected", "Faults injected so far", registry=r)
        self.runs = Gauge("gpu_npd_sim_task_runs", "Scheduler task runs so far (checks and reports)", registry=r)
        self.api = MetricCounter("gpu_npd_sim_api_requests", "Kubernetes API requests by verb, resource and code",
                           ["verb", "resource", "code"], registry=r)

    def watch(self, fleet: Any) -> None:
        self.nodes.set_function(lambda: len(fleet.nodes))
        self.faults.set_function(lambda: len(fleet.fault_log.records()))
        self.runs.set_function(lambda: fleet.scheduler.runs)

    def api_request(self, verb: str, resource: str, code: str) -> None:
        self.api.labels(verb, resource, code).inc()
