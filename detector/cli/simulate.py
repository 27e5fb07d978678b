"""`gpu-npd simulate`: one process acting as the gpu-npd agent of a whole fleet of fake GPU nodes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

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
    from detector.rules.sources import BUILTIN_RULES, describe_rules, load_ruleset, rule_sources
    from detector.cli.signals import on_stop_signals
    from detector.core.check import CheckRegistry
    from detector.daemon.endpoints import Endpoints
    from detector.kube.api import ApiError, ConfigError, KubeApi
    from detector.kube.health import ApiHealth
    from detector.sim.faultlog import FaultLog
    from detector.sim.fleet import Fleet, FleetSettings
    from detector.sim.fleetfile import load_fleet

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1 or args.qps <= 0 or args.burst < 1:
        raise UsageError("--workers, --qps and --burst must be positive")
    spec = load_fleet(args.fleet)
    registry = CheckRegistry.from_entry_points()
    ruleset = load_ruleset(args.rules, registry)
    replaced = all(s["source"] != BUILTIN_RULES for s in rule_sources(ruleset))   # a warning: said aloud
    logging.getLogger("gpu_npd").log(logging.WARNING if replaced else logging.INFO, describe_rules(ruleset))
    emulator = None
    if args.emulator:
        from kube_emulator import Emulator
        from kube_emulator.rbac import deploy_rbac

        emulator = Emulator(rbac_paths=(deploy_rbac("base"), deploy_rbac("kwok")))   # deploy/'s, as packaged
        emulator.start()
        kubeconfig = emulator.write_kubeconfig(Path(_tmpdir()) / "simulator.kubeconfig", user=SIMULATOR_USER)
        print(f"emulator at {emulator.url}", file=sys.stderr)
    else:
        kubeconfig = args.kubeconfig
    metrics = FleetMetrics()
    try:
        api = KubeApi.from_kubeconfig(str(kubeconfig) if kubeconfig else None, qps=args.qps, burst=args.burst,
                                      pool_size=args.workers)
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
    print(f"gpu-npd simulate: /metrics, /healthz and /faults on http://{endpoints.address}", file=sys.stderr)
    try:
        try:
            fleet.start(progress=lambda message: print(f"gpu-npd simulate: {message}", file=sys.stderr, flush=True))
        except ApiError as e:             # registering or adopting nodes: nothing to simulate without them
            raise UsageError(f"cannot register the fleet's nodes: {e.explain(SIMULATOR_RBAC)}") from None
        # From here on the API server's troubles are said once for the whole fleet, and never stop it.
        api.health = ApiHealth(logging.getLogger("gpu_npd.sim"), rbac_hint=SIMULATOR_RBAC)
        stop.wait(args.duration)
    finally:
        fleet.stop()
        endpoints.stop()
        if emulator is not None:
            emulator.stop()
    print(f"gpu-npd simulate: stopped; {len(fault_log.records())} faults injected", file=sys.stderr)
    return 0


def _shard(value: str) -> tuple[int, int]:
    """`K/N` -> (K, N), with 0 <= K < N."""
    k, slash, n = value.partition("/")
    if not (slash and k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N (shard K of N, such as 2/4), got {value!r}")
    return int(k), int(n)


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="gpu-npd-sim-")


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
        self.api = Counter("gpu_npd_sim_api_requests", "Kubernetes API requests by verb, resource and code",
                           ["verb", "resource", "code"], registry=r)

    def watch(self, fleet: Any) -> None:
        self.nodes.set_function(lambda: len(fleet.nodes))
        self.faults.set_function(lambda: len(fleet.fault_log.records()))
        self.runs.set_function(lambda: fleet.scheduler.runs)

    def api_request(self, verb: str, resource: str, code: str) -> None:
        self.api.labels(verb, resource, code).inc()
