"""XID 144-150 decoding (detector/checks/xid/nvlink5.py) against NVIDIA's "XID 144-150 Decode" table: both
IntrInfo layouts, the row picked by sub-code or error status, RLW_RXPIPE's promotion, what is not decoded
and why; the acceptance line through `diagnose --kernel-log` (a `dmesg -x` file), the -xid149 scenario,
and fake_nvml's line builder."""

from __future__ import annotations

import json
from itertools import combinations

import pytest

from detector.checks.xid.incidents import nvlink_decode
from detector.checks.xid.nvlink5 import decode, decode_line
from detector.checks.xid.nvlink5_table import GUIDANCE, ROWS
from detector.checks.xid.parser import parse_line
from detector.cli.main import main
from fake_nvml.nvlink5_lines import DOWNSTREAM_145, LINK_DOWN_149, nvlink5_xid_line

ACCEPTANCE = ("NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_DOWN Fatal XC0 i0 Link 14 (0x025001c6 0x00000000 "
              "0x00000000 0x00000000 0x00000000 0x00000000)")


def test_table_rows_are_well_formed():
    for r in ROWS:
        assert 144 <= r.xid <= 150 and len(r.subcode) == 6 and set(r.v1 + r.v2 + r.subcode) <= {"0", "1"}, r
        assert len(r.v1) == 10 + bool(r.action2) and len(r.v2) == 7 + bool(r.action2), r
        assert r.resolution in {"RESET_GPU", "IGNORE", "XID_154_EVAL"} and r.action2 in {"", "RESET_GPU"}, r
        assert r.investigation in GUIDANCE, r
    # No two rows of one XID claim the same bits, sub-code and status with different outcomes.
    for a, b in combinations(ROWS, 2):
        if a.xid == b.xid and a.subcode == b.subcode and a.status == b.status and (
                _overlap(a.v1, b.v1) or _overlap(a.v2, b.v2) or _overlap(a.v1, b.v2) or _overlap(a.v2, b.v1)):
            assert (a.resolution, a.investigation, a.severity) == (b.resolution, b.investigation, b.severity) \
                or a.unit != b.unit and set(a.names) & set(b.names), (a, b)


def _overlap(x: str, y: str) -> bool:
    """Whether some IntrInfo matches both patterns' low bits (RXPIPE's top bit is either)."""
    n = min(len(x), len(y))
    return x[-n:] == y[-n:]


@pytest.mark.parametrize("intrinfo,status,word,decoded,unit,layout,resolution", [
    (0x025001C6, 0x0, "NETIR_LINK_DOWN", "149.37", "NETIR_LINK_DOWN", "V1", "RESET_GPU"),   # issue 32's line
    (0x02500011, 0x0, "NETIR_LINK_DOWN", "149.37", "NETIR_LINK_DOWN", "V2", "RESET_GPU"),   # R575+ layout
    (0x00000011, 0x0, "", "149.0", "NETIR_LINK_DOWN", "V2", "RESET_GPU"),                 # no word: the bits
    (0x026001C6, 0x0, "NETIR_LINK_EVT", "149.38", "NETIR_LINK_EVT", "V1", "IGNORE"),      # Fatal word, IGNORE
    (0x028001C6, 0x0, "NETIR_LINK_EVT", "149.40", "NETIR_LINK_EVT", "V1", "IGNORE"),
    (0x02A001C6, 0x0, "NETIR_LINK_EVT", "149.42", "NETIR_LINK_EVT", "V1", "RESET_GPU"),
    (0x00000014, 0x3, "NETIR_MFDE_EVENT", "149.0", "NETIR_MFDE_EVENT", "V2", "IGNORE"),
    (0x00000014, 0x1, "NETIR_MFDE_EVENT", "149.0", "NETIR_MFDE_EVENT", "V2", "RESET_GPU"),
    (0x00000018, 0x0, "NETIR_INT", "149.0", "NETIR_INT", "V2", "RESET_GPU"),
])
def test_149_rows(intrinfo, status, word, decoded, unit, layout, resolution):
    d = decode(149, intrinfo, status, word)
    assert (d.decoded, d.unit, d.layout, d.resolution, d.note) == (decoded, unit, layout, resolution, "")


