"""The fake nvidia-smi prints what the real one prints, from the same fake node NVML reads."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from detector.backends.pciaddr import nvml_bus_id
from detector.backends.smi_listing import parse_smi_list
from fake_nvml.faults import Fault
from fake_nvml.node import FakeNode, NodeState
from fake_nvml.nvml import FakeNvml
from fake_nvml.scenario import load_scenario
from fake_nvml.smi import SmiResult, main, run_smi
from fake_nvml.statefile import SCENARIO_ENV, STATE_ENV, save_state

REPO_ROOT = Path(__file__).resolve().parents[1]
LIST_LINE = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9a-f-]{36})\)$")
LOST_LINE = ("Unable to determine the device handle for GPU0000:5D:00.0: "
             "GPU is lost.  Reboot the system to recover this GPU")
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n\n")


def node_of(scenario: str) -> FakeNode:
    return load_scenario(scenario).build()


def smi(scenario: str, *argv: str) -> SmiResult:
    return run_smi(node_of(scenario).snapshot(), list(argv), now=datetime(2024, 6, 4, 9, 5, 7))


def nvml_uuids(node: FakeNode) -> list[str]:
    nv = FakeNvml(node)
    nv.nvmlInit()
    try:
        return [nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(nv.nvmlDeviceGetCount())]
    finally:
        nv.nvmlShutdown()


def parse_csv(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text), skipinitialspace=True))


# -- -L -------------------------------------------------------------------------------------------

def test_list_gpus_matches_nvml_uuids_in_index_order():
    node = node_of("h100-sxm-8")
    result = run_smi(node.snapshot(), ["-L"])

    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 8
    parsed = [LIST_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m[1]) for m in parsed] == list(range(8))
    assert {m[2] for m in parsed} == {"NVIDIA H100 80GB HBM3"}
    assert [m[3] for m in parsed] == nvml_uuids(node)


def test_long_option_is_the_same_as_short():
    assert smi("h100-sxm-8", "--list-gpus") == smi("h100-sxm-8", "-L")


def test_list_gpus_leaves_out_a_gpu_the_driver_never_attached():
    node = node_of("h100-sxm-8-gpu-missing")
    missing_uuid = node.snapshot().gpus[6].uuid
    result = run_smi(node.snapshot(), ["-L"])

    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert len(lines) == 7
    assert missing_uuid not in result.stdout
    assert [LIST_LINE.match(line)[1] for line in lines] == [str(i) for i in range(7)]   # renumbered, as NVML does
    assert [LIST_LINE.match(line)[3] for line in lines] == nvml_uuids(node)


def test_list_gpus_reports_a_lost_gpu_by_bus_id_and_fails():
    result = smi("h100-sxm-8-xid79", "-L")

    assert result.returncode == 15                       # NVML_ERROR_GPU_IS_LOST, as nvidia-smi exits
    lines = result.stdout.splitlines()
    assert len(lines) == 8
    assert lines[3] == LOST_LINE                         # GPU 3 sits at 0000:5d:00.0
    assert all(LIST_LINE.match(line) for i, line in enumerate(lines) if i != 3)


def test_lost_gpu_reads_like_the_real_one():
    """The fake's lost-GPU line says what a real driver said (marian-nmt/marian#251) and reads the same."""
    import yaml

    from detector.backends.smi_listing import parse_smi_list
    real = yaml.safe_load((REPO_ROOT / "tests/fixtures/real_smi/gh-marian-nmt-marian-251.yaml").read_text())
    [real_reason] = real["expect"]["errors"].values()
    result = smi("h100-sxm-8-xid79", "-L")
    listing = parse_smi_list(result.returncode, result.stdout)
    assert (result.returncode, listing.status, listing.reason) == (15, "partial", "gpu_lost")
    assert listing.errors == {"0000:5d:00.0": real_reason}
    assert len(listing.uuids) == 7


# -- driver not loaded ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [[], ["-L"], ["--query-gpu=index", "--format=csv"]])
def test_no_driver_fails_every_invocation_with_exit_9(argv):
    result = smi("h100-sxm-8-no-driver", *argv)

    assert result.returncode == 9
    assert result.stdout == NO_DRIVER


