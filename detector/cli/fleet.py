"""`gpu-npd fleet` (and the kubectl plugin `kubectl gpu-npd`): the cluster's GPU nodes that need a look.

kubectl runs a plugin named kubectl-gpu_npd for `kubectl gpu-npd ...` (a dash in the command is an
underscore in the file name), passing the words after `gpu-npd` and its environment (KUBECONFIG) but none
of kubectl's own flags: so the plugin takes --kubeconfig and --context itself, and finds the kubeconfig as
kubectl does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from detector.core.domain_origin import DomainGpu, DomainVerdict
from detector.kube.api import ApiError
from detector.kube.fleet_view import PAGE_SIZE, STALE_AFTER_S, FlakyGpu, FleetView, flaky_gpus
from detector.kube.stamps import rfc3339

EXIT_NOTHING_WRONG, EXIT_PROBLEMS, EXIT_USAGE, EXIT_API = 0, 1, 2, 3
EXIT_CODES = ("exit code: 0 nothing is wrong, 1 a node is listed (an unhealthy GPU, a gpu-npd condition True, "
              "or gpu-npd not reporting), 2 bad usage or no usable kubeconfig, 3 the API server could not be "
              "read, or not all of it (unreachable, too slow, the list refused: see deploy/fleet-viewer for the "
              "read-only RBAC; an answer too large or of the wrong shape, a continue token repeated, too many "
              "pages; nodes of the wrong shape skipped, the others still shown)")
PLUGIN = "kubectl gpu-npd"
# Printed cells are cut to this many characters (an ellipsis at the cut): a column is as wide as its widest
# cell, so one long cell would widen every row. TAINTS, the last column, widens only its own row: it may
# hold a few taints in full.
CELL_MAX = 64
TAINTS_MAX = 256
LINE_MAX = 1000                  # a line on stderr (the API server's message in it is the server's to choose)
# Characters a terminal acts on rather than shows (C0 and C1 controls, escape sequences among them) and
# those that reorder a line (bidi overrides): whoever can write a node's status chooses these texts, so
# each is shown as "?".
_UNPRINTABLE = dict.fromkeys([*range(0x20), *range(0x7f, 0xa0), 0x200e, 0x200f, *range(0x202a, 0x202f),
                              *range(0x2066, 0x206a)], "?")


DESCRIPTION = ("Read every GPU node from the API server (one LIST, in pages) and list those with a degraded or "
               "failed GPU (the gpu-npd.io/unhealthy-gpus annotation), a gpu-npd condition True, or whose gpu-npd "
               "is not reporting (no heartbeat for --stale-after, or never), with the node's readiness and taints. "
               f"Needs get and list on nodes, nothing more (deploy/fleet-viewer).\n{EXIT_CODES}.")
EPILOG = ("examples:\n"
          "  gpu-npd fleet                                      # $KUBECONFIG or ~/.kube/config\n"
          "  kubectl gpu-npd                                    # the same, as a kubectl plugin\n"
          "  kubectl gpu-npd fleet -o json | jq '.nodes[].unhealthyGpus[]'\n"
          "  gpu-npd fleet -l gpu-npd.io/rack=rack-07 --all     # one rack, healthy nodes too\n"
          "  gpu-npd fleet --flaky                              # GPUs failing boot after boot: RMA them\n"
          "  gpu-npd fleet --flaky -o json | jq -r '.gpus[].serial'   # their serials, for the RMA\n"
          "  gpu-npd fleet --kubeconfig kc.yaml --context admin # another kubeconfig and context")


def add_fleet_parser(sub: Any) -> None:
    f = sub.add_parser("fleet", help="list the cluster's GPU nodes with unhealthy GPUs, gpu-npd conditions True, "
                                     "or no report", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(f)


def add_fleet_arguments(f: argparse.ArgumentParser) -> None:
    f.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig (default: the first file in $KUBECONFIG, else ~/.kube/config, else the "
                        "pod's in-cluster service account)")
    f.add_argument("--context", metavar="NAME", help="the kubeconfig context to use (default: its current one)")
    f.add_argument("-l", "--selector", default="", metavar="SELECTOR",
                   help="list only the nodes this label selector matches, all taken as GPU nodes (default: "
                        "every node, GPU nodes being those with a label deploy/'s DaemonSet selects by, "
                        "nvidia.com/gpu.present=true or NFD's feature.node.kubernetes.io/pci-10de.present, "
                        "or anything gpu-npd writes)")
    f.add_argument("--all", action="store_true", help="list the healthy GPU nodes too")
    f.add_argument("--flaky", action="store_true",
                   help="list instead the GPUs, by serial, whose incidents recur across boots (the annotation's "
                        "per-GPU boots, 2 or more) and those the GpuFlaky condition names: what to send back "
                        "(exit code 1 when one is listed); run `gpu-npd history --rma` on its node for the evidence")
    f.add_argument("--stale-after", type=float, default=STALE_AFTER_S, metavar="SECONDS",
                   help="gpu-npd is not reporting when its newest condition heartbeat is older than this "
                        f"(default {STALE_AFTER_S:g}: three of the daemon's 300 s heartbeats)")
    f.add_argument("--chunk-size", type=int, default=PAGE_SIZE, metavar="N",
                   help=f"nodes per page of the LIST (default {PAGE_SIZE}, as kubectl)")
    f.add_argument("-o", "--output", choices=("table", "json"), default="table", help="default: table")
    f.set_defaults(func=cmd_fleet)


def cmd_fleet(args: argparse.Namespace) -> int:
    from detector.config import UsageError
    from detector.rules.sources import builtin_rules_dir
    from detector.kube.api import ConfigError, KubeApi
    from detector.kube.connection import user_kubeconfig
    from detector.kube.fleet_view import FleetListError, read_fleet
    from detector.rules.loader import load_rules

    if args.chunk_size < 1 or args.stale_after <= 0:
        raise UsageError("--chunk-size must be at least 1 and --stale-after above 0")
    try:
        api = KubeApi.from_kubeconfig(user_kubeconfig(args.kubeconfig), args.context, qps=50.0, burst=50)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        view = read_fleet(api, load_rules([builtin_rules_dir()]).types(), args.selector, args.chunk_size,
                          args.stale_after, keep_all=args.all)
    except ApiError as e:
        return _failed(f"{_clip(e.explain(FLEET_RBAC_HINT), LINE_MAX)}{_hint(e)}")
    except FleetListError as e:
        return _failed(str(e))
    flaky = flaky_gpus(view) if args.flaky else []
    if args.flaky and args.output == "json":
        print(json.dumps({"gpus": [f.to_dict() for f in flaky], "nodes": view.gpu_nodes,
                          "malformed": {"nodes": view.malformed, "first": view.first_malformed or None}}, indent=2))
    elif args.flaky:
        print(render_flaky(flaky, view.gpu_nodes))
    elif args.output == "json":
        print(json.dumps(fleet_json(view, args.stale_after), indent=2))
    else:
        print(render_fleet(view, keep_all=args.all))
    if view.malformed:
        print(_clip(f"gpu-npd: {view.malformed} node{'s' if view.malformed != 1 else ''} had a malformed shape "
                    f"and {'were' if view.malformed != 1 else 'was'} skipped; first: {view.first_malformed}",
                    LINE_MAX), file=sys.stderr)
        return EXIT_API
    if args.flaky:
        return EXIT_PROBLEMS if flaky else EXIT_NOTHING_WRONG
    return EXIT_NOTHING_WRONG if view.nothing_wrong else EXIT_PROBLEMS


def _failed(why: str) -> int:
    print(_clip(f"gpu-npd: cannot list nodes: {why}", LINE_MAX), file=sys.stderr)
    return EXIT_API


def _hint(e: ApiError) -> str:
    """What to do about a request that took too long or an answer too large (api.py's deadline and cap)."""
    if e.status == 0 and e.reason == "TooLarge":
        return " (a smaller --chunk-size makes each page smaller)"
    if e.status == 0 and e.reason == "Timeout":
        return " (a smaller --chunk-size makes each page quicker to send)"
    return ""


FLEET_RBAC_HINT = ("deploy/fleet-viewer does (get and list nodes, read-only): bind its ClusterRole gpu-npd-fleet-viewer "
                   "to yourself, as its binding example shows")


def fleet_json(view: FleetView, stale_after_s: float) -> dict[str, Any]:
    return {"summary": view.summary(), "nothingWrong": view.nothing_wrong, "staleAfterSeconds": stale_after_s,
            "nodes": [n.to_dict() for n in view.nodes],
            "domains": [domain_json(d) for d in view.domains()],
            "malformed": {"nodes": view.malformed, "first": view.first_malformed or None}}


def domain_json(d: DomainVerdict) -> dict[str, Any]:
    """One NVLink domain: its nodes, its affected GPUs, and where its fault most likely started (`origin`
    null when no single GPU can be named: `verdict` says why)."""
    def gpu(g: DomainGpu) -> dict[str, Any]:
        x = g.link_xid
        return {"node": g.node, "gpu": g.gpu, "pciBusId": g.pci_bus_id, "xid": x.decoded if x else None,
                "fatal": x.fatal if x else None, "link": x.link if x else None,
                "time": rfc3339(x.time) if x and x.time is not None else None}
    return {"cluster_uuid": d.cluster_uuid, "clique_id": d.clique_id, "nodes": list(d.nodes),
            "gpus_affected": len(d.affected), "origin": gpu(d.origin) if d.origin else None,
            "verdict": d.verdict, "explanation": d.explain(), "candidates": [gpu(c) for c in d.candidates],
            "downstream_only": d.downstream_only}


def render_fleet(view: FleetView, keep_all: bool = False) -> str:
    """One row per unhealthy GPU, per gpu-npd condition True and per node not reporting (a healthy node
    listed with --all has one row of its own), then the summary line."""
    from detector.cli.render import columns

    rows = [("NODE", "GPU", "BUS ID", "UUID", "SERIAL", "STATE", "ACTION/REASON", "SINCE", "STATUS", "TAINTS")]
    for node in view.nodes:
        tail = (node.status, _clip(",".join(str(t) for t in node.taints) or "-", TAINTS_MAX))
        for g in node.unhealthy:
            rows.append((node.name, "-" if g.index is None else str(g.index), g.pci_bus_id or "-", g.uuid or "-",
                         g.serial or "-", g.state, g.action or "-", g.since or "-", *tail))
        for c in node.conditions:
            rows.append((node.name, "-", "-", "-", "-", c.type, c.reason or "-", c.since or "-", *tail))
        if node.more_conditions:
            rows.append((node.name, "-", "-", "-", "-", f"+{node.more_conditions} conditions", "TooMany", "-", *tail))
        if not node.reporting:
            rows.append((node.name, "-", "-", "-", "-", "not-reporting",
                         "NoHeartbeat" if node.last_heartbeat else "NeverReported", node.last_heartbeat or "-", *tail))
        if node.annotation_error:
            rows.append((node.name, "-", "-", "-", "-", "unreadable", "BadAnnotation", "-", *tail))
        if not node.has_problems:
            rows.append((node.name, "-", "-", "-", "-", "healthy", "-", "-", *tail))
    rows = [tuple(_clip(cell, CELL_MAX) for cell in row[:-1]) + row[-1:] for row in rows]
    lines = columns(rows) if len(rows) > 1 else []
    domains = [d for d in view.domains() if d.affected or keep_all]
    if domains:
        lines.append("")
        lines.extend(columns([("NVLINK DOMAIN", "NODES", "GPUS AFFECTED", "ORIGIN", "EVIDENCE")] + [
            (f"{d.cluster_uuid}/{d.clique_id}", str(len(d.nodes)), str(len(d.affected)),
             d.origin.label() if d.origin else {"several": "several", "none": "none"}.get(d.verdict, "-"),
             _clip(d.explain(), 4 * CELL_MAX)) for d in domains]))
    lines.append(summary_line(view))
    return "\n".join(lines)


def render_flaky(gpus: list[FlakyGpu], nodes: int) -> str:
    """One row per GPU whose incidents recur across boots, most boots first, then a summary line."""
    from detector.cli.render import columns

    plural = "s" if nodes != 1 else ""
    if not gpus:
        return f"no GPU's incidents recur across boots: {nodes} GPU node{plural} read"
    rows = [("NODE", "GPU", "SERIAL", "BUS ID", "UUID", "BOOTS", "FLAKY", "STATE", "ACTION", "SINCE")]
    for f in gpus:
        g = f.gpu
        rows.append(tuple(_clip(cell, CELL_MAX) for cell in (
            f.node, "-" if g.index is None else str(g.index), g.serial or "-", g.pci_bus_id or "-", g.uuid or "-",
            "?" if f.boots is None else str(f.boots), "yes" if f.flaky else "no", g.state, g.action or "-",
            g.since or "-")))
    flaky = sum(f.flaky for f in gpus)
    return "\n".join([*columns(rows), f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} failing on more than one "
                      f"boot ({flaky} flaky) on {len({f.node for f in gpus})} of {nodes} GPU node{plural}"])


