"""`gpu-npd`: diagnose a GPU node now, list checks and scenarios, validate rule files.

Exit codes: 0 healthy, 1 problems found, 2 bad usage, bad rules or config, an unusable backend or output that
cannot be written; 130 Ctrl-C; 141 the output's reader went away (signals.ended_well).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from detector import __version__
from detector.cli.hosts import BackendError, open_host
from detector.cli.signals import Parser, ended_well, on_stop_signals, restore
from detector.config import UsageError, load_selected_checks
from detector.core.check import CheckRegistry, RegistryError
from detector.core.clock import SimulatedClock
from detector.rules.loader import RuleErrors
from detector.rules.sources import describe_rules, load_ruleset, rule_sources
from detector.yamlsource import SourceError

if TYPE_CHECKING:
    from fake_nvml.fault_kind import FaultKind

EXIT_HEALTHY, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
MAX_DURATION_S = 86400.0


def main(argv: Sequence[str] | None = None) -> int:
    """Every command, the emulator's included, ends as a Unix tool does when its pipe or disk does (ended_well)."""
    return ended_well(lambda: _main(list(sys.argv[1:] if argv is None else argv)))


def _main(argv: list[str]) -> int:
    if argv[:1] == ["emulator"]:                 # its own parser and --help
        from kube_emulator.cli import main as emulator_main

        return emulator_main(argv[1:], prog="gpu-npd emulator", parser_class=Parser)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command: a usage error is one line and exit code 2; Ctrl-C ends it (ended_well says how)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = on_stop_signals() if in_main_thread else {}   # long-running commands install their own
    try:
        return args.func(args)
    except (UsageError, SourceError, BackendError, RegistryError, KeyError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"gpu-npd: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        restore(previous)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gpu-npd",
        description="GPU node problem detector: finds GPUs that fell off the bus, degraded PCIe links, "
                    "XIDs and more, and says what to do about them.",
        epilog="Try it without GPUs: gpu-npd diagnose --nvml fake:h100-sxm-8-pcie-x8",
    )
    parser.add_argument("--version", action="version", version=f"gpu-npd {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND")

    d = sub.add_parser(
        "diagnose", help="check this node once and print what is wrong",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every check once through the rules and print the GPUs and the problems found.\n"
                    "Exit code: 0 healthy, 1 problems found, 2 bad usage, bad rules or unusable backend.",
        epilog="examples:\n"
               "  gpu-npd diagnose                                   # this node, real NVML\n"
               "  gpu-npd diagnose --nvml fake:h100-sxm-8-xid79 -o json\n"
               "  gpu-npd diagnose --duration 300                    # preflight: watch 5 min, judge rates\n"
               "  gpu-npd diagnose --nvml fake:h100-sxm-8-nvlink-replay --duration 120   # simulated: instant\n"
               "  gpu-npd diagnose --rules +my-rules.yaml             # the bundled rules plus mine\n"
               "  gpu-npd diagnose --checks xid --kernel-log /var/log/kern.log   # post-mortem\n"
               "  journalctl -k -b -1 | gpu-npd diagnose --checks xid --kernel-log -\n"
               "  gpu-npd diagnose --checks nccl                     # all-reduce probe (needs idle GPUs)\n"
               "  gpu-npd diagnose --checks nccl --nccl-tests /opt/nccl-tests/build/all_reduce_perf\n"
               "  gpu-npd diagnose --nvml fake:h100-sxm-8-nvlink-down --checks nccl\n"
               "  gpu-npd diagnose --nvml replay:/tmp/gpu-case-1234  # judge a bundle (gpu-npd bundle) again\n"
               "  gpu-npd scenarios                                  # fake nodes to try")
    d.add_argument("--nvml", default=os.environ.get("GPU_NPD_NVML", "real"), metavar="BACKEND",
                   help="real, fake:SCENARIO, fake:PATH.yaml, or replay:PATH (a saved nvidia-smi -q / -q -x output, "
                        "or a folder holding one, such as a 'gpu-npd bundle': its kernel.log and nvml.json are read "
                        "too; judged as one snapshot) (default: $GPU_NPD_NVML or real)")
    d.add_argument("--rules", action="append", metavar="PATH",
                   help="rule file or directory, repeatable. '+PATH' adds PATH to the bundled rules; a plain "
                        "PATH replaces them ('builtin' names them, so '--rules builtin --rules PATH' extends "
                        "too). Default: the bundled rules. Rule names must be unique across them all. The "
                        "active rule sets are printed at start")
    d.add_argument("--checks", metavar="A,B", help="comma-separated checks to run (default: every enabled "
                                                   "one, which leaves out the opt-in nccl probe; see "
                                                   "'gpu-npd checks')")
    d.add_argument("--config", type=Path, metavar="FILE", help="YAML settings: checks.<name>.<setting>")
    d.add_argument("--expect-gpus", type=int, metavar="N",
                   help="GPUs this node must have (default: as many as are on the PCI bus)")
    d.add_argument("--kernel-log", metavar="FILE",
                   help="post-mortem: scan this saved kernel log instead of the live one: a file (dmesg in any "
                        "mode, syslog, journalctl short/iso/precise/monotonic/json/cat, kmsg, Talos; gzip, bzip2 "
                        "or xz), a directory or quoted glob of rotated pieces (read oldest first), or '-' for "
                        "stdin. Runs only the xid check unless --checks says otherwise; needs no NVIDIA driver")
    d.add_argument("--duration", type=float, metavar="SECONDS",
                   help="watch the node this long, each check on its interval, and judge windows and counter "
                        "rates as the daemon does (a preflight for a job's nodes; Ctrl-C judges what was seen). "
                        "Without it, one sweep: counters are judged as totals since the driver loaded, against "
                        "the same-model GPUs beside them. On a fake node the time is simulated: it returns at once")
    d.add_argument("-o", "--output", choices=("table", "json"), default="table", help="default: table")
    d.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="default: $NODE_NAME or hostname")
    d.add_argument("--sysfs-root", type=Path, metavar="DIR", help="read sysfs (PCI bus, InfiniBand) under DIR (default: /sys); the driver check reads proc, dev and run beside it (DIR/../proc)")
    d.add_argument("--nvidia-smi", metavar="PATH", help="nvidia-smi to run (default: nvidia-smi on PATH; "
                                                        "in fake mode an in-process fake)")
    d.add_argument("--inventory-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="give up on NVML calls after this long (default: 10)")
    d.add_argument("--nccl-tests", metavar="PATH",
                   help="run this all_reduce_perf (nccl-tests) for the nccl check; implies --checks nccl "
                        "when --checks is not given")
    d.add_argument("--nccl-size", metavar="SIZE", help="bytes the nccl probe all-reduces (default 8G)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr while long checks run")
    d.set_defaults(func=cmd_diagnose)

    c = sub.add_parser(
        "checks", help="list the checks and the fields rules can use",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Every check: what it looks at, how often, its settings (for --config), the fields its\n"
                    "observations carry (what a rule's `when` can test) and the metrics it exports.",
        epilog="examples:\n"
               "  gpu-npd checks                                     # every check, its settings and fields\n"
               "  gpu-npd checks | sed -n '/^thermal:/,/^$/p'        # one check\n"
               "  gpu-npd diagnose --nvml fake:h100-sxm-8 --checks xid,pcie   # run only these")
    c.set_defaults(func=cmd_checks)

    r = sub.add_parser("validate-rules", help="load rule files and report every mistake (exit 2) or OK",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Load rule files as the daemon would and print every mistake of every file at "
                                   "once\n(file:line: field: what was expected, with 'did you mean' for a near "
                                   "miss), or what loaded.",
                       epilog="examples:\n"
                              "  gpu-npd validate-rules                         # the bundled rules\n"
                              "  gpu-npd validate-rules +my-rules.yaml          # the bundled rules plus a file of "
                              "your own\n"
                              "  gpu-npd validate-rules my-rules.yaml           # only these (files or folders)")
    r.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or directories, as --rules takes them ('+PATH' adds to the bundled rules; "
                        "default: builtin)")
    r.set_defaults(func=cmd_validate_rules)

    s = sub.add_parser(
        "scenarios", help="list the bundled fake-node scenarios for --nvml fake:NAME",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The bundled fake nodes, each with what is wrong with it: try gpu-npd on them without a GPU.",
        epilog="examples:\n"
               "  gpu-npd scenarios                                  # the fake nodes, for --nvml fake:NAME\n"
               "  gpu-npd scenarios | grep xid                       # the ones with an XID\n"
               "  gpu-npd scenarios --faults                         # the fault kinds and their parameters\n"
               "  gpu-npd diagnose --nvml fake:h100-sxm-8-xid79      # judge one")
    s.add_argument("--faults", action="store_true",
                   help="list the fault kinds instead: what each does and its parameters, for scenario files, "
                        "fleet files, POST /faults and the gpu-npd.io/inject-fault annotation")
    s.set_defaults(func=cmd_scenarios)

    from detector.cli.bundle import add_bundle_parser
    from detector.cli.daemon import add_daemon_parsers
    from detector.cli.demo import add_demo_parser
    from detector.cli.fleet import add_fleet_parser
    from detector.cli.simulate import add_simulate_parser

    add_daemon_parsers(sub)
    add_bundle_parser(sub)
    add_demo_parser(sub)
    add_simulate_parser(sub)
    add_fleet_parser(sub)
    return parser


def cmd_diagnose(args: argparse.Namespace) -> int:
    # Imported here: `gpu-npd run` (the DaemonSet's long-lived process) never needs them.
    from detector.agent.oneshot import diagnose_once, diagnose_over
    from detector.checks.xid.logfiles import LogNotFound, saved_logs
    from detector.cli.render import Diagnosis, render_table

    registry = CheckRegistry.from_entry_points()
    ruleset = load_ruleset(args.rules, registry)
    overrides: dict = {}
    if args.expect_gpus is not None:
        if args.expect_gpus < 1:
            raise UsageError("--expect-gpus must be at least 1")
        overrides["visibility"] = {"expected_gpus": args.expect_gpus}
    selected = args.checks
    if not args.kernel_log and args.nvml.startswith("replay:"):
        kept = _replay_kernel_log(args.nvml.partition(":")[2])
        if kept is not None:                   # a bundle's kernel log: the XID and driver-line rules read it
            overrides["xid"] = {"kernel_log_file": str(kept)}
    if args.kernel_log:
        try:
            saved_logs(args.kernel_log)
        except LogNotFound as e:
            raise UsageError(f"--kernel-log {e}") from None
        overrides["xid"] = {"kernel_log_file": args.kernel_log}
        selected = selected or "xid"           # a saved log's analysis, not this node's live state
    if args.nccl_tests or args.nccl_size:
        selected = selected or "nccl"
        if "nccl" not in [n.strip() for n in selected.split(",")]:
            raise UsageError("--nccl-tests and --nccl-size configure the nccl check, which --checks leaves out")
        overrides["nccl"] = _nccl_overrides(args)
    if args.duration is not None:
        if not 0 < args.duration <= MAX_DURATION_S:
            raise UsageError(f"--duration must be more than 0 and at most {MAX_DURATION_S:g} seconds (a day); "
                             "for longer, run the daemon (gpu-npd run)")
        if args.kernel_log or args.nvml.startswith("replay"):
            raise UsageError("--duration watches a live node; a saved kernel log or a replayed capture does not "
                             "change while it is watched")
    clock = SimulatedClock() if args.duration and args.nvml.startswith("fake:") else time.monotonic
    checks = load_selected_checks(registry, selected, args.config, overrides, clock=clock)
    post_mortem = bool(args.kernel_log) and [c.name for c in checks] == ["xid"]
    host = open_host(args.nvml, node_name=args.node_name, sysfs_root=args.sysfs_root, nvidia_smi=args.nvidia_smi,
                     post_mortem=post_mortem, clock=clock)
    # one sweep and no more: no window will fill, so counters since the driver loaded are compared across GPUs
    host.one_sweep = not args.duration
    if not args.quiet:
        print(f"gpu-npd: {describe_rules(ruleset)}", file=sys.stderr, flush=True)
    progress = None if args.quiet else _show_progress
    watch = None
    try:
        if args.duration:
            if not args.quiet:
                time_kind = "simulated time of the fake node" if host.simulated_time else "Ctrl-C to stop early"
                print(f"gpu-npd: watching the node for {args.duration:g} s ({time_kind})", file=sys.stderr,
                      flush=True)
            sweep, problems, watched = diagnose_over(host, checks, ruleset, args.duration, args.inventory_timeout,
                                                     progress=progress)
            watch = watched.to_dict()
        else:
            sweep, problems = diagnose_once(host, checks, ruleset, args.inventory_timeout, progress=progress)
    finally:
        host.close()
    diagnosis = Diagnosis(args.nvml, sweep, problems, rule_sources(ruleset), replay=getattr(host, "replay", None),
                          watch=watch)
    if args.output == "json":
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        print(render_table(diagnosis))
    return EXIT_PROBLEMS if diagnosis.problems else EXIT_HEALTHY


def _replay_kernel_log(path: str) -> Path | None:
    from detector.backends.replay.raw import SnapshotError
    from detector.cli.replay_host import replay_kernel_log

    try:
        return replay_kernel_log(Path(path)) if path.strip() else None
    except SnapshotError as e:
        raise BackendError(f"--nvml replay: {e}") from None


def _nccl_overrides(args: argparse.Namespace) -> dict:
    overrides: dict = {}
    if args.nccl_tests:
        path = Path(args.nccl_tests)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise UsageError(f"--nccl-tests {args.nccl_tests}: not an executable file (build nccl-tests and "
                             "name its build/all_reduce_perf)")
        overrides.update(nccl_tests=str(path), backend="nccl-tests")
    if args.nccl_size:
        overrides["size"] = args.nccl_size
    return overrides


def _show_progress(check: str, message: str) -> None:
    print(f"gpu-npd: {check}: {message}", file=sys.stderr, flush=True)


def cmd_checks(args: argparse.Namespace) -> int:
    registry = CheckRegistry.from_entry_points()
    for name in registry.names():
        cls = registry.get(name)
        print(f"{name}: {cls.description}")
        opt_in = "" if cls.enabled_by_default else ", opt-in (enable it, or name it in --checks)"
        print(f"  every {cls.default_interval_s:g}s, timeout {cls.default_timeout_s:g}s{opt_in}")
        for key, spec in cls.config_fields.items():
            print(f"  setting {key} (default {spec.default!r}): {spec.help}")
        for field, meaning in {**cls.fields}.items():
            print(f"  field {field}: {meaning}")
        for metric, gauge in cls.gauges.items():
            labels = ",".join(("gpu", "pci_bus_id", *gauge.labels, *([gauge.by] if gauge.by else [])))
            print(f"  metric {metric}{{{labels}}}: {gauge.help} (field {gauge.field})")
        print()
    print("Every check also has the fields check, check_status, check_error and duration_ms, and the settings\n"
          "interval, timeout and enabled (opt-in checks run only when enabled or named in --checks).")
    return EXIT_HEALTHY


def cmd_validate_rules(args: argparse.Namespace) -> int:
    """Every mistake in every file, one `file:line: field: problem` a line; exit 2 if there is any."""
    registry = CheckRegistry.from_entry_points()
    try:
        ruleset = load_ruleset(args.paths or None, registry)
    except RuleErrors as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        files = len({error.file for error in e.errors})
        print(f"gpu-npd: {len(e.errors)} error(s) in {files} file(s)", file=sys.stderr)
        return EXIT_USAGE
    print(f"OK: {len(ruleset.rules)} rules in {len(ruleset.files)} file(s); {describe_rules(ruleset)}")
    return EXIT_HEALTHY


def cmd_scenarios(args: argparse.Namespace) -> int:
    from detector.cli.render import columns
    from fake_nvml.scenario import bundled_scenarios, load_scenario

    if args.faults:
        from fake_nvml.faults import FAULT_KINDS

        kinds = sorted(FAULT_KINDS.values(), key=lambda k: k.name)
        indent = " " * (max(len(k.name) for k in kinds) + 2)    # the help lines start under the parameters
        for kind, line in zip(kinds, columns([(k.name, _fault_params(k)) for k in kinds])):
            print(f"{line}\n{indent}{kind.help}")
        return EXIT_HEALTHY
    print("\n".join(columns([(name, load_scenario(name).description) for name in bundled_scenarios()])))
    return EXIT_HEALTHY


def _fault_params(kind: FaultKind) -> str:
    """`gpu, code: int, count?: int`: whether it names a GPU, then its parameters (`?`: optional)."""
    params = ", ".join(f"{p}{'' if p in kind.required else '?'}: {t.__name__}" for p, t in kind.params.items())
    return f"{'gpu, ' if kind.needs_gpu else ''}{params or '-'}"


if __name__ == "__main__":
    sys.exit(main())
