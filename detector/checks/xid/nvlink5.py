"""XID 144-150 decoded as NVIDIA's catalogue asks: the line's interrupt info (IntrInfo, its first hex word)
names the NVLink5 unit and the sub-code, its Error Status (the second word) the row, and the row the
resolution. The line's own Fatal/Nonfatal word is not enough: `149, NETIR_LINK_EVT Fatal ... (0x026001c6`
(149.38) is IGNORE, and RLW_RXPIPE's "Nonfatal" lines are RESET_GPU when their action-2 bit is set.

The driver prints (catalogue, WORKFLOW_NVLINK5_ERR): `Xid (PCI:...): <xid>, <unit> <Fatal|Nonfatal>
XC<n> i<n> Link <n> (<intrInfo> <errorStatus> <debug0> ... <debug4>)`. Drivers before R575 put the unit in
IntrInfo[9:5] (V1), R575 and later in IntrInfo[6:0] (V2); a line does not say which, so both are tried
(the table's two layouts never name different units for the same bits of one XID; a test holds it to that).

A line the table does not cover (no interrupt info, a unit or sub-code it does not list, a status it has
no row for, or a unit in the bits that the line's unit word contradicts) is "not decoded": its reason is
said, and the rules judge it by its Fatal/Nonfatal word as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from detector.checks.xid.nvlink5_table import GUIDANCE, ROWS, NvlinkRow

NVLINK5_XIDS = range(144, 151)
_REGISTERS = re.compile(r"[(\[]\s*(0x[0-9a-fA-F]{1,8})\b(?:\s+(0x[0-9a-fA-F]{1,8})\b)?")
_SUBCODE_SHIFT, _SUBCODE_MASK = 20, 0x3F        # IntrInfo[25:20]
_BY_XID: dict[int, tuple[NvlinkRow, ...]] = {x: tuple(r for r in ROWS if r.xid == x) for x in NVLINK5_XIDS}


@dataclass(frozen=True, slots=True)
class Nvlink5Decode:
    """What the catalogue makes of one XID 144-150 line."""

    xid: int
    intrinfo: int | None = None
    error_status: int | None = None
    layout: str = ""              # "V1" (before R575) or "V2" (R575 and later): the one whose bits matched
    unit: str = ""                # the unit the bits encode, as the line names it when it names it
    row: NvlinkRow | None = None
    promoted: bool = False        # RLW_RXPIPE's action-2 bit was set: the row's action 2 applies
    note: str = ""                # why there is no row (or what else the reader should know)

    @property
    def subcode(self) -> int | None:
        return None if self.intrinfo is None else (self.intrinfo >> _SUBCODE_SHIFT) & _SUBCODE_MASK

    @property
    def decoded(self) -> str:
        """The catalogue's name for it: `149.37`; '' without interrupt info."""
        return "" if self.subcode is None else f"{self.xid}.{self.subcode}"

    @property
    def resolution(self) -> str:
        if self.row is None:
            return ""
        return self.row.action2 if self.promoted else self.row.resolution

    @property
    def guidance(self) -> str:
        """The investigatory action in words, with the table's note when the peer is the source."""
        if self.row is None:
            return ""
        text = GUIDANCE.get(self.row.investigation, self.row.investigation)
        if "Other end of link: source" in self.row.effect:
            text += " (the other end of the link is the source)"
        return text

    def fields(self) -> dict[str, object]:
        """The xid check's observation fields for it."""
        row = self.row
        return {
            "intrinfo": _hex(self.intrinfo), "error_status": _hex(self.error_status),
            "xid_decoded": self.decoded, "nvlink_layout": self.layout if row else "",
            "nvlink_decoded_unit": self.unit if row else "",
            "nvlink_resolution": self.resolution, "nvlink_investigation": row.investigation if row else "",
            "nvlink_severity": (row.severity + (", promoted (action 2)" if self.promoted else "")) if row else "",
            "nvlink_effect": row.effect if row else "", "nvlink_guidance": self.guidance,
            "nvlink_note": self.note,
        }



def registers(message: str) -> tuple[int | None, int | None]:
    """(IntrInfo, Error Status) from `... Link 14 (0x025001c6 0x00000000 ...)`; None where absent."""
    m = _REGISTERS.search(message)
    if not m:
        return None, None
    return int(m.group(1), 16), (int(m.group(2), 16) if m.group(2) else None)


@lru_cache(maxsize=1024)
def decode_line(xid: int, message: str, word: str = "") -> Nvlink5Decode:
    """(Cached: a flood repeats one message.) Decode a 144-150 line's message (after the code and any pid/name); `word`: the unit it names."""
    intrinfo, status = registers(message)
    return decode(xid, intrinfo, status, word)


