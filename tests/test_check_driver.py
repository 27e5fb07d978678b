"""The driver check: kernel modules, device files, kernel module vs library version, persistence mode and
the driver's recovery action: the parsers on real text and look-alikes, the real reader on written trees,
the check on scenarios that trip it and ones that must not, the rules at their boundaries, diagnose JSON
and the daemon against the emulator."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import builtin_rules, Clock, diagnose_host, diagnose_scenario, node_for
from test_cli import diagnose_json
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.backends.system import (HostSystem, SystemInfo, host_system, parse_device_minor,
                                      parse_driver_version, parse_proc_modules)
from detector.checks.driver import DriverCheck
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.system import fake_system, write_system

FIXTURES = Path(__file__).parent / "fixtures" / "driver"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def driver(scenario: str, registry, **kwargs):
    return diagnose_scenario(scenario, registry, checks=["driver"], **kwargs)


def node_fields(outcome) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations if o.fields["scope"] == "node")


def gpu_fields(outcome, index: int) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations
                if o.fields["scope"] == "gpu" and o.gpu.index == index)


# ---- parsers, on real text ----------------------------------------------------------------------


@pytest.mark.parametrize("name,live", [
    ("proc_modules_talos.txt", {"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm"}),
    ("proc_modules_desktop.txt", {"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm"}),
    ("proc_modules_nouveau.txt", set()),
    ("proc_modules_unloading.txt", set()),
])
def test_proc_modules_tell_nvidia_modules_from_look_alikes(name, live):
    modules = parse_proc_modules(fixture(name))
    info = SystemInfo(modules=modules)
    nvidia = {m for m in ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm") if info.loaded(m)}
    assert nvidia == live
    assert not info.loaded("i2c_nvidia") and not info.loaded("nvidiafb")


def test_look_alike_modules_are_other_names_and_unloading_is_not_loaded():
    desktop = SystemInfo(modules=parse_proc_modules(fixture("proc_modules_desktop.txt")))
    assert desktop.loaded("i2c_nvidia_gpu") and not desktop.loaded("nvidia_peermem")
    nouveau = SystemInfo(modules=parse_proc_modules(fixture("proc_modules_nouveau.txt")))
    assert nouveau.loaded("nouveau") and not nouveau.loaded("nvidia")
    unloading = SystemInfo(modules=parse_proc_modules(fixture("proc_modules_unloading.txt")))
    assert unloading.modules["nvidia"] == "Unloading" and unloading.loaded("nvidia") is False
    assert unloading.loaded("nvidia_peermem") and SystemInfo().loaded("nvidia") is None


@pytest.mark.parametrize("name,version,flavor", [
    ("version_515.76.txt", "515.76", "proprietary"),
    ("version_440.95.01.txt", "440.95.01", "proprietary"),
    ("version_177.80.txt", "177.80", "proprietary"),
    ("version_open_575.57.08.txt", "575.57.08", "open"),
    ("version_open_aarch64_580.65.06.txt", "580.65.06", "open"),
    ("version_no_nvrm_line.txt", None, None),
])
def test_kernel_module_version_from_real_version_files(name, version, flavor):
    assert parse_driver_version(fixture(name)) == (version, flavor)


def test_device_minor_from_the_gpu_information_file():
    assert parse_device_minor(fixture("information_rtx3090.txt")) == 0
    assert parse_device_minor(fixture("information_old_no_minor.txt")) is None
    assert parse_device_minor("Device Minor: \t seven\n") is None


# ---- the real reader on written trees ----------------------------------------------------------


def test_real_and_fake_readers_agree_on_a_written_tree(tmp_path):
    node = node_for("h100-sxm-8-driver-devfile-missing")
    node.inject(Fault("module_unloaded", params={"module": "nvidia_uvm"}))
    state = node.snapshot()
    write_system(state, tmp_path)
    real = host_system(tmp_path / "sys").read()
    fake = fake_system(node).read()
    assert real.modules == fake.modules and real.gpu_minors == fake.gpu_minors
    assert real.device_files == fake.device_files and "nvidia6" not in real.device_files
    assert (real.kernel_module_version, real.kernel_module_flavor) == ("550.90.07", "proprietary")
    assert real.fabric_manager_running is True and real.errors == ()


def test_the_real_reader_reports_what_it_cannot_read_as_unknown(tmp_path):
    info = HostSystem(tmp_path / "proc", tmp_path / "dev", tmp_path / "run").read()
    assert info.modules is None and info.device_files is None and info.gpu_minors is None
    assert info.kernel_module_version is None and info.fabric_manager_running is None
    assert any("modules" in e for e in info.errors)


def test_fabric_manager_from_its_pid_file_or_the_host_process_table(tmp_path):
    node = node_for("h100-sxm-8")
    write_system(node.snapshot(), tmp_path)
    reader = lambda: HostSystem(tmp_path / "proc", tmp_path / "dev", tmp_path / "run", max_age_s=0)  # noqa: E731
    assert reader().read().fabric_manager_running is True
    (tmp_path / "run" / "nvidia-fabricmanager" / "nv-fabricmanager.pid").unlink()
    assert reader().read().fabric_manager_running is True          # found by its comm in the process table
    (tmp_path / "proc" / "4242" / "comm").write_text("python3\n")
    assert reader().read().fabric_manager_running is False
    (tmp_path / "proc" / "1" / "comm").write_text("tini\n")          # a container's own process table
    assert reader().read().fabric_manager_running is None


def test_a_reading_is_shared_by_the_checks_of_one_sweep(tmp_path):
    write_system(node_for("h100-sxm-8").snapshot(), tmp_path)
    clock = Clock(0.0)
    reader = HostSystem(tmp_path / "proc", tmp_path / "dev", tmp_path / "run", clock=clock)
    first = reader.read()
    (tmp_path / "dev" / "nvidia-uvm").unlink()
    assert reader.read() is first
    clock.now = 6.0
    assert "nvidia-uvm" not in reader.read().device_files


def test_roots_sit_beside_the_sysfs_root():
    reader = host_system(Path("/host/sys"))
    assert (reader.proc_root, reader.dev_root, reader.run_root) == (Path("/host/proc"), Path("/host/dev"),
                                                                    Path("/host/run"))
    assert host_system(Path("/sys")).proc_root == Path("/proc") and host_system(None).dev_root == Path("/dev")


def test_this_machine_reads_without_raising():
    info = host_system(None).read()
    assert info.modules is None or isinstance(info.modules, dict)
    if os.path.exists("/proc/modules"):
        assert info.modules is not None


# ---- the check on scenarios ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-driver-570", "a100-pcie-4", "v100-sxm-8",
                                      "rtx-4090-1"])
def test_healthy_nodes_raise_nothing(scenario, registry):
    out = driver(scenario, registry)
    assert out.problems == [] and out.sweep.runs[0].status == "ok"
    node = node_fields(out)
    assert node["version_mismatch"] is False and node["modules_missing"] == "" and node["device_files_missing"] == ""


def test_recovery_action_is_unknown_before_driver_565_never_failed(registry):
    out = driver("h100-sxm-8", registry)
    assert {gpu_fields(out, i)["recovery_action"] for i in range(8)} == {"unknown"}
    assert "recovery action unknown" in out.sweep.runs[0].summary
    new = driver("h100-sxm-8-driver-570", registry)
    assert {gpu_fields(new, i)["recovery_action"] for i in range(8)} == {"NONE"}
    assert gpu_fields(new, 0)["reset_required"] is False


def test_recovery_action_reset_names_the_gpu_and_a_reset_clears_it(registry):
    node = node_for("h100-sxm-8-driver-recovery-reset")
    out = diagnose_host(fake_host(node), registry, checks=["driver"])
    problem = out.by_rule()["driver-recovery-action"]
    assert (problem.type, problem.action, problem.severity) == ("GpuRecoveryRequired", "RESET_GPU", Severity.CRITICAL)
    assert [g.index for g in problem.gpus] == [3] and "GPU_RESET" in problem.message
    assert gpu_fields(out, 3)["reset_required"] is True
    node.inject(Fault("recover", 3))
    assert diagnose_host(fake_host(node), registry, checks=["driver"]).problems == []


@pytest.mark.parametrize("nvml_action,action", [("NODE_REBOOT", "RESTART_BM"), ("DRAIN_P2P", "DRAIN_P2P"),
                                                ("DRAIN_AND_RESET", "DRAIN_AND_RESET"),
                                                ("SYSTEM_REBOOT", "RESTART_BM"), ("RECOVER_IMEX_DOMAIN", "INSPECT")])
def test_the_recommended_action_follows_the_drivers(nvml_action, action, registry):
    node = node_for("h100-sxm-8-driver-570")
    node.inject(Fault("recovery_action", 0, {"action": nvml_action}))
    problem = diagnose_host(fake_host(node), registry, checks=["driver"]).by_rule()["driver-recovery-action"]
    assert problem.action == action


def test_a_reboot_class_action_survives_a_gpu_reset_not_a_reboot(registry):
    node = node_for("h100-sxm-8-driver-570")
    node.inject(Fault("recovery_action", 2, {"action": "NODE_REBOOT"}))
    node.inject(Fault("recover", 2))
    assert diagnose_host(fake_host(node), registry, checks=["driver"]).rules() == {"driver-recovery-action"}
    node.inject(Fault("reboot"))
    assert diagnose_host(fake_host(node), registry, checks=["driver"]).problems == []


def test_version_mismatch_is_one_problem_across_checks_and_a_reboot_clears_it(registry):
    """NVML, nvidia-smi and the driver check all see it; the node gets one problem (visibility's, as for
    DriverNotLoaded) and the driver check's result says which module is loaded."""
    node = node_for("h100-sxm-8-driver-mismatch")
    out = diagnose_host(fake_host(node), registry, checks=["driver", "visibility"])
    assert out.rules() == {"nvml-version-mismatch"}
    [problem] = out.problems
    assert (problem.type, problem.reason, problem.action) == ("GpuDriverUnhealthy", "DriverVersionMismatch", "RESTART_BM")
    assert "Driver/library version mismatch" in problem.message
    fields = node_fields(out)
    assert fields["nvml_status"] == "LibRmVersionMismatch" and fields["version_mismatch"] is True
    assert fields["kernel_module_version"] == "535.183.01"
    assert any("API mismatch" in r.message for r in node.kernel_records())
    node.inject(Fault("reboot"))
    assert diagnose_host(fake_host(node), registry, checks=["driver", "visibility"]).problems == []