@pytest.mark.parametrize("argv", [[], ["-L"], ["--query-gpu=index", "--format=csv"]])
def test_a_driver_upgraded_under_the_loaded_module_fails_as_the_real_one_does(argv):
    """Text and exit status as in tests/fixtures/real_smi/gh-intel-llvm-17614.yaml, read the same way."""
    node = node_of("h100-sxm-8")
    node.inject(Fault("version_mismatch"))
    state = node.snapshot()
    result = run_smi(state, argv)
    library = ".".join(state.driver_version.split(".")[:2])
    assert (result.returncode, result.stdout) == (
        255, f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {library}\n")
    assert (parse_smi_list(result.returncode, result.stdout).reason) == "version_mismatch"
    node.inject(Fault("reboot"))
    assert run_smi(node.snapshot(), ["-L"]).returncode == 0


# -- --query-gpu ------------------------------------------------------------------------------------

def test_query_csv_has_a_header_with_units_and_values_with_units():
    result = smi("h100-sxm-8", "--query-gpu=index,name,pci.bus_id,memory.total,power.draw,utilization.gpu,"
                 "temperature.gpu,persistence_mode,count", "--format=csv")

    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == ("index, name, pci.bus_id, memory.total [MiB], power.draw [W], "
                                             "utilization.gpu [%], temperature.gpu, persistence_mode, count")
    header, *rows = parse_csv(result.stdout)
    assert len(rows) == 8
    assert rows[0] == ["0", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", "81559 MiB", "72.00 W", "0 %",
                       "33", "Enabled", "8"]
    assert [r[2] for r in rows] == [nvml_bus_id(g.pci_bus_id) for g in node_of("h100-sxm-8").snapshot().gpus]


def test_query_noheader_nounits_gives_bare_numbers():
    result = smi("h100-sxm-8-pcie-x8", "--query-gpu=index,pcie.link.width.current,pcie.link.width.max,"
                 "pcie.link.gen.current,memory.total", "--format=csv,noheader,nounits")

    assert result.returncode == 0
    rows = parse_csv(result.stdout)
    assert len(rows) == 8 and rows[0][0] == "0"        # no header line
    widths = {int(r[0]): int(r[1]) for r in rows}
    assert widths[5] == 8
    assert all(w == 16 for i, w in widths.items() if i != 5)
    assert all(r[2] == "16" and r[3] == "5" and r[4] == "81559" for r in rows)


def test_query_nounits_drops_units_from_the_header_too():
    result = smi("h100-sxm-8", "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,nounits")

    header, first, *_ = parse_csv(result.stdout)
    assert header == ["memory.total", "memory.used", "memory.free"]
    assert first == ["81559", "0", "81559"]


def test_query_reflects_injected_faults():
    node = node_of("h100-sxm-8")
    node.inject(Fault("ecc", 1, {"uncorrected": 2}))
    node.inject(Fault("busy", 4, {"utilization": 97, "memory_mib": 4096}))
    result = run_smi(node.snapshot(), ["--query-gpu=index,ecc.errors.uncorrected.volatile.total,utilization.gpu,"
                                       "memory.used", "--format=csv,noheader"])

    rows = {r[0]: r[1:] for r in parse_csv(result.stdout)}
    assert rows["1"][0] == "2"
    assert rows["4"] == ["0", "97 %", "4096 MiB"]


def test_query_of_a_lost_gpu_prints_the_handle_error_in_its_row():
    result = smi("h100-sxm-8-xid79", "--query-gpu=index,pci.bus_id", "--format=csv,noheader")

    assert result.returncode == 15
    lines = result.stdout.splitlines()
    assert len(lines) == 8 and lines[3] == LOST_LINE
    assert lines[4] == "4, 00000000:9A:00.0"


def test_query_with_id_selects_one_gpu_by_index_uuid_or_bus_id():
    node = node_of("h100-sxm-8-pcie-x8")
    state = node.snapshot()
    for target in ("5", state.gpus[5].uuid, "00000000:AB:00.0", "0000:ab:00.0"):
        result = run_smi(state, ["-i", target, "--query-gpu=index,pcie.link.width.current",
                                 "--format=csv,noheader"])
        assert (result.returncode, result.stdout) == (0, "5, 8\n"), target
    assert run_smi(state, ["--id=2", "-L"]).stdout.startswith("GPU 2: ")


def test_id_that_matches_no_gpu_is_not_found():
    result = smi("h100-sxm-8", "-i", "8", "-L")

    assert (result.returncode, result.stdout) == (6, "No devices were found\n")


def test_unknown_field_is_rejected_with_the_real_message():
    result = smi("h100-sxm-8", "--query-gpu=index,foo", "--format=csv")

    assert result.returncode == 2
    assert result.stdout.splitlines()[0] == 'Field "foo" is not a valid field to query.'


def test_query_without_format_is_an_argument_error():
    result = smi("h100-sxm-8", "--query-gpu=index")

    assert result.returncode == 2
    assert "nvidia-smi -h" in result.stdout


def test_unknown_option_is_an_argument_error():
    result = smi("h100-sxm-8", "--frobnicate")

    assert result.returncode == 2
    assert result.stdout.startswith("ERROR: Option --frobnicate is not recognized.")


def test_help_exits_zero():
    result = smi("h100-sxm-8", "-h")

    assert result.returncode == 0
    assert "--query-gpu" in result.stdout and "--list-gpus" in result.stdout


# -- the summary table ------------------------------------------------------------------------------

def test_default_table_has_driver_cuda_and_every_bus_id():
    state = node_of("h100-sxm-8").snapshot()
    result = run_smi(state, [], now=datetime(2024, 6, 4, 9, 5, 7))

    assert result.returncode == 0
    out = result.stdout
    assert out.startswith("Tue Jun  4 09:05:07 2024")
    assert "| NVIDIA-SMI 550.90.07              Driver Version: 550.90.07      CUDA Version: 12.4     |" in out
    for gpu in state.gpus:
        assert nvml_bus_id(gpu.pci_bus_id) in out
    assert out.count("NVIDIA H100 80GB HBM3") == 8
    assert "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |" in out
    assert "| N/A   33C    P0             72W /  700W |       0MiB /  81559MiB |      0%      Default |" in out
    assert "No running processes found" in out
    table_lines = [line for line in out.splitlines() if line[:1] in "|+"]
    assert {len(line) for line in table_lines} == {91}


def test_default_table_lists_running_processes():
    node = node_of("h100-sxm-8")
    node.inject(Fault("busy", 2, {"pid": 110276, "memory_mib": 178}))
    out = run_smi(node.snapshot(), []).stdout

    assert "|    2   N/A  N/A    110276      C   python3                                       178MiB |" in out
    assert "No running processes found" not in out


def test_default_table_with_a_lost_gpu_prints_only_the_error():
    result = smi("h100-sxm-8-xid79")

    assert (result.returncode, result.stdout) == (15, LOST_LINE + "\n")


# -- main(): another process, environment, hang ------------------------------------------------------

def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (STATE_ENV, SCENARIO_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def run_module(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fake_nvml.smi", *argv], env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=60)


def test_another_process_sees_a_fault_injected_before_the_state_was_saved(tmp_path):
    node = node_of("h100-sxm-8")
    uuids = nvml_uuids(node)
    state_file = tmp_path / "node.json"
    save_state(node, state_file)
    before = run_module("-L", **{STATE_ENV: str(state_file)})
    node.inject(Fault("xid", 3, {"code": 79}))
    save_state(node, state_file)

    after = run_module("-L", **{STATE_ENV: str(state_file)})

    assert before.returncode == 0 and LOST_LINE not in before.stdout
    assert after.returncode == 15
    assert after.stdout.splitlines()[3] == LOST_LINE
    assert after.stdout.splitlines()[0] == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {uuids[0]})"


def test_main_builds_a_scenario_named_in_the_environment():
    result = run_module("--query-gpu=index,pcie.link.width.current", "--format=csv,noheader",
                        **{SCENARIO_ENV: "h100-sxm-8-pcie-x8"})

    assert result.returncode == 0
    assert "5, 8" in result.stdout.splitlines()


def test_main_without_a_node_says_which_variables_to_set():
    result = run_module("-L")

    assert result.returncode == 2
    assert result.stdout == ""
    assert STATE_ENV in result.stderr and SCENARIO_ENV in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"name": "x"})])
