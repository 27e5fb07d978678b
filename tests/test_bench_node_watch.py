"""bench/node_watch.py runs end to end on a short scaled hour (no timing assertions: the figures are the
benchmark's to print, not a unit test's to judge)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_run_counts_the_watch_and_ignores_kubelets_updates():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "node_watch.py"), "--hour-s", "4", "--settle", "360"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = figures["watch_on"], figures["watch_off"]
    assert on["by_verb_resource"].get("watch nodes", 0) > 0 and "watch nodes" not in off["by_verb_resource"]
    assert on["startup_requests"]["list nodes"] == 1 and "list nodes" not in off["startup_requests"]
    assert 1 <= on["on_change_calls"] <= 3              # the first read (and gpu-npd's own conditions), not kubelet's
    assert off["on_change_calls"] == 0 and on["watch_timeout_s"] == 1


def test_help_says_the_clock_is_scaled():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "node_watch.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT).stdout
    for words in ("--hour-s", "scaled", "kubelet", "per node-hour"):
        assert words in out