def summary_line(view: FleetView) -> str:
    counts = (f"{view.gpu_nodes} GPU node{'s' if view.gpu_nodes != 1 else ''}, {gpu_count(view)}, {view.failed} "
              f"failed, {view.degraded} degraded, {view.not_reporting} not reporting"
              + (f", {view.malformed} malformed (skipped)" if view.malformed else ""))
    if view.nothing_wrong:
        return f"nothing is wrong: {counts}"
    return f"{view.with_problems} node{'s' if view.with_problems != 1 else ''} to look at: {counts}"


def gpu_count(view: FleetView) -> str:
    """The GPUs the nodes say they have (capacity nvidia.com/gpu, else the nvidia.com/gpu.count label). A node
    that says nothing (no device plugin, as the README's emulator node) is not counted as 0 GPUs, which its
    failed GPUs' rows would contradict: the count says it is a lower bound, or unknown."""
    if not view.uncounted:
        return f"{view.gpus} GPU{'s' if view.gpus != 1 else ''}"
    if view.uncounted == view.gpu_nodes:
        return "GPU count unknown"
    return (f"{view.gpus}+ GPUs ({view.uncounted} node{'s' if view.uncounted != 1 else ''} without a GPU count)")


def _clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (an ellipsis at the cut), with what a terminal would act on shown
    as "?"."""
    return (text if len(text) <= limit else text[:limit - 1] + "…").translate(_UNPRINTABLE)


def kubectl_plugin(argv: Sequence[str] | None = None) -> int:
    """`kubectl gpu-npd [fleet] [options]`: kubectl runs the kubectl-gpu_npd executable with the words
    after `gpu-npd`; the fleet view is its one command, so `fleet` may be left out."""
    from detector.cli.main import run_command
    from detector.cli.signals import Parser, ended_well

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["fleet"]:
        args = args[1:]
    parser = Parser(prog=f"{PLUGIN} [fleet]", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(parser)
    return ended_well(lambda: run_command(parser.parse_args(args)))
