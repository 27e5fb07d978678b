"""The daemon's footprint: `gpu-npd run` loads only what a node needs (bench/footprint.py measures the
RSS; these tests keep modules that only other commands use from creeping back into its imports)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from conftest import REPO
from detector.backends.kernlog.kmsg import boot_time

# What `gpu-npd run` imports before its first sweep: the command line, the daemon, every registered
# check (entry points) and what the real backend's kernel-log reader calls at start.
RUN_IMPORTS = """
import json, sys
from detector.cli.main import build_parser
build_parser()
from detector.cli.daemon import cmd_run
from detector.core.check import CheckRegistry
import detector.backends.infiniband, detector.backends.system, detector.kube.api
from detector.backends.kernlog import boot_time, read_boot_id
CheckRegistry.from_entry_points()
boot_time(), read_boot_id()
print(json.dumps(sorted(sys.modules)))
"""

# Modules the daemon has no use for on a node: the fake node, diagnose's one-shot run and table, the
# optional saved-log scanner, the test-only Kubernetes client, and psutil (one number, read directly).
NOT_FOR_A_NODE = ("fake_nvml", "detector.agent.oneshot", "detector.cli.render", "detector.sim", "kube_emulator",
                  "hyperscan", "kubernetes", "trustme", "psutil")


def test_gpu_npd_run_imports_nothing_only_other_commands_use():
    proc = subprocess.run([sys.executable, "-c", RUN_IMPORTS], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout)
    assert "detector.daemon.run" in modules and "pynvml" in modules and "prometheus_client" in modules
    loaded = [m for m in modules if m.split(".")[0] in NOT_FOR_A_NODE or m.startswith(NOT_FOR_A_NODE)]
    assert loaded == []


def test_boot_time_is_the_kernels_btime_as_psutil_reads_it():
    assert boot_time() == psutil.boot_time()
    stat = open("/proc/stat").read()
    assert f"btime {int(boot_time())}\n" in stat


def test_boot_time_without_btime_falls_back_to_the_monotonic_clock(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("".join(line for line in open("/proc/stat") if not line.startswith("btime")))
    for path in (stat, tmp_path / "missing"):
        assert abs(boot_time(str(path)) - (time.time() - time.monotonic())) < 1.0
