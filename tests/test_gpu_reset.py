"""GPU reset instead of a reboot (--reset-gpus): nvidia-smi's real answers, the fake's reset, each reason a
reset is refused, the rate limit, and the daemon end to end against the API emulator (GPU 3 reset,
verified and its DeviceTaintRule removed; a process holding it; a fault a reset does not cure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, node_for, stop_process
from detector.agent.gpu_reset import GpuResetter, ResetSettings
from detector.backends.children import ToolOutcome
from detector.backends.gpu_reset import DONE, FAILED, IN_USE, NOT_SUPPORTED, classify
from detector.core.gpu_health import FAILED as GPU_FAILED, HEALTHY, GpuHealth
from detector.core.types import GpuRef
from detector.daemon.local import REPO_DEPLOY, local_daemon, publish_gpu_slice
from detector.daemon.run import DaemonSettings
from detector.kube.device_taints import DeviceTaintSettings, rule_name
from fake_nvml.faults import Fault
from fake_nvml.host import InProcessSmi, fake_host
from fake_nvml.smi import run_smi
from kube_emulator import Emulator

FIXTURES = REPO / "tests" / "fixtures" / "gpu_reset"
SCENARIO = "h100-sxm-8-driver-recovery-reset"


def answer(name: str, rc: int) -> ToolOutcome:
    return ToolOutcome("ok", rc, (FIXTURES / name).read_text())


# -- nvidia-smi's words ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, rc, kind", [
    ("reset-done.txt", 0, DONE), ("reset-done-all.txt", 0, DONE),
    ("reset-in-use-client.txt", 255, IN_USE), ("reset-in-use-drm.txt", 255, IN_USE),
    ("reset-in-use-process.txt", 255, IN_USE), ("reset-not-supported.txt", 3, NOT_SUPPORTED),
    ("reset-unknown-error.txt", 255, FAILED),
    ("pm-enabled.txt", 0, FAILED), ("pm-already-disabled.txt", 0, FAILED),   # look-alikes: no reset said
])
def test_real_answers_are_read_right(name, rc, kind):
    assert classify(answer(name, rc)).kind == kind


def test_exit_zero_without_the_words_or_words_without_exit_zero_is_no_reset():
    assert classify(ToolOutcome("ok", 0, "All done.\n")).kind == FAILED               # nvidia-smi -rgc's answer
    assert classify(ToolOutcome("ok", 255, (FIXTURES / "reset-done.txt").read_text())).kind == FAILED
    assert classify(ToolOutcome("timeout", detail="nvidia-smi did not finish within 60s")).kind == FAILED


def test_fake_smi_answers_as_the_real_one():
    node = node_for(SCENARIO)
    bus = node.snapshot().gpus[3].pci_bus_id
    held = run_smi(node.snapshot(), ["-r", "-i", bus])            # persistence mode holds it (NVSentinel #1690)
    assert held.returncode == 255 and classify(ToolOutcome("ok", 255, held.stdout)).kind == IN_USE
    assert held.stdout.splitlines()[:2] == (FIXTURES / "reset-in-use-client.txt").read_text().splitlines()[:2] \
        or "In use by another client" in held.stdout
    assert not held.actions
    off = run_smi(node.snapshot(), ["-pm", "0", "-i", bus])
    assert off.stdout == "Disabled persistence mode for GPU 00000000:5D:00.0.\nAll done.\n"
    smi = InProcessSmi(node)
    smi.run(["-pm", "0", "-i", bus], 5)
    again = smi.run(["-pm", "0", "-i", bus], 5)
    assert again.stdout.startswith("Persistence mode is already Disabled for GPU 00000000:5D:00.0.")
    done = smi.run(["-r", "-i", bus], 5)
    assert done.returncode == 0 and done.stdout == "GPU 00000000:5D:00.0 was successfully reset.\nAll done.\n"
    assert node.snapshot().gpus[3].recovery_action == 0                         # GPU_RESET cleared
    node.inject(Fault("reset_unsupported"))
    refused = smi.run(["-r", "-i", bus], 5)
    assert refused.returncode == 3 and refused.stdout == "Resetting GPU 00000000:5D:00.0 is not supported.\n"


def test_fake_smi_process_writes_a_reset_back_to_its_state_file(tmp_path, monkeypatch):
    from fake_nvml.smi import main
    from fake_nvml.statefile import STATE_ENV, load_state, save_state
    node = node_for(SCENARIO)
    node.inject(Fault("persistence", gpu=3, params={"on": False}))
    path = tmp_path / "state.json"
    save_state(node, path)
    monkeypatch.setenv(STATE_ENV, str(path))
    assert main(["-r", "-i", "0000:5d:00.0"]) == 0
    assert load_state(path).gpus[3].recovery_action == 0


# -- the policy, one step at a time --------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class MigOn:
    """NVML as the node's, but GPU 3 in MIG mode."""

    def __init__(self, nvml):
        self._nvml = nvml

    def __getattr__(self, name):
        return getattr(self._nvml, name)

    def nvmlDeviceGetMigMode(self, handle):
        return [1, 1]


