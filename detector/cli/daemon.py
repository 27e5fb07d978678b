"""`gpu-npd run` (the DaemonSet's process), `gpu-npd clear` and `gpu-npd emulator`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from detector.cli.history import add_history_parser
from detector.agent.agent import (CLEAR_RESULT_FILE, CLEAR_RESULT_LIMIT, PROBLEMS_FILE, PROBLEMS_LIMIT, AgentSettings,
                                  read_json, write_clear_request)
from detector.agent.gpu_reset import ResetSettings
from detector.cli.signals import on_stop_signals
from detector.core.nodestatus import MAINTENANCE_ANNOTATION
from detector.daemon.logs import setup_logging
from detector.daemon.run import Daemon, DaemonSettings
from detector.kube.device_taints import DeviceTaintSettings
from detector.kube.events import EventSettings
from detector.kube.nodewatch import NodeWatchSettings
from detector.kube.reporter import ReporterSettings

DEFAULT_LISTEN = "0.0.0.0:9808"
ROOT_STATE_DIR = Path("/var/lib/gpu-npd")     # root's; the DaemonSet passes it as --state-dir (deploy/, the chart)
STATE_DIR_ENV = "GPU_NPD_STATE_DIR"


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def default_state_dir(environ: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """The one default state directory: where `run` keeps its state when not told, and where `history`,
    `clear` (and `bundle`) look. $GPU_NPD_STATE_DIR when set; else /var/lib/gpu-npd for root (as in the
    DaemonSet's pod); else the user's own, $XDG_STATE_HOME/gpu-npd or ~/.local/state/gpu-npd, so a local run
    needs no root and its history is found without a flag."""
    env = os.environ if environ is None else environ
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV])
    if (os.geteuid() if euid is None else euid) == 0:
        return ROOT_STATE_DIR
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):                      # the XDG spec: a relative value is to be ignored
        return Path(xdg) / "gpu-npd"
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".local" / "state" / "gpu-npd" if os.path.isabs(home) else ROOT_STATE_DIR


def node_state_dir(nvml: str, given: Path | None, default: Path | None = None) -> Path | None:
    """The state directory of the node `--nvml` names: `given` (--state-dir, $GPU_NPD_STATE_DIR) when there
    is one; else this machine's own (default_state_dir) for its real GPUs; else none. A fake or replayed
    node keeps nothing by default: its fault drills would enter this machine's held problems and GPU
    history (a fake node boots with the same boot id every time, so a held XID would outlive the drill)."""
    if given is not None:
        return given
    if nvml == "real":
        return default if default is not None else default_state_dir()
    return None


def add_daemon_parsers(sub: Any) -> None:
    state_dir = default_state_dir()
    r = sub.add_parser(
        "run", help="run as the node's daemon: checks on their intervals, conditions and events to Kubernetes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The DaemonSet's process. Runs every check on its interval (the xid check at once when the\n"
                    "kernel log has new lines), applies the rules, and keeps the node's gpu-npd conditions and\n"
                    "events current. Checks never wait for the API server: while it is down or refuses, problems\n"
                    "still show in /metrics and the log, and reports catch up when it is back. Serves /metrics,\n"
                    "/healthz (liveness: the daemon's own loops) and /readyz (reports reach the API server).\n"
                    "Stops within seconds on SIGTERM or SIGINT, even while NVML hangs; a second one exits at once.\n"
                    "Settings come from flags, or the environment variables named in brackets.",
        epilog="examples:\n"
               "  gpu-npd run                                       # in a pod: in-cluster config, $NODE_NAME\n"
               "  gpu-npd run --kubeconfig ~/.kube/config --node-name gpu-17\n"
               "  gpu-npd run --nvml fake:h100-sxm-8 --kubeconfig emulator.kubeconfig --node-name demo\n"
               "  gpu-npd run --nvml fake:h100-sxm-8 --no-kube      # metrics and logs only")
    r.add_argument("--node-name", default=_env("NODE_NAME"), help="this node's Kubernetes name [NODE_NAME]; required, with --no-kube "
                                                             "too (it names the node in logs and messages)")
    r.add_argument("--kubeconfig", default=_env("KUBECONFIG"),
                   help="kubeconfig file [KUBECONFIG] (default: the pod's in-cluster service account)")
    r.add_argument("--no-kube", action="store_true", help="report to metrics and logs only (still needs --node-name)")
    r.add_argument("--nvml", default=_env("GPU_NPD_NVML", "real"), metavar="BACKEND",
                   help="real, fake:SCENARIO or fake:PATH.yaml [GPU_NPD_NVML] (default: real)")
    r.add_argument("--rules", action="append", metavar="PATH",
                   help="rule file or directory, repeatable; '+PATH' adds to the bundled rules, a plain PATH "
                        "replaces them; 'builtin' names them (default: builtin). Logged at start")
    r.add_argument("--checks", metavar="A,B", help="checks to run (default: every enabled one; the nccl probe "
                                                   "is opt-in: name it here or set checks.nccl.enabled)")
    r.add_argument("--config", type=Path, metavar="FILE", help="YAML settings: checks.<name>.interval|timeout|...")
    r.add_argument("--listen", default=_env("GPU_NPD_LISTEN", DEFAULT_LISTEN), metavar="HOST:PORT",
                   help=f"/metrics, /healthz and /readyz [GPU_NPD_LISTEN] (default: {DEFAULT_LISTEN}: in a pod, the "
                        "pod IP and loopback; on a host, every interface: name one there)")
    r.add_argument("--state-dir", type=Path, default=_env(STATE_DIR_ENV), metavar="DIR",
                   help="keeps the kernel-log cursor, held problems, the GPUs' history and evidence bundles "
                        f"across restarts [{STATE_DIR_ENV}] (default: {state_dir} for --nvml real, where gpu-npd "
                        "history and clear look: /var/lib/gpu-npd as root, else $XDG_STATE_HOME/gpu-npd or "
                        "~/.local/state/gpu-npd; none for a fake or replayed node)")
    r.add_argument("--sysfs-root", type=Path, metavar="DIR", help="sysfs at DIR (default /sys; /host/sys in a pod); the driver check reads proc, dev and run beside it")
    r.add_argument("--nvidia-smi", metavar="PATH", help="nvidia-smi to run (default: nvidia-smi on PATH)")
    r.add_argument("--inventory-timeout", type=float, default=10.0, metavar="S", help="NVML call timeout (default 10)")
    r.add_argument("--heartbeat", type=float, default=300.0, metavar="S",
                   help="refresh the conditions' lastHeartbeatTime this often, plus up to 10%% jitter, never sooner (default 300)")
    r.add_argument("--qps", type=float, default=5.0, help="client-side API requests per second (default 5)")
    r.add_argument("--burst", type=int, default=10, help="client-side API burst (default 10)")
    r.add_argument("--event-burst", type=int, default=25, help="events per node before rate limiting (default 25)")
    r.add_argument("--event-refill", type=float, default=300.0, metavar="S",
                   help="one more event allowed every S seconds after the burst (default 300)")
    r.add_argument("--start-spread", type=float, default=10.0, metavar="S",
                   help="spread the checks' first runs over S seconds (default 10)")
    r.add_argument("--no-node-watch", action="store_true",
                   help="do not watch this node: checks that read the node object (the allocatable check, "
                        "maintenance) judge without it. For sites that cannot grant list and watch on nodes; "
                        "by default one watch on this node (field selector on its name) and, when the "
                        "allocatable check or --dra-taints needs them, on its ResourceSlices")
    r.add_argument("--verify-sweeps", type=int, default=3, metavar="N",
                   help="a cure (a reboot, a GPU back) is trusted only after every check passed N rounds since: "
                        "until then a failed GPU stays fenced and the node's remediation ask stays (default 3; "
                        "0 trusts it at once)")
    r.add_argument("--maintenance-annotation", default=MAINTENANCE_ANNOTATION, metavar="KEY",
                   help="a node annotation your maintenance tooling sets (any value but 'false'): while it is there, "
                        "or KEP-5683's MaintenanceInProgress or DrainInProgress is True, no remediation is asked "
                        f"(default {MAINTENANCE_ANNOTATION}; '' for the conditions alone)")
    r.add_argument("--dra-taints", action="store_true",
                   default=_env("GPU_NPD_DRA_TAINTS", "").lower() in ("1", "true", "yes"),
                   help="taint failed and degraded GPUs through DRA: a DeviceTaintRule (resource.k8s.io, KEP-5055) "
                        "per unhealthy GPU of the NVIDIA DRA driver's ResourceSlices, deleted when it recovers; "
                        "needs the RBAC of deploy/overlays/dra-taints [GPU_NPD_DRA_TAINTS] (default: off)")
    r.add_argument("--dra-taint-degraded-effect", choices=("NoSchedule", "NoExecute", "None"), default="NoSchedule",
                   help="the taint effect for a degraded GPU; None: no taint (default: NoSchedule)")
    r.add_argument("--dra-taint-failed-effect", choices=("NoSchedule", "NoExecute", "None"), default="NoExecute",
                   help="the taint effect for a failed GPU; None: no taint (default: NoExecute)")
    r.add_argument("--bundles-keep", type=int, default=5, metavar="N",
                   help="evidence bundles kept under --state-dir/bundles when a GPU fails or the node first asks "
                        "for remediation (one per incident; the oldest removed first; 0: none) (default: 5)")
    r.add_argument("--bundles-max-size", type=float, default=256, metavar="MIB",
                   help="all evidence bundles together at most this many MiB (default: 256)")
    r.add_argument("--bundle-max-size", type=float, default=64, metavar="MIB",
                   help="one evidence bundle at most this many MiB (default: 64)")
    r.add_argument("--bundle-no-redact", action="store_true",
                   help="keep addresses, host names and user names in evidence bundles (default: redacted)")
    r.add_argument("--reset-gpus", action="store_true",
                   default=_env("GPU_NPD_RESET_GPUS", "").lower() in ("1", "true", "yes"),
                   help="reset a failed GPU whose action is RESET_GPU (nvidia-smi -r) instead of leaving it fenced "
                        "until a reboot, once its DRA taint is written (needs --dra-taints) and no process uses it; "
                        "one GPU at a time, at most one per --reset-interval per node and --reset-per-day per GPU; "
                        "a reset that fails or does not cure asks for the node's remediation (docs/remediation.md) "
                        "[GPU_NPD_RESET_GPUS] (default: off)")
    r.add_argument("--reset-interval", type=float, default=600.0, metavar="S",
                   help="at most one GPU reset per node this often (default 600)")
    r.add_argument("--reset-per-day", type=int, default=2, metavar="N",
                   help="at most N resets of one GPU within 24 h; past that it is escalated (default 2)")
    r.add_argument("--log-format", choices=("text", "json"), default=_env("GPU_NPD_LOG_FORMAT", "text"),
                   help="[GPU_NPD_LOG_FORMAT] (default: text)")
    r.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    r.set_defaults(func=cmd_run)

    c = sub.add_parser(
        "clear", help="release held conditions (XID conditions hold until a reboot or this)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Ask the running daemon on this node to release held conditions, for example after a GPU\n"
                    "reset. Run it in the daemon's pod: kubectl exec -n gpu-npd POD -- gpu-npd clear GpuXidError",
        epilog="examples:\n"
               "  gpu-npd clear --list                 # what is held, since when and until what; clears nothing\n"
               "  gpu-npd clear GpuXidError            # release the XID condition after a GPU reset\n"
               "  gpu-npd clear --wait 0               # release everything held; do not wait for the answer")
    c.add_argument("types", nargs="*", metavar="TYPE", help="condition types to clear (default: all held)")
    c.add_argument("--list", action="store_true", help="show what is held (since when, why, until what) and "
                                                       "what is live, and clear nothing")
    c.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="wait this long for the daemon to say what it cleared (default 15; 0: do not wait)")
    c.add_argument("--state-dir", type=Path, default=state_dir, metavar="DIR",
                   help=f"the daemon's --state-dir [{STATE_DIR_ENV}] (default: {state_dir})")
    c.set_defaults(func=cmd_clear)

    add_history_parser(sub, state_dir)

    # Listed here for `gpu-npd --help`; main() hands `gpu-npd emulator ...` to the emulator's own parser.
    sub.add_parser("emulator", help="run the bundled Kubernetes API emulator (tests and demos); see "
                                    "gpu-npd emulator --help")


def _keeper_settings(args: argparse.Namespace) -> Any:
    from detector.agent.bundles import KeeperSettings
    from detector.config import UsageError

    if args.bundles_keep < 0:
        raise UsageError(f"--bundles-keep {args.bundles_keep}: expected 0 (keep none) or more")
    for flag, value in (("--bundles-max-size", args.bundles_max_size), ("--bundle-max-size", args.bundle_max_size)):
        if not 0 < value <= 1 << 20:
            raise UsageError(f"{flag} {value:g}: expected more than 0 MiB")
    if args.bundles_keep == 0:
        return None
    return KeeperSettings(keep=args.bundles_keep, max_total_bytes=int(args.bundles_max_size * (1 << 20)),
                          max_bundle_bytes=int(min(args.bundle_max_size, args.bundles_max_size) * (1 << 20)),
                          redact=not args.bundle_no_redact)


def cmd_run(args: argparse.Namespace) -> int:
    from detector.cli.hosts import open_host
    from detector.cli.render import Diagnosis
    from detector.config import UsageError, load_selected_checks
    from detector.rules.sources import BUILTIN_RULES, describe_rules, load_ruleset, rule_sources
    from detector.core.check import CheckRegistry
    from detector.kube.api import ConfigError, KubeApi

    if not args.node_name:
        raise UsageError("no node name: set NODE_NAME (the DaemonSet sets it from spec.nodeName) or --node-name")
    if args.reset_gpus and not args.dra_taints:
        raise UsageError("--reset-gpus needs --dra-taints: a GPU is reset only once its DRA device taint fences "
                         "it (no new work lands on it); nothing else fences one GPU")
    if args.reset_gpus and args.no_kube:
        raise UsageError("--reset-gpus needs the API server (its DRA device taint fences the GPU): not with --no-kube")
    if args.reset_interval < 0 or args.reset_per_day < 1:
        raise UsageError(f"--reset-interval {args.reset_interval:g} / --reset-per-day {args.reset_per_day}: "
                         "expected 0 or more seconds and at least 1 reset")
    if args.verify_sweeps < 0:
        raise UsageError(f"--verify-sweeps {args.verify_sweeps}: expected 0 (trust a cure at once) or more rounds")
    setup_logging(args.log_format, args.log_level, args.node_name)
    registry = CheckRegistry.from_entry_points()
    ruleset = load_ruleset(args.rules, registry)
    replaced = all(s["source"] != BUILTIN_RULES for s in rule_sources(ruleset))   # a warning: said aloud
    logging.getLogger("gpu_npd").log(logging.WARNING if replaced else logging.INFO, describe_rules(ruleset))
    checks = load_selected_checks(registry, args.checks, args.config)
    state_dir = _run_state_dir(args.nvml, args.state_dir)
    api = None
    if not args.no_kube:
        try:
            api = KubeApi.from_kubeconfig(args.kubeconfig, qps=args.qps, burst=args.burst)
        except (ConfigError, OSError, ValueError) as e:
            raise UsageError(f"cannot configure the Kubernetes client: {e}") from None
    host = open_host(args.nvml, node_name=args.node_name, sysfs_root=args.sysfs_root, nvidia_smi=args.nvidia_smi,
                     kernel_cursor=state_dir / "kmsg-cursor.json" if state_dir else None)
    settings = DaemonSettings(
        listen=args.listen,
        agent=AgentSettings(inventory_timeout_s=args.inventory_timeout, start_spread_s=args.start_spread,
                            state_dir=state_dir, verify_sweeps=args.verify_sweeps,
                            maintenance_annotation=args.maintenance_annotation),
        reporter=ReporterSettings(heartbeat_s=args.heartbeat,
                                  events=EventSettings(burst=args.event_burst, refill_per_s=1 / args.event_refill)),
        dra_taints=DeviceTaintSettings(
            degraded_effect=None if args.dra_taint_degraded_effect == "None" else args.dra_taint_degraded_effect,
            failed_effect=None if args.dra_taint_failed_effect == "None" else args.dra_taint_failed_effect)
        if args.dra_taints and not args.no_kube else None,
        node_watch=None if args.no_node_watch else NodeWatchSettings(),
        bundles=_keeper_settings(args),
        gpu_reset=ResetSettings(min_interval_s=args.reset_interval, per_gpu_per_day=args.reset_per_day)
        if args.reset_gpus else None,
    )
    try:
        daemon = Daemon(host, checks, ruleset, api, settings,
                        fresh_checks=lambda: load_selected_checks(registry, args.checks, args.config),
                        verdict=lambda sweep, problems: Diagnosis(args.nvml, sweep, problems,
                                                                  rule_sources(ruleset)).to_dict())
    except OSError as e:
        host.close()
        raise UsageError(f"--listen {args.listen}: {e.strerror or e}") from None
    on_stop_signals(lambda signum: daemon.stop.set())      # a second one exits at once
    return daemon.run()


def _run_state_dir(nvml: str, given: Path | None) -> Path | None:
    """node_state_dir, made: a --state-dir that cannot be made is a usage error; the default one costs only
    what is kept across restarts, and the log says why nothing is."""
    from detector.config import UsageError

    log = logging.getLogger("gpu_npd")
    state_dir = node_state_dir(nvml, given)
    if state_dir is None:
        log.info("no state kept across restarts: a %s node keeps none unless given --state-dir (its faults are "
                 "not this machine's history in %s)", nvml.partition(":")[0], default_state_dir())
        return None
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if given is not None:
            raise UsageError(f"--state-dir {state_dir}: {e.strerror or e}") from None
        log.warning("cannot keep state in %s (%s): nothing is kept across restarts; give --state-dir DIR",
                    state_dir, e.strerror or e)
        return None
    log.info("state kept in %s%s", state_dir, "" if given is not None else " (the default; gpu-npd history reads it)")
    return state_dir


def cmd_clear(args: argparse.Namespace) -> int:
    """Only problems held until a reboot or a clear are released: one that reflects what a check sees now
    (a GPU missing) ends when the fault does, and the command says so."""
    from detector.config import UsageError

    if not args.state_dir.is_dir():
        raise UsageError(f"--state-dir {args.state_dir}: no such directory (is the daemon running here?)")
    if args.list:
        return _list_held(args.state_dir, set(args.types) or None)
    path = write_clear_request(args.state_dir, args.types, time.time())
    what = ", ".join(args.types) if args.types else "all held conditions"
    print(f"asked the daemon to clear {what} ({path})")
    deadline = time.monotonic() + max(args.wait, 0.0)
    result_file = args.state_dir / CLEAR_RESULT_FILE
    while not result_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        result = read_json(result_file, CLEAR_RESULT_LIMIT, "the clear result")
    except FileNotFoundError:
        print("the daemon has not taken the request yet; it does at its next check run "
              "(see its log, or run gpu-npd clear --list)")
        return 0
    except (OSError, ValueError) as e:
        print(f"gpu-npd: cannot read {result_file}: {e}", file=sys.stderr)
        return 2
    cleared, live = _latches(result, "cleared"), _latches(result, "live")
    for latch in cleared:
        print(f"cleared {latch.get('type')}/{latch.get('reason')} (rule {latch.get('rule')}): {latch.get('message')}")
    for latch in live:
        print(f"left {latch.get('type')}/{latch.get('reason')} (rule {latch.get('rule')}): it reflects what the "
              f"{latch.get('check')} check sees now and clears by itself when the fault is gone")
    if not cleared and not live:
        print("nothing was held")
    return 0


def _latches(document: object, key: str) -> list[dict]:
    """The latch objects listed under `key` of a state file; anything of another shape is left out."""
    found = document.get(key) if isinstance(document, dict) else None
    return [l for l in found if isinstance(l, dict)] if isinstance(found, list) else []


def _list_held(state_dir: Path, types: set[str] | None) -> int:
    try:
        latches = _latches(read_json(state_dir / PROBLEMS_FILE, PROBLEMS_LIMIT, "the held problems"), "latches")
    except FileNotFoundError:
        latches = []
    except (OSError, ValueError) as e:
        print(f"gpu-npd: cannot read {state_dir / PROBLEMS_FILE}: {e}", file=sys.stderr)
        return 2
    shown = [l for l in latches if types is None or l.get("type") in types]
    if not shown:
        print("nothing is held")
    for l in shown:
        first = l.get("first")
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(first)) \
            if isinstance(first, (int, float)) and 0 <= first < 1e11 else "?"
        until = {"reboot": "held until a reboot or a clear", "manual": "held until a clear",
                 "observation": "live: ends when the fault does (clear leaves it)"}.get(str(l.get("recovery", "")), "")
        print(f"{l.get('type')}/{l.get('reason')}  since {since}  rule {l.get('rule')}  {until}\n    {l.get('message')}")
    return 0
