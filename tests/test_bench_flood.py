"""bench/flood.py runs end to end on a tiny flood and loses nothing (no timing assertions: the speed
budget is the benchmark's to judge, not a unit test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"lines", "lines_read", "daemon_cpu_s", "lines_per_cpu_s", "wall_s", "wall_lines_per_s", "xid_lines_in",
          "xid_events_out", "xid_counted_by_check", "xid_by_code_in", "xid_by_code_out", "lost_records",
          "peak_rss_mib", "nothing_lost"}


@pytest.mark.parametrize("source", ["kmsg", "journal"])
def test_tiny_flood_loses_nothing(source):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "flood.py"), "--source", source, "--lines", "2000",
                           "--xid-every", "50", "--timeout", "60"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    f = figures[source]
    assert FIELDS <= set(f)
    assert f["lines"] == f["lines_read"] == 2000
    assert f["xid_lines_in"] == 40
    assert f["xid_events_out"] == f["xid_counted_by_check"] == 40
    assert f["xid_by_code_out"] == f["xid_by_code_in"]
    assert f["lost_records"] == 0 and f["nothing_lost"] and figures["nothing_lost"]
    assert f["peak_rss_mib"] > 0 and f["daemon_cpu_s"] >= 0


def test_help_explains_the_measurement():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "flood.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT).stdout
    for word in ("--lines", "--xid-every", "--source", "per core", "journalctl", "SOCK_SEQPACKET"):
        assert word in out