@pytest.mark.parametrize("code,intrinfo,status,word,resolution", [
    (145, 0x00000004, 0x1, "RLW_REMAP", "XID_154_EVAL"),        # V2 RLW_REMAP
    (145, 0x00000082, 0x40, "RLW_REMAP", "RESET_GPU"),          # V1 RLW_REMAP
    (145, 0x00000007, 0x2, "RLW_SRC_TRACK", "IGNORE"),
    (145, 0x000000E2, 0x1, "RLW_SRC_TRACK", "RESET_GPU"),
    (145, 0x00000008, 0x20000, "RLW_TAGSTATE", "RESET_GPU"),
    (144, 0x00000021, 0x2, "SAW_MVB", "RESET_GPU"),
    (146, 0x00000009, 0x4, "TLW_CTRL", "RESET_GPU"),
    (147, 0x0000000E, 0x1, "TREX", "IGNORE"),
    (148, 0x0000000F, 0x80000000, "NVLPW", "IGNORE"),
    (150, 0x00000000, 0xFFFFFFFF, "MSE", "RESET_GPU"),
])
def test_status_rows(code, intrinfo, status, word, resolution):
    assert decode(code, intrinfo, status, word).resolution == resolution


def test_rxpipe_action_2_bit_promotes_to_reset():
    """V1 IntrInfo[10] / V2 IntrInfo[7] set on an RLW_RXPIPE 0x1/0x2/0x4 row: the table's action 2."""
    assert decode(145, 0x0409A0C2, 0x1, "RLW_RXPIPE").resolution == "IGNORE"
    promoted = decode(145, 0x0409A4C2, 0x1, "RLW_RXPIPE")
    assert (promoted.resolution, promoted.promoted) == ("RESET_GPU", True)
    assert decode(145, 0x00000086, 0x4, "RLW_RXPIPE").resolution == "RESET_GPU"       # V2 bit 7
    assert decode(145, 0x0409A4C2, 0x8, "RLW_RXPIPE").resolution == "IGNORE"          # 0x8 is not promotable


@pytest.mark.parametrize("code,intrinfo,status,word,note", [
    (149, None, None, "NETIR_LINK_DOWN", "no interrupt info"),
    (149, 0xDEADBEEF, None, "NETIR_LINK_DOWN", "encodes no unit of XID 149"),
    (149, 0x00D001C6, 0x0, "NETIR_LINK_EVT", "sub-code 149.13 of NETIR_LINK_EVT is not in the catalogue"),
    (145, 0x040988E2, None, "RLW_SRC_TRACK", "no error status"),
    (145, 0x040988E2, 0x40, "RLW_SRC_TRACK", "error status 0x00000040 of RLW_SRC_TRACK is not in the catalogue"),
    (145, 0x00000001, 0x2, "RLW_SRC_TRACK", "encodes no unit of XID 145"),
    # The bits say RLW_SRC_TRACK, the line says RLW_REMAP: say so, decide nothing.
    (145, 0x040988E2, 0x8, "RLW_REMAP", "encodes RLW_SRC_TRACK (V1) but the line says RLW_REMAP"),
])
def test_not_decoded_says_why(code, intrinfo, status, word, note):
    d = decode(code, intrinfo, status, word)
    assert d.row is None and d.resolution == "" and note in d.note, d.note


def test_a_contradicted_unit_falls_back_on_the_fatal_word(tmp_path, capsys):
    line = ("NVRM: Xid (PCI:0008:01:00): 145, RLW_REMAP Fatal XC1 i0 Link 12 (0x040988e2 0x00000008 0x00000000 "
            "0x00000000 0x00000000 0x00000000)")
    path = tmp_path / "kern.log"
    path.write_text(f"kern  :err   : [  5.000000] {line}\n")
    main(["diagnose", "--checks", "xid", "-q", "-o", "json", "--kernel-log", str(path)])
    [problem] = json.loads(capsys.readouterr().out)["problems"]
    assert problem["rule"] == "xid-144-150-fatal"
    assert "encodes RLW_SRC_TRACK (V1) but the line says RLW_REMAP" in problem["message"]


