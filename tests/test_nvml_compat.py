"""Every nvidia-ml-py that pyproject.toml allows runs: the safe look-ups of detector/backends/nvmlcompat.py,
the driver check with a binding that lacks the recovery-action names, every NVML name the code reads against
the real name lists of the range's floor and of 13.610.43, and the Makefile's compat job against pyproject's
range. (`make nvml-compat` runs every scenario under those bindings; these tests need none installed.)"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pynvml
import pytest

from conftest import diagnose_host, node_for
from detector.backends.nvmlcompat import HEADER_VALUES, MISSING, GpuFabricInfo, GpuFabricInfoV2, constant, optional
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "nvml_compat"
COMPAT_BINDINGS = ("12.535.77", "13.610.43")


def binding_names(version: str) -> set[str]:
    lines = (FIXTURES / f"pynvml-{version}.names").read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


# ---- constant(): the binding's value, else the header's, else MISSING -------------------------------


def test_a_constant_the_binding_has_is_the_bindings():
    binding = types.SimpleNamespace(NVML_GPU_RECOVERY_ACTION_BUS_RESET=6, NVML_SUCCESS=0)
    assert constant("NVML_GPU_RECOVERY_ACTION_BUS_RESET", binding) == 6
    assert constant("NVML_SUCCESS", binding) == 0


def test_a_constant_the_binding_lacks_is_the_headers():
    old = types.SimpleNamespace(NVML_SUCCESS=0)          # 12.535.77 has neither name below
    assert constant("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", old) == 230
    assert constant("NVML_GPU_RECOVERY_ACTION_BUS_RESET", old) == 6
    assert constant("NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT", old) == 7


def test_a_constant_known_to_neither_is_missing_and_matches_no_reading():
    value = constant("NVML_SOMETHING_FROM_A_LATER_DRIVER", types.SimpleNamespace())
    assert value is MISSING
    assert value != 0 and value not in {0: "NONE", 1: "GPU_RESET"}
    with pytest.raises(TypeError):
        int(value)


def test_the_degraded_bandwidth_width_is_the_corrected_header_value_even_where_a_binding_says_0x11():
    binding_13_580 = types.SimpleNamespace(NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW=17)
    width = constant("NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW", binding_13_580)
    healthy = 2 | 2 << 2 | 2 << 4 | 2 << 6              # every health field FALSE: nothing wrong
    assert healthy & width == 2                          # DEGRADED_BW_FALSE, where 17 would read 0 (unknown)


@pytest.mark.parametrize("name", sorted(set(HEADER_VALUES) - {"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW"}))
def test_the_header_values_agree_with_the_current_binding(name):
    assert getattr(pynvml, name) == HEADER_VALUES[name]


def test_the_struct_versions_are_sizeof_and_version_as_nvml_struct_version_makes_them():
    assert ctypes.sizeof(GpuFabricInfo) == 28
    assert HEADER_VALUES["nvmlGpuFabricInfo_v2"] == ctypes.sizeof(GpuFabricInfoV2) | 2 << 24
    assert GpuFabricInfoV2().version == pynvml.nvmlGpuFabricInfo_v2
    assert ctypes.sizeof(GpuFabricInfoV2) == ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v2_t)


# ---- optional(): a function the binding or the driver lacks is None ---------------------------------


def _raising(code: int):
    def call(*args):
        raise pynvml.NVMLError(code)
    return call


def test_a_function_missing_from_the_binding_is_none():
    assert optional(types.SimpleNamespace(), "nvmlDeviceGetGpuFabricInfo_v4", object()) is None


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED])
def test_a_function_the_driver_lacks_or_does_not_support_is_none(code):
    nvml = types.SimpleNamespace(nvmlDeviceGetMarginTemperature=_raising(code))
    assert optional(nvml, "nvmlDeviceGetMarginTemperature", object()) is None


def test_an_answer_passes_through_and_a_gpu_error_is_raised():
    nvml = types.SimpleNamespace(nvmlDeviceGetMinorNumber=lambda handle: 3,
                                 nvmlDeviceGetSerial=_raising(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert optional(nvml, "nvmlDeviceGetMinorNumber", object()) == 3
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        optional(nvml, "nvmlDeviceGetSerial", object())


# ---- the driver check's recovery action with an old binding or driver -------------------------------

# Run in a process of its own: the names go before anything imports the check, as with a real old binding.
_OLD_BINDING = """
import json, sys
import pynvml
for name in [n for n in dir(pynvml) if n.startswith(tuple(sys.argv[2].split(",")))]:
    delattr(pynvml, name)
