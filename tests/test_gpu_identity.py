"""The right GPU, always: a GPU is its PCI bus id first; an index is NVML's own or none.

8 GPUs on the PCI bus, NVML sees 7, the missing one in the middle of PCI order: NVML renumbers the GPUs
after it, so its PCI-order position (3) is another, healthy GPU's index. The problem must name the
missing GPU by bus id with no index, and no healthy GPU's row may show it.
"""

from __future__ import annotations

from conftest import diagnose_host, node_for
from detector.cli.render import Diagnosis, render_table
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host

MISSING = "0000:5d:00.0"          # PCI position 3 of the H100 node's eight


def _diagnosis(registry) -> Diagnosis:
    node = node_for("h100-sxm-8")
    node.inject(Fault("nvml_invisible", 3, {}))
    out = diagnose_host(fake_host(node), registry)
    return Diagnosis("fake:h100-sxm-8", out.sweep, out.problems)


def test_missing_gpu_in_the_middle_is_named_by_bus_id_never_by_another_gpus_index(registry):
    d = _diagnosis(registry)
    nvml = {g.pci_bus_id: g.index for g in d.sweep.inventory.gpus}
    assert len(nvml) == 7 and MISSING not in nvml and nvml["0000:9a:00.0"] == 3      # NVML renumbered
    [problem] = [p for p in d.problems if p.rule == "gpu-not-visible-to-nvml"]
    assert [(g.index, g.pci_bus_id) for g in problem.gpus] == [(None, MISSING)]
    assert problem.message.startswith(f"GPU ({MISSING}):")
    report = d.to_dict()
    assert report["problems"][0]["gpus"] == [] and report["problems"][0]["gpu_details"] == [
        {"index": None, "uuid": None, "pci_bus_id": MISSING}]
    by_bus = {g["pci_bus_id"]: g for g in report["gpus"]}
    assert by_bus[MISSING]["index"] is None and by_bus[MISSING]["error"] == "NotSeenByNvml"
    assert {b: g["index"] for b, g in by_bus.items() if b != MISSING} == nvml      # NVML's own indices


def test_table_shows_the_missing_gpu_on_its_own_row_and_every_healthy_gpu_ok(registry):
    table = render_table(_diagnosis(registry))
    rows = [line.split() for line in table.splitlines() if ":00.0  " in line and not line.startswith(" ")]
    states = {next(c for c in r if c.endswith(":00.0")): r[-1] for r in rows}
    assert states.pop(MISSING) == "GpuNotVisibleToNvml"
    assert len(states) == 7 and set(states.values()) == {"ok"}
    assert f"GPUs {MISSING}" in table


class _SmiSaying:
    """nvidia-smi that prints what a real one printed, with its exit code."""

    def __init__(self, returncode: int, text: str):
        from detector.backends.smi import SmiOutcome
        self._outcome = SmiOutcome("ok", returncode, text, "")

    def run(self, args, timeout_s):
        return self._outcome


def test_nvidia_smi_naming_one_gpu_blames_that_gpu_only(registry):
    """nvidia-smi -L stops at a GPU it cannot open and exits non-zero: that GPU gets the error, the
    seven it never reached are not called 'not listed'."""
    host = fake_host(node_for("h100-sxm-8"))
    host.smi = _SmiSaying(255, "Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error\n")
    out = diagnose_host(host, registry, checks=["visibility"])
    [problem] = out.problems
    assert (problem.rule, [(g.index, g.pci_bus_id) for g in problem.gpus]) == (
        "gpu-failing-in-nvidia-smi", [(3, MISSING)])
    assert "Unknown Error" in problem.message
    node = out.sweep.runs[0].result
    assert (node["smi_status"], node["smi_reason"]) == ("partial", "unknown_error")


def test_nvidia_smi_without_the_driver_says_why(registry):
    host = fake_host(node_for("h100-sxm-8"))
    host.smi = _SmiSaying(9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                             "Make sure that the latest NVIDIA driver is installed and running.\n")
    out = diagnose_host(host, registry, checks=["visibility"])
    [problem] = out.problems
    assert problem.rule == "nvidia-smi-failed" and "driver_not_loaded" in problem.message
    assert out.sweep.runs[0].result["smi_reason"] == "driver_not_loaded"


def test_driver_library_version_mismatch_is_its_own_finding(registry):
    host = fake_host(node_for("h100-sxm-8"))
    host.smi = _SmiSaying(255, "Failed to initialize NVML: Driver/library version mismatch\n"
                               "NVML library version: 570.124\n")
    out = diagnose_host(host, registry, checks=["visibility"])
    assert out.rules() == {"nvidia-smi-failed", "nvidia-smi-version-mismatch"}


def test_a_gpu_that_falls_off_the_bus_is_still_named_by_its_uuid(registry):
    """The daemon's check saw the GPU healthy before; once lost, NVML cannot say its UUID, the message does."""
    from detector.checks.visibility import VisibilityCheck
    from detector.core.sweep import run_sweep

    node = node_for("h100-sxm-8")
    host = fake_host(node)
    check = VisibilityCheck()
    run_sweep(host, [check])
    uuid = node.snapshot().gpus[3].uuid
    node.inject(Fault("xid", 3, {"code": 79}))
    [lost] = [o for o in run_sweep(host, [check]).runs[0].observations if o.fields.get("nvml_error") == "GpuIsLost"]
    assert (lost.gpu.index, lost.gpu.uuid, lost.gpu.pci_bus_id) == (3, uuid, MISSING)
