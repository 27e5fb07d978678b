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
    assert out.rules() == {"nvidia-smi-version-mismatch"}, "one cause, one problem"
    assert out.by_rule()["nvidia-smi-version-mismatch"].action == "RESTART_BM"


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


# -- table and JSON tell the same story, and only NVML's own indices appear ---------------------------

def _table_rows(table: str) -> dict[str, tuple[str, str]]:
    """bus id -> (GPU column, STATE column) of the table's GPU rows."""
    rows = {}
    for line in table.splitlines():
        cells = line.split()
        bus = next((c for c in cells if len(c) == 12 and c.count(":") == 2 and c[-2] == "."), None)
        if bus and not line.startswith(" "):
            rows[bus] = (cells[0], cells[-1])
    return rows


def _assert_table_and_json_agree(d: Diagnosis) -> None:
    report = d.to_dict()
    rows = _table_rows(render_table(d))
    nvml = {g.pci_bus_id: g.index for g in d.sweep.inventory.gpus}
    blamed = {g["pci_bus_id"] for p in report["problems"] for g in p["gpu_details"]}
    assert set(rows) == {g["pci_bus_id"] for g in report["gpus"]}
    for g in report["gpus"]:
        index, state = rows[g["pci_bus_id"]]
        assert g["index"] == nvml.get(g["pci_bus_id"])                   # NVML's own index, or null
        assert index == ("-" if g["index"] is None else str(g["index"]))
        assert (state == "ok") == (g["pci_bus_id"] not in blamed), (g, state)


def test_table_and_json_agree_when_a_gpu_in_the_middle_is_missing(registry):
    _assert_table_and_json_agree(_diagnosis(registry))


def test_nvidia_smi_exiting_15_with_one_error_line_blames_that_gpu_in_table_and_json(registry):
    """What nvidia-smi -L prints for a lost GPU in the middle (exit 15, the line in its place): the GPUs
    it lists are never 'not listed', the named one alone carries the finding, by its bus id."""
    node = node_for("h100-sxm-8")
    uuids = [g.uuid for g in node.snapshot().gpus]
    lines = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})" for i, u in enumerate(uuids)]
    lines[3] = ("Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  "
                "Reboot the system to recover this GPU")
    host = fake_host(node)
    host.smi = _SmiSaying(15, "\n".join(lines) + "\n")
    out = diagnose_host(host, registry, checks=["visibility"])
    assert [(p.rule, [(g.index, g.pci_bus_id) for g in p.gpus]) for p in out.problems] == [
        ("gpu-failing-in-nvidia-smi", [(3, MISSING)])]
    result = out.sweep.runs[0].result
    assert (result["smi_status"], result["smi_reason"], result["smi_gpus"]) == ("partial", "gpu_lost", 7)
    d = Diagnosis("fake:h100-sxm-8", out.sweep, out.problems)
    _assert_table_and_json_agree(d)
    assert _table_rows(render_table(d))[MISSING] == ("3", "GpuNvidiaSmiError")


def test_a_gpu_nvml_does_not_see_has_its_own_row_even_when_no_rule_judges_it(registry):
    """The row comes from what the visibility check saw, not from the rules: with the GPU's rule
    disabled the report still shows it, by bus id, without an index."""
    d = _diagnosis(registry)
    d = Diagnosis(d.backend, d.sweep, [p for p in d.problems if p.rule != "gpu-not-visible-to-nvml"])
    assert d.problems == []
    assert _table_rows(render_table(d))[MISSING] == ("-", "NotSeenByNvml")
    [entry] = [g for g in d.to_dict()["gpus"] if g["pci_bus_id"] == MISSING]
    assert (entry["index"], entry["error"]) == (None, "NotSeenByNvml")


def test_pci_order_names_a_lost_gpu_only_when_nvml_counts_every_bound_gpu():
    """NVML numbers the GPUs bound to the driver in PCI order, so a lost GPU's index gives its bus id only
    when NVML enumerates all of them; otherwise the index may point at a neighbour, and it stays unnamed."""
    from detector.backends.pci import PciDevice
    from detector.core.inventory import GpuInfo, Inventory
    bus = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]
    pci = [PciDevice(b, 0x10DE, 0x2330, 0x030200, "nvidia") for b in bus]
    lost = Inventory("550", None, [GpuInfo(0, "GPU-a", pci_bus_id=bus[0]), GpuInfo(1, error="GpuIsLost"),
                                   GpuInfo(2, "GPU-c", pci_bus_id=bus[2]), GpuInfo(3, "GPU-d", pci_bus_id=bus[3])])
    assert lost.named_from_pci(pci).gpus[1].pci_bus_id == bus[1]
    # NVML enumerates three of the four bound GPUs: index 1 is no longer the second bus id for sure.
    fewer = Inventory("550", None, [GpuInfo(0, "GPU-a", pci_bus_id=bus[0]), GpuInfo(1, error="GpuIsLost"),
                                    GpuInfo(2, "GPU-d", pci_bus_id=bus[3])])
    assert fewer.named_from_pci(pci).gpus[1].pci_bus_id is None
    # The known GPUs disagree with PCI order: no guessing either.
    swapped = Inventory("550", None, [GpuInfo(0, "GPU-a", pci_bus_id=bus[2]), GpuInfo(1, error="GpuIsLost"),
                                      GpuInfo(2, "GPU-c", pci_bus_id=bus[0]), GpuInfo(3, "GPU-d", pci_bus_id=bus[3])])
    assert swapped.named_from_pci(pci).gpus[1].pci_bus_id is None
