"""The nccl-tests backend (`detector.checks.nccl.nccl_tests`) against a fake all_reduce_perf.

The fake (tests/fixtures/nccl/fake_all_reduce_perf.py) is a real process: it records its argv, prints
a fixture, and exits with a code, dies by a signal, or hangs with a child in its process group. So the
flags, the progress relayed, the verdicts and the killing of the whole group at the deadline are real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from detector.checks.nccl.nccl_tests import NcclTestsBackend, find_all_reduce_perf
from detector.checks.nccl.probe import FAILED, OK, TIMEOUT, ProbeRequest, ProbeUnavailable

FAKE = Path(__file__).parent / "fixtures" / "nccl" / "fake_all_reduce_perf.py"
G8 = 8 * 1024 ** 3


@pytest.fixture(autouse=True)
def _fake_is_executable():
    assert os.access(FAKE, os.X_OK), f"{FAKE} must be executable (chmod +x)"


class Probe:
    """One backend run against the fake, with what it printed and what it was told."""

    def __init__(self, tmp_path: Path, backend: type[NcclTestsBackend] = NcclTestsBackend, **fake_env: str):
        self.argv_file = tmp_path / "argv.json"
        self.messages: list[str] = []
        env = {"FAKE_ALL_REDUCE_PERF_ARGV": str(self.argv_file)}
        env.update({f"FAKE_ALL_REDUCE_PERF_{k.upper()}": v for k, v in fake_env.items()})
        self.backend = backend(str(FAKE), env=env, tick_s=0.1, kill_grace_s=1.0)

    def run(self, ranks: int = 8, size_bytes: int = G8, timeout_s: float = 10.0, **kw):
        request = ProbeRequest(ranks=ranks, size_bytes=size_bytes, timeout_s=timeout_s,
                               progress=self.messages.append, **kw)
        return self.backend.run(request)

    @property
    def argv(self) -> list[str]:
        return json.loads(self.argv_file.read_text())


def test_pass_flags_figures_and_progress(tmp_path):
    probe = Probe(tmp_path, fixture="h100x8-pass.txt")
    result = probe.run()
    assert probe.argv == ["-b", str(G8), "-e", str(G8), "-g", "8", "-w", "5", "-n", "20", "-c", "1"]
    assert result.status == OK and result.error == ""
    assert (result.backend, result.transport, result.ranks, result.size_bytes) == ("nccl-tests", "nccl", 8, G8)
    assert (result.avg_busbw_gbps, result.busbw_gbps, result.min_busbw_gbps, result.wrong) == \
        (480.767, 480.767, 480.56, 0)
    assert 0 < result.duration_s < 5
    assert probe.messages[0] == f"running {FAKE} -b {G8} -e {G8} -g 8 -w 5 -n 20 -c 1 (killed at 10s)"
    assert "8589934592 B: busbw 480.6 GB/s out-of-place, 481.0 GB/s in-place, 0 wrong" in probe.messages
    assert "all_reduce_perf done: avg busbw 480.767 GB/s, 0 out-of-bounds" in probe.messages
    assert not any("NCCL INFO" in m for m in probe.messages)          # chatter is not relayed


def test_request_values_reach_the_flags(tmp_path):
    probe = Probe(tmp_path, fixture="h100x8-pass.txt")
    probe.run(ranks=4, size_bytes=1 << 30, warmup=2, iterations=7)
    assert probe.argv == ["-b", "1073741824", "-e", "1073741824", "-g", "4", "-w", "2", "-n", "7", "-c", "1"]


def test_degraded(tmp_path):
    result = Probe(tmp_path, fixture="h100x8-degraded.txt").run()
    assert result.status == OK
    assert (result.busbw_gbps, result.min_busbw_gbps, result.wrong) == (230.297, 230.18, 0)


def test_wrong_values_exit_1_is_ok_with_a_count(tmp_path):
    probe = Probe(tmp_path, fixture="h100x8-wrong.txt", exit="1")
    result = probe.run()
    assert result.status == OK and result.error == ""
    assert result.wrong == 33554400 + 131072 and result.busbw_gbps == 480.023
    assert "8589934592 B: busbw 480.2 GB/s out-of-place, 479.8 GB/s in-place, 33685472 wrong" in probe.messages


@pytest.mark.parametrize("code", ["1", "3"])
def test_aborted(tmp_path, code):
    probe = Probe(tmp_path, fixture="h100x8-aborted.txt", exit=code)
    result = probe.run()
    assert result.status == FAILED
    assert result.error.startswith(f"all_reduce_perf failed (exit {code}): h100-node-03: Test NCCL failure "
                                   "common.cu:1005 'unhandled cuda error")
    assert result.busbw_gbps is None and result.wrong is None
    warn = ("h100-node-03:77120:77146 [5] enqueue.cc:1556 NCCL WARN Cuda failure "
            "'uncorrectable NVLink error detected during the execution'")
    assert warn in probe.messages
    assert ".. h100-node-03 pid 77120: Test failure common.cu:891" in probe.messages


def test_crash_by_signal(tmp_path):
    result = Probe(tmp_path, fixture="h100x8-pass.txt", signal="SIGSEGV").run()
    assert result.status == FAILED
    assert result.error.startswith("all_reduce_perf killed by signal SIGSEGV (11)")


def test_non_zero_exit_without_output(tmp_path):
    result = Probe(tmp_path, exit="255").run()
    assert (result.status, result.error) == (FAILED, "all_reduce_perf exited 255 without results; no output")


def test_flags_the_binary_rejects_are_a_failure(tmp_path):
    """The real binary answers an unknown option with the usage and exit 0: that must not pass."""
    class Bogus(NcclTestsBackend):
        def argv(self, request):
            return super().argv(request) + ["-x", "1"]

    probe = Probe(tmp_path, Bogus, fixture="h100x8-pass.txt")
    result = probe.run()
    assert probe.argv[-2:] == ["-x", "1"]
    assert (result.status, result.error) == (FAILED, "all_reduce_perf failed: invalid option 'x'")


def test_binary_that_cannot_start(tmp_path):
    messages: list[str] = []
    result = NcclTestsBackend(str(tmp_path / "missing" / "all_reduce_perf")).run(
        ProbeRequest(ranks=8, size_bytes=G8, timeout_s=5, progress=messages.append))
    assert result.status == FAILED
    assert result.error == f"cannot run {tmp_path}/missing/all_reduce_perf: No such file or directory"
    not_executable = tmp_path / "all_reduce_perf"
    not_executable.write_text("#!/bin/sh\n")
    result = NcclTestsBackend(str(not_executable)).run(ProbeRequest(ranks=8, size_bytes=G8, timeout_s=5))
    assert (result.status, result.error) == (FAILED, f"cannot run {not_executable}: Permission denied")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_hang_is_killed_with_its_whole_process_group(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    probe = Probe(tmp_path, fixture="h100x8-aborted.txt", hang="1", child_pid=str(child_pid_file))
    started = time.monotonic()
    result = probe.run(timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert result.status == TIMEOUT
    assert result.error.startswith("all_reduce_perf killed after 1s (the whole process group); last output: ")
    assert 1.0 <= result.duration_s and elapsed < 1.0 + 1.0 + 1.0          # timeout + grace + slack
    child = int(child_pid_file.read_text())
    deadline = time.monotonic() + 3
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child), f"sleep child {child} outlived the probe"


def test_progress_ticks_while_it_runs(tmp_path):
    probe = Probe(tmp_path, fixture="h100x8-pass.txt", line_delay="0.02")
    result = probe.run(timeout_s=30)
    assert result.status == OK
    ticks = [m for m in probe.messages if m.startswith("all_reduce_perf running for")]
    assert ticks and all(re.fullmatch(r"all_reduce_perf running for \d+s \(killed at 30s\)", t) for t in ticks)


# --------------------------------------------------------------------------------------------------
# find_all_reduce_perf
# --------------------------------------------------------------------------------------------------

def _install(folder: Path, name: str = "all_reduce_perf") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    shutil.copy(FAKE, target)
    target.chmod(0o755)
    return target


def test_find_configured_executable(tmp_path):
    binary = _install(tmp_path / "opt")
    assert find_all_reduce_perf(str(binary), path="") == str(binary)


def test_find_on_path(tmp_path):
    binary = _install(tmp_path / "bin")
    assert find_all_reduce_perf(None, path=str(tmp_path / "bin")) == str(binary)
    assert find_all_reduce_perf("", path=str(tmp_path / "bin")) == str(binary)


def test_find_configured_bare_name_on_path(tmp_path):
    binary = _install(tmp_path / "bin", "all_reduce_perf_mpi")
    assert find_all_reduce_perf("all_reduce_perf_mpi", path=str(tmp_path / "bin")) == str(binary)


def test_an_unusable_configured_binary_is_an_error_not_a_reason_to_run_another(tmp_path):
    _install(tmp_path / "bin")                    # on PATH, and still not run in its place
    with pytest.raises(ProbeUnavailable) as caught:
        find_all_reduce_perf(str(tmp_path / "nope" / "all_reduce_perf"), path=str(tmp_path / "bin"))
    message = str(caught.value)
    assert f"configured {tmp_path}/nope/all_reduce_perf does not exist" in message
    assert "Install nccl-tests" in message and "--nccl-tests PATH" in message and "checks.nccl.nccl_tests" in message


def test_find_nothing_says_what_where_and_how_to_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProbeUnavailable) as caught:
        find_all_reduce_perf(None, path=str(empty))
    message = str(caught.value)
    assert f"all_reduce_perf is not on PATH ({empty})" in message
    assert "Install nccl-tests" in message and "--nccl-tests PATH" in message
    with pytest.raises(ProbeUnavailable, match="configured 'all_reduce_perf_mpi' is not on PATH"):
        find_all_reduce_perf("all_reduce_perf_mpi", path=str(empty))


@pytest.mark.parametrize("setup, why", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("#!/bin/sh\n"), "is not executable"),
])
def test_find_says_why_the_configured_one_is_unusable(tmp_path, setup, why):
    target = tmp_path / "all_reduce_perf"
    setup(target)
    with pytest.raises(ProbeUnavailable, match=re.escape(f"configured {target} {why}")):
        find_all_reduce_perf(str(target), path="")


def test_find_without_path_uses_the_environment(tmp_path, monkeypatch):
    binary = _install(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert find_all_reduce_perf(None) == str(binary)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProbeUnavailable, match=re.escape(f"is not on PATH ({tmp_path})")):
        find_all_reduce_perf(None)