def test_main_with_a_missing_or_corrupt_state_file_fails_cleanly(tmp_path, content):
    state_file = tmp_path / "node.json"
    if content is not None:
        state_file.write_text(content)

    result = run_module("-L", **{STATE_ENV: str(state_file)})

    assert result.returncode == 2
    assert STATE_ENV in result.stderr and "Traceback" not in result.stderr


def test_main_with_an_unknown_scenario_fails_cleanly():
    result = run_module("-L", **{SCENARIO_ENV: "no-such-scenario"})

    assert result.returncode == 2
    assert SCENARIO_ENV in result.stderr and "Traceback" not in result.stderr


def test_main_hangs_as_long_as_the_state_says(tmp_path, monkeypatch, capsys):
    node = node_of("h100-sxm-8")
    node.inject(Fault("smi_hang", None, {"seconds": 0.3}))
    state_file = tmp_path / "node.json"
    save_state(node, state_file)
    monkeypatch.delenv(SCENARIO_ENV, raising=False)
    monkeypatch.setenv(STATE_ENV, str(state_file))

    started = time.monotonic()
    code = main(["-L"])
    elapsed = time.monotonic() - started

    assert code == 0
    assert elapsed >= 0.3
    assert len(capsys.readouterr().out.splitlines()) == 8


def test_run_smi_never_sleeps_even_for_a_hung_state():
    state: NodeState = node_of("h100-sxm-8-smi-hang").snapshot()
    assert state.smi_hang_s > 0

    started = time.monotonic()
    result = run_smi(state, ["-L"])

    assert result.returncode == 0
    assert time.monotonic() - started < 5       # the scenario hangs for 120 s; run_smi must not