def test_registers_are_read_only_from_144_150_lines():
    event = parse_line("NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error "
                       "detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)")
    assert nvlink_decode(event)["xid_decoded"] == "" and nvlink_decode(event)["intrinfo"] == ""
    assert decode_line(149, "NETIR_LINK_DOWN Fatal XC0 i0 Link 14").note == "no interrupt info in the line"


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_acceptance_dmesg_x_line_gives_149_37(fmt, tmp_path, capsys):
    """`dmesg -x` prints `kern  :err   : [ seconds] message`: the kernel's facility, so the line counts."""
    path = tmp_path / "dmesg-x.log"
    path.write_text(f"kern  :err   : [ 1234.567890] {ACCEPTANCE}\n")
    code = main(["diagnose", "--checks", "xid", "--kernel-log", str(path), *(["-o", "json"] if fmt == "json" else [])])
    out = capsys.readouterr().out
    assert code == 1
    if fmt == "table":
        assert "XID 149.37  (0008:01:00.0)" in out
        assert "XID 149.37 NETIR_LINK_DOWN on link 14: Link Fatal; catalogue resolution RESET_GPU, investigate " \
               "the peer device (the other end of the link is the source)" in out
        return
    report = json.loads(out)
    [problem] = report["problems"]
    assert (problem["rule"], problem["action"]) == ("xid-144-150-reset", "RESET_GPU")
    [event] = next(c for c in report["checks"] if c["name"] == "xid")["result"]["kernel_events"]
    assert (event["xid_decoded"], event["nvlink_resolution"], event["link"]) == ("149.37", "RESET_GPU", 14)
    # The observation the rule saw carries the whole decode.
    f = nvlink_decode(parse_line(f"kern  :err   : [ 1234.567890] {ACCEPTANCE}"))
    assert (f["xid_decoded"], f["intrinfo"], f["error_status"], f["nvlink_subcode"], f["link"],
            f["nvlink_resolution"], f["nvlink_investigation"], f["nvlink_severity"], f["nvlink_layout"]) == \
        ("149.37", "0x025001c6", "0x00000000", "NETIR_LINK_DOWN", 14, "RESET_GPU", "INVESTIGATE_PEER_DEVICE",
         "Link Fatal", "V1")


def test_xid149_scenario_names_gpu_1_only(capsys):
    code = main(["diagnose", "--nvml", "fake:gb200-nvl72-4-xid149", "-q", "-o", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    gpus = {(g["index"], g["pci_bus_id"]) for p in report["problems"] for g in p["gpu_details"] or []}
    assert gpus == {(1, "0009:01:00.0")}
    assert [p["rule"] for p in report["problems"]] == ["xid-144-150-reset"]
    assert "XID 149.37 NETIR_LINK_DOWN on link 14" in report["problems"][0]["message"]


def test_healthy_tray_stays_healthy(capsys):
    assert main(["diagnose", "--nvml", "fake:gb200-nvl72-4", "-q", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []


def test_fake_lines_are_what_the_driver_prints_and_decode_as_the_catalogue_says():
    line = nvlink5_xid_line("0009:01:00.0", LINK_DOWN_149)
    assert line == ("NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_DOWN Fatal XC0 i0 Link 14 (0x025001c6 0x00000000 "
                    "0x00000000 0x00000000 0x00000000 0x00000000)")
    f = nvlink_decode(parse_line(line))
    assert (f["xid_decoded"], f["nvlink_resolution"], f["link"]) == ("149.37", "RESET_GPU", 14)
    down = nvlink_decode(parse_line(nvlink5_xid_line("0018:01:00.0", DOWNSTREAM_145)))
    assert (down["xid_decoded"], down["nvlink_decoded_unit"], down["nvlink_resolution"], down["link"]) == \
        ("145.0", "RLW_SRC_TRACK", "XID_154_EVAL", 12)
    with pytest.raises(ValueError):
        nvlink5_xid_line("0009:01:00.0", LINK_DOWN_149.__class__(79, "X", True, 0, 0))
