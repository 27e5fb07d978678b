"""`make gpu-check` (tools/gpu_check.py): one folder with every step's output and a summary that says
what each step found. Dry-run on a fake node here, also in a Python laid out like the GPU machine's
(only the runtime packages, pytest and setuptools; no gpu-npd installed, no kubernetes, trustme or
hyperscan); on a GPU machine the same code runs real NVML and provokes CUDA faults."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from test_cli import _driver_present

TOOL = [sys.executable, str(REPO / "tools" / "gpu_check.py")]
FIXTURES = REPO / "tests" / "fixtures" / "gpu_check"
SHORT_DAEMON = ["--settle", "6", "--quiet", "3"]

sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402

# What python3 has on the GPU machine gpu-check runs on (no network there): distributions, by name.
DEVICE_PACKAGES = ("nvidia-ml-py", "psutil", "pyyaml", "prometheus-client", "urllib3", "pytest", "pluggy",
                   "iniconfig", "packaging", "pygments", "setuptools")
ABSENT_THERE = ("kubernetes", "trustme", "hyperscan")


def test_dry_run_writes_every_step_and_a_summary(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([*TOOL, "--out", str(out), "--nvml", "fake:h100-sxm-8-pcie-x8", *SHORT_DAEMON],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    lines = {line.split()[0]: line for line in summary.splitlines()[1:] if not line.startswith(" ")}
    assert set(lines) == {"conformance", "diagnose", "nccl", "daemon", "raw"}
    assert "passed" in lines["conformance"] and "failed" not in lines["conformance"]
    assert "problems: PcieLinkWidthDegraded" in lines["diagnose"]      # a finding, not a failure
    report = json.loads((out / "diagnose.json").read_text())
    from detector.core.check import CheckRegistry
    assert {c["name"] for c in report["checks"]} == set(CheckRegistry.from_entry_points().names())
    nccl = json.loads((out / "nccl.json").read_text())
    assert [c["name"] for c in nccl["checks"]] == ["nccl"] and nccl["checks"][0]["status"] == "ok"
    assert "SERIAL" in (out / "diagnose.txt").read_text()
    assert (out / "conformance.xml").is_file()

    # The daemon sees the same degraded link: one condition, and the GPU's device of the ResourceSlice
    # tainted NoSchedule through DRA. A dry run says in one line why it provokes no fault.
    daemon = json.loads((out / "daemon.json").read_text())
    assert daemon["exit_code"] == 0
    assert daemon["verdict"]["conditions_true"] == ["GpuPcieDegraded/PcieLinkWidthDegraded"]
    assert daemon["verdict"]["device_taint_rules"] == ["gpu-npd.io/gpu-unhealthy=degraded:NoSchedule on gpu-5"]
    # the two conditions a remediator and the readiness gate read are always there; others only once seen
    assert daemon["verdict"]["condition_types"] == ["GpuNodeNeedsRemediation", "GpuNodeUnverified", "GpuPcieDegraded"]
    assert "ok: verdict NOT healthy" in lines["daemon"]
    assert "faults: skipped: a dry run" in summary
    steady = daemon["steady"]
    assert 15 < steady["rss_mib"] < 200 and steady["rss_anon_mib"] + steady["rss_file_mib"] <= steady["rss_mib"] + 1
    assert 0 <= steady["cpu_millicores"] < 500 and steady["threads"] >= 3
    assert daemon["api_requests"] > 0 and len(daemon["gpus"]) == 8
    everything = json.loads((out / "gpu-check.json").read_text())
    assert [s["name"] for s in everything["steps"]] == ["conformance", "diagnose", "nccl", "daemon", "raw"]


def test_a_step_that_breaks_fails_alone_and_says_why(tmp_path):
    """A scenario that does not exist: diagnose exits 2 and the daemon step cannot build the node's
    ResourceSlice; both are FAILED lines, raw still runs, and the exit code is 1."""
    out = tmp_path / "check"
    proc = subprocess.run([*TOOL, "--out", str(out), "--nvml", "fake:no-such-node", "--skip", "conformance,nccl"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = {line.split()[0]: line for line in (out / "summary.txt").read_text().splitlines()[1:]
             if not line.startswith(" ")}
    assert list(lines) == ["diagnose", "daemon", "raw"]
    assert "FAILED: exit 2" in lines["diagnose"]
    assert "FAILED: " in lines["daemon"] and "no-such-node" in lines["daemon"]
    assert "Traceback" in (out / "daemon.error.txt").read_text()
    assert lines["raw"].split()[1] == "0"


def _device_like_python(root: Path) -> Path:
    """A venv holding only DEVICE_PACKAGES (linked from this one), as the GPU machine's python3 has them."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next(root.glob("lib/python3*/site-packages"))
    for name in DEVICE_PACKAGES:
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists() and not top.endswith(".pth") and top != "__pycache__":
                (site / top).symlink_to(source)
    return root / "bin" / "python"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_runs_on_a_bare_checkout_with_only_the_device_packages(tmp_path):
    python = _device_like_python(tmp_path / "venv")
    probe = ("import importlib.metadata as m, importlib.util as u, sys\n"
             f"absent = [n for n in {ABSENT_THERE!r} if u.find_spec(n)]\n"
             "ours = list(m.entry_points(group='gpu_npd.checks'))\n"
             "print(absent, len(ours))")
    seen = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert seen.stdout.split() == ["[]", "0"], seen.stdout + seen.stderr     # nothing of gpu-npd installed there

    out = tmp_path / "check"
    checkout = _bare_checkout(tmp_path / "checkout")        # no gpu_npd.egg-info that `make install` left
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_CHECK_PYTHON={python}", "GPU_CHECK_NVML=fake:h100-sxm-8",
                           f"GPU_CHECK_OUT={out}", f"GPU_CHECK_ARGS=--skip nccl {' '.join(SHORT_DAEMON)}"],
                          capture_output=True, text=True, timeout=300, cwd=checkout,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {s["name"]: s for s in json.loads((out / "gpu-check.json").read_text())["steps"]}
    assert list(steps) == ["conformance", "diagnose", "daemon", "raw"]
    assert steps["conformance"]["outcome"].startswith("ok: ") and "passed" in steps["conformance"]["outcome"]
    assert "visibility ok" in steps["diagnose"]["outcome"] and "xid ok" in steps["diagnose"]["outcome"]
    assert steps["diagnose"]["outcome"].endswith("problems: none")
    assert steps["daemon"]["outcome"].startswith("ok: verdict healthy")
    assert (checkout / "build" / "gpu-check-metadata").is_dir()