def test_missing_uvm_module_is_critical_while_nvml_still_works(registry):
    out = driver("h100-sxm-8-modules-uvm-unloaded", registry)
    assert out.rules() == {"driver-modules-missing"}
    assert node_fields(out)["modules_missing"] == "nvidia_uvm" and node_fields(out)["nvml_status"] == "ok"


def test_no_driver_at_all_is_left_to_the_visibility_check(registry):
    out = driver("h100-sxm-8-no-driver", registry)
    assert out.problems == []
    assert node_fields(out)["modules_missing"] == "nvidia,nvidia_uvm"


def test_nouveau_is_a_conflict_and_peermem_is_only_reported(registry):
    out = driver("h100-sxm-8-modules-nouveau", registry)
    assert out.rules() == {"driver-conflicting-module"}
    assert node_fields(out)["modules_optional"] == "nvidia_modeset=loaded,nvidia_drm=loaded,nvidia_peermem=loaded"
    node = node_for("h100-sxm-8")
    node.inject(Fault("module_unloaded", params={"module": "nvidia_peermem"}))
    out = diagnose_host(fake_host(node), registry, checks=["driver"])
    assert out.problems == [] and "nvidia_peermem=not_loaded" in node_fields(out)["modules_optional"]


def test_missing_device_files_name_the_control_file_and_the_gpus(registry):
    out = driver("h100-sxm-8-driver-devfile-missing", registry)
    assert out.rules() == {"driver-device-files-missing"}
    assert node_fields(out)["device_files_missing"] == "nvidia-uvm,nvidia6"
    assert gpu_fields(out, 6)["device_file_present"] is False and gpu_fields(out, 5)["device_file_present"] is True