def health(node, index: int = 3, state: str = GPU_FAILED, verifying: bool = False) -> GpuHealth:
    g = node.snapshot().gpus[index]
    ref = GpuRef(index, g.uuid, g.pci_bus_id)
    return GpuHealth(ref, state, "RESET_GPU" if state == GPU_FAILED else "NONE", ("DriverRecoveryAction",),
                     verifying=verifying)


def resetter(node, *, fenced=True, settings=None, state_dir=None, host=None):
    events, bundles, clock = [], [], Clock()
    r = GpuResetter(host or fake_host(node), settings or ResetSettings(cure_wait_s=60.0), fenced=lambda k: fenced,
                    events=events.extend, before_reset=lambda reason, gpus: bundles.append((reason, gpus)),
                    verifying_rounds=3, state_dir=state_dir, clock=clock)
    return r, events, bundles, clock


def messages(events) -> list[str]:
    assert all(e.reason == "GpuReset" and e.report == "event" for e in events)
    return [e.message for e in events]


def test_reset_checks_turns_persistence_off_and_back_and_verifies():
    node = node_for(SCENARIO)
    r, events, bundles, clock = resetter(node)
    r.gpus([health(node)])
    r.step()
    said = messages(events)
    assert len(said) == 1 and said[0].startswith("GPU 3 (") and "reset done" in said[0]
    for checked in ("fenced", "0 process(es)", "persistence mode on", "MIG off", "NVLinks up, fabric manager running",
                    "persistence mode turned back on", "was successfully reset"):
        assert checked in said[0], said[0]
    gpu = node.snapshot().gpus[3]
    assert gpu.recovery_action == 0 and gpu.persistence_mode is True
    assert bundles == [("GpuReset", [health(node).gpu])]                 # the evidence, before the reset
    r.gpus([health(node, verifying=True)])                               # the checks see it cured: verifying
    clock.now += 3600
    r.step()
    assert len(events) == 1 and r.reset_failed() == []
    r.gpus([health(node, state=HEALTHY)])
    r.step()
    assert "the reset worked" in events[-1].message and r.reset_failed() == []


def test_a_process_on_the_gpu_waits_and_says_so_once():
    node = node_for(SCENARIO)
    node.inject(Fault("process_holds", gpu=3, params={"pid": 777}))
    r, events, bundles, _ = resetter(node)
    r.gpus([health(node)])
    r.step()
    r.step()
    assert messages(events) == [messages(events)[0]] and "not reset yet: in use by 1 process(es) (pid 777)" \
        in events[0].message
    assert node.snapshot().gpus[3].recovery_action != 0 and not bundles and r.reset_failed() == []


@pytest.mark.parametrize("why, fenced, asks", [
    ("not fenced yet: its DRA device taint is not written", False, False),
    ("the node asks for remediation already", True, True),
])
def test_not_fenced_or_node_asking_waits(why, fenced, asks):
    from detector.agent.active import ConditionStatus
    from detector.core.types import Severity
    node = node_for(SCENARIO)
    r, events, _, _ = resetter(node, fenced=fenced)
    r.conditions([ConditionStatus("GpuNodeNeedsRemediation", asks, "GpusFailed", "", Severity.CRITICAL)])
    r.gpus([health(node)])
    r.step()
    assert why in messages(events)[0] and node.snapshot().gpus[3].recovery_action != 0


def test_mig_on_escalates():
    node = node_for(SCENARIO)
    host = fake_host(node)
    host.nvml = MigOn(host.nvml)
    r, events, _, _ = resetter(node, host=host)
    r.gpus([health(node)])
    r.step()
    assert "not reset: MIG mode is on" in events[0].message and "escalated" in events[0].message
    assert len(r.reset_failed()) == 1 and node.snapshot().gpus[3].recovery_action != 0


def test_nvlink_without_fabric_manager_escalates():
    node = node_for("h100-sxm-8-fabric-manager-down")
    node.inject(Fault("recovery_action", gpu=3, params={"action": "GPU_RESET"}))
    r, events, _, _ = resetter(node)
    r.gpus([health(node)])
    r.step()
    assert "fabric manager is not running: every NVLink-connected GPU" in events[0].message
    assert r.reset_failed() and node.snapshot().gpus[3].recovery_action != 0