from detector.cli.main import main
code = main(["diagnose", "--nvml", sys.argv[1], "--checks", "driver", "-o", "json", "-q"])
print(json.dumps({"code": code}))
"""


def diagnose_without(scenario: str, prefixes: str) -> tuple[int, dict, list[dict]]:
    done = subprocess.run([sys.executable, "-c", _OLD_BINDING, scenario, prefixes], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report_text, _, code_line = done.stdout.strip().rpartition("\n")
    report = json.loads(report_text)
    return json.loads(code_line)["code"], report, report["checks"][0]["result"]["gpus"]


def test_without_the_recovery_names_a_driver_before_565_reads_unknown_and_nothing_fails():
    code, report, gpus = diagnose_without("fake:h100-sxm-8", "NVML_GPU_RECOVERY_ACTION_,NVML_FI_DEV_GET_GPU_RECOVERY")
    assert code == 0 and report["problems"] == [] and report["checks"][0]["status"] == "ok"
    assert {(g["recovery_action"], g["recovery_action_nvml"]) for g in gpus} == {("unknown", "unknown")}


def test_without_the_recovery_names_a_newer_driver_still_reports_its_action():
    # 12.535.77 lacks field 230 and every action: the driver answers in numbers, the header names them.
    code, report, gpus = diagnose_without("fake:h100-sxm-8-driver-recovery-reset",
                                          "NVML_GPU_RECOVERY_ACTION_,NVML_FI_DEV_GET_GPU_RECOVERY")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["driver-recovery-action"]
    assert (gpus[3]["recovery_action"], gpus[3]["recovery_action_nvml"]) == ("RESET_GPU", "GPU_RESET")
    assert {g["recovery_action"] for i, g in enumerate(gpus) if i != 3} == {"NONE"}


def test_a_bus_reset_is_named_under_13_610_which_lacks_the_name(tmp_path):
    scenario = tmp_path / "bus-reset.yaml"
    scenario.write_text("description: GPU 0 asks for a bus reset (NVML 615).\nextends: h100-sxm-8-driver-570\n"
                        "faults:\n  - {at: 0, kind: recovery_action, gpu: 0, action: BUS_RESET}\n")
    code, report, gpus = diagnose_without(f"fake:{scenario}",
                                          "NVML_GPU_RECOVERY_ACTION_BUS_RESET,NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT")
    assert code == 1 and (gpus[0]["recovery_action"], gpus[0]["recovery_action_nvml"]) == ("RESET_GPU", "BUS_RESET")


def test_field_values_function_not_found_from_an_old_driver_is_unknown_not_a_failure(registry):
    host = fake_host(node_for("h100-sxm-8-driver-570"))
    host.nvml.nvmlDeviceGetFieldValues = _raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    out = diagnose_host(host, registry, checks=["driver"])
    assert out.problems == [] and out.sweep.runs[0].status == "ok"
    gpus = out.sweep.runs[0].result["gpus"]
    assert {g["recovery_action"] for g in gpus} == {"unknown"} and len(gpus) == 8


def test_the_fabric_check_reads_through_the_header_layout_with_the_legacy_call(registry):
    node = node_for("h100-sxm-8-fabric-failed")
    host = fake_host(node)
    host.nvml.nvmlDeviceGetGpuFabricInfoV = _raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)   # driver before 550
    out = diagnose_host(host, registry, checks=["fabric"])
    assert "fabric-registration-failed" in out.rules()
    gpus = out.sweep.runs[0].result["gpus"]
    assert [g["registered"] for g in gpus] == [True, False] + [True] * 6
    assert {g["health_mask"] for g in gpus} == {None}          # the legacy struct has no health mask
    node.inject(Fault("recover", 1))
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).problems == []


# ---- every NVML name the code reads, against the real bindings at both ends of the range -------------

_USE = re.compile(r"\b(?:pynvml|_R|nvml)\.((?:nvml|NVML|c_nvml)\w*)")
_LOOKUP = re.compile(r"nvml_constant\(\"(\w+)\"\)")


def _code_lines():
    for top in ("detector", "fake_nvml", "tools", "kube_emulator", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                yield f"{path.relative_to(ROOT)}:{number}", line


@pytest.mark.parametrize("version", COMPAT_BINDINGS)
def test_every_nvml_name_read_directly_is_in_the_binding(version):
    names = binding_names(version)
    lacking = [f"{where}: {m.group(1)}" for where, line in _code_lines() for m in _USE.finditer(line)
               if m.group(1) not in names]
    assert lacking == [], f"nvidia-ml-py {version} lacks these: read them with nvmlcompat.constant or getattr"


def test_every_name_looked_up_safely_resolves_to_a_number_under_every_binding():
    used = {m.group(1) for _, line in _code_lines() for m in _LOOKUP.finditer(line)}
    assert "NVML_GPU_RECOVERY_ACTION_BUS_RESET" in used       # the one that killed 13.610.43 at import
    for version in COMPAT_BINDINGS:
        names = binding_names(version)
        unresolved = sorted(n for n in used if n not in names and n not in HEADER_VALUES)
        assert unresolved == [], f"no value for these under nvidia-ml-py {version}: add them to HEADER_VALUES"


def test_the_fixture_lists_are_the_bindings_they_name():
    floor, h100 = binding_names("12.535.77"), binding_names("13.610.43")
    assert "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" not in floor and "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" in h100
    assert "NVML_GPU_RECOVERY_ACTION_BUS_RESET" not in h100 and "NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN" in h100


# ---- the compat job: its comparison, and that it covers pyproject's range

def _compat_tool():
    spec = importlib.util.spec_from_file_location("nvml_compat", ROOT / "tools" / "nvml_compat.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                   # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_compat_job_names_scenario_version_and_difference():
    tool = _compat_tool()
    healthy = tool.Outcome(0, (), (("driver", "ok"), ("fabric", "ok")))
    failed = tool.Outcome(1, (("check-failed", "CheckFailed", ()),), (("driver", "ok"), ("fabric", "error")))
    reference = tool.Scan("13.615.71", {"h100-sxm-8": healthy, "a100-pcie-4": healthy})
    assert tool.differences(reference, tool.Scan("12.535.77", {"h100-sxm-8": healthy, "a100-pcie-4": healthy})) == []
    lines = tool.differences(reference, tool.Scan("12.535.77", {"h100-sxm-8": failed}))
    assert lines[0] == ("h100-sxm-8 under nvidia-ml-py 12.535.77: exit code 1, 13.615.71 gives 0; problems only "
                        "here: [('check-failed', 'CheckFailed', ())]; check status: fabric error (not ok)")
    assert lines[1] == "a100-pcie-4: not run under nvidia-ml-py 12.535.77"
    dropped = tool.Outcome(0, (), (("driver", "ok"),))
    assert tool.differences(reference, tool.Scan("13.610.43", {"h100-sxm-8": dropped, "a100-pcie-4": healthy})) \
        == ["h100-sxm-8 under nvidia-ml-py 13.610.43: check status: fabric not run (not ok)"]


# ---- the compat job covers pyproject's range -----------------------------------------------------


def _range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("nvidia-ml-py"))
    match = re.fullmatch(r"nvidia-ml-py>=([\d.]+),<([\d.]+)", spec.replace(" ", ""))
    assert match, f"pyproject's {spec!r}: the compat job expects >=FLOOR,<CEILING"
    return tuple(map(int, match.group(1).split("."))), tuple(map(int, match.group(2).split(".")))


def test_the_makefile_runs_the_compat_job_with_the_ranges_floor_and_13_610_as_part_of_make_test():
    makefile = (ROOT / "Makefile").read_text()
    versions = re.search(r"^NVML_COMPAT_VERSIONS \?= (.+)$", makefile, re.M).group(1).split()
    floor, ceiling = _range()
    first = tuple(map(int, versions[0].split(".")))
    assert first[:len(floor)] == floor, f"the compat job's first binding {versions[0]} is not pyproject's floor"
    assert all(tuple(map(int, v.split("."))) < ceiling for v in versions)
    assert "13.610.43" in versions
    assert re.search(r"^test: .*\bnvml-compat\b", makefile, re.M)