def test_persistence_off_is_a_warning_per_gpu_where_the_site_requires_it(registry):
    out = driver("h100-sxm-8-persistence-off", registry, settings={"driver": {"require_persistence": True}})
    problem = out.by_rule()["driver-persistence-off"]
    assert (problem.type, problem.severity) == ("GpuPersistenceModeOff", Severity.WARNING)
    assert [g.index for g in problem.gpus] == [1, 5] and "nvidia-persistenced" in problem.message
    assert out.rules() == {"driver-persistence-off"}


def test_persistence_off_on_some_gpus_of_a_node_set_up_for_it_is_a_warning_by_default(registry):
    """6 of 8 GPUs run with persistence: the 2 without lost it (a reset or reload drops the setting)."""
    out = driver("h100-sxm-8-persistence-off", registry)
    assert out.rules() == {"driver-persistence-off"}
    assert [g.index for g in out.by_rule()["driver-persistence-off"].gpus] == [1, 5]
    assert "6 other GPU(s) of this node have it on" in out.problems[0].message
    assert gpu_fields(out, 1)["persistence_required"] is False and gpu_fields(out, 1)["persistence_on_others"] == 6
    assert "persistence off on 2/8 GPU(s)" in out.sweep.runs[0].summary


def test_persistence_off_on_every_gpu_is_reported_but_no_problem_by_default(registry):
    """The driver's default is off and jobs run without it (real healthy VMs and desktops): observed, not
    judged, unless the site asks."""
    node = node_for("h100-sxm-8-persistence-off")
    for gpu in (0, 2, 3, 4, 6, 7):
        node.inject(Fault("persistence_off", gpu))
    out = diagnose_host(fake_host(node), registry, checks=["driver"])
    assert out.problems == [] and "persistence off on 8/8 GPU(s)" in out.sweep.runs[0].summary
    out = diagnose_host(fake_host(node), registry, checks=["driver"], settings={"driver": {"require_persistence": True}})
    assert len(out.by_rule()["driver-persistence-off"].gpus) == 8


