"""Driver failures the kernel prints without an Xid (issue 31), for the xid check's driver-line reading:
a GPU whose RM init failed, a GSP firmware that stops answering, PCIe AER reports on a GPU's link, an
nvidia_peermem that will not load. Each fault prints the lines a real driver and kernel print (shapes from
tests/fixtures/driver_lines/) and changes the node's state where the real failure does (a GPU whose RM init
failed is on the PCI bus but not in NVML).

A GPU sits below one PCIe port in the fake (`upstream_port`), which the PCI bus reports as the GPU's
upstream, as sysfs does, so a port's AER lines can be tied to the GPU below it."""

from __future__ import annotations

from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.node import FakeGpu, FakeNode, NodeState

# PCIe AER report lines per severity, as Linux 6.x prints them: the port announces the report, then the
# endpoint's device prints it (tests/fixtures/driver_lines/: pop-os, returnn, wilicc).
_AER = {
    "corrected": ("Correctable error message received from", "Correctable", "Data Link Layer", "Receiver ID",
                  "00000080/0000e000", "[ 7] BadDLLP"),
    "uncorrected": ("Uncorrectable (Non-Fatal) error message received from", "Uncorrectable (Non-Fatal)",
                    "Transaction Layer", "Requester ID", "00004000/00000000", "[14] CmpltTO                (First)"),
    "fatal": ("Uncorrectable (Fatal) error message received from", "Uncorrectable (Fatal)", "Transaction Layer",
              "Receiver ID", "00000020/00000000", "[ 5] SDES                   (First)"),
}


def upstream_port(gpu: FakeGpu) -> str:
    """The PCIe switch port above the GPU: the device before the GPU's bus (0000:18:00.0 -> 0000:17:00.0)."""
    domain, bus, _ = gpu.pci_bus_id.split(":")
    return f"{domain}:{max(int(bus, 16) - 1, 0):02x}:00.0"


def _rm_init_failed(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.nvml_visible = False            # on the PCI bus; the driver never brought it up
    node.log_kernel(f"NVRM: GPU {gpu.pci_bus_id}: RmInitAdapter failed! (0x22:0x56:667)")
    node.log_kernel(f"NVRM: GPU {gpu.pci_bus_id}: rm_init_adapter failed, device minor number {gpu.minor}")


def _gsp_timeout(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    n = gpu.index                       # the driver numbers GPUs in the order it attached them: PCI order
    node.log_kernel(f"NVRM: GPU{n} _kgspIsHeartbeatTimedOut: Heartbeat timed out, currentTimeMs 812751949 "
                    "heartbeat 1899482 heartbeatWithOffsetMs 812745879 diff 6070 timeout 5200")
    node.log_kernel(f"NVRM: GPU{n} _kgspLogRpcTimeout: ********************************* GSP Timeout "
                    "**********************************")
    if f.params.get("xid", True):
        domain, bus, dev_fn = gpu.pci_bus_id.split(":")
        node.log_kernel(f"NVRM: Xid (PCI:{domain}:{bus}:{dev_fn.split('.')[0]}): 119, pid='<unknown>', "
                        f"name=<unknown>, Timeout after 6s of waiting for RPC response from GPU{n} GSP! Expected "
                        "function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).")
        node.emit_xid(gpu, 119)


def _pcie_aer(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    severity = f.params.get("severity", "corrected")
    if severity not in _AER:
        raise ValueError(f"fault 'pcie_aer': severity must be one of {', '.join(_AER)}, got {severity!r}")
    received, sev, layer, agent, status, bit = _AER[severity]
    port, bus = upstream_port(gpu), gpu.pci_bus_id
    device = f"10de:{gpu.model.pci_device_id >> 16:04x}"
    for _ in range(f.params.get("count", 1)):
        node.log_kernel(f"pcieport {port}: AER: {received} {bus}")
        node.log_kernel(f"nvidia {bus}: PCIe Bus Error: severity={sev}, type={layer}, ({agent})")
        node.log_kernel(f"nvidia {bus}:   device [{device}] error status/mask={status}")
        node.log_kernel(f"nvidia {bus}:    {bit}")
        if severity != "corrected":
            node.log_kernel(f"nvidia {bus}: AER: can't recover (no error_detected callback)")


def _peermem_failed(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    state.modules_unloaded = sorted({*state.modules_unloaded, "nvidia_peermem"})
    node.log_kernel("nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client")
    node.log_kernel("nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)")


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """Nothing of its own: a GPU reset or a reboot brings the GPU back through `recover` (nvml_visible), and
    the driver check's module state heals with its own module."""


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("rm_init_failed", True, {}, (), _rm_init_failed,
              "the driver's RM init fails for the GPU (RmInitAdapter failed!): on the PCI bus, absent from NVML"),
    FaultKind("gsp_timeout", True, {"xid": bool}, (), _gsp_timeout,
              "the GPU's GSP firmware stops answering: heartbeat and RPC timeout lines, then XID 119 "
              "(xid: false prints none)"),
    FaultKind("pcie_aer", True, {"severity": str, "count": int}, (), _pcie_aer,
              "PCIe AER reports on the GPU's link (severity corrected, uncorrected or fatal; count reports), "
              "announced by the port above it"),
    FaultKind("peermem_failed", False, {}, (), _peermem_failed,
              "nvidia_peermem fails to load (built against another RDMA stack): GPUDirect RDMA unavailable"),
)
