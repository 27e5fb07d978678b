"""Ctrl-C stops `diagnose` promptly while nvidia-smi hangs, and the hung nvidia-smi does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_while_nvidia_smi_hangs_exits_at_once_and_kills_it(tmp_path, signum, code):
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
    proc.send_signal(signum)
    began = time.monotonic()
    out, _ = proc.communicate(timeout=10)
    assert time.monotonic() - began < 3 and proc.returncode == code
    assert out == ""                                   # no results printed as if nothing had happened
    time.sleep(0.2)
    left_behind = _running(smi_pid)
    if left_behind:                                    # never leave it behind, even when the test fails
        os.kill(smi_pid, signal.SIGKILL)
    assert not left_behind


def _wait_for_line(stream, needle: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"never saw {needle!r} in: {''.join(seen)}")


def test_sigterm_stops_the_daemon_promptly_while_an_nvml_call_hangs(tmp_path):
    # GPU 2 blocks every NVML call for two minutes; the inventory's deadline is set far beyond the test.
    proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "run", "--nvml", "fake:h100-sxm-8-nvml-hang",
                             "--no-kube", "--node-name", "hang-1", "--listen", "127.0.0.1:0", "--start-spread", "0",
                             "--inventory-timeout", "100", "--log-level", "debug"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_line(proc.stderr, "metrics and health on http://")
        time.sleep(1.5)                                # the first sweep is now stuck on GPU 2
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=15)[1]
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and took < 5, (proc.returncode, took, rest)
    assert "stopping without waiting for scheduler" in rest and "stopped" in rest
    assert "Traceback" not in rest


def test_a_second_ctrl_c_exits_at_once_and_kills_child_groups(tmp_path):
    """The first signal asks politely (here: a command that ignores it); the second does not wait."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "from detector.cli.signals import on_stop_signals\n"
        "from detector.backends.children import LIVE_GROUPS\n"
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "LIVE_GROUPS.add(child.pid)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "on_stop_signals(lambda signum: print('first', flush=True))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
        "print('not interrupted', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "first"
    assert proc.poll() is None                         # the first one only asked
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 130 and time.monotonic() - began < 2
    time.sleep(0.2)
    left_behind = _running(child)
    if left_behind:
        os.kill(child, signal.SIGKILL)
    assert not left_behind
