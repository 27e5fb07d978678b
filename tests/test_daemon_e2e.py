"""The daemon end to end: a fake GPU node, the real Daemon, the Kubernetes API emulator on loopback
enforcing deploy/'s RBAC. Time is scaled where the real figure is minutes (backoff caps, the outage)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import node_for
from detector.daemon.local import REPO_DEPLOY, LocalDaemon, local_daemon
from detector.daemon.run import EXIT_OK, DaemonSettings
from detector.kube.conditions import MARKER
from fake_nvml.faults import Fault
from kube_emulator import Emulator

KUBELET_TYPES = {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure"}
FAST_CHECKS = {"visibility": {"interval": 0.5}, "pcie": {"interval": 0.5}, "xid": {"interval": 0.5}}


def fast_settings(**reporter: float) -> DaemonSettings:
    s = DaemonSettings(listen="127.0.0.1:0")
    s.agent.start_spread_s = 0.0
    s.reporter.backoff_base_s = reporter.get("backoff_base_s", 0.01)
    s.reporter.backoff_cap_s = reporter.get("backoff_cap_s", 0.5)     # 30 s scaled by 1/60
    s.reporter.heartbeat_s = reporter.get("heartbeat_s", 300.0)
    s.reporter.start_wait_s = reporter.get("start_wait_s", 5.0)
    return s


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emu:
        yield emu


@pytest.fixture
def running(emulator, tmp_path):
    started: list[LocalDaemon] = []

    def start(**kw) -> LocalDaemon:
        kw.setdefault("settings", fast_settings())
        kw.setdefault("check_settings", FAST_CHECKS)
        kw.setdefault("checks", list(kw["check_settings"]))     # these tests are about these checks alone
        local = local_daemon(kw.pop("scenario", "h100-sxm-8"), kw.pop("name", "gpu-1"), emulator=emulator,
                             workdir=tmp_path, **kw).start()
        started.append(local)
        return local

    yield start
    for local in started:
        local.stop()


def status(local: LocalDaemon, type_: str) -> str | None:
    return local.conditions().get(type_, {}).get("status")


def settled(local: LocalDaemon, timeout_s: float = 10.0) -> None:
    """Judged healthy: a problem never seen on the node has no condition (issue 34), so judged and absent."""
    assert local.wait_for(lambda: local.settled("GpuXidError", "GpuPcieDegraded")
                          and status(local, "GpuXidError") is None
                          and status(local, "GpuPcieDegraded") is None, timeout_s), local.conditions()


def test_fault_sets_condition_and_recovery_clears_it_without_touching_kubelet(running, emulator):
    local = running()
    settled(local)
    emulator.set_node_condition("gpu-1", {"type": "Ready", "status": "True", "reason": "KubeletReady",
                                          "message": "kubelet is posting ready status (updated)"})
    kubelet_before = {t: c for t, c in local.conditions().items() if t in KUBELET_TYPES}

    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True" and status(local, "GpuMissing") == "True")
    xid = local.conditions()["GpuXidError"]
    assert xid["reason"] == "Xid79GpuFellOffBus" and xid["message"].startswith(MARKER)
    assert "GPU 3 (GPU-" in xid["message"] and "0000:5d:00.0" in xid["message"] and "RESTART_BM" in xid["message"]
    assert len(xid["message"]) <= 1024

    local.node.inject(Fault("pcie", gpu=5, params={"width": 8}))
    assert local.wait_for(lambda: status(local, "GpuPcieDegraded") == "True")
    local.node.inject(Fault("recover", gpu=5))
    assert local.wait_for(lambda: status(local, "GpuPcieDegraded") == "False")       # observation recovery
    assert status(local, "GpuXidError") == "True"                                     # held until reboot

    local.node.inject(Fault("reboot"))
    assert local.wait_for(lambda: status(local, "GpuXidError") == "False" and status(local, "GpuMissing") == "False")
    kubelet_after = {t: c for t, c in local.conditions().items() if t in KUBELET_TYPES}
    assert kubelet_after == kubelet_before
    assert emulator.request_count(code=403) == 0 and emulator.request_count(code=422) == 0


def test_identical_repeats_make_one_event_with_a_growing_count(running):
    local = running()
    settled(local)
    for i in range(4):
        local.node.inject(Fault("xid", gpu=1, params={"code": 13, "pid": 4242, "via": "kernel"}))
        time.sleep(0.3)
    assert local.wait_for(lambda: any(e["reason"].startswith("Xid13") and e.get("count") == 4
                                      for e in local.events()), 10), local.events()
    xid13 = [e for e in local.events() if e["reason"].startswith("Xid13")]
    assert len(xid13) == 1
    assert xid13[0]["source"] == {"component": "gpu-npd", "host": "gpu-1"}
    assert xid13[0]["involvedObject"]["kind"] == "Node" and xid13[0]["involvedObject"]["name"] == "gpu-1"


def test_restart_neither_resets_nor_duplicates(running, emulator, tmp_path):
    state = tmp_path / "state"
    first = running(state_dir=state)
    settled(first)
    first.node.inject(Fault("xid", gpu=2, params={"code": 48, "via": "kernel"}))
    assert first.wait_for(lambda: status(first, "GpuXidError") == "True")
    before = first.conditions()["GpuXidError"]
    assert first.wait_for(lambda: any(e["reason"] == before["reason"] for e in first.events()))
    # GPU 2 failed: its evidence bundle is kept and named once (the restart must not take another)
    assert first.wait_for(lambda: any(e["reason"] == "EvidenceKept" for e in first.events()), 30)
    events_before = first.events()
    first.daemon.stop.set()
    first.thread.join(10)

    second = running(state_dir=state, node=first.node)        # the same node, a new daemon process
    seen: list[str | None] = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:                        # several sweeps of every check
        seen.append(status(second, "GpuXidError"))
        time.sleep(0.02)
    assert set(seen) == {"True"}
    after = second.conditions()["GpuXidError"]
    assert after["lastTransitionTime"] == before["lastTransitionTime"] and after["reason"] == before["reason"]
    assert second.daemon.agent.active.latches                  # restored, not re-read
    assert [(e["reason"], e.get("count")) for e in second.events()] == \
        [(e["reason"], e.get("count")) for e in events_before]


def test_existing_conditions_are_kept_until_their_checks_ran_and_stale_ones_pruned(emulator, tmp_path):
    emulator.create_node("gpu-2", conditions=[
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"},
        {"type": "GpuXidError", "status": "True", "reason": "Xid79GpuFellOffBus", "message": MARKER + "earlier",
         "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "GpuRetiredCheck", "status": "False", "reason": "NoGpuRetiredCheck", "message": MARKER + "none"},
        {"type": "VendorThing", "status": "True", "reason": "Other", "message": "someone else's"},
    ])
    local = local_daemon("h100-sxm-8", "gpu-2", emulator=emulator, workdir=tmp_path, settings=fast_settings())
    agent, reporter = local.daemon.agent, local.daemon.reporter
    try:
        agent.run([c for c in agent.checks if c.name == "visibility"])
        reporter.flush()
        conditions = local.conditions()
        assert "GpuRetiredCheck" not in conditions and conditions["VendorThing"]["status"] == "True"
        assert conditions["GpuXidError"]["message"] == MARKER + "earlier"      # xid has not run: untouched
        # GpuMissing is the xid check's too (a GPU whose driver init failed): not judged until both ran.
        assert "GpuMissing" not in conditions
        agent.run([c for c in agent.checks if c.name == "xid"])
        reporter.flush()
        conditions = local.conditions()
        assert conditions["GpuXidError"]["status"] == "False"                  # judged: nothing in the log
        assert "GpuMissing" not in conditions and reporter.settled(["GpuMissing"])   # judged, never True: unwritten
    finally:
        local.daemon.host.close()


def test_api_trouble_costs_only_delay(running, emulator):
    local = running()
    settled(local)
    emulator.fail(429, count=3, retry_after=1)
    local.node.inject(Fault("pcie", gpu=1, params={"width": 8}))
    assert local.wait_for(lambda: status(local, "GpuPcieDegraded") == "True", 15)
    emulator.fail(503, count=4)
    emulator.drop(3)
    local.node.inject(Fault("xid", gpu=6, params={"code": 79}))
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True", 15)

    emulator.down(duration_s=2.0)                              # two minutes, scaled by 1/60
    local.node.inject(Fault("recover", gpu=1))                 # happens while the API server is away
    local.node.inject(Fault("reboot"))
    local.node.inject(Fault("pcie", gpu=4, params={"width": 4}))
    time.sleep(1.0)
    assert not emulator.is_up
    assert local.wait_for(lambda: emulator.is_up, 5)
    # GpuMissing: False if it turned True before the reboot, absent if the reboot came first (issue 34)
    assert local.wait_for(lambda: status(local, "GpuXidError") == "False" and status(local, "GpuMissing") != "True"
                          and "GPU 4" in local.conditions()["GpuPcieDegraded"]["message"], 15), local.conditions()
    assert local.thread.is_alive()
    assert local.daemon.health() == (True, "ok")
    assert emulator.request_count(code=429) >= 3 and emulator.request_count(code=503) >= 1


def get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_missing_permission_is_one_clear_line_and_checks_go_on(emulator, tmp_path, caplog):
    rbac = tmp_path / "rbac"
    rbac.mkdir()
    text = (REPO_DEPLOY / "rbac.yaml").read_text().replace('resources: ["nodes/status"]', 'resources: ["nodes/proxy"]')
    assert "nodes/proxy" in text
    (rbac / "rbac.yaml").write_text(text)
    caplog.set_level(logging.INFO, logger="gpu_npd")
    with Emulator(rbac_paths=(rbac,)) as narrow:
        local = local_daemon("h100-sxm-8", "gpu-3", emulator=narrow, workdir=tmp_path, settings=fast_settings(),
                             check_settings=FAST_CHECKS).start()
        try:
            address = local.daemon.endpoints.address
            assert local.wait_for(lambda: get(address, "/readyz")[0] == 503, 10)
            local.node.inject(Fault("xid", gpu=2, params={"code": 79}))
            assert local.wait_for(lambda: 'gpu_npd_problem_gauge{reason="Xid79GpuFellOffBus",type="GpuXidError"} 1.0'
                                  in get(address, "/metrics")[1], 10)
            time.sleep(1.0)                                       # more sweeps, more refused patches
            assert local.thread.is_alive()
            assert get(address, "/healthz") == (200, "ok\n")
            code, why = get(address, "/readyz")
            assert code == 503 and "patch nodes/status (403 Forbidden)" in why and "deploy/base/rbac.yaml" in why
            assert "gpu_npd_reporting 0.0" in get(address, "/metrics")[1]
            refusals = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("gpu_npd.kube")]
            assert len(refusals) == 1, [r.getMessage() for r in refusals]
            line = refusals[0].getMessage()
            assert "forbids gpu-npd to patch nodes/status" in line and "get, list and watch nodes, patch nodes/status" in line
            assert narrow.request_count(verb="patch", resource="nodes/status") <= 2   # asked again rarely
        finally:
            local.stop()
        assert local.exit_code == EXIT_OK and "Traceback" not in caplog.text


def test_api_down_for_the_first_minutes_checks_run_and_report_when_it_returns(running, emulator, caplog):
    """The acceptance drill, scaled by 1/20: the API server unreachable for the first 3 minutes (9 s), an
    XID at minute 1 (3 s), one outage warning a minute (3 s), backoff capped at 30 s (1.5 s)."""
    scale = 1 / 20
    caplog.set_level(logging.INFO, logger="gpu_npd")
    settings = fast_settings(backoff_base_s=0.5 * scale, backoff_cap_s=30 * scale, start_wait_s=300 * scale)
    settings.reporter.outage_log_every_s = 60 * scale
    emulator.create_node("gpu-out", labels={"nvidia.com/gpu.present": "true"})
    emulator.down(duration_s=180 * scale)
    t0 = time.monotonic()
    local = running(name="gpu-out", settings=settings)
    address = local.daemon.endpoints.address
    health: list[int] = []
    xid_at = t0 + 60 * scale
    injected = False
    metrics_during_outage = ""
    while time.monotonic() - t0 < 180 * scale - 0.3:
        health.append(get(address, "/healthz")[0])
        if not injected and time.monotonic() >= xid_at:
            local.node.inject(Fault("xid", gpu=5, params={"code": 79}))
            injected = True
        if injected and not metrics_during_outage:
            text = get(address, "/metrics")[1]
            if 'gpu_npd_problem_gauge{reason="Xid79GpuFellOffBus",type="GpuXidError"} 1.0' in text:
                metrics_during_outage = text
        time.sleep(0.05)
    assert not emulator.is_up and injected
    assert metrics_during_outage, "the XID never reached /metrics while the API server was down"
    assert "gpu_npd_reporting 0.0" in metrics_during_outage
    assert get(address, "/readyz")[0] == 503
    assert local.wait_for(lambda: emulator.is_up, 5)
    back = time.monotonic()
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True", 10), local.conditions()
    delay = time.monotonic() - back
    assert delay < 2 * 30 * scale + 0.5, f"{delay:.1f}s after the API server came back"
    assert "0000:" in local.conditions()["GpuXidError"]["message"]
    assert local.wait_for(lambda: get(address, "/readyz") == (200, "ok\n"), 5)
    assert set(health) == {200} and len(health) > 50
    outage = [r.getMessage() for r in caplog.records
              if r.name == "gpu_npd.kube" and r.levelno >= logging.WARNING]
    assert 1 <= len(outage) <= 5, outage
    assert "API server unavailable" in outage[0]
    assert any("available again" in r.getMessage() for r in caplog.records if r.name == "gpu_npd.kube")


def test_heartbeat_refreshes_without_moving_transition_time(running, emulator):
    local = running(settings=fast_settings(heartbeat_s=0.4))
    settled(local)
    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))      # a condition to refresh: a healthy node
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True")   # has none of these (issue 34)
    transition = local.conditions()["GpuXidError"]["lastTransitionTime"]
    patches = emulator.request_count(verb="patch", resource="nodes/status")
    time.sleep(2.0)
    assert emulator.request_count(verb="patch", resource="nodes/status") >= patches + 3
    assert local.conditions()["GpuXidError"]["lastTransitionTime"] == transition


def test_gpu_npd_run_serves_metrics_and_stops_on_sigterm(emulator, tmp_path):
    emulator.create_node("gpu-9")
    kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
    exe = shutil.which("gpu-npd", path=str(Path(sys.executable).parent)) or "gpu-npd"
    port_file = tmp_path / "log"
    proc = subprocess.Popen([exe, "run", "--nvml", "fake:h100-sxm-8-pcie-x8", "--node-name", "gpu-9",
                             "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0", "--log-format", "json",
                             "--start-spread", "0", "--state-dir", str(tmp_path / "state")],
                            stderr=port_file.open("wb"), env={**os.environ, "NODE_NAME": ""})
    try:
        address = None
        deadline = time.monotonic() + 20
        while address is None and time.monotonic() < deadline:
            for line in port_file.read_text().splitlines():
                entry = json.loads(line)
                assert entry["node"] == "gpu-9"
                if "http://" in entry["msg"]:
                    address = entry["msg"].rsplit("http://", 1)[1]
            time.sleep(0.1)
        assert address, port_file.read_text()
        def degraded() -> bool:
            node = emulator.node("gpu-9")
            return any(c["type"] == "GpuPcieDegraded" and c["status"] == "True"
                       for c in node["status"].get("conditions", []))
        deadline = time.monotonic() + 20
        while not degraded() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert degraded()
        assert urllib.request.urlopen(f"http://{address}/healthz").read() == b"ok\n"
        metrics = urllib.request.urlopen(f"http://{address}/metrics").read().decode()
        assert 'gpu_npd_problem_gauge{reason="PcieLinkWidthDegraded",type="GpuPcieDegraded"} 1.0' in metrics
        assert 'gpu_npd_pcie_link_width{gpu="5",pci_bus_id="0000:ab:00.0"} 8.0' in metrics
        assert 'gpu_npd_api_requests_total{code="200",resource="nodes/status",verb="patch"}' in metrics
        assert 'gpu_npd_check_runs_total{check="xid",status="ok"}' in metrics
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_long_probe_never_delays_an_xid(running):
    node = node_for("h100-sxm-8", "gpu-probe")
    node.inject(Fault("nccl_hang", params={"seconds": 3.0}))        # the probe takes 3 s
    local = running(name="gpu-probe", node=node, checks=["xid", "nccl"],
                    check_settings={"xid": {"interval": 0.5}, "nccl": {"timeout": 20}})
    time.sleep(0.5)                                                  # the probe is under way
    started = time.monotonic()
    node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert local.wait_for(lambda: status(local, "GpuXidError") == "True", 2.0)
    assert time.monotonic() - started < 2.0
    assert "GpuNcclProbeFailed" not in local.conditions()            # still probing: nothing judged yet
    # The probe ends after its 3 s and finds the GPU that fell off the bus meanwhile.
    assert local.wait_for(lambda: status(local, "GpuNcclProbeFailed") == "True", 10.0)
    assert "rank 3 (GPU 3" in local.conditions()["GpuNcclProbeFailed"]["message"]
