"""NVIDIA's "XID 144-150 Decode" table, as data: which NVLink5 unit and sub-code an XID 144-150 line's
interrupt info encodes, and what the catalogue says to do about each error status.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog", sheet "XID 144-150 Decode"
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, R575/R580 edition). Transcribed
row by row; the bit strings are the table's own, without its "-" (don't care) positions:

- `v1`: the low bits of IntrInfo for drivers before R575 (IntrInfo[9:5] the unit, [4:0] the XID - 143;
  RLW_RXPIPE's rows add bit 10, the bit its "Decode for action 2" sets);
- `v2`: the low bits for R575 and later (IntrInfo[6:0] the unit; RLW_RXPIPE's rows add bit 7);
- `subcode`: IntrInfo[25:20], the six bits the catalogue writes before the unit bits (`149.37` is 100101);
  it picks the row of a 149 link event, and is 000000 on every other unit's rows;
- `status`: the Error Status (the line's second word) the row is for; None where the table gives none
  (149's NETIR and link-event rows: the sub-code alone picks the row).

Columns kept as the table writes them: resolution (Data Center Recovery Action), investigation
(Investigatory Action), severity, HW/SW, and the local/remote effect. `action2`: RLW_RXPIPE's promotion,
the resolution when the v1/v2 action-2 bit is set.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NvlinkRow:
    """One row of the decode table."""

    xid: int
    unit: str                    # the table's name; "V1/V2" when the two driver generations name it apart
    v1: str                      # IntrInfo's low bits before R575, most significant first
    v2: str                      # ... from R575
    subcode: str                 # IntrInfo[25:20]
    status: int | None           # Error Status; None: any
    resolution: str              # RESET_GPU, IGNORE or XID_154_EVAL
    investigation: str
    severity: str                # Fatal, Link Fatal, Non-fatal (the table's marks * ** ? kept)
    hw_sw: str
    effect: str                  # the table's Local/Remote column
    action2: str = ""            # RLW_RXPIPE: the resolution when the action-2 bit is set

    @property
    def names(self) -> tuple[str, ...]:
        """The words a driver prints for this unit (`NETIR_LINK_EVT` before R575, `NETIR_LINK_DOWN` after)."""
        return tuple(n.strip() for n in self.unit.split("/"))


# Effects the table repeats (Local/Remote column; the table's asterisks point to its footnotes).
_NONE = "Local: none; Remote: none"
_XID48 = "Local: Xid 48, AppCrash (Xid 45); Remote: PacketLoss (possible)"
_XC = "Local: XC/AppCrash (Xid 45); Remote: none"
_TLW_FATAL = "Local: XID 48, PacketLoss (possible); Remote: PacketLoss (possible)"
_POISON_LOCAL = "Local: Will lead to Xid 48. Will lead to poison or Xid94/95; Remote: none"
_POISON_REMOTE = "Local: XID 48; Remote: Will lead to poison or Xid94"
_LOSS = "Local: PacketLoss (possible/delayed); Remote: PacketLoss (possible/delayed)"
_PEER = ("Local: PacketLoss (possible/delayed); Remote: PacketLoss (possible/delayed). "
         "Other end of link: source of link fatal")
_LOCAL_FATAL = "Local: fatal; Remote: PacketLoss (possible/delayed)"
_MSE = "Local: Fatal; Remote: None"

_SW_STATUS = 0x80000000      # the table's software-reported status on most units


def _unit(xid: int, unit: str, v1: str, v2: str,
          rows: list[tuple[int | None, str, str, str, str, str]], subcode: str = "000000",
          action2: str = "") -> list[NvlinkRow]:
    """Rows of one unit: (status, resolution, investigation, severity, hw/sw, effect) each."""
    return [NvlinkRow(xid, unit, v1, v2, subcode, status, res, inv, sev, hw, eff, action2)
            for status, res, inv, sev, hw, eff in rows]


def _tlw(unit: str, v1: str, v2: str) -> list[NvlinkRow]:
    """The four TLW RX/TX pipes share one set of rows."""
    return _unit(146, unit, v1, v2, [
        (0x1, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x2, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "HW", _POISON_LOCAL),
        (0x4, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _TLW_FATAL),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ])


def _link_event(subcode: str, resolution: str, investigation: str, severity: str, hw_sw: str,
                effect: str) -> NvlinkRow:
    return NvlinkRow(149, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "0111000110", "0010001", subcode, None,
                     resolution, investigation, severity, hw_sw, effect)


ROWS: tuple[NvlinkRow, ...] = (
    *_unit(144, "SAW_MVB", "0000100001", "0000001", [
        (0x01, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "HW", _POISON_LOCAL),
        (0x02, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x04, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x08, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "HW", _POISON_REMOTE),
        (0x10, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x20, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
    ]),
    *_unit(145, "RLW_CTRL", "0001100010", "0000011", [
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(145, "RLW_REMAP", "0010000010", "0000100", [
        (0x001, "XID_154_EVAL", "CONTACT_SUPPORT", "Non-fatal", "SW", _XC),
        (0x002, "XID_154_EVAL", "CONTACT_SUPPORT", "Non-fatal", "SW", _XC),
        (0x004, "XID_154_EVAL", "CHECK_NVLINK_FAILURE_FLOW", "Non-fatal", "SW", _XC),
        (0x008, "XID_154_EVAL", "CHECK_NVLINK_FAILURE_FLOW", "Non-fatal", "SW", _XC),
        (0x010, "XID_154_EVAL", "CHECK_NVLINK_FAILURE_FLOW", "Non-fatal", "SW", _XC),
        (0x020, "XID_154_EVAL", "CHECK_NVLINK_FAILURE_FLOW", "Non-fatal", "SW", _XC),
        (0x040, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x080, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x100, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x200, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(145, "RLW_RSPCOL", "0010100010", "0000101", [
        (0x1, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x2, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    # The promotable rows: bit 10 (V1) / bit 7 (V2) clear -> IGNORE, set -> Action 2, RESET_GPU.
    *_unit(145, "RLW_RXPIPE", "00011000010", "00000110", [
        (0x1, "IGNORE", "CONTACT_SUPPORT", "Non-fatal*", "SW", "Local: none; Remote: PacketLoss"),
        (0x2, "IGNORE", "CONTACT_SUPPORT", "Non-fatal*", "SW", "Local: none; Remote: PacketLoss"),
        (0x4, "IGNORE", "CONTACT_SUPPORT", "Non-fatal*", "SW", "Local: PacketLoss; Remote: none"),
    ], action2="RESET_GPU"),
    *_unit(145, "RLW_RXPIPE", "0011000010", "0000110", [
        (0x8, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "HW/SW", _NONE),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(145, "RLW_SRC_TRACK", "0011100010", "0000111", [
        (0x01, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x02, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x04, "XID_154_EVAL", "IGNORE", "Non-fatal", "HW/SW", _XC),
        (0x08, "XID_154_EVAL", "IGNORE", "Non-fatal", "HW/SW", _XC),
        (0x10, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x20, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(145, "RLW_TAGSTATE", "0100000010", "0001000", [
        (0x000001, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x000002, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x010000, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x020000, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (0x100000, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _XID48),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(146, "TLW_CTRL", "0100100011", "0001001", [
        (0x1, "IGNORE", "IGNORE", "Non-fatal", "HW", _NONE),
        (0x2, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "HW", _POISON_REMOTE),
        (0x4, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "HW", _TLW_FATAL),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_tlw("TLW_RX/TLW_RX_PIPE0", "0101000011", "0001010"),
    *_tlw("TLW_RX/TLW_RX_PIPE1", "0101000011", "0001011"),
    *_tlw("TLW_TX/TLW_TX_PIPE0", "0101100011", "0001100"),
    *_tlw("TLW_TX/TLW_TX_PIPE1", "0101100011", "0001101"),
    *_unit(147, "TREX", "0110000100", "0001110", [
        (0x1, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW",
         "NOTE: not in production code, so should not be experienced"),
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    *_unit(148, "NVLPW_CTRL/NVLPW", "0000000101", "0001111", [
        (_SW_STATUS, "IGNORE", "CONTACT_SUPPORT", "Non-fatal", "SW", _NONE),
    ]),
    NvlinkRow(149, "NETIR/NETIR_INT", "0000000110", "0011000", "000000", None, "RESET_GPU",
              "SYMPATHETIC_REPORT_SOLO", "Link Fatal", "HW/SW", _LOSS),
    _link_event("000000", "RESET_GPU", "SYMPATHETIC_REPORT_SOLO", "Link Fatal", "HW/SW", _LOSS),
    _link_event("000001", "RESET_GPU", "REPORT_ISSUE (if seen >1 per day)", "Link Fatal", "HW/SW", _LOSS),
    _link_event("000010", "RESET_GPU", "INVESTIGATE_LINK_SI", "Link Fatal", "HW/SW", _LOSS),
    _link_event("000100", "RESET_GPU", "INVESTIGATE_LINK_SI", "Link Fatal", "HW", _LOSS),
    _link_event("001010", "RESET_GPU", "INVESTIGATE_LINK_SI", "Link Fatal", "HW", _LOSS),
    _link_event("001111", "RESET_GPU", "INVESTIGATE_SW_USER", "Link Fatal", "SW", _LOSS),
    _link_event("010000", "RESET_GPU", "INVESTIGATE_SW_USER_LINK_SI", "Link Fatal", "SW", _LOSS),
    _link_event("010001", "RESET_GPU", "INVESTIGATE_SW_USER", "Link Fatal", "SW", _LOSS),
    _link_event("010010", "RESET_GPU", "INVESTIGATE_SW_USER_LINK_SI", "Link Fatal", "SW", _LOSS),
    _link_event("010101", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _LOSS),
    _link_event("010110", "RESET_GPU", "INVESTIGATE_SW_USER", "Link Fatal", "SW", _LOSS),
    _link_event("100000", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _PEER),
    _link_event("100001", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _PEER),
    _link_event("100010", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _PEER),
    _link_event("100011", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW", _PEER),
    _link_event("100100", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _PEER),
    _link_event("100101", "RESET_GPU", "INVESTIGATE_PEER_DEVICE", "Link Fatal", "HW/SW", _PEER),
    _link_event("100110", "IGNORE", "INVESTIGATE_SW/USER", "Link Fatal", "HW/SW", _LOSS),
    _link_event("101000", "IGNORE", "INVESTIGATE_HOST", "Fatal", "SW", _LOCAL_FATAL),
    _link_event("101010", "RESET_GPU", "INVESTIGATE_LINK_SI_AND_CABLES", "Link Fatal?", "HW", _LOSS),
    _link_event("101011", "RESET_GPU", "INVESTIGATE_LINK_SI_AND_CABLES", "Link Fatal?", "HW", _LOSS),
    *_unit(149, "NETIR_BER_EVENT", "1000100110", "0010011", [
        (status, "IGNORE", "INVESTIGATE_LINK_SI_AND_CABLES", "Non-fatal", "HW", _NONE)
        for status in (0x0, 0x1, 0x2, 0x3)
    ]),
    *_unit(149, "NETIR_MFDE_EVENT", "1001000110", "0010100", [
        (0x1, "RESET_GPU", "CONTACT_SUPPORT", "Fatal**", "HW/SW", _LOCAL_FATAL),
        (0x3, "IGNORE", "IGNORE", "Non-fatal", "NA", _NONE),
        (0x4, "RESET_GPU", "CONTACT_SUPPORT", "Fatal**", "HW/SW", _LOCAL_FATAL),
        (0x5, "RESET_GPU", "CONTACT_SUPPORT", "Fatal**", "HW/SW", _LOCAL_FATAL),
        (0x7, "RESET_GPU", "CONTACT_SUPPORT", "Fatal**", "HW/SW", _LOCAL_FATAL),
    ]),
    *_unit(150, "MSE Degraded", "0000000000", "0000000", [
        (0x00000000, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "FW", _MSE),
        (0xFFFFFFFF, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "FW", _MSE),
    ]),
    *_unit(150, "MSE_WATCHDOG", "0000000000", "0000000", [
        (0x00000000, "RESET_GPU", "CONTACT_SUPPORT", "Fatal", "FW", _MSE),
    ]),
)

# The Investigatory Action buckets, in words (the catalogue's "Fault Resolution Buckets" sheet, shortened).
GUIDANCE: dict[str, str] = {
    "IGNORE": "no investigation needed",
    "CONTACT_SUPPORT": "contact support if it recurs",
    "CHECK_NVLINK_FAILURE_FLOW": "a by-product if a link of the partition went down in the last 30 s, "
                                 "else report the issue",
    "SYMPATHETIC_REPORT_SOLO": "usually sympathetic: resolve the other errors first, report the issue if "
                               "it was seen alone",
    "REPORT_ISSUE (if seen >1 per day)": "report the issue if it is seen more than once a day",
    "INVESTIGATE_LINK_SI": "investigate the link's signal integrity",
    "INVESTIGATE_LINK_SI_AND_CABLES": "check the link's cable, transceiver, temperature and seating",
    "INVESTIGATE_SW_USER": "investigate software or a user that took the link down, if unexpected",
    "INVESTIGATE_SW/USER": "investigate software or a user that took the link down, if unexpected",
    "INVESTIGATE_SW_USER_LINK_SI": "investigate software or a user that took the link down, if "
                                   "unexpected, then the link's signal integrity",
    "INVESTIGATE_PEER_DEVICE": "investigate the peer device",
    "INVESTIGATE_HOST": "check the host's other logs: likely a secondary sign of another action or fault",
}
