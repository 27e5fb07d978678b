"""Run the emulator as a process, for demos, for kubectl, and for benchmarks that drive it from outside.

Prints the base URL on stdout (so a script can read it) and runs until SIGINT or SIGTERM. It enforces
deploy/base's RBAC: the copy packaged with gpu-npd (so it runs from any directory, and installed),
or a checkout's with --deploy-dir, or any RBAC files with --rbac. With --https it serves TLS from a
CA made at start, and the kubeconfigs it writes carry that CA, so kubectl verifies it as a cluster.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from kube_emulator.changes import DEFAULT_CAPACITY
from kube_emulator.kinds import DEFAULT_DRA_VERSION, DRA_VERSIONS
from kube_emulator.rbac import ADMIN, deploy_rbac, packaged_deploy_dir
from kube_emulator.emulator import (
    BOOKMARK_INTERVAL_S,
    DEFAULT_USER,
    KUBECONFIG_IDENTITIES,
    Emulator,
)

EXIT_OK, EXIT_USAGE = 0, 2


def build_parser(prog: str = "python -m kube_emulator",
                 parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A small Kubernetes API server (core/v1 nodes, events and pods, coordination.k8s.io/v1 "
                    "leases; get, list, watch, create, update, patch, delete, server-side dry run) that enforces "
                    "the project's RBAC.",
        epilog=f"""Point kubectl at it:

  {prog} --https --kubeconfig-out kc.yaml --node gpu-17 &
  export KUBECONFIG=$PWD/kc.yaml
  kubectl get node gpu-17                     # as {DEFAULT_USER} (the current context)
  kubectl --context admin get nodes -w        # as admin (system:masters): the gpu-npd account may not list
  kubectl --context admin describe node gpu-17
  kubectl auth can-i patch nodes --subresource=status   # yes: deploy/base grants the daemon that

The kubeconfig has one context per identity ({", ".join(KUBECONFIG_IDENTITIES)}), each with its own
bearer token; with --https it carries the CA (certificate-authority-data), so no --insecure-skip-tls-verify.
Tokens and the CA live as long as the process: write the kubeconfig again after a restart.""")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="address to listen on; port 0 picks a free one (default %(default)s)")
    parser.add_argument("--https", action="store_true",
                        help="serve HTTPS with a certificate from a CA made at start (needs the trustme package); "
                             "the URL printed starts with https:// and kubeconfigs carry the CA")
    parser.add_argument("--kubeconfig-out", type=Path, metavar="FILE",
                        help=f"write a kubeconfig here with a context per identity: {DEFAULT_USER} (current; "
                             "context gpu-npd:gpu-npd) and admin (system:masters; context admin)")
    parser.add_argument("--admin-kubeconfig-out", type=Path, metavar="FILE",
                        help="write a kubeconfig for the admin user (system:masters) alone here")
    parser.add_argument("--ca-out", type=Path, metavar="FILE",
                        help="with --https, also write the CA certificate (PEM) here, e.g. for curl --cacert")
    parser.add_argument("--watch-history", type=int, default=DEFAULT_CAPACITY, metavar="N",
                        help="changes kept for watches that resume from a resourceVersion; older resourceVersions "
                             "answer 410 Gone (Expired) and the client lists again (default %(default)s)")
    parser.add_argument("--bookmark-interval", type=float, default=BOOKMARK_INTERVAL_S, metavar="SECONDS",
                        help="how often a watch with allowWatchBookmarks=true gets a BOOKMARK event "
                             "(default %(default)s)")
    parser.add_argument("--dra-version", default=DEFAULT_DRA_VERSION, choices=(*DRA_VERSIONS, "none"),
                        help="the resource.k8s.io version serving ResourceSlices and DeviceTaintRules "
                             "(default %(default)s; none: not served)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--deploy-dir", type=Path, metavar="DIR",
                       help="enforce the RBAC in DIR/base, DIR being a gpu-npd checkout's deploy/ directory "
                            "(default: the copy of deploy/base/rbac.yaml packaged with gpu-npd, in "
                            f"{packaged_deploy_dir()})")
    where.add_argument("--rbac", type=Path, action="append", metavar="PATH",
                       help="enforce the RBAC in these YAML files or directories instead; repeatable "
                            "(--rbac deploy/base --rbac deploy/kwok adds the fleet simulator's)")
    parser.add_argument("--node", action="append", default=[], metavar="NAME",
                        help="create this node at start; repeatable")
    return parser


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen wants HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def rbac_paths(rbac: Sequence[Path] | None, deploy_dir: Path | None) -> list[Path]:
    """`--rbac` paths as given; else DIR/base of `--deploy-dir`; else the packaged copy of deploy/base."""
    if rbac:
        missing = [str(p) for p in rbac if not p.exists()]
        if missing:
            raise ValueError(f"RBAC path not found: {', '.join(missing)} (give --rbac FILE_OR_DIR)")
        return list(rbac)
    base = deploy_rbac("base", deploy_dir)
    if deploy_dir is not None and not base.is_dir():
        raise ValueError(f"--deploy-dir {deploy_dir}: no base/ directory in it (give the deploy/ directory of a "
                         "gpu-npd checkout, or leave --deploy-dir out for the packaged RBAC)")
    return [base]


def main(argv: Sequence[str] | None = None, prog: str = "python -m kube_emulator",
         parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    """`prog`: how the user called it (`gpu-npd emulator` hands its own name in, and its parser class, which
    lets a help it cannot write fail)."""
    args = build_parser(prog, parser_class).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        host, port = parse_listen(args.listen)
        rbac = rbac_paths(args.rbac, args.deploy_dir)
        if args.ca_out and not args.https:
            raise ValueError("--ca-out needs --https (over plain HTTP there is no CA)")
        if args.watch_history < 1 or args.bookmark_interval <= 0:
            raise ValueError("--watch-history must be at least 1 and --bookmark-interval above 0")
        emulator = Emulator(rbac_paths=rbac, https=args.https, watch_history=args.watch_history,
                            bookmark_interval_s=args.bookmark_interval,
                            dra_version=None if args.dra_version == "none" else args.dra_version)
        if not emulator.authorizer.policy.bindings:
            raise ValueError(f"no RBAC role bindings in {', '.join(map(str, rbac))}: every request but the "
                             "admin's would be forbidden")
        logging.getLogger("kube_emulator").info("kube-emulator RBAC from %s", ", ".join(map(str, rbac)))
    except (ValueError, OSError) as e:
        print(f"kube-emulator: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            url = emulator.start(host, port)
            for name in args.node:
                emulator.create_node(name)
            if args.kubeconfig_out:
                emulator.write_kubeconfig(args.kubeconfig_out, identities=KUBECONFIG_IDENTITIES)
            if args.ca_out:
                emulator.write_ca(args.ca_out)
            if args.admin_kubeconfig_out:
                emulator.write_kubeconfig(args.admin_kubeconfig_out, user=ADMIN)
        except Exception as e:  # noqa: BLE001 - bad port, bad node name, unwritable file: one line, exit 2
            emulator.stop()
            print(f"kube-emulator: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        print(url, flush=True)
        while not stop.wait(0.5):
            pass
        emulator.stop()
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
