"""A GPU that falls off the bus between NVML's read at the start of a sweep and nvidia-smi -L's, run after:
NVML is asked once more, and the GPU is judged by what NVML says of it now (lost: critical, RESTART_BM), not
as a one-sweep disagreement of the two tools (a warning that would fence it as degraded first)."""

from __future__ import annotations

import sys
from dataclasses import replace

from conftest import diagnose_host, node_for
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host


class FallsOffFirst:
    """nvidia-smi whose run comes just after GPU 3 fell off the bus."""

    def __init__(self, smi, node):
        self.smi, self.node = smi, node

    def run(self, args, timeout_s):
        self.node.inject(Fault("xid", gpu=3, params={"code": 79, "via": "nvml"}))
        return self.smi.run(args, timeout_s)


def test_a_gpu_lost_between_nvml_and_nvidia_smi_is_judged_lost(registry):
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    host = replace(host, smi=FallsOffFirst(host.smi, node))
    out = diagnose_host(host, registry, checks=["visibility"])
    [gpu3] = [o for o in out.sweep.runs[0].observations if o.gpu and o.gpu.pci_bus_id == "0000:5d:00.0"]
    assert (gpu3.fields["in_nvml"], gpu3.fields["nvml_error"], gpu3.fields["in_smi"]) == (False, "GpuIsLost", False)
    assert {(p.rule, p.action) for p in out.problems} == {("gpu-fell-off-bus", "RESTART_BM")}


def test_a_gpu_nvidia_smi_alone_leaves_out_is_still_the_tools_disagreement(registry, tmp_path):
    """NVML still answers for it: nvidia-smi's own omission, a warning as before."""
    listing = "".join(f"GPU {g.index}: {g.model.name} (UUID: {g.uuid})\n"
                      for g in node_for("h100-sxm-8").snapshot().gpus if g.index != 3)
    script = tmp_path / "smi.py"
    script.write_text(f"import sys\nsys.stdout.write({listing!r})\n")
    host = fake_host(node_for("h100-sxm-8"), smi_command=[sys.executable, str(script)])
    out = diagnose_host(host, registry, checks=["visibility"])
    assert {p.rule for p in out.problems} == {"gpu-not-listed-by-nvidia-smi"}
