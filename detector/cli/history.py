"""`gpu-npd history`: what the daemon remembers across reboots, for the person deciding on an RMA.

It reads the node check's history file in the daemon's state directory (read-only: it never moves or
rewrites it) and prints each GPU's incidents, by serial, and the boots with the problems each had.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from detector.checks.node.history import HISTORY_FILE, GpuRecord, read_history


def add_history_parser(sub: argparse._SubParsersAction, default_state_dir: Path) -> None:
    h = sub.add_parser(
        "history", help="each GPU's incidents and the boots' problems, kept across reboots (RMA evidence)",
        description="Print what the daemon on this node remembers across reboots: each GPU's incidents "
                    "(critical reset-, reboot- or replace-class problems), by serial, and each boot with the "
                    "problems it had. A GPU with incidents on 3 boots within 30 days is GpuFlaky; the same "
                    "problem after each of 3 reboots within 24 h is GpuRemediationLoop. Run it in the "
                    "daemon's pod: kubectl exec -n gpu-npd POD -- gpu-npd history --gpu SERIAL")
    h.add_argument("--gpu", metavar="ID", help="only this GPU: its serial, UUID or PCI bus id")
    h.add_argument("-o", "--output", choices=("table", "json"), default="table")
    h.add_argument("--state-dir", type=Path, default=default_state_dir,
                   help=f"the daemon's --state-dir (default: {default_state_dir})")
    h.set_defaults(func=cmd_history)


def cmd_history(args: argparse.Namespace) -> int:
    if not args.state_dir.is_dir():
        print(f"gpu-npd: --state-dir {args.state_dir}: no such directory (is the daemon running here, with "
              "this --state-dir?)", file=sys.stderr)
        return 2
    history, problem = read_history(args.state_dir)
    if problem:
        print(f"gpu-npd: {problem}", file=sys.stderr)
        return 2
    gpus = list(history.gpus.values())
    if args.gpu:
        gpus = [g for g in gpus if args.gpu in (g.serial, g.uuid, g.pci_bus_id, g.key)]
        if not gpus:
            known = ", ".join(g.key for g in history.gpus.values()) or "none"
            print(f"gpu-npd: no GPU {args.gpu} in {args.state_dir / HISTORY_FILE} (GPUs with incidents: "
                  f"{known})", file=sys.stderr)
            return 1
    if args.output == "json":
        print(json.dumps({"gpus": [asdict(g) for g in gpus], "boots": [asdict(b) for b in history.boots]},
                         indent=2))
        return 0
    print(_table(gpus, history.boots if not args.gpu else []))
    return 0


def _table(gpus: list[GpuRecord], boots: list) -> str:
    lines = []
    if not gpus:
        lines.append("no GPU incidents recorded")
    for g in sorted(gpus, key=lambda g: (g.index is None, g.index or 0, g.key)):
        boots_hit = len({i.boot for i in g.incidents})
        lines.append(f"GPU {g.index if g.index is not None else '?'}  serial {g.serial or 'unknown'}  "
                     f"uuid {g.uuid or 'unknown'}  bus {g.pci_bus_id or 'unknown'}  "
                     f"{len(g.incidents)} incident(s) on {boots_hit} boot(s)")
        lines.append(f"  {'WHEN (UTC)':<20} {'BOOT':<10} {'ACTION':<16} REASON")
        for i in sorted(g.incidents, key=lambda i: i.time):
            lines.append(f"  {_when(i.time):<20} {i.boot[:8]:<10} {i.action:<16} {i.reason}")
    if boots:
        lines.append("")
        lines.append(f"{'BOOT':<10} {'FIRST SEEN (UTC)':<20} PROBLEMS")
        for b in sorted(boots, key=lambda b: b.first_seen):
            lines.append(f"{b.boot[:8]:<10} {_when(b.first_seen):<20} {', '.join(sorted(b.problems)) or '-'}")
    return "\n".join(lines)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