def _bare_checkout(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked and not ignored), nothing installed."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():                              # detector/rules/builtin -> rules/
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    return dest


def test_event_fields_read_real_xid_events():
    """Events the daemon wrote on a real H100 while CUDA programs faulted (tests/fixtures/gpu_check)."""
    events = {e["reason"]: e["message"] for e in json.loads((FIXTURES / "events-h100-vm-580.json").read_text())}
    assert gpu_check.event_fields(events["Xid31GpuMemoryPageFault"]) == {
        "gpu": 0, "xid": 31, "process": "python3", "pid": 682}
    # That version of the daemon did not find the pid of an XID 13 (on the third of its lines): said so.
    assert gpu_check.event_fields(events["Xid13GraphicsEngineException"]) == {
        "gpu": 0, "xid": 13, "process": None, "pid": None}
    assert gpu_check.event_fields(events["NvlinkMissing"])["xid"] is None


class _Events:
    """The emulator's side of _await_event: events as they are listed, changing as calls go by."""

    def __init__(self, *snapshots: list[dict]):
        self.snapshots = list(snapshots)

    def events(self) -> list[dict]:
        return self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]


def _event(reason: str, count: int, message: str) -> dict:
    return {"reason": reason, "count": count, "message": message, "type": "Warning",
            "involvedObject": {"name": gpu_check.NODE}}


def test_a_fault_is_matched_to_the_xid_event_that_is_new_or_counted_again():
    messages = {e["reason"]: e["message"] for e in json.loads((FIXTURES / "events-h100-vm-580.json").read_text())}
    xid13 = messages["Xid13GraphicsEngineException"]
    unrelated = _event("NodeWideProblem", 1, messages["NodeWideProblem"])
    before = {"Xid13GraphicsEngineException": 1, "NodeWideProblem": 1}
    repeated = _event("XidApplicationErrorsRepeated", 1, messages["XidApplicationErrorsRepeated"])
    emulator = _Events([unrelated, _event("Xid13GraphicsEngineException", 1, xid13)],
                       [unrelated, repeated, _event("Xid13GraphicsEngineException", 2, xid13)])
    found = gpu_check._await_event(emulator, before, {"launch": 0.0}, timeout_s=5, xid=13)
    assert found["event"]["reason"] == "Xid13GraphicsEngineException" and found["event"]["count"] == 2
    assert found["also"] == ["XidApplicationErrorsRepeated"]
    assert found["seconds_to_event"] > 0

    quiet = _Events([unrelated, _event("Xid13GraphicsEngineException", 1, xid13)])
    assert gpu_check._await_event(quiet, before, {"launch": 0.0}, timeout_s=0.2, xid=13) == {
        "event": None, "seconds_to_event": None, "also": []}


