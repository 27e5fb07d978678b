#!/usr/bin/env python3
"""Kernel-log scanning throughput and memory, against `grep -F -c Xid` on the same file.

Generates a kernel log (default 1 GiB) in syslog format with realistic noise and 0.01% XID lines,
then runs the real post-mortem path (`gpu-npd diagnose --checks xid --kernel-log FILE -o json`) in a
fresh process and reports its scan time (the check's own duration), peak RSS and the ratio of its
throughput to grep's. `--flood` adds 800,000 repeats of one XID (a real incident's shape) and reports
how many problems they become. The last line printed is a JSON object of the figures.

    .venv/bin/python bench/scan_kernel_log.py                 # 1 GiB, 0.01% XID lines
    .venv/bin/python bench/scan_kernel_log.py --flood         # plus 800,000 XID 95 lines
    .venv/bin/python bench/scan_kernel_log.py --size-mib 128  # quicker
    .venv/bin/python bench/scan_kernel_log.py --format json   # journalctl -o json (also journal-iso,
                                                              # dmesg-x, talos)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOISE = [
    "eth0: renamed from veth{r:x}",
    "audit: type=1400 audit({t}.{r}:{r}): apparmor=\"DENIED\" operation=\"open\" profile=\"cri-containerd.apparmor.d\" "
    "name=\"/proc/{r}/status\" pid={r} comm=\"python3\" requested_mask=\"r\" denied_mask=\"r\"",
    "EXT4-fs (nvme0n1p{r}): mounted filesystem with ordered data mode. Quota mode: none.",
    "cni0: port {r}(veth{r:x}) entered forwarding state",
    "IPv6: ADDRCONF(NETDEV_CHANGE): veth{r:x}: link becomes ready",
    "nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  550.90.07",
    "pcieport 0000:00:01.{r}: AER: Corrected error message received from 0000:00:01.{r}",
    "mlx5_core 0000:{r:02x}:00.0: mlx5_pcie_event:301:(pid {r}): PCIe slot advertised sufficient power (27W).",
    "device veth{r:x} entered promiscuous mode",
    "XFS (dm-{r}): Mounting V5 Filesystem",
    "TCP: request_sock_TCP: Possible SYN flooding on port {r}. Sending cookies.",
    "Memory cgroup out of memory: Killed process {r} (python3) total-vm:{r}kB, anon-rss:{r}kB",
    "nvidia-uvm: Loaded the UVM driver, major device number 510.",
    "systemd-journald[{r}]: Received client request to flush runtime journal.",
]
XID_LINES = [
    "NVRM: Xid (PCI:0000:{bus}:00): 13, pid={r}, name=python3, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0)",
    "NVRM: Xid (PCI:0000:{bus}:00): 31, pid={r}, name=pt_main_thread, Ch 00000010, intr 10000000. MMU Fault",
    "NVRM: Xid (PCI:0000:{bus}:00): 94, pid={r}, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
    "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link {r} egress non-posted PRIV error (First)",
]
BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
FLOOD_LINE = "NVRM: Xid (PCI:0000:5d:00): 95, pid=4242, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}+0000"


# How each tool wraps a kernel line: (wall time, seconds since boot, message) -> line.
FORMATS = {
    "syslog": lambda t, mono, msg: f"{time.strftime('%b %e %H:%M:%S', time.gmtime(t))} gpu-node-17 kernel: "
                                   f"[{mono:12.6f}] {msg}\n",
    "journal-iso": lambda t, mono, msg: f"{_iso(t)} gpu-node-17 kernel: {msg}\n",
    "dmesg-x": lambda t, mono, msg: f"kern  :info  : [{mono:12.6f}] {msg}\n",
    "talos": lambda t, mono, msg: f"172.20.0.2: kern:    info: [{_iso(t)}]: {msg}\n",
    "json": lambda t, mono, msg: json.dumps({"__REALTIME_TIMESTAMP": str(int(t * 1e6)),
                                             "__MONOTONIC_TIMESTAMP": str(int(mono * 1e6)),
                                             "_BOOT_ID": "0d1c6bd9f1b14d7a8d8f2b5c3e4a5b6c",
                                             "_TRANSPORT": "kernel", "SYSLOG_IDENTIFIER": "kernel",
                                             "MESSAGE": msg}) + "\n",
}


def generate(path: Path, size: int, xid_rate: float, flood: int, seed: int = 7,
             fmt: str = "syslog") -> tuple[int, int]:
    """Write a kernel log of about `size` bytes in format `fmt`; return (lines, XID lines)."""
    rng = random.Random(seed)
    lines = xids = 0
    t0 = 1763700000.0                        # wall clock of the first line
    mono = 50.0
    per_line = 130
    flood_every = max(1, (size // per_line) // flood) if flood else 0
    written = 0
    with path.open("w", encoding="utf-8") as f:
        batch: list[str] = []
        while written < size:
            mono += rng.random() * 0.01
            r = rng.randrange(1, 60000)
            if flood_every and lines % flood_every == 0 and xids < flood:
                msg = FLOOD_LINE
                xids += 1
            elif rng.random() < xid_rate:
                msg = rng.choice(XID_LINES).format(bus=rng.choice(BUSES), r=r % 64)
                xids += 1
            else:
                msg = rng.choice(NOISE).format(r=r, t=int(t0 + mono))
            line = FORMATS[fmt](t0 + mono, mono, msg)
            batch.append(line)
            written += len(line)
            lines += 1
            if len(batch) >= 10000:
                f.write("".join(batch))
                batch.clear()
        f.write("".join(batch))
    return lines, xids


def best_of(n: int, fn) -> float:
    return min(fn() for _ in range(n))


def time_grep(path: Path) -> float:
    def once() -> float:
        t = time.perf_counter()
        # Output to a pipe: GNU grep stops at the first match when its output is /dev/null.
        subprocess.run(["grep", "-F", "-c", "Xid", str(path)], stdout=subprocess.PIPE, check=False)
        return time.perf_counter() - t
    return best_of(3, once)


def run_diagnose(path: Path) -> tuple[float, float, dict]:
    """The post-mortem path in a fresh process: (scan seconds, peak RSS MiB, report)."""
    cmd = [sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "xid",
           "--kernel-log", str(path), "-o", "json"]
    best = None
    for _ in range(3):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate()
        if proc.returncode not in (0, 1):
            raise SystemExit(f"diagnose failed ({proc.returncode}): {err.strip()}")
        report = json.loads(out)
        scan_s = report["checks"][0]["duration_ms"] / 1000
        if best is None or scan_s < best[0]:
            best = (scan_s, report)
    rss = peak_rss_mib(cmd)
    return best[0], rss, best[1]


def peak_rss_mib(cmd: list[str]) -> float:
    """Peak RSS of one run of `cmd`, from the kernel's accounting of the finished child."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024             # Linux reports KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="size of the generated log (default 1024)")
    parser.add_argument("--flood", action="store_true", help="add 800,000 repeats of one XID 95 line")
    parser.add_argument("--flood-lines", type=int, default=800_000)
    parser.add_argument("--format", choices=sorted(FORMATS), default="syslog",
                        help="how the lines are wrapped (default syslog, with the kernel's own timestamps)")
    parser.add_argument("--dir", type=Path, help="where to write the log (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the generated log")
    args = parser.parse_args()

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="gpu-npd-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / ("kern-flood.log" if args.flood else "kern.log")
    size = args.size_mib * 1024 * 1024
    if shutil.disk_usage(workdir).free < size * 1.2:
        raise SystemExit(f"not enough free disk in {workdir} for a {args.size_mib} MiB log")
    try:
        print(f"generating {args.size_mib} MiB kernel log at {path} ...", flush=True)
        t = time.perf_counter()
        lines, xids = generate(path, size, 0.0001, args.flood_lines if args.flood else 0, fmt=args.format)
        actual = path.stat().st_size
        print(f"  {lines:,} lines, {xids:,} XID/SXid lines, {actual / 2**20:.0f} MiB in {time.perf_counter() - t:.1f}s")
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)       # warm the page cache
        grep_s = time_grep(path)
        scan_s, rss, report = run_diagnose(path)
        result = report["checks"][0]["result"]
        figures = {
            "format": args.format, "size_mib": round(actual / 2**20, 1), "lines": result["lines_scanned"], "xid_lines": xids,
            "kernel_events_listed": len(result["kernel_events"]),
            "kernel_events_omitted": result["kernel_events_omitted"],
            "scan_s": round(scan_s, 3), "grep_s": round(grep_s, 3),
            "lines_per_s": round(result["lines_scanned"] / scan_s),
            "mb_per_s": round(actual / 1e6 / scan_s, 1),
            "grep_mb_per_s": round(actual / 1e6 / grep_s, 1),
            "ratio_to_grep": round(grep_s / scan_s, 3),
            "peak_rss_mib": round(rss, 1),
            "problems": len(report["problems"]),
            "problem_rules": sorted({p["rule"] for p in report["problems"]}),
        }
        print(f"  gpu-npd: {figures['scan_s']}s = {figures['lines_per_s']:,} lines/s, {figures['mb_per_s']} MB/s, "
              f"peak RSS {figures['peak_rss_mib']} MiB")
        print(f"  grep -F -c Xid: {figures['grep_s']}s = {figures['grep_mb_per_s']} MB/s; "
              f"ratio {figures['ratio_to_grep']} (budget >= 0.5)")
        print(f"  {figures['problems']} problems: {', '.join(figures['problem_rules'])}")
        print(json.dumps(figures))
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            if not args.dir:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
