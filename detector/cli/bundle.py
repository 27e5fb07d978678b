"""`gpu-npd bundle`: write an evidence bundle of this node now (detector/agent/bundle_writer.py), a folder that
is itself a replay: `gpu-npd diagnose --nvml replay:DIR` judges it again, anywhere."""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque
from pathlib import Path

from detector.cli.daemon import node_state_dir
from detector.config import UsageError

EXIT_WRITTEN, EXIT_USAGE = 0, 2
MAX_READ_BATCHES = 1000          # kernel-log reads for one bundle: 50,000 lines each at most


def add_bundle_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bundle", help="write an evidence bundle of this node (a replay folder) for a support case or an RMA",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Gather what a person or a support case needs about this node now, into a new folder laid\n"
                    "out as a replay: nvidia-smi -q -x (30 s timeout), nvidia-smi nvlink -s (15 s), the driver's\n"
                    "modules, version and /dev entries, NVML's answers nvidia-smi does not print (nvml.json),\n"
                    "this boot's kernel log around its incidents (kernel.log), gpu-npd's verdict (verdict.json,\n"
                    "as diagnose -o json) and, with --state-dir, the GPUs' history. manifest.json lists it all.\n"
                    "Addresses, host names and user names are redacted unless --no-redact; the node name and the\n"
                    "GPUs' serials, UUIDs and bus ids are kept. Exit code: 0 written, 2 bad usage or unwritable.",
        epilog="examples:\n"
               "  gpu-npd bundle --out /tmp/gpu-case-1234               # this node, real NVML\n"
               "  gpu-npd diagnose --nvml replay:/tmp/gpu-case-1234      # judge it again, anywhere\n"
               "  gpu-npd bundle --nvml fake:h100-sxm-8-remap-pending --out /tmp/b\n"
               "  gpu-npd bundle --state-dir /var/lib/gpu-npd --out /tmp/b   # with the GPUs' history\n"
               "  gpu-npd bundle --kernel-log /var/log/kern.log --out /tmp/b  # a saved kernel log instead\n"
               "  gpu-npd bundle --max-size 16 --no-redact --out /tmp/b      # 16 MiB cap, nothing redacted")
    b.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="the folder to write: new, or empty (made with its parents)")
    b.add_argument("--nvml", default=os.environ.get("GPU_NPD_NVML", "real"), metavar="BACKEND",
                   help="real, fake:SCENARIO, fake:PATH.yaml or replay:PATH, as diagnose takes it "
                        "(default: $GPU_NPD_NVML or real)")
    b.add_argument("--kernel-log", metavar="FILE",
                   help="keep this saved kernel log (a file, directory or glob of rotated pieces, as diagnose "
                        "reads it) instead of the live one; its last --max-size bytes at most")
    b.add_argument("--state-dir", type=Path, metavar="DIR", default=os.environ.get("GPU_NPD_STATE_DIR"),
                   help="the daemon's state directory: its history.json goes into the bundle (default: "
                        "$GPU_NPD_STATE_DIR, else the one `gpu-npd run` keeps for this machine's real GPUs)")
    b.add_argument("--max-size", type=float, default=64, metavar="MIB",
                   help="size cap of the whole bundle in MiB (default 64): the kernel log is cut to its newest "
                        "lines, another file past the cap is left out; the manifest lists both")
    b.add_argument("--redact", dest="redact", action="store_true", default=True,
                   help="replace IP and MAC addresses, host names, e-mail addresses and home-directory user names "
                        "(default)")
    b.add_argument("--no-redact", dest="redact", action="store_false", help="keep them")
    b.add_argument("--reason", default="on request", help="why the bundle was taken, kept in its manifest")
    b.add_argument("--rules", action="append", metavar="PATH", help="rule files, as diagnose takes them")
    b.add_argument("--config", type=Path, metavar="FILE", help="YAML settings: checks.<name>.<setting>")
    b.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="default: $NODE_NAME or hostname")
    b.add_argument("--sysfs-root", type=Path, metavar="DIR", help="read sysfs under DIR (default: /sys)")
    b.add_argument("--nvidia-smi", metavar="PATH", help="nvidia-smi to run (default: nvidia-smi on PATH)")
    b.add_argument("--inventory-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="give up on NVML calls after this long (default: 10)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    b.set_defaults(func=cmd_bundle)


def cmd_bundle(args: argparse.Namespace) -> int:
    from detector.agent.bundle_writer import BundleError, BundleOptions, KernelLogTail, prepare_folder, write_bundle
    from detector.checks.xid.logfiles import LogNotFound, saved_logs
    from detector.cli.hosts import open_host
    from detector.cli.main import _replay_kernel_log
    from detector.cli.render import Diagnosis
    from detector.config import load_selected_checks
    from detector.core.check import CheckRegistry
    from detector.rules.sources import load_ruleset, rule_sources

    if not 0 < args.max_size <= 4096:
        raise UsageError("--max-size must be more than 0 and at most 4096 MiB")
    max_bytes = int(args.max_size * (1 << 20))
    saved = args.kernel_log
    if not saved and args.nvml.startswith("replay:"):
        kept = _replay_kernel_log(args.nvml.partition(":")[2])
        saved = str(kept) if kept is not None else None
    if saved:
        try:
            pieces = saved_logs(saved)
        except LogNotFound as e:
            raise UsageError(f"--kernel-log {e}") from None
    try:
        prepare_folder(args.out)
    except BundleError as e:
        raise UsageError(str(e)) from None
    say = (lambda message: None) if args.quiet else \
        (lambda message: print(f"gpu-npd: bundle: {message}", file=sys.stderr, flush=True))
    registry = CheckRegistry.from_entry_points()
    ruleset = load_ruleset(args.rules, registry)
    overrides = {"xid": {"kernel_log_file": saved}} if saved else {}
    checks = load_selected_checks(registry, None, args.config, overrides)
    host = open_host(args.nvml, node_name=args.node_name, sysfs_root=args.sysfs_root, nvidia_smi=args.nvidia_smi)
    state_dir = node_state_dir(args.nvml, Path(args.state_dir) if args.state_dir else None)
    try:
        kernel_lines = None
        if host.kernel_log is not None and not saved:
            say("reading this boot's kernel log")
            tail = KernelLogTail(host.kernel_log)
            for _ in range(MAX_READ_BATCHES):
                if not tail.read_available():
                    break
            kernel_lines = tail.lines()
        options = BundleOptions(reason=args.reason, max_bytes=max_bytes, redact=args.redact,
                                history=state_dir / "history.json" if state_dir else None,
                                inventory_timeout_s=args.inventory_timeout,
                                kernel_text=_saved_text(pieces, max_bytes) if saved else None)
        manifest = write_bundle(
            host, checks, ruleset, args.out, options,
            lambda sweep, problems: Diagnosis(args.nvml, sweep, problems, rule_sources(ruleset),
                                              replay=getattr(host, "replay", None)).to_dict(),
            kernel_lines, progress=say)
    finally:
        host.close()
    total = sum(f["bytes"] for f in manifest.files)
    say(f"wrote {len(manifest.files)} files, {total} bytes"
        + (f"; cut or left out under the {args.max_size:g} MiB cap: {', '.join(manifest.truncated)}"
           if manifest.truncated else ""))
    print(args.out)
    return EXIT_WRITTEN


def _saved_text(pieces: list, max_bytes: int) -> str:
    """The saved log's pieces, oldest first, as text: the newest `max_bytes` of it at most, whole lines."""
    lines: deque[str] = deque()
    size = 0
    for piece in pieces:
        with piece.open() as stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                lines.append(line if line.endswith("\n") else line + "\n")
                size += len(line)
                while size > max_bytes and lines:
                    size -= len(lines.popleft())
    return "".join(lines)
