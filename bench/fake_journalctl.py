#!/usr/bin/env python3
"""A fake `journalctl -k -o json` for bench/flood.py: a kernel journal that holds a flood.

The journal is described by a small JSON file named by $FLOOD_JOURNAL: {"pre": P, "total": T, "xid_every":
K, "boot_id": ..., "t0": ...}. Entries 0..P-1 are what the kernel logged before the flood; entries P..T-1
are the flood (flood_line below: ordinary kernel lines with a real XID line every K-th). bench/flood.py
raises `total` when the flood starts, so the whole flood is in the journal at once (journald wrote it as
fast as the kernel printed) and every run of this script hands out as many entries as it is asked for.

Understands what JournaldReader runs: `-k -o json --no-pager --quiet`, with `-n N` (the newest N entries)
or `--after-cursor C -n N` (the N entries after C). Entries look like journald's: strings for every field,
the kmsg time as _SOURCE_MONOTONIC_TIMESTAMP, _TRANSPORT=kernel. Standard library only, so that it starts
fast under `python -S`.
"""

from __future__ import annotations

import json
import os
import sys

# Ordinary kernel lines (none is an XID): what fills a kernel log while something floods it.
NOISE = (
    "IPv6: ADDRCONF(NETDEV_CHANGE): veth1a2b3c4: link becomes ready",
    "cni0: port 3(veth1a2b3c4) entered forwarding state",
    "INFO: task cache_mgr_event:620917 blocked for more than 120 seconds.",
    "audit: type=1400 audit(1728757532.114:4242): apparmor=\"DENIED\" operation=\"open\" "
    "profile=\"cri-containerd.apparmor.d\" name=\"/proc/sys/kernel/hostname\" pid=31337 comm=\"nginx\"",
    "nvidia-nvswitch0: open (major=511)",
    "NVRM: GPU0 GSP RPC buffer contains function 76 (GSP_RM_CONTROL) and data 0x000000002080014b.",
    "xfs filesystem being remounted at /var/lib/kubelet/pods/1f2e3d4c/volume-subpaths supports timestamps until 2038",
    "eth0: renamed from tmp1a2b3",
)

# Real XID lines (tests/fixtures/real_logs: gpud #117 and #1160, bumblebee, nvidia forums), all of codes
# whose rule reports an event, each line with the event reason's code so that counts can be compared.
XIDS = (
    (45, "NVRM: Xid (PCI:0000:61:00): 45, pid=1496200, name=distprovers-gpu, Ch 0000000a"),
    (13, "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
         "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"),
    (31, "NVRM: Xid (PCI:0000:cb:00): 31, pid=626486, name=pt_main_thread, Ch 00000008, intr 00000000. MMU "
         "Fault: ENGINE GRAPHICS GPCCLIENT_T1_14 faulted @ 0x7f2f_cca58000. Fault is of type FAULT_PDE "
         "ACCESS_TYPE_VIRT_READ"),
    (32, "NVRM: Xid (PCI:0000:01:00): 32, Channel ID 00000005 intr 00008000"),
    (69, "NVRM: Xid (PCI:0000:01:00): 69, Class Error: ChId 0005, Class 0000a097, Offset 00000d9c, Data "
         "ffffffff, ErrorCode 0000000c"),
)

PRE = (
    "Linux version 6.8.0-49-generic (buildd@lcy02-amd64-103) (x86_64-linux-gnu-gcc-13 (Ubuntu 13.2.0-23ubuntu4) "
    "13.2.0, GNU ld (GNU Binutils for Ubuntu) 2.42) #49-Ubuntu SMP PREEMPT_DYNAMIC Mon Nov  4 02:06:24 UTC 2024",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  560.35.03  Fri Aug 16 21:39:15 UTC 2024",
)

LEVEL_NOISE, LEVEL_XID = 6, 3      # KERN_INFO, KERN_ERR (the driver prints XIDs at KERN_ERR)


def flood_line(i: int, xid_every: int) -> tuple[str, int, int | None]:
    """The flood's i-th line (0-based): (text, level, XID code or None)."""
    if xid_every > 0 and (i + 1) % xid_every == 0:
        code, text = XIDS[(i // xid_every) % len(XIDS)]
        return text, LEVEL_XID, code
    return NOISE[i % len(NOISE)], LEVEL_NOISE, None


def expected_xids(lines: int, xid_every: int) -> dict[int, int]:
    """XID lines per code in a flood of `lines` lines."""
    counts: dict[int, int] = {}
    if xid_every > 0:
        for n in range(lines // xid_every):
            code = XIDS[n % len(XIDS)][0]
            counts[code] = counts.get(code, 0) + 1
    return counts


def entry(index: int, journal: dict) -> str:
    """Journal entry `index` as one line of `journalctl -o json`."""
    pre = journal["pre"]
    if index < pre:
        text, level = PRE[index % len(PRE)], 6
    else:
        text, level, _ = flood_line(index - pre, journal["xid_every"])
    usec = 5_000_000 + index * 10             # kernel time: 10 us apart
    boot = journal["boot_id"]
    return json.dumps({
        "__CURSOR": f"s=7e3f0c1d2b4a45f8a1c9d0e2f3b4c5d6;b={boot};m={usec:x};t={usec:x};x=0;i={index}",
        "__REALTIME_TIMESTAMP": str(int(journal["t0"] * 1e6) + usec),
        "__MONOTONIC_TIMESTAMP": str(usec + 120), "_BOOT_ID": boot, "_TRANSPORT": "kernel",
        "PRIORITY": str(level), "SYSLOG_FACILITY": "0", "SYSLOG_IDENTIFIER": "kernel",
        "_SOURCE_MONOTONIC_TIMESTAMP": str(usec), "_MACHINE_ID": "2b1f0e3c4d5a69788796a5b4c3d2e1f0",
        "_HOSTNAME": "flood-node", "_RUNTIME_SCOPE": "system", "MESSAGE": text,
    })


def main(argv: list[str]) -> int:
    with open(os.environ["FLOOD_JOURNAL"], encoding="utf-8") as f:
        journal = json.load(f)
    total = journal["total"]
    after, n = None, None
    args = iter(argv)
    for a in args:
        if a == "--after-cursor":
            after = next(args)
        elif a == "-n":
            n = int(next(args))
    if after is not None:
        start = int(after.rsplit("i=", 1)[1]) + 1
        end = total if n is None else min(total, start + n)
    else:
        start, end = (0, total) if n is None else (max(0, total - n), total)
    out = sys.stdout
    out.write("".join(entry(i, journal) + "\n" for i in range(start, end)))
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