def test_platform_refusal_escalates_and_is_never_tried_again_this_boot():
    node = node_for(SCENARIO)
    node.inject(Fault("reset_unsupported"))
    node.inject(Fault("recovery_action", gpu=5, params={"action": "GPU_RESET"}))
    r, events, _, clock = resetter(node, settings=ResetSettings(min_interval_s=0.0))
    r.gpus([health(node), health(node, 5)])
    r.step()
    assert "the reset failed (not-supported)" in events[0].message and "is not supported" in events[0].message
    r.step()
    assert "this platform refused a GPU reset in this boot" in events[1].message
    assert len(r.reset_failed()) == 2
    assert node.snapshot().gpus[3].persistence_mode is True             # restored after the refusal too


def test_a_reset_that_does_not_cure_escalates_after_cure_wait():
    node = node_for(SCENARIO)
    node.inject(Fault("reset_uncured", gpu=3))
    r, events, _, clock = resetter(node, settings=ResetSettings(cure_wait_s=120.0))
    r.gpus([health(node)])
    r.step()
    assert "reset done" in events[0].message
    clock.now += 60
    r.step()
    assert len(events) == 1                                              # the checks still have time
    clock.now += 61
    r.step()
    assert "the reset did not cure it: still failed (DriverRecoveryAction)" in events[1].message
    assert r.reset_failed() and "did not cure" in r.reset_failed()[0]
    node.inject(Fault("reboot"))
    assert r.reset_failed() == []                                        # a reboot ends it


def test_rate_limits_per_node_and_per_gpu_kept_across_restarts(tmp_path):
    node = node_for(SCENARIO)
    node.inject(Fault("recovery_action", gpu=5, params={"action": "GPU_RESET"}))
    settings = ResetSettings(min_interval_s=600.0, per_gpu_per_day=2, cure_wait_s=1.0)
    r, events, _, clock = resetter(node, settings=settings, state_dir=tmp_path)
    r.gpus([health(node)])
    r.step()                                                             # GPU 3 reset
    r.gpus([health(node, state=HEALTHY)])
    r.step()
    node.inject(Fault("recovery_action", gpu=3, params={"action": "GPU_RESET"}))
    r.gpus([health(node, 5)])
    r.step()
    assert "waiting for the node's reset rate" in events[-1].message and node.snapshot().gpus[5].recovery_action
    # a restarted daemon keeps the rate (gpu-resets.json)
    r2, events2, _, clock2 = resetter(node, settings=settings, state_dir=tmp_path)
    clock2.now = clock.now + 100
    r2.gpus([health(node, 5)])
    r2.step()
    assert "waiting for the node's reset rate" in events2[-1].message
    clock2.now += 600
    r2.step()
    assert "reset done" in events2[-1].message                           # GPU 5, once the interval passed
    r2.gpus([health(node, 5, state=HEALTHY)])
    r2.step()
    for _ in range(2):                                                   # GPU 3 again: its second reset today
        clock2.now += 601
        node.inject(Fault("recovery_action", gpu=3, params={"action": "GPU_RESET"}))
        r2.gpus([health(node)])
        r2.step()
        r2.gpus([health(node, state=HEALTHY)])
        r2.step()
    assert "reset 2 times within 24h already (at most 2)" in events2[-1].message and r2.reset_failed()


# -- the daemon against the API emulator ----------------------------------------------------------------

DRA_RBAC = REPO / "deploy" / "overlays" / "dra-taints" / "rbac.yaml"
FAST = {"driver": {"interval": 0.3}}
NODE = "gpu-1"


def daemon_settings(**reset) -> DaemonSettings:
    s = DaemonSettings(listen="127.0.0.1:0")
    s.agent.start_spread_s, s.agent.verify_sweeps = 0.0, 2
    s.reporter.backoff_base_s, s.reporter.backoff_cap_s = 0.01, 0.5
    s.dra_taints = DeviceTaintSettings(backoff_base_s=0.01, backoff_cap_s=0.5, start_grace_s=0.0, qps=50.0, burst=100)
    s.gpu_reset = ResetSettings(**{"min_interval_s": 0.0, "cure_wait_s": 2.0, **reset})
    return s