def test_settings_choose_the_modules(registry):
    out = driver("h100-sxm-8", registry, settings={"driver": {"required_modules": ["nvidia", "gdrdrv"]}})
    assert node_fields(out)["modules_missing"] == "gdrdrv" and out.rules() == {"driver-modules-missing"}


@pytest.mark.parametrize("system", [None, "broken"])
def test_a_host_whose_plumbing_cannot_be_read_reports_unknown_not_missing(system, registry):
    class Broken:
        def read(self) -> SystemInfo:
            raise PermissionError("/proc is not mounted")
    host = fake_host(node_for("h100-sxm-8"))
    host.system = Broken() if system else None
    out = diagnose_host(host, registry, checks=["driver"])
    node = node_fields(out)
    assert node["plumbing"] == "unknown" and node["modules_missing_count"] is None and out.problems == []
    assert gpu_fields(out, 0)["device_file_present"] is None and gpu_fields(out, 0)["device_file"] == "nvidia0"
    assert "unknown" in out.sweep.runs[0].summary
    assert out.sweep.runs[0].status == "ok"
    assert ("PermissionError" in str(out.sweep.runs[0].result["node"].get("unreadable"))) == bool(system)


def test_the_fabric_check_now_reads_the_fake_fabric_manager(registry):
    node = node_for("h100-sxm-8-fabric-manager-down")
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).rules() == {"fabric-manager-not-running"}


# ---- rule thresholds, on observations ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(DriverCheck.fields)
    base.update(scope="node", nvml_status="ok", modules_missing_count=0, modules_conflicting_count=0,
                device_files_missing_count=0, version_mismatch=False)
    return {p.rule for p in engine.evaluate([Observation("driver", {**base, **fields})])}


