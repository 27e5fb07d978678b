"""run_process: a probe program in its own process group, output relayed and bounded, the whole group
killed at the deadline, and nothing it leaves behind surviving it."""

from __future__ import annotations

import sys
import time

from detector.checks.nccl import process
from detector.checks.nccl.process import run_process


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_output_is_relayed_line_by_line_and_kept(tmp_path):
    lines: list[str] = []
    out = run_process([sys.executable, "-c", "import sys; print('one'); print('two', file=sys.stderr); sys.exit(3)"],
                      10, on_line=lines.append)
    assert (out.status, out.returncode) == ("exited", 3)
    assert sorted(lines) == ["one", "two"] and "one\n" in out.output and "two\n" in out.output


def test_the_whole_group_is_killed_at_the_deadline_even_if_it_ignores_sigterm(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = (f"import os, signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"c = subprocess.Popen(['sleep', '1000']); open({str(pidfile)!r}, 'w').write(str(c.pid)); "
              f"print('started', flush=True); time.sleep(1000)")
    ticks: list[float] = []
    started = time.monotonic()
    out = run_process([sys.executable, "-c", script], 1.0, on_tick=ticks.append, tick_s=0.3, kill_grace_s=0.5)
    assert out.status == "timeout" and "whole process group" in out.error and out.output == "started\n"
    assert time.monotonic() - started < 3.0
    assert ticks and all(t < 1.2 for t in ticks)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_what_a_finished_program_leaves_running_is_killed(tmp_path):
    pidfile = tmp_path / "orphan.pid"
    out = run_process(["bash", "-c", f"sleep 1000 & echo $! > {pidfile}; echo done"], 10)
    assert out.status == "exited" and out.returncode == 0
    orphan = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(orphan)


def test_a_missing_program_is_an_outcome_not_an_exception():
    out = run_process(["/nonexistent/all_reduce_perf"], 5)
    assert out.status == "error" and "No such file" in out.error and out.returncode is None


def test_broken_callbacks_lose_nothing():
    def broken(*_: object) -> None:
        raise RuntimeError("display gone")
    out = run_process([sys.executable, "-c", "import time; print('a', flush=True); time.sleep(0.4); print('b')"],
                      10, on_line=broken, on_tick=broken, tick_s=0.1)
    assert out.status == "exited" and out.output == "a\nb\n"


def test_very_long_output_keeps_head_and_tail(monkeypatch):
    monkeypatch.setattr(process, "HEAD_LINES", 3)
    monkeypatch.setattr(process, "TAIL_LINES", 2)
    out = run_process([sys.executable, "-c", "[print(i) for i in range(10)]"], 10)
    assert out.output == "0\n1\n2\n... 5 lines not kept ...\n8\n9\n" and out.dropped_lines == 5
