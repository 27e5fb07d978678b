"""The kernel lines the driver prints for NVLink5 XIDs 144-150, for scenarios and fleet faults.

The form is the one NVIDIA's catalogue gives (WORKFLOW_NVLINK5_ERR) and real GB200 logs show:

    NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_DOWN Fatal XC0 i0 Link 14 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)

(`<unit> <Fatal|Nonfatal> XC<cross-contain> i<injected> Link <nn> (<intrInfo> <errorStatus> <debug x4>)`; no
pid/name unless a process is named). Two lines a GB200 NVL72 rack prints when one GPU's link fails:
LINK_DOWN_149 on that GPU (149.37: RESET_GPU, investigate the peer device) and DOWNSTREAM_145 on every other
GPU of the NVLink domain, the form of real GB200 logs (gpud's kmsg_extended_test.go: `145, RLW_SRC_TRACK
Nonfatal XC1 i0 Link 12 (0x040988e2 0x00000008 ...)`), which the catalogue decodes as 145.0 RLW_SRC_TRACK,
error status 0x8: XID_154_EVAL, non-fatal (Local: XC/AppCrash, Xid 45). marin-community/marin#9086 saw one
GPU's XID 149 and the downstream XID 145 on the rack's 63 others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Nvlink5Xid:
    """One 144-150 line's content, less the GPU."""

    code: int
    unit: str                   # the word the driver prints: NETIR_LINK_DOWN, RLW_SRC_TRACK, ...
    fatal: bool
    link: int
    intrinfo: int
    error_status: int = 0
    cross_contain: int = 0
    injected: int = 0

    def message(self) -> str:
        """The part after `<code>, `."""
        words = " ".join(f"0x{w:08x}" for w in (self.intrinfo, self.error_status, 0, 0, 0, 0))
        return (f"{self.unit} {'Fatal' if self.fatal else 'Nonfatal'} XC{self.cross_contain} i{self.injected} "
                f"Link {self.link:02d} ({words})")


# One GPU's link goes down with the other end as the source (149.37).
LINK_DOWN_149 = Nvlink5Xid(149, "NETIR_LINK_DOWN", True, 14, 0x025001C6)
# What the other GPUs of the domain print (145.0 RLW_SRC_TRACK, status 0x8: XID_154_EVAL), on link 12 as in
# the real line; pass another link with dataclasses.replace.
DOWNSTREAM_145 = Nvlink5Xid(145, "RLW_SRC_TRACK", False, 12, 0x040988E2, 0x00000008, cross_contain=1)


def pci_prefix(pci_bus_id: str) -> str:
    """`0009:01:00.0` -> `PCI:0009:01:00`, as the driver names the GPU in an Xid line."""
    domain, bus, dev_fn = pci_bus_id.split(":")
    return f"PCI:{domain}:{bus}:{dev_fn.split('.')[0]}"


def nvlink5_xid_line(pci_bus_id: str, xid: Nvlink5Xid) -> str:
    """The whole kernel message: `NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_DOWN Fatal XC0 i0 Link 14 (...)`."""
    if not 144 <= xid.code <= 150:
        raise ValueError(f"XID {xid.code} is not an NVLink5 XID (144-150)")
    return f"NVRM: Xid ({pci_prefix(pci_bus_id)}): {xid.code}, {xid.message()}"
