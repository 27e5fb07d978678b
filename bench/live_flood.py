#!/usr/bin/env python3
"""The daemon's live kernel-log path under a flood: how many lines a second the xid check takes.

Feeds the xid check kernel records as /dev/kmsg hands them over (kernel facility, seconds since boot,
wall time), a flood of one XID 95 (a real incident's shape: 800,000 lines in a few hours) mixed with
ordinary kernel noise, in batches as the daemon's reader delivers them, and times the check's runs.
Budget (DESIGN section 8): >= 100,000 lines/s on one core, nothing lost. The last line printed is a
JSON object of the figures.

    .venv/bin/python bench/live_flood.py                # 400,000 lines, half of them XID 95
    .venv/bin/python bench/live_flood.py --lines 100000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from detector.backends.kernlog.records import LogLine  # noqa: E402
from detector.checks.xid import XidCheck  # noqa: E402
from detector.core.sweep import run_sweep  # noqa: E402
from fake_nvml.host import fake_host  # noqa: E402
from fake_nvml.scenario import load_scenario  # noqa: E402

FLOOD = "NVRM: Xid (PCI:0000:5d:00): 95, pid=4242, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"
NOISE = "IPv6: ADDRCONF(NETDEV_CHANGE): veth1a2b3c: link becomes ready"
BATCH = 4096                        # records one read_available() hands over


class _Flood:
    """A live reader: `lines` kmsg records, BATCH at a time."""

    name = "kmsg (bench)"

    def __init__(self, lines: int):
        self.left, self.seq, self.t0 = lines, 0, time.time()

    def read_available(self) -> list[LogLine]:
        batch = []
        for _ in range(min(BATCH, self.left)):
            self.seq += 1
            text = FLOOD if self.seq % 2 else NOISE
            batch.append(LogLine(text, seq=self.seq, boot_id="bench", monotonic_us=self.seq * 1000,
                                 realtime=self.t0 + self.seq / 1000, priority=3))
        self.left -= len(batch)
        return batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=400_000)
    args = parser.parse_args()
    host = fake_host(load_scenario("h100-sxm-8").build(None))
    host.threaded = False
    reader = _Flood(args.lines)
    host.kernel_log = reader
    check = XidCheck({"nvml_events": False})
    incidents = lines = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while reader.left:
        run = run_sweep(host, [check], inventory_timeout_s=5).runs[0]
        lines += run.result["lines_scanned"]
        incidents += run.result["incidents"]
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    figures = {"lines": lines, "xid_lines": (lines + 1) // 2, "incidents": incidents,
               "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "lines_per_cpu_s": round(lines / cpu),
               "budget_lines_per_s": 100_000}
    print(f"{lines:,} lines ({figures['xid_lines']:,} XID 95) in {cpu:.2f} s of CPU: "
          f"{figures['lines_per_cpu_s']:,} lines/s per core (budget >= 100,000); {incidents} incident(s)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