def test_fault_program_without_a_cuda_library_says_so_and_launches_nothing(tmp_path):
    """Here there is no GPU: cupy is absent and torch (if installed) has no CUDA, so the program tries
    what it can, launches no kernel, and ends with one line saying why."""
    proc = subprocess.run([sys.executable, "-c", gpu_check.FAULT_PROGRAM, "trap"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    said = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not any("launch" in s for s in said)
    assert said[-1] == {"skip": "neither cupy nor torch could run a CUDA kernel here: no fault provoked"}
    if importlib.util.find_spec("torch"):
        assert said[0]["via"] == "torch" and said[0]["error"]


@pytest.mark.skipif(_driver_present(), reason="this machine has a GPU: the refusal is for machines without one")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([*TOOL, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "no NVIDIA GPU" in proc.stderr and "--nvml fake:" in proc.stderr


def test_largest_mappings_add_up_to_the_process_rss():
    """This test process's own /proc/self/smaps: every mapping's RSS summed is its VmRSS (both read from
    the kernel a moment apart), the interpreter's library among them."""
    mappings = gpu_check.largest_mappings(os.getpid(), top=10_000)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss_mib = int(status["VmRSS"].split()[0]) / 1024
    assert abs(sum(m for _, m in mappings) - rss_mib) < max(2.0, 0.05 * rss_mib)
    assert mappings == sorted(mappings, key=lambda item: -item[1])
    names = [name for name, _ in mappings]
    assert any("python" in name or name == "[heap]" for name in names[:5])
    assert gpu_check.largest_mappings(-1) == []


CUPY_STAND_IN = '''
"""Stands in for cupy: compiles nothing, and the launched kernel fails at the next synchronize, as a
faulting CUDA kernel does."""
import types

launched = []

class RawModule:
    def __init__(self, code):
        assert 'extern "C" __global__ void fault(int v)' in code
    def get_function(self, name):
        return lambda grid, block, args: launched.append(name)

class Device:
    def __init__(self, index):
        pass
    def synchronize(self):
        if launched:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

int32 = int
cuda = types.SimpleNamespace(Device=Device)
'''


class _GrowingEvents:
    """The emulator's events as a daemon writes them while faults go on: every look finds each of the
    real H100's two XID events counted once more (XID 43 never comes)."""

    def __init__(self, messages: dict[str, str]):
        self.messages, self.looks = messages, 0

    def events(self) -> list[dict]:
        self.looks += 1
        return [_event(reason, self.looks, self.messages[reason])
                for reason in ("Xid31GpuMemoryPageFault", "Xid13GraphicsEngineException")]


def test_faults_on_a_gpu_each_run_alone_and_are_matched_to_their_event(tmp_path):
    """The real-GPU path of the daemon step with cupy stood in: each fault is a process of its own that
    says its pid and launch time, its CUDA error is kept, and its event is found (or said missing)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "cupy.py").write_text(CUPY_STAND_IN)
    messages = {e["reason"]: e["message"] for e in json.loads((FIXTURES / "events-h100-vm-580.json").read_text())}
    times = gpu_check.DaemonTimes(settle_s=0, quiet_s=0, fault_timeout_s=60, event_timeout_s=0.5)
    faults = gpu_check._provoke(tmp_path, _GrowingEvents(messages), {"PYTHONPATH": str(tmp_path / "lib")}, times)
    assert [f["kernel"] for f in faults] == [f.kernel for f in gpu_check.FAULTS]
    pids = [f["pid"] for f in faults]
    assert all(isinstance(p, int) and p > 0 for p in pids) and len(set(pids)) == len(pids)
    for f in faults:
        assert f["via"] == "cupy" and f["exit_code"] == 1 and "cudaErrorIllegalAddress" in f["error"]
        assert f["launch"] >= f["started"]
    by_kernel = {f["kernel"]: f for f in faults}
    assert by_kernel["illegal_address"]["event"]["reason"] == "Xid31GpuMemoryPageFault"
    assert by_kernel["illegal_address"]["event"]["pid"] == 682          # the real event's own pid
    assert by_kernel["shared_misaligned"]["event"]["reason"] == "Xid13GraphicsEngineException"
    # No event about XID 43 changed: the one that did is kept, and its own XID shows the mismatch.
    assert by_kernel["trap"]["event"]["reason"] == "Xid31GpuMemoryPageFault" and by_kernel["trap"]["event"]["xid"] == 31
    assert "== trap exit 1" in (tmp_path / "faults.log").read_text()
    lines = gpu_check._daemon_summary({
        "verdict": {"conditions_true": [], "device_taint_rules": [], "conditions_seen": 20},
        "after_faults": {"conditions_true": [], "device_taint_rules": []}, "faults": faults,
        "steady": {"rss_mib": 50.0, "rss_anon_mib": 30.0, "rss_file_mib": 20.0, "cpu_millicores": 2.5,
                   "seconds": 30.0, "threads": 6, "largest_mappings": []},
        "footprint": {"peak_rss_mib": 51.0, "peak_tree_rss_mib": 80.0}})
    assert any(line.startswith("fault illegal_address (pid ") and "Xid31GpuMemoryPageFault" in line
               and "process python3, pid 682" in line for line in lines)
