"""nvidia-smi naming a GPU that neither NVML nor the PCI bus lists: still a GPU, never dropped.

The output is real (dcgm-exporter#604, tests/fixtures/real_smi/gh-nvidia-dcgm-exporter-604.yaml: a GPU
disconnected from its host, named with a three-digit domain); a script prints it as nvidia-smi would."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from conftest import node_for
from detector.checks.visibility import VisibilityCheck
from detector.core.sweep import run_sweep
from fake_nvml.host import fake_host

REAL = Path(__file__).parent / "fixtures" / "real_smi" / "gh-nvidia-dcgm-exporter-604.yaml"


def smi_printing(tmp_path: Path, output: str, code: int) -> list[str]:
    script = tmp_path / "smi.py"
    script.write_text(f"import sys\nsys.stdout.write({output!r})\nsys.exit({code})\n")
    return [sys.executable, str(script)]


def test_an_smi_error_for_an_unknown_bus_id_is_its_own_observation(tmp_path):
    doc = yaml.safe_load(REAL.read_text())
    node = node_for("h100-sxm-8")                 # its GPUs: 0000:18:00.0 ... 0000:db:00.0, no 0000:ba:80.0
    host = fake_host(node, smi_command=smi_printing(tmp_path, doc["output"], doc["documented_exit_code"]))
    try:
        run = run_sweep(host, [VisibilityCheck()]).runs[0]
    finally:
        host.close()
    by_bus = {o.gpu.pci_bus_id: o for o in run.observations if o.gpu}
    assert "0000:ba:00.0" in by_bus and len(by_bus) == 9          # the eight GPUs, and the one smi named
    unknown = by_bus["0000:ba:80.0"]
    named = {"pci_bus_id": "0000:ba:80.0", "on_pci": False, "driver": "", "in_nvml": False,
             "nvml_error": "", "in_smi": False, "smi_error": "Unknown Error"}
    assert {key: unknown.fields[key] for key in named} == named
    assert unknown.fields["nvml_p95_s"] is None and unknown.fields["nvml_calls"] == 0    # NVML never timed it
    assert unknown.gpu.index is None                               # no NVML index: named by its bus id
    assert run.result["smi_only_bus_ids"] == ["0000:ba:80.0"]
    assert run.result["smi_status"] == "partial" and run.result["smi_reason"] == "unknown_error"
    # The eight GPUs NVML and the bus know are not blamed for another GPU's error line.
    assert all(by_bus[b].fields["in_smi"] is None for b in by_bus if b != "0000:ba:80.0")


def test_a_known_gpu_named_by_smi_is_not_listed_as_unknown(tmp_path):
    output = "Unable to determine the device handle for GPU 0000:BA:00.0: Unknown Error\n"
    node = node_for("h100-sxm-8")
    host = fake_host(node, smi_command=smi_printing(tmp_path, output, 255))
    try:
        run = run_sweep(host, [VisibilityCheck()]).runs[0]
    finally:
        host.close()
    assert run.result["smi_only_bus_ids"] == []
    assert len([o for o in run.observations if o.gpu]) == 8


def test_the_unknown_gpu_is_reported_as_a_problem_naming_its_bus_id(tmp_path, registry):
    from conftest import diagnose_host
    doc = yaml.safe_load(REAL.read_text())
    host = fake_host(node_for("h100-sxm-8"), smi_command=smi_printing(tmp_path, doc["output"],
                                                                      doc["documented_exit_code"]))
    out = diagnose_host(host, registry, checks=["visibility"])
    problem = out.by_rule()["gpu-unknown-failing-in-nvidia-smi"]
    assert [g.pci_bus_id for g in problem.gpus] == ["0000:ba:80.0"] and "Unknown Error" in problem.message
