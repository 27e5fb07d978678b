"""`gpu-npd history`: what the daemon remembers across reboots, for the person deciding on an RMA.

It reads the node check's history file in the daemon's state directory (read-only: it never moves or
rewrites it) and prints each GPU's incidents, by serial, and the boots with the problems each had. With
`--rma` it prints the evidence a support case takes (rma.py): a header naming the node, the time and
gpu-npd's version, then one block per GPU, most incidents first, flagged when flaky by the node check's
rule, with the evidence bundles that name it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from detector import __version__
from detector.checks.node.check import NodeStateCheck, span
from detector.checks.node.history import HISTORY_FILE, GpuRecord, SeenGpu, read_history
from detector.agent.bundle_index import read_bundles
from detector.cli.rma import render_rma, rma_report
from detector.config import UsageError, load_check_settings
from detector.yamlsource import MappingReader, SourceError

EPILOG = ("examples:\n"
          "  gpu-npd history                                    # each GPU's incidents, each boot's problems\n"
          "  gpu-npd history --gpu 1654922006536 -o json        # one GPU, by serial, UUID or bus id\n"
          "  gpu-npd history --rma > rma.txt                    # what to attach to a support case\n"
          "  gpu-npd history --rma -o json --config /etc/gpu-npd/config.yaml   # the daemon's flaky rule\n"
          "  kubectl exec -n gpu-npd POD -- gpu-npd history --rma   # in the daemon's pod")


def add_history_parser(sub: argparse._SubParsersAction, default_state_dir: Path) -> None:
    h = sub.add_parser(
        "history", help="each GPU's incidents and the boots' problems, kept across reboots (RMA evidence)",
        description="Print what the daemon on this node remembers across reboots: each GPU's incidents "
                    "(critical reset-, reboot- or replace-class problems), by serial, and each boot with the "
                    "problems it had. A GPU with incidents on 3 boots within 30 days is GpuFlaky; the same "
                    "problem after each of 3 reboots within 24 h is GpuRemediationLoop. Run it in the "
                    "daemon's pod: kubectl exec -n gpu-npd POD -- gpu-npd history --gpu SERIAL. --rma prints "
                    "what a support case takes: the node, the time, gpu-npd's version, then each GPU with "
                    "incidents (serial, UUID, bus id), most incidents first, whether it is flaky, its "
                    "incidents and the evidence bundles (<state-dir>/bundles) that name it.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("--rma", action="store_true",
                   help="the RMA evidence: each GPU to send back with its incidents and bundles")
    h.add_argument("--config", type=Path, metavar="FILE",
                   help="the daemon's --config, for the node check's flaky_boots and flaky_window (default: "
                        "the node check's defaults, 3 boots within 30 days)")
    h.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), metavar="NAME",
                   help="the node's name in the --rma header (default: $NODE_NAME, as the daemon's pod has it, "
                        "else the node its newest bundle names)")
    h.add_argument("--gpu", metavar="ID", help="only this GPU: its serial, UUID or PCI bus id")
    h.add_argument("-o", "--output", choices=("table", "json"), default="table")
    h.add_argument("--state-dir", type=Path, metavar="DIR",
                   help=f"the daemon's --state-dir [GPU_NPD_STATE_DIR] (default: {default_state_dir}, where "
                        "gpu-npd run keeps it)")
    h.set_defaults(func=cmd_history, default_state_dir=default_state_dir)


def cmd_history(args: argparse.Namespace) -> int:
    given = args.state_dir is not None
    if not given:
        args.state_dir = args.default_state_dir
    if given and not args.state_dir.is_dir():         # a directory named on purpose: a typo is said
        print(f"gpu-npd: --state-dir {args.state_dir}: no such directory (is the daemon running here, with "
              "this --state-dir?)", file=sys.stderr)
        return 2
    history, problem = read_history(args.state_dir)      # a missing directory or file: an empty history
    if problem:
        print(f"gpu-npd: {problem}", file=sys.stderr)
        return 2
    if not (args.state_dir / HISTORY_FILE).exists() and args.output == "table" and not (args.rma or args.gpu):
        print(nothing_recorded(args.state_dir))            # the JSON and the RMA report say it in their form
        return 0
    gpus = list(history.gpus.values())
    if args.gpu:
        gpus = [g for g in gpus if args.gpu in (g.serial, g.uuid, g.pci_bus_id, g.key)]
        if not gpus:
            known = ", ".join(g.key for g in history.gpus.values()) or "none"
            print(f"gpu-npd: no GPU {args.gpu} in {args.state_dir / HISTORY_FILE} (GPUs with incidents: "
                  f"{known})", file=sys.stderr)
            return 1
    if args.rma:
        return _rma(args, gpus, history.seen)
    if args.output == "json":
        print(json.dumps({"gpus": [asdict(g) for g in gpus], "boots": [asdict(b) for b in history.boots]},
                         indent=2))
        return 0
    print(_table(gpus, history.boots if not args.gpu else []))
    return 0


def nothing_recorded(state_dir: Path) -> str:
    """What a person reads when no daemon has kept a history here yet: where it would be, and who writes it."""
    return (f"no history recorded in {state_dir} yet: gpu-npd run keeps it there (with --nvml real, or given "
            "--state-dir); the DaemonSet's is /var/lib/gpu-npd on each node: kubectl exec -n gpu-npd POD -- "
            "gpu-npd history")


def _rma(args: argparse.Namespace, gpus: list[GpuRecord], seen: dict[str, SeenGpu]) -> int:
    flaky_boots, flaky_window = flaky_rule(args.config)
    bundles, notes = read_bundles(args.state_dir)
    node = args.node_name or next((b.node for b in bundles if b.node), "") or "unknown"
    report = rma_report(gpus, bundles, node=node, now=time.time(), version=__version__, state_dir=args.state_dir,
                        flaky_boots=flaky_boots, flaky_window_s=flaky_window, notes=notes, seen=seen)
    if args.output == "json":
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_rma(report, span(flaky_window)))
    return 0


def flaky_rule(config: Path | None) -> tuple[int, float]:
    """The node check's flaky_boots and flaky_window: from the daemon's config file where given (read and
    checked as the daemon reads it), else the check's defaults. UsageError naming the file, line and field
    when they are wrong."""
    fields = NodeStateCheck.config_fields
    boots, window = fields["flaky_boots"].default, fields["flaky_window"].default
    if config is None:
        return boots, window
    try:
        file, settings = load_check_settings(config)
        node = settings.get("node") or {}
        reader = MappingReader(file, node, "checks.node")
        boots = reader.get("flaky_boots", int, boots)
        window = reader.get("flaky_window", float, window)
        if boots < 1:
            raise reader.error("flaky_boots", "must be at least 1")
        if window <= 0:
            raise reader.error("flaky_window", "must be a positive number of seconds")
    except SourceError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--config {config}: {e.strerror or e}") from None
    return boots, window


def _table(gpus: list[GpuRecord], boots: list) -> str:
    from detector.cli.render import columns          # here: `gpu-npd run` builds this parser, never the table
    lines = []
    if not gpus:
        lines.append("no GPU incidents recorded")
    for g in sorted(gpus, key=lambda g: (g.index is None, g.index or 0, g.key)):
        boots_hit = len({i.boot for i in g.incidents})
        lines.append(f"GPU {g.index if g.index is not None else '?'}  serial {g.serial or 'unknown'}  "
                     f"uuid {g.uuid or 'unknown'}  bus {g.pci_bus_id or 'unknown'}  "
                     f"{len(g.incidents)} incident(s) on {boots_hit} boot(s)")
        rows = [("WHEN (UTC)", "BOOT", "ACTION", "REASON"),
                *((_when(i.time), i.boot[:8], i.action, i.reason) for i in sorted(g.incidents, key=lambda i: i.time))]
        lines += ["  " + row for row in columns(rows)]
    if boots:
        lines.append("")
        lines += columns([("BOOT", "FIRST SEEN (UTC)", "PROBLEMS"),
                          *((b.boot[:8], _when(b.first_seen), ", ".join(sorted(b.problems)) or "-")
                            for b in sorted(boots, key=lambda b: b.first_seen))])
    return "\n".join(lines)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