@pytest.fixture
def run_daemon(tmp_path):
    started = []

    def go(*faults: Fault):
        emulator = Emulator(rbac_paths=(REPO_DEPLOY, DRA_RBAC))
        emulator.start()
        node = node_for(SCENARIO, NODE)
        for f in faults:
            node.inject(f)
        publish_gpu_slice(emulator, node)
        local = local_daemon(SCENARIO, NODE, emulator=emulator, workdir=tmp_path, settings=daemon_settings(),
                             check_settings=FAST, checks=["driver", "node"], node=node)
        local._owns_emulator = True
        started.append(local.start())
        return local

    yield go
    for local in started:
        local.stop()


def reset_events(local) -> list[str]:
    return [e.get("message", "") for e in local.events() if e.get("reason") == "GpuReset"]


def test_daemon_resets_gpu_3_verifies_and_lifts_its_taint(run_daemon):
    local = run_daemon()
    name = rule_name(NODE, "gpu-3")
    assert local.wait_for(lambda: any("reset done" in m for m in reset_events(local)), 20), reset_events(local)
    done = next(m for m in reset_events(local) if "reset done" in m)
    assert done.startswith("GPU 3 (") and "0000:5d:00.0" in done
    assert local.wait_for(lambda: any("the reset worked" in m for m in reset_events(local)), 20), reset_events(local)
    assert local.wait_for(lambda: name not in {r["metadata"]["name"] for r in local.emulator.device_taint_rules()})
    assert local.node.snapshot().gpus[3].persistence_mode is True
    assert local.conditions()["GpuNodeNeedsRemediation"]["status"] == "False"


def test_daemon_does_not_reset_a_gpu_a_process_holds_and_says_why(run_daemon):
    local = run_daemon(Fault("process_holds", gpu=3, params={"pid": 4242}))
    assert local.wait_for(lambda: any("in use by 1 process(es) (pid 4242)" in m for m in reset_events(local)), 20)
    assert not any("reset done" in m for m in reset_events(local))
    assert local.node.snapshot().gpus[3].recovery_action != 0
    assert rule_name(NODE, "gpu-3") in {r["metadata"]["name"] for r in local.emulator.device_taint_rules()}


def test_daemon_escalates_a_reset_that_does_not_cure(run_daemon):
    local = run_daemon(Fault("reset_uncured", gpu=3))
    assert local.wait_for(lambda: local.conditions().get("GpuNodeNeedsRemediation", {}).get("reason")
                          == "GpuResetFailed", 30), (reset_events(local), local.conditions())
    condition = local.conditions()["GpuNodeNeedsRemediation"]
    assert condition["status"] == "True" and "did not cure" in condition["message"]
    assert any("escalated" in m for m in reset_events(local))


def test_gpu_npd_run_reset_gpus_resets_gpu_3_and_lifts_its_taint(tmp_path):
    """The issue's acceptance as a person runs it: `gpu-npd run --nvml fake:h100-sxm-8-driver-recovery-reset
    --reset-gpus --dra-taints` against the emulator, with the DaemonSet's and the DRA overlay's RBAC."""
    import os
    import subprocess
    import sys
    import time

    from detector.daemon.local import SERVICE_ACCOUNT

    config = tmp_path / "config.yaml"
    config.write_text("checks:\n  driver: {interval: 0.5}\n")
    with Emulator(rbac_paths=(REPO_DEPLOY, DRA_RBAC)) as emulator:
        node = node_for(SCENARIO, NODE)        # the same GPUs (UUIDs come from the node's name) the run plays
        emulator.create_node(NODE, labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "8"})
        publish_gpu_slice(emulator, node)
        kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig", user=SERVICE_ACCOUNT)
        log = tmp_path / "run.log"
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "detector.cli.main", "run", "--nvml", f"fake:{SCENARIO}", "--node-name", NODE,
                 "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0", "--start-spread", "0",
                 "--checks", "driver,node", "--config", str(config), "--verify-sweeps", "2",
                 "--dra-taints", "--reset-gpus", "--reset-interval", "0"],
                cwd=REPO, env={**os.environ, "NODE_NAME": ""}, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            def events() -> list[str]:
                return [e.get("message", "") for e in emulator.events() if e.get("reason") == "GpuReset"]

            deadline = time.monotonic() + 60
            while not any("the reset worked" in m for m in events()) and time.monotonic() < deadline \
                    and proc.poll() is None:
                time.sleep(0.2)
            assert any(m.startswith("GPU 3 (") and "reset done" in m for m in events()), \
                (events(), log.read_text()[-3000:])
            assert any("the reset worked" in m for m in events()), events()
            name = rule_name(NODE, "gpu-3")
            while name in {r["metadata"]["name"] for r in emulator.device_taint_rules()} \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            assert name not in {r["metadata"]["name"] for r in emulator.device_taint_rules()}
        finally:
            stop_process(proc)
