"""The checks and builtin rules on every bundled scenario, and on faults injected at run time."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import builtin_rules, diagnose_host, diagnose_scenario, node_for
from detector.backends.pci import SysfsPciBus, nvidia_gpus
from detector.checks.visibility import parse_smi_list
from detector.core.check import Check, CheckOutput, CheckRegistry
from detector.core.types import Observation, Severity
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.node import FakeNode, TimedFault
from fake_nvml.pci import pci_devices, write_sysfs
from fake_nvml.scenario import bundled_scenarios
from fake_nvml.statefile import STATE_ENV, mirror_to, save_state

HGX_BUS_IDS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
               "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]


@pytest.mark.parametrize("scenario", bundled_scenarios())
def test_every_bundled_scenario_runs_every_check_cleanly(scenario, registry):
    settings = {"visibility": {"smi_timeout": 0.3}, "nccl": {"enabled": True}}
    out = diagnose_scenario(scenario, registry, settings=settings, inventory_timeout_s=0.5)
    assert {r.name for r in out.sweep.runs} == set(registry.names())
    for run in out.sweep.runs:
        if run.name == "nccl" and (len(out.sweep.inventory.gpus) < 2 or out.sweep.inventory.nvml_error):
            assert run.status == "skipped" and run.error, run      # nothing to all-reduce across
        else:
            assert run.status == "ok", (run.name, run.error)


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "a100-pcie-4", "rtx-4090-1", "gb200-nvl72-4"])
def test_healthy_scenarios_have_no_problems(scenario, registry):
    out = diagnose_scenario(scenario, registry)
    assert out.problems == []
    assert all(g.error is None and g.pci_bus_id for g in out.sweep.inventory.gpus)


def test_healthy_h100_inventory_lists_eight_gpus_with_bus_ids(registry):
    out = diagnose_scenario("h100-sxm-8", registry)
    assert [g.pci_bus_id for g in out.sweep.inventory.gpus] == HGX_BUS_IDS
    assert [g.index for g in out.sweep.inventory.gpus] == list(range(8))
    assert all(g.pcie.current_width == 16 and g.pcie.current_gen == 5 for g in out.sweep.inventory.gpus)


def test_pcie_x8_names_gpu_5_only(registry):
    out = diagnose_scenario("h100-sxm-8-pcie-x8", registry)
    assert out.rules() == {"pcie-width-degraded"}
    problem = out.problems[0]
    assert [g.index for g in problem.gpus] == [5]
    assert problem.check == "pcie" and problem.type == "GpuPcieDegraded"
    assert "x8, expected x16" in problem.message and "0000:ab:00.0" in problem.message


def test_missing_gpu_is_named_by_its_bus_id(registry):
    out = diagnose_scenario("h100-sxm-8-gpu-missing", registry)
    assert out.rules() == {"gpu-not-visible-to-nvml"}
    problem = out.problems[0]
    assert problem.check == "visibility" and problem.severity is Severity.CRITICAL
    assert [g.pci_bus_id for g in problem.gpus] == ["0000:ba:00.0"]
    assert [g.index for g in problem.gpus] == [None]   # NVML gave it no index; index 6 is another GPU
    assert "0000:ba:00.0" in problem.message
    assert len(out.sweep.inventory.gpus) == 7


def test_xid79_names_gpu_3_and_its_bus_id(registry):
    out = diagnose_scenario("h100-sxm-8-xid79", registry)
    assert out.rules() == {"gpu-fell-off-bus", "xid-79"}      # NVML says lost; the kernel log says why
    problem = out.problems[0]
    assert [(g.index, g.pci_bus_id) for g in problem.gpus] == [(3, "0000:5d:00.0")]
    assert problem.action == "RESTART_BM"
    lost = out.sweep.inventory.gpus[3]
    assert lost.error == "GpuIsLost" and lost.pci_bus_id == "0000:5d:00.0"


def test_fault_injected_into_a_running_node_is_seen_by_the_next_sweep(registry):
    node = node_for("h100-sxm-8")
    assert diagnose_host(fake_host(node), registry).problems == []
    node.inject(Fault("xid", 6, {"code": 79}))
    node.inject(Fault("pcie", 1, {"width": 4}))
    out = diagnose_host(fake_host(node), registry)
    assert out.rules() == {"gpu-fell-off-bus", "xid-79", "pcie-width-degraded"}
    assert [g.index for g in out.by_rule()["gpu-fell-off-bus"].gpus] == [6]
    assert [g.index for g in out.by_rule()["xid-79"].gpus] == [6]
    assert [g.index for g in out.by_rule()["pcie-width-degraded"].gpus] == [1]
    node.inject(Fault("recover"))       # a reset: the GPU is back, the XID stays in this boot's log
    assert diagnose_host(fake_host(node), registry).rules() == {"xid-79"}
    assert diagnose_host(fake_host(node), registry, checks=["visibility", "pcie"]).problems == []


def test_scheduled_fault_applies_when_its_time_comes(registry):
    now = [0.0]
    state = node_for("h100-sxm-8").snapshot()
    node = FakeNode(state, [TimedFault(30, Fault("xid", 2, {"code": 79}))], clock=lambda: now[0])
    assert diagnose_host(fake_host(node), registry).problems == []
    now[0] = 31.0
    assert diagnose_host(fake_host(node), registry).rules() == {"gpu-fell-off-bus", "xid-79"}


def test_pcie_width_is_judged_only_while_busy(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("pcie", 2, {"width": 8, "utilization": 0}))   # idle: the width may be reduced then
    out = diagnose_host(fake_host(node), registry, checks=["pcie"])
    assert out.problems == [] and out.sweep.runs[0].observations[2].fields["busy"] is False
    node.inject(Fault("busy", 2, {"utilization": 20}))   # light use, under busy_utilization (30 %)
    assert diagnose_host(fake_host(node), registry, checks=["pcie"]).problems == []
    node.inject(Fault("busy", 2, {"utilization": 30}))
    out = diagnose_host(fake_host(node), registry, checks=["pcie"])
    assert out.rules() == {"pcie-width-degraded"} and [g.index for g in out.problems[0].gpus] == [2]
    assert "x8, expected x16, while busy at 30% utilization" in out.problems[0].message
    settings = {"pcie": {"busy_utilization": 50}}
    assert diagnose_host(fake_host(node), registry, checks=["pcie"], settings=settings).problems == []


def test_a_gpu_whose_utilization_nvml_cannot_give_is_not_judged(registry):
    """A real A100 in MIG mode prints utilization N/A: busy is unknown (null), and null never matches."""
    from pathlib import Path
    from detector.rules.engine import RuleEngine
    from detector.cli.replay_host import replay_host
    mig = Path(__file__).parent / "fixtures" / "real_machines" / "x-telegraf-a100-sxm4-80gb-mig-535"
    out = diagnose_host(replay_host(mig), registry, checks=["pcie"])
    fields = out.sweep.runs[0].observations[0].fields
    assert (fields["utilization_pct"], fields["busy"]) == (None, None) and out.problems == []
    engine = RuleEngine(builtin_rules())
    narrow = {**fields, "current_width": 8, "current_gen": 1}
    assert engine.evaluate([Observation("pcie", narrow, out.sweep.runs[0].observations[0].gpu)]) == []
    assert {p.rule for p in engine.evaluate([Observation("pcie", {**narrow, "busy": True, "utilization_pct": 90},
                                                         out.sweep.runs[0].observations[0].gpu)])} \
        == {"pcie-width-degraded", "pcie-gen-degraded"}


def test_a_pcie_fault_is_seen_under_load_unless_told_idle(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("pcie", 4, {"width": 4}))
    out = diagnose_host(fake_host(node), registry, checks=["pcie"])
    assert [g.index for g in out.by_rule()["pcie-width-degraded"].gpus] == [4]
    assert out.sweep.runs[0].observations[4].fields["utilization_pct"] == 90


def test_pcie_generation_is_judged_only_while_busy(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("pcie", 0, {"gen": 1, "utilization": 0}))     # idle: power saving, by design
    assert diagnose_host(fake_host(node), registry).problems == []
    node.inject(Fault("busy", 0, {"utilization": 90}))
    out = diagnose_host(fake_host(node), registry)
    assert out.rules() == {"pcie-gen-degraded"}
    assert "Gen1 while busy, expected Gen5" in out.problems[0].message


def test_no_driver_is_one_driver_problem_not_eight(registry):
    out = diagnose_scenario("h100-sxm-8-no-driver", registry)
    assert out.rules() == {"nvml-unavailable", "node-wide-problem",      # and so the node needs remediation,
                           "node-remediation-requested"}                 # and is not verified for work
    assert "DriverNotLoaded" in out.problems[0].message
    assert "while 8 NVIDIA GPUs are on the PCI bus" in out.problems[0].message


def test_hung_nvml_call_names_the_wedged_gpu_and_does_not_stall(registry):
    t0 = time.monotonic()
    out = diagnose_scenario("h100-sxm-8-nvml-hang", registry, inventory_timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert out.rules() == {"gpu-nvml-hung"}
    assert [g.index for g in out.by_rule()["gpu-nvml-hung"].gpus] == [2]
    assert out.sweep.inventory.gpus[2].pci_bus_id == "0000:3a:00.0"    # named through PCI order


def test_hung_nvidia_smi_is_a_finding(registry):
    out = diagnose_scenario("h100-sxm-8-smi-hang", registry, settings={"visibility": {"smi_timeout": 0.2}})
    assert out.rules() == {"nvidia-smi-hung", "node-wide-problem", "node-remediation-requested"}


def test_expected_gpu_count_from_config(registry):
    out = diagnose_scenario("h100-sxm-8", registry, settings={"visibility": {"expected_gpus": 9}})
    assert out.rules() == {"gpu-count-below-expected", "node-wide-problem", "node-remediation-requested"}
    assert "only 8 of 9 expected GPUs" in out.problems[0].message


def test_nvidia_smi_can_be_left_out(registry):
    node = node_for("h100-sxm-8-smi-hang")
    out = diagnose_host(fake_host(node), registry, settings={"visibility": {"nvidia_smi": False}})
    assert out.problems == []


# -- the real readers over fake data ---------------------------------------------------------------

def test_sysfs_reader_sees_what_the_fake_bus_holds(tmp_path):
    node = node_for("h100-sxm-8-gpu-missing")
    state = node.snapshot()
    write_sysfs(state, tmp_path)
    assert SysfsPciBus(tmp_path).devices() == pci_devices(state)
    gpus = nvidia_gpus(SysfsPciBus(tmp_path))
    assert [d.bus_id for d in gpus] == HGX_BUS_IDS                  # NVSwitches (class 0x0680) left out
    assert [d.driver for d in gpus].count(None) == 1


def test_sysfs_reader_skips_malformed_entries_and_reports_missing_root(tmp_path):
    write_sysfs(node_for("a100-pcie-4").snapshot(), tmp_path)
    broken = tmp_path / "bus" / "pci" / "devices" / "0000:00:1f.0"
    broken.mkdir()
    (broken / "vendor").write_text("not hex\n")
    assert len(SysfsPciBus(tmp_path).devices()) == 4
    with pytest.raises(FileNotFoundError):
        SysfsPciBus(tmp_path / "nowhere").devices()


def test_diagnosis_through_sysfs_tree_and_subprocess_nvidia_smi(tmp_path, registry):
    """The real code paths end to end: a written sysfs tree and fake-nvidia-smi as a process,
    both following the node through a state file after a fault is injected."""
    state_file = tmp_path / "state.json"
    node = FakeNode(node_for("h100-sxm-8").snapshot(), on_change=mirror_to(state_file))
    save_state(node, state_file)
    node.inject(Fault("xid", 3, {"code": 79}))
    write_sysfs(node.snapshot(), tmp_path / "sys")
    host = fake_host(node, sysfs_root=tmp_path / "sys", smi_command=[sys.executable, "-m", "fake_nvml.smi"],
                     smi_env={STATE_ENV: str(state_file)})
    out = diagnose_host(host, registry)
    assert out.rules() == {"gpu-fell-off-bus", "xid-79"}
    visibility = next(r for r in out.sweep.runs if r.name == "visibility")
    # nvidia-smi named the lost GPU and exited 15: a partial listing, the other seven listed.
    assert visibility.result["smi_status"] == "partial" and visibility.result["smi_gpus"] == 7
    assert visibility.result["smi_reason"] == "gpu_lost"


def test_hung_nvidia_smi_process_is_killed_at_its_timeout(tmp_path):
    from detector.backends.smi import SubprocessSmi
    script = tmp_path / "smi"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    t0 = time.monotonic()
    outcome = SubprocessSmi([str(script)]).run(["-L"], timeout_s=0.3)
    assert outcome.status == "timeout"
    assert time.monotonic() - t0 < 5


def test_missing_nvidia_smi_binary_is_reported_not_raised(tmp_path):
    from detector.backends.smi import SubprocessSmi
    outcome = SubprocessSmi([str(tmp_path / "no-such-smi")]).run(["-L"], 1.0)
    assert outcome.status == "not_found"


def test_parse_smi_list_formats():
    text = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaaaaaa-0000-0000-0000-000000000000)\n"
            "Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  Reboot the system\n")
    listing = parse_smi_list(15, text)
    assert listing.status == "partial" and listing.reason == "gpu_lost"
    assert listing.uuids == {"GPU-aaaaaaaa-0000-0000-0000-000000000000"}
    assert listing.errors == {"0000:5d:00.0": "GPU is lost.  Reboot the system"}
    failed = parse_smi_list(9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    assert failed.status == "failed" and "exit code 9" in failed.detail and failed.reason == "driver_not_loaded"


# -- checks that misbehave, and checks that join from outside the core -------------------------------

class _SleepyCheck(Check):
    name = "sleepy"
    description = "a check that never finishes"
    fields = {}
    default_timeout_s = 0.2

    def run(self, ctx):
        time.sleep(30)


class _BrokenCheck(Check):
    name = "broken"
    description = "a check that raises"
    fields = {}

    def run(self, ctx):
        raise RuntimeError("sensor exploded")


class _FanCheck(Check):
    name = "fan"
    description = "a third-party check"
    fields = {"rpm": "fan speed"}

    def run(self, ctx):
        return CheckOutput([Observation(self.name, {"rpm": 0}, g.ref()) for g in ctx.inventory.gpus[:1]])


def test_a_new_check_joins_the_registry_and_rules_without_core_changes(tmp_path, registry):
    from detector.core.sweep import run_sweep
    from detector.rules.engine import RuleEngine
    from detector.rules.loader import load_rules
    mine = CheckRegistry()
    mine.register(_FanCheck)
    (tmp_path / "fan.yaml").write_text(
        "version: 1\nrules:\n  - {name: fan-stopped, check: fan, when: rpm == 0, type: GpuFanFailed,"
        " reason: FanStopped, severity: critical, action: CHECK_MECHANICALS, message: 'fan at {rpm} rpm'}\n")
    rules = load_rules([tmp_path], mine.fields_by_check())
    sweep = run_sweep(fake_host(node_for("h100-sxm-8")), [_FanCheck()])
    problems = RuleEngine(rules).evaluate(sweep.observations)
    assert [(p.rule, [g.index for g in p.gpus]) for p in problems] == [("fan-stopped", [0])]


def test_hanging_and_failing_checks_become_problems_and_the_sweep_goes_on(registry):
    from detector.core.sweep import run_sweep
    from detector.rules.engine import RuleEngine
    from detector.rules.loader import load_rules
    from detector.rules.sources import builtin_rules_dir
    from detector.checks.pcie import PcieCheck
    t0 = time.monotonic()
    sweep = run_sweep(fake_host(node_for("h100-sxm-8-pcie-x8")), [_SleepyCheck(), _BrokenCheck(), PcieCheck()])
    assert time.monotonic() - t0 < 5
    assert {r.name: r.status for r in sweep.runs} == {"sleepy": "timeout", "broken": "error", "pcie": "ok"}
    fields = {**registry.fields_by_check(), "sleepy": _SleepyCheck.all_fields(), "broken": _BrokenCheck.all_fields()}
    problems = RuleEngine(load_rules([builtin_rules_dir()], fields)).evaluate(sweep.observations)
    assert {p.rule for p in problems} == {"check-timed-out", "check-failed", "pcie-width-degraded"}
    failed = next(p for p in problems if p.rule == "check-failed")
    assert "the broken check failed: RuntimeError: sensor exploded" in failed.message


def test_registry_refuses_two_checks_with_one_name():
    mine = CheckRegistry()
    mine.register(_FanCheck)
    other = type("OtherFan", (_FanCheck,), {})
    with pytest.raises(ValueError, match="two checks are named 'fan'"):
        mine.register(other)


def test_builtin_checks_come_from_entry_points(registry):
    assert {"visibility", "pcie"} <= set(registry.names())
