"""Ctrl-C stops `diagnose` promptly while nvidia-smi hangs, and the hung nvidia-smi does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import REPO


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_ctrl_c_while_nvidia_smi_hangs_exits_at_once_and_kills_it(tmp_path):
    pid_file = tmp_path / "smi.pid"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    smi.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", "fake:h100-sxm-8",
                             "--nvidia-smi", str(smi), "-q"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    smi_pid = int(pid_file.read_text())
    assert _running(smi_pid)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    out, _ = proc.communicate(timeout=10)
    assert time.monotonic() - began < 3 and proc.returncode == 130
    assert out == ""                                   # no results printed as if nothing had happened
    time.sleep(0.2)
    left_behind = _running(smi_pid)
    if left_behind:                                    # never leave it behind, even when the test fails
        os.kill(smi_pid, signal.SIGKILL)
    assert not left_behind
