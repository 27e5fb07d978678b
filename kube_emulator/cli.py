"""Run the emulator as a process, for demos and for benchmarks that drive it from outside.

Prints the base URL on stdout (so a script can read it) and runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from kube_emulator.rbac import ADMIN
from kube_emulator.server import DEFAULT_USER, Emulator

EXIT_OK, EXIT_USAGE = 0, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kube-emulator",
        description="An in-process Kubernetes API server (core/v1 nodes and events) with the project's RBAC.")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="address to listen on; port 0 picks a free one (default %(default)s)")
    parser.add_argument("--kubeconfig-out", type=Path, metavar="FILE",
                        help=f"write a kubeconfig for {DEFAULT_USER} here")
    parser.add_argument("--admin-kubeconfig-out", type=Path, metavar="FILE",
                        help="write a kubeconfig for the admin user (system:masters) here")
    parser.add_argument("--rbac", type=Path, action="append", metavar="PATH",
                        help="RBAC YAML file or directory; repeatable (default deploy/base)")
    parser.add_argument("--node", action="append", default=[], metavar="NAME",
                        help="create this node at start; repeatable")
    return parser


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen wants HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        host, port = parse_listen(args.listen)
        rbac = args.rbac or [Path("deploy/base")]
        missing = [str(p) for p in rbac if not p.exists()]
        if missing:
            raise ValueError(f"RBAC path not found: {', '.join(missing)} (give --rbac FILE_OR_DIR)")
        emulator = Emulator(rbac_paths=rbac)
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
                emulator.write_kubeconfig(args.kubeconfig_out)
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