def decode(xid: int, intrinfo: int | None, error_status: int | None, word: str = "") -> Nvlink5Decode:
    """The catalogue row for (xid, IntrInfo, Error Status), or why there is none. `word`: the unit the line
    names; when it names another unit of this XID than the bits encode, the line is not decoded."""
    if xid not in _BY_XID:
        return Nvlink5Decode(xid, intrinfo, error_status, note="not an NVLink5 XID (144-150)")
    if intrinfo is None:
        return Nvlink5Decode(xid, note="no interrupt info in the line")
    matches = _units(xid, intrinfo)
    if not matches:
        return Nvlink5Decode(xid, intrinfo, error_status,
                             note=f"interrupt info {_hex(intrinfo)} encodes no unit of XID {xid} in the catalogue")
    known_word = bool(word) and any(word in r.names for r in _BY_XID[xid])
    if known_word:
        named = [(lay, r) for lay, r in matches if word in r.names]
        if not named:
            return Nvlink5Decode(xid, intrinfo, error_status, note=(
                f"interrupt info {_hex(intrinfo)} encodes {_listed(matches)} but the line says {word}: "
                "not decoded"))
        matches = named
    unit = word if known_word else _listed(matches, layouts=False)
    layout = "/".join(sorted({lay for lay, _ in matches}))
    subcode = f"{(intrinfo >> _SUBCODE_SHIFT) & _SUBCODE_MASK:06b}"
    rows = [(lay, r) for lay, r in matches if r.subcode == subcode]
    if not rows:
        return Nvlink5Decode(xid, intrinfo, error_status, layout, unit,
                             note=f"sub-code {xid}.{int(subcode, 2)} of {unit} is not in the catalogue")
    if any(r.status is not None for _, r in rows):
        if error_status is None:
            return Nvlink5Decode(xid, intrinfo, None, layout, unit, note="no error status in the line")
        rows = [(lay, r) for lay, r in rows if r.status in (None, error_status)]
        if not rows:
            return Nvlink5Decode(xid, intrinfo, error_status, layout, unit,
                                 note=f"error status {_hex(error_status)} of {unit} is not in the catalogue")
    decoded = [Nvlink5Decode(xid, intrinfo, error_status, lay, unit, r, _promoted(intrinfo, lay, r))
               for lay, r in rows]
    outcomes = {(d.resolution, d.row.investigation, d.row.severity) for d in decoded if d.row}
    if len(outcomes) > 1:
        return Nvlink5Decode(xid, intrinfo, error_status, layout, unit, note=(
            f"interrupt info {_hex(intrinfo)} may be {_listed(rows)}, which the catalogue resolves apart: "
            "not decoded"))
    first = decoded[0]
    return Nvlink5Decode(xid, intrinfo, error_status, layout, unit, first.row, first.promoted)


def _units(xid: int, intrinfo: int) -> list[tuple[str, NvlinkRow]]:
    """(layout, row) for every row of this XID whose V1 or V2 unit bits match IntrInfo."""
    return [(layout, r) for r in _BY_XID[xid] for layout, bits in (("V1", r.v1), ("V2", r.v2))
            if _matches(intrinfo, bits, promotable=bool(r.action2))]


def _listed(rows: list[tuple[str, NvlinkRow]], layouts: bool = True) -> str:
    """`TLW_RX (V1)`, or `MSE Degraded or MSE_WATCHDOG`: a V1 row by its V1 name, a V2 row by its V2 name."""
    names = {(r.names[0] if lay == "V1" else r.names[-1]) + (f" ({lay})" if layouts else "") for lay, r in rows}
    return " or ".join(sorted(names))


def _promoted(intrinfo: int, layout: str, row: NvlinkRow) -> bool:
    """RLW_RXPIPE's action-2 bit: the top bit of its pattern (IntrInfo[10] in V1, [7] in V2)."""
    return bool(row.action2) and _bit(intrinfo, len(row.v1 if layout == "V1" else row.v2) - 1)


def _matches(intrinfo: int, bits: str, promotable: bool) -> bool:
    """The low bits of IntrInfo are `bits`; a promotable row's top bit may be either."""
    if promotable:
        bits = bits[1:]
    return intrinfo & ((1 << len(bits)) - 1) == int(bits, 2)


def _bit(value: int, n: int) -> bool:
    return bool((value >> n) & 1)


def _hex(value: int | None) -> str:
    return "" if value is None else f"0x{value:08x}"


EMPTY_FIELDS = Nvlink5Decode(0).fields()      # every field, empty: for events that are not 144-150
