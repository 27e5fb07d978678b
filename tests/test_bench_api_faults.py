"""bench/api_faults.py runs end to end in its quick mode and prints its table and figures (the bounds are the
benchmark's to judge on its full run, not a unit test's on a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "api_faults.py"


def test_quick_run_prints_a_table_and_the_figures():
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--scenario", "gone", "--scenario", "endless-line"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split() == ["scenario", "figure", "bound", "verdict"], proc.stdout + proc.stderr
    assert [line.split()[0] for line in lines[1:3]] == ["gone", "endless-line"]
    figures = json.loads(lines[-1])
    assert figures["seconds"] == 5 and set(figures["scenarios"]) == {"gone", "endless-line"}
    gone, endless = figures["scenarios"]["gone"], figures["scenarios"]["endless-line"]
    assert gone["requests"] >= 1 and gone["busiest_minute"] == gone["requests"] and gone["alive"]
    assert endless["peak_rss_mib"] > 0 and endless["node_watches"] >= 1
    assert proc.returncode == (0 if figures["ok"] else 1) and "Traceback" not in proc.stderr


def test_bad_usage_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, str(BENCH), "--scenario", "nope"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_help_names_every_scenario_and_bound():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT).stdout
    for words in ("gone", "ends-at-once", "bookmark-then-end", "429", "5xx", "retry-after-100000",
                  "retry-after-inf", "endless-line", "trickle", "--quick", "--seconds", "VmHWM", "12"):
        assert words in out
