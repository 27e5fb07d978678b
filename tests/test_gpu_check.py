"""`make gpu-check` (tools/gpu_check.py): one folder with every step's output and a summary that says
what each step found. Dry-run on a fake node here; on a GPU machine the same code runs real NVML."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from test_cli import _driver_present

TOOL = [sys.executable, str(REPO / "tools" / "gpu_check.py")]


def test_dry_run_writes_every_step_and_a_summary(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([*TOOL, "--out", str(out), "--nvml", "fake:h100-sxm-8-pcie-x8"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    lines = {line.split()[0]: line for line in summary.splitlines()[1:]}
    assert set(lines) == {"conformance", "diagnose", "nccl", "raw"}
    assert "passed" in lines["conformance"] and "failed" not in lines["conformance"]
    assert "problems: PcieLinkWidthDegraded" in lines["diagnose"]      # a finding, not a failure
    report = json.loads((out / "diagnose.json").read_text())
    from detector.core.check import CheckRegistry
    assert {c["name"] for c in report["checks"]} == set(CheckRegistry.from_entry_points().names())
    nccl = json.loads((out / "nccl.json").read_text())
    assert [c["name"] for c in nccl["checks"]] == ["nccl"] and nccl["checks"][0]["status"] == "ok"
    assert "SERIAL" in (out / "diagnose.txt").read_text()
    assert (out / "conformance.xml").is_file()


@pytest.mark.skipif(_driver_present(), reason="this machine has a GPU: the refusal is for machines without one")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([*TOOL, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "no NVIDIA GPU" in proc.stderr and "--nvml fake:" in proc.stderr
