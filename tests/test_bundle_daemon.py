"""The daemon keeps an evidence bundle when a GPU turns failed: `gpu-npd run --nvml fake:h100-sxm-8-xid79
--state-dir S` against the emulator writes one under S/bundles within a minute, and an EvidenceKept Event names
it; the keeper's own rules (one per incident, a bounded queue, the last few within a disk cap) on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from detector.agent.bundle_writer import BundleOptions, Manifest
from detector.agent.bundles import BundleKeeper, KeeperSettings
from detector.core.gpu_health import GpuHealth
from detector.core.types import GpuRef
from conftest import stop_process
from detector.daemon.local import REPO_DEPLOY
from kube_emulator import Emulator

WORKTREE = Path(__file__).resolve().parent.parent


def test_gpu_npd_run_keeps_a_bundle_when_gpu_3_falls_off_the_bus(tmp_path):
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        emulator.create_node("gpu-3x")
        kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
        state = tmp_path / "state"
        log = tmp_path / "log"
        proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "run", "--nvml", "fake:h100-sxm-8-xid79",
                                 "--node-name", "gpu-3x", "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0",
                                 "--log-format", "json", "--start-spread", "0", "--state-dir", str(state)],
                                cwd=WORKTREE, stderr=log.open("wb"),
                                env={**os.environ, "NODE_NAME": "", "PYTHONPATH": str(WORKTREE)})
        try:
            def kept() -> list[dict]:
                return [e for e in emulator.events() if e.get("reason") == "EvidenceKept"]
            deadline = time.monotonic() + 60
            while not kept() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert kept(), log.read_text()[-3000:]
            bundles = sorted((state / "bundles").iterdir())
            assert len(bundles) == 1, bundles
            message = kept()[0]["message"]
            assert str(bundles[0]) in message and "0000:5d:00.0" in message
            manifest = json.loads((bundles[0] / "manifest.json").read_text())
            assert [g["pci_bus_id"] for g in manifest["gpus"]] == ["0000:5d:00.0"]
            assert manifest["reason"].startswith("gpu failed") and manifest["node"] == "gpu-3x"
            names = {f["name"] for f in manifest["files"]}
            assert {"kernel.log", "verdict.json", "nvidia-smi-q.xml", "nvml.json"} <= names
            assert "Xid" in (bundles[0] / "kernel.log").read_text()
            assert manifest["bytes"] <= 64 << 20
        finally:
            stop_process(proc, 10)


# -- the keeper alone -------------------------------------------------------------------------------------

GPU3 = GpuRef(3, "GPU-3", "0000:5d:00.0")
GPU5 = GpuRef(5, "GPU-5", "0000:ab:00.0")


def _writer(calls: list, block: threading.Event | None = None):
    def write(out: Path, options: BundleOptions) -> Manifest:
        if block is not None:
            block.wait(10)
        calls.append(options)
        (out / "manifest.json").write_text("{}")
        (out / "kernel.log").write_bytes(b"x" * 1000)
        return Manifest("now", "n", "b", options.reason, options.incident, options.redact,
                        files=[{"name": "kernel.log", "bytes": 1000}])
    return write


def _drain(keeper: BundleKeeper) -> None:
    while not keeper._queue.empty():
        keeper._take(keeper._queue.get_nowait())


def test_one_bundle_per_incident_and_a_new_one_for_a_new_gpu(tmp_path):
    calls: list = []
    keeper = BundleKeeper(tmp_path / "bundles", _writer(calls))
    failed3 = [GpuHealth(GPU3, "failed", "RESET_GPU")]
    keeper.gpus(failed3)
    keeper.gpus(failed3)                                # still failed: the same incident
    from detector.agent.active import ConditionStatus
    keeper.conditions([ConditionStatus("GpuNodeNeedsRemediation", True, "X", "m")])   # the ask that follows
    keeper.gpus([*failed3, GpuHealth(GPU5, "failed", "RESET_GPU")])                   # another GPU fails
    _drain(keeper)
    assert [c.gpus for c in calls] == [(GPU3,), (GPU5,)]
    keeper.gpus([])                                     # all well: the incident ends
    keeper.conditions([ConditionStatus("GpuNodeNeedsRemediation", False, "X", "m")])
    keeper.gpus(failed3)                                # fails again: a new incident
    _drain(keeper)
    assert len(calls) == 3 and calls[2].incident != calls[0].incident


def test_a_full_queue_drops_with_a_log_line_and_never_blocks(tmp_path, caplog):
    keeper = BundleKeeper(tmp_path / "bundles", _writer([]), KeeperSettings(queue=1))
    t0 = time.monotonic()
    keeper.capture("reset", [GPU3])
    keeper.capture("reset", [GPU5])
    assert time.monotonic() - t0 < 0.5
    assert keeper.dropped == 1 and "dropped" in caplog.text


def test_a_reset_waits_for_its_bundle_but_no_longer_than_it_said(tmp_path):
    """The GPU reset asks for the evidence on its own thread and waits (bounded) until it is written, so the
    bundle shows the GPU before the reset; a writer slower than the wait, or a dropped request, says False."""
    stop = threading.Event()
    calls: list = []
    keeper = BundleKeeper(tmp_path / "bundles", _writer(calls))
    worker = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
    worker.start()
    try:
        assert keeper.capture("GpuReset", [GPU3], wait_s=10.0) is True
        assert [c.gpus for c in calls] == [(GPU3,)] and len(keeper.written) == 1   # written before it returned
        slow = threading.Event()
        late = BundleKeeper(tmp_path / "late", _writer([], block=slow))
        late_worker = threading.Thread(target=late.run, args=(stop,), daemon=True)
        late_worker.start()
        t0 = time.monotonic()
        assert late.capture("GpuReset", [GPU3], wait_s=0.3) is False
        assert time.monotonic() - t0 < 2.0
        slow.set()
    finally:
        stop.set()
    full = BundleKeeper(tmp_path / "full", _writer([]), KeeperSettings(queue=1))
    full.capture("first", [GPU5])                          # waits in the queue (no worker)
    assert full.capture("GpuReset", [GPU3], wait_s=5.0) is False and full.dropped == 1   # dropped: no wait


def test_the_last_few_are_kept_within_the_disk_cap(tmp_path):
    folder = tmp_path / "bundles"
    keeper = BundleKeeper(folder, _writer([]), KeeperSettings(keep=2, max_total_bytes=10_000))
    for i in range(4):
        keeper._take(keeper_request(f"r{i}", 1000.0 + i))
    assert [p.name.split("-", 1)[1] for p in sorted(folder.iterdir())] == ["r2", "r3"]
    small = BundleKeeper(folder, _writer([]), KeeperSettings(keep=5, max_total_bytes=2_500))
    small._take(keeper_request("r4", 1004.0))
    assert [p.name.split("-", 1)[1] for p in sorted(folder.iterdir())] == ["r3", "r4"]


def keeper_request(reason: str, when: float):
    from detector.agent.bundles import _Request
    return _Request(reason, "i", (), when)


def test_a_failing_writer_leaves_no_half_bundle_and_the_worker_goes_on(tmp_path):
    def broken(out: Path, options: BundleOptions) -> Manifest:
        (out / "partial").write_text("x")
        raise OSError("disk full")
    keeper = BundleKeeper(tmp_path / "bundles", broken)
    keeper.capture("reset", [GPU3])
    _drain(keeper)
    assert list((tmp_path / "bundles").iterdir()) == []


@pytest.mark.parametrize("keep", ["0"])
def test_bundles_keep_zero_keeps_none(keep):
    from detector.cli.daemon import _keeper_settings
    from detector.cli.main import build_parser
    args = build_parser().parse_args(["run", "--bundles-keep", keep])
    assert _keeper_settings(args) is None


def test_a_restarted_daemon_takes_no_second_bundle_of_a_gpu_still_failed(tmp_path):
    folder = tmp_path / "bundles"
    (folder / "20261127T000000Z-gpu-failed").mkdir(parents=True)
    (folder / "20261127T000000Z-gpu-failed" / "manifest.json").write_text(json.dumps(
        {"version": 1, "boot_id": "boot-1", "incident": "i-1",
         "gpus": [{"index": 3, "serial": "s", "uuid": "GPU-3", "pci_bus_id": "0000:5d:00.0"}]}))
    calls: list = []
    same_boot = BundleKeeper(folder, _writer(calls), boot_id="boot-1")
    same_boot.gpus([GpuHealth(GPU3, "failed", "RESET_GPU")])
    _drain(same_boot)
    assert calls == []
    next_boot = BundleKeeper(folder, _writer(calls), boot_id="boot-2")    # rebooted, failed again: new evidence
    next_boot.gpus([GpuHealth(GPU3, "failed", "RESET_GPU")])
    _drain(next_boot)
    assert [c.gpus for c in calls] == [(GPU3,)]