@pytest.mark.parametrize("fields,expected", [
    ({"modules_missing_count": 0}, set()), ({"modules_missing_count": 1}, {"driver-modules-missing"}),
    ({"modules_missing_count": None}, set()),
    ({"modules_missing_count": 3, "nvml_status": "DriverNotLoaded"}, set()),
    ({"modules_conflicting_count": 1}, {"driver-conflicting-module"}),
    ({"device_files_missing_count": 1}, {"driver-device-files-missing"}),
    ({"device_files_missing_count": None}, set()),
    ({"version_mismatch": True}, {"driver-version-differs"}), ({"version_mismatch": None}, set()),
    ({"version_mismatch": True, "nvml_status": "LibRmVersionMismatch"}, set()),    # visibility's problem
])
def test_node_rule_boundaries(engine, fields, expected):
    assert judge(engine, **fields) == expected


@pytest.mark.parametrize("fields,expected", [
    ({"recovery_action": "NONE"}, set()), ({"recovery_action": "unknown"}, set()), ({"recovery_action": None}, set()),
    ({"recovery_action": "RESET_GPU"}, {"driver-recovery-action"}),
    ({"persistence_mode": "disabled", "persistence_required": True}, {"driver-persistence-off"}),
    ({"persistence_mode": "disabled", "persistence_required": False}, set()),
    ({"persistence_mode": "enabled", "persistence_required": True}, set()),
    ({"persistence_mode": "not_supported", "persistence_required": True}, set()),
    ({"reset_required": True, "recovery_action": "unknown"}, set()),     # the memory check owns pending work
])
def test_gpu_rule_boundaries(engine, fields, expected):
    assert judge(engine, scope="gpu", **fields) == expected


# ---- end to end --------------------------------------------------------------------------------


def test_diagnose_json_end_to_end():
    code, report = diagnose_json("h100-sxm-8-driver-recovery-reset", "--checks", "driver")
    assert code == 1 and {p["rule"] for p in report["problems"]} == {"driver-recovery-action"}
    result = report["checks"][0]["result"]
    assert result["node"]["kernel_module_version"] == "570.133.20" and result["node"]["kernel_module_flavor"] == "open"
    assert result["gpus"][3]["recovery_action_nvml"] == "GPU_RESET" and "persistence_mode" not in result["node"]
    code, report = diagnose_json("h100-sxm-8", "--checks", "driver")
    assert code == 0 and report["checks"][0]["result"]["gpus"][0]["recovery_action"] == "unknown"


def test_daemon_sets_and_clears_the_driver_condition(running):
    local = running(name="gpu-drv", checks=["driver"], check_settings={"driver": {"interval": 0.3}})

    def status() -> str | None:
        return local.conditions().get("GpuDriverUnhealthy", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuDriverUnhealthy") and status() is None, 10), local.conditions()
    local.node.inject(Fault("module_unloaded", params={"module": "nvidia_uvm"}))
    assert local.wait_for(lambda: status() == "True", 10)
    condition = local.conditions()["GpuDriverUnhealthy"]
    assert condition["reason"] == "DriverModulesMissing" and "nvidia_uvm" in condition["message"]
    local.node.inject(Fault("recover"))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()


def test_a_compute_node_without_modeset_or_drm_is_healthy(registry):
    """A real H100 node ran CUDA with nvidia and nvidia_uvm alone (../shared/real-machines/h100-vm-580,
    proc-modules.txt): display modules are reported, required only where a setting says so."""
    node = node_for("h100-sxm-8")
    for module in ("nvidia_drm", "nvidia_modeset"):
        node.inject(Fault("module_unloaded", params={"module": module}))
    out = diagnose_host(fake_host(node), registry, checks=["driver"])
    assert out.problems == []
    assert "nvidia_modeset=not_loaded" in node_fields(out)["modules_optional"]
    out = diagnose_host(fake_host(node), registry, checks=["driver"],
                        settings={"driver": {"required_modules": ["nvidia", "nvidia_uvm", "nvidia_modeset"]}})
    assert out.rules() == {"driver-modules-missing"} and node_fields(out)["modules_missing"] == "nvidia_modeset"
