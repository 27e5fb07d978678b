"""XID / SXid line parsing (`detector.checks.xid.parser`) and the fast log scanner (`...xid.scan`).

1. Every driver format from REFERENCE.md section 2, inside every log wrapper, must parse: kind, code,
   canonical bus id, pid/name, Fatal/Nonfatal, XID 154 recovery action, and the wrapper's timestamps.
2. Look-alike lines (user space quoting an XID, malformed XID text, other NVRM / nvswitch / AER lines,
   SXid detail lines) must not be events.
3. `scan_stream` finds exactly the lines `parse_line` finds, with the right 1-based line numbers, for
   any chunk size, line ending, over-long line or invalid UTF-8.

The message texts follow lines published in public bug reports (NVIDIA/open-gpu-kernel-modules,
leptonai/gpud, NVIDIA/nvtrust, kubernetes-sigs/dra-driver-nvidia-gpu issues and PRs); PCI addresses,
pids and UUIDs were changed where it helps a check.
"""

from __future__ import annotations

import io
import random
from dataclasses import replace
from datetime import datetime, timezone

import pytest

from detector.checks.xid.parser import UNVERIFIED, USER_SPACE, BootBanner, KernelEvent, UuidMapping, parse_line, parse_message
from detector.checks.xid.scan import scan_stream

YEAR = 2025
# 2025-10-06 17:59:27 UTC, the wall time every timestamped wrapper below carries (Monday).
T0 = datetime(2025, 10, 6, 17, 59, 27, tzinfo=timezone.utc).timestamp()

# --------------------------------------------------------------------------------------------------
# Wrappers: (id, prefix, expected monotonic_s, expected time). Timestamps are checked for events.
# --------------------------------------------------------------------------------------------------
WRAPPERS = [
    ("plain", "", None, None),
    ("dmesg", "[  123.456789] ", 123.456789, None),
    ("dmesg-long-uptime", "[1231741.378609] ", 1231741.378609, None),
    ("dmesg-raw-kern", "<4>[  123.456789] ", 123.456789, None),              # dmesg -r, facility kern
    ("dmesg-T", "[Mon Oct  6 17:59:27 2025] ", None, T0),
    ("dmesg-T-2digit-day", "[Thu Oct 16 17:59:27 2025] ", None, T0 + 10 * 86400),
    ("dmesg-x", "kern  :err   : [  123.456789] ", 123.456789, None),
    ("dmesg-x-warn", "kern  :warn  : [ 4567.000001] ", 4567.000001, None),
    ("syslog", "Oct  6 17:59:27 gpu-node-7 kernel: ", None, T0),
    ("syslog-mono", "Oct  6 17:59:27 gpu-node-7 kernel: [ 123.4] ", 123.4, T0),
    ("journal-short-precise", "Oct 06 17:59:27.123456 gpu-node-7 kernel: ", None, T0 + 0.123456),
    ("rfc3339", "2025-10-06T17:59:27.123456+00:00 gpu-node-7 kernel: ", None, T0 + 0.123456),
    ("rfc3339-Z", "2025-10-06T17:59:27.123456Z gpu-node-7 kernel: ", None, T0 + 0.123456),
    ("rfc3339-offset", "2025-10-06T19:59:27.123456+02:00 gpu-node-7 kernel: ", None, T0 + 0.123456),
    ("rfc3339-mono", "2025-10-06T17:59:27.123456+00:00 gpu-node-7 kernel: [  123.456789] ",
     123.456789, T0 + 0.123456),
    ("kmsg", "4,1234,5678901,-;", 5.678901, None),
    ("kmsg-caller", "3,88211,123456789012,-,caller=C12;", 123456.789012, None),
]

# --------------------------------------------------------------------------------------------------
# Driver messages: (id, message, kind, code, bus, extra expectations). kind "uuid" = UuidMapping.
# Unlisted KernelEvent fields must keep their defaults: pid None, process_name "", fatal None,
# recovery_action "".
# --------------------------------------------------------------------------------------------------
UUID_A = "GPU-604d7f6a-1c2b-4e3d-9f8a-0b1c2d3e4f50"
NVLINK_REGS = "(0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)"

MESSAGES = [
    # old drivers: no "PCI:" in front of the bus id
    ("old-14", "NVRM: Xid (0000:03:00): 14, Channel 00000001",
     "xid", 14, "0000:03:00.0", {"message": "Channel 00000001"}),
    ("old-13", "NVRM: Xid (0000:02:00): 13, 0003 00000000 00008297 00000d94 00000000 00000080",
     "xid", 13, "0000:02:00.0", {"message": "0003 00000000 00008297 00000d94 00000000 00000080"}),
    # PCI:, no pid/name
    ("79-nopid", "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
     "xid", 79, "0000:01:00.0", {"message": "GPU has fallen off the bus."}),
    # pid='<unknown>', name=<unknown>
    ("79-unknown", "NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     "xid", 79, "0000:05:00.0", {"message": "GPU has fallen off the bus."}),
    ("13-unknown", "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp "
     "Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
     "xid", 13, "0000:cb:00.0",
     {"message": "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"}),
    ("48-dbe", "NVRM: Xid (PCI:0000:9b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
     "error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
     "xid", 48, "0000:9b:00.0", {}),
    # pid=digits, errorString ... Info 0x...
    ("109-errorString", "NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
     "errorString CTX SWITCH TIMEOUT, Info 0x58005",
     "xid", 109, "0000:cb:00.0", {"pid": 1797828, "process_name": "pt_main_thread",
                                  "message": "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"}),
    # upper-case bus id, process name with a dot
    ("31-upper-bus-dotted-name", "NVRM: Xid (PCI:0000:3B:00): 31, pid=2345, name=python3.10, Ch 00000010, "
     "intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f8b_c0000000. "
     "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
     "xid", 31, "0000:3b:00.0", {"pid": 2345, "process_name": "python3.10"}),
    # process name with a space
    ("31-name-with-space", "NVRM: Xid (PCI:0000:01:00): 31, pid=4242, name=Web Content, Ch 00000028, "
     "intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_2 faulted @ 0x1_00000000. "
     "Fault is of type FAULT_PTE ACCESS_TYPE_VIRT_READ",
     "xid", 31, "0000:01:00.0", {"pid": 4242, "process_name": "Web Content"}),
    # domain 0009 (Grace-based systems)
    ("43-domain-0009", "NVRM: Xid (PCI:0009:01:00): 43, pid=3188489, name=trigger_xid, channel 0x0b00000a",
     "xid", 43, "0009:01:00.0", {"pid": 3188489, "process_name": "trigger_xid", "message": "channel 0x0b00000a"}),
    ("45-after-149", "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by "
     "previous Xid 149",
     "xid", 45, "0000:dc:00.0", {"pid": 1818990, "process_name": "python3",
                                 "message": "Ch 00000001 caused by previous Xid 149"}),
    # 8-digit domain, as NVML spells it
    ("63-8digit-domain", "NVRM: Xid (PCI:00000000:3B:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: "
     "New row (0x00000000026c10f0) marked for remapping, reset gpu to activate.",
     "xid", 63, "0000:3b:00.0", {}),
    # "fatal" in the text of an XID outside 144-150 must not set `fatal`
    ("74-nvlink", "NVRM: Xid (PCI:0000:3b:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error "
     "detected on link 11(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
     "xid", 74, "0000:3b:00.0", {"fatal": None}),
    ("94-contained", "NVRM: Xid (PCI:0000:ca:00): 94, pid=2163541, name=python, Contained: SM (0x1). "
     "RST: No, D-RST: No",
     "xid", 94, "0000:ca:00.0", {"pid": 2163541, "process_name": "python",
                                 "message": "Contained: SM (0x1). RST: No, D-RST: No"}),
    ("95-uncontained", "NVRM: Xid (PCI:0000:ca:00): 95, pid=2163541, name=python, Uncontained: FBHUB. "
     "RST: Yes, D-RST: No",
     "xid", 95, "0000:ca:00.0", {"pid": 2163541, "process_name": "python"}),
    ("119-gsp", "NVRM: Xid (PCI:0000:3b:00): 119, pid=1582259, name=nvc:[driver], Timeout after 6s of waiting "
     "for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
     "xid", 119, "0000:3b:00.0", {"pid": 1582259, "process_name": "nvc:[driver]"}),
    # XID 144-150: Fatal / Nonfatal
    ("144-nonfatal", f"NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 {NVLINK_REGS}",
     "xid", 144, "0000:01:00.0", {"fatal": False}),
    ("145-nonfatal", "NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 "
     "0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)",
     "xid", 145, "0018:01:00.0", {"fatal": False}),
    ("146-fatal", f"NVRM: Xid (PCI:0008:01:00): 146, TLW_TX Fatal XC0 i0 Link 05 {NVLINK_REGS}",
     "xid", 146, "0008:01:00.0", {"fatal": True}),
    ("147-nonfatal", f"NVRM: Xid (PCI:0009:01:00): 147, TREX_CTRL Nonfatal XC1 i0 Link 17 {NVLINK_REGS}",
     "xid", 147, "0009:01:00.0", {"fatal": False}),
    ("148-fatal", f"NVRM: Xid (PCI:0019:01:00): 148, NVLPW_CTRL Fatal XC0 i0 Link -1 {NVLINK_REGS}",
     "xid", 148, "0019:01:00.0", {"fatal": True}),
    ("149-fatal-wide", "NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 "
     "0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     "xid", 149, "0009:01:00.0", {"fatal": True}),
    ("149-fatal", "NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 "
     "0x00000000 0x00000000 0x00000000 0x00000000)",
     "xid", 149, "0019:01:00.0", {"fatal": True}),
    ("150-nonfatal", f"NVRM: Xid (PCI:0009:01:00): 150, MSE_WATCHDOG Nonfatal XC0 i0 Link -1 {NVLINK_REGS}",
     "xid", 150, "0009:01:00.0", {"fatal": False}),
    # XID 154: the recovery action the driver now asks for
    ("154-none", "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) "
     "to 0x0 (None)",
     "xid", 154, "0009:01:00.0", {"recovery_action": "NONE"}),
    ("154-gpu-reset", "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
     "(GPU Reset Required)",
     "xid", 154, "0000:3b:00.0", {"recovery_action": "RESET_GPU"}),
    ("154-node-reboot", "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
     "(Node Reboot Required)",
     "xid", 154, "0000:3b:00.0", {"recovery_action": "RESTART_BM"}),
    ("154-drain-p2p", "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x3 "
     "(Drain P2P)",
     "xid", 154, "0000:3b:00.0", {"recovery_action": "DRAIN_P2P"}),
    ("154-drain-and-reset", "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 (None) "
     "to 0x4 (Drain and Reset)",
     "xid", 154, "0009:01:00.0", {"recovery_action": "DRAIN_AND_RESET"}),
    ("154-unknown-label", "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 (None) "
     "to 0x5 (Recover IMEX Domain)",
     "xid", 154, "0009:01:00.0", {"recovery_action": "INSPECT"}),
    # fallen off the bus without an Xid
    ("fell-off-no-xid", "NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
     "xid", 79, "0000:18:00.0", {"message": "GPU has fallen off the bus."}),
    ("fell-off-no-xid-at", "NVRM: GPU at PCI:0000:B3:00: GPU has fallen off the bus.",
     "xid", 79, "0000:b3:00.0", {}),
    # NVSwitch SXid: Fatal / Non-fatal, bus id keeps its function
    ("sxid-12028-nonfatal", "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress "
     "non-posted PRIV error (First)",
     "sxid", 12028, "0000:05:00.0",
     {"fatal": False, "message": "Non-fatal, Link 32 egress non-posted PRIV error (First)"}),
    ("sxid-22013-nonfatal", "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion "
     "Link DLREQ interrupt",
     "sxid", 22013, "0000:04:00.0", {"fatal": False}),
    ("sxid-19084-nonfatal", "nvidia-nvswitch2: SXid (PCI:0000:86:00.0): 19084, Non-fatal, Link 10 AN1 "
     "Heartbeat Timeout Error",
     "sxid", 19084, "0000:86:00.0", {"fatal": False}),
    ("sxid-24007-fatal", "nvidia-nvswitch0: SXid (PCI:0000:0a:00.0): 24007, Fatal, Link 08 sourcetrack "
     "TCEN0 crumbstore ECC DBE Error",
     "sxid", 24007, "0000:0a:00.0", {"fatal": True}),
    ("sxid-fatal-function-1", "nvidia-nvswitch5: SXid (PCI:0000:C5:00.1): 20034, Fatal, Link 30 LTSSM "
     "Fault Up",
     "sxid", 20034, "0000:c5:00.1", {"fatal": True}),
    # UUID mapping: upper-case "GPU-" prefix, lower-case hex
    ("uuid-upper", "NVRM: GPU at PCI:0000:06:00: GPU-604D7F6A-1C2B-4E3D-9F8A-0B1C2D3E4F50",
     "uuid", None, "0000:06:00.0", {"uuid": UUID_A}),
    ("uuid-lower", "NVRM: GPU at PCI:0000:3B:00: GPU-03460ed0-0b72-7fcc-9e49-a215c3e33c58",
     "uuid", None, "0000:3b:00.0", {"uuid": "GPU-03460ed0-0b72-7fcc-9e49-a215c3e33c58"}),
    ("uuid-domain-0009", "NVRM: GPU at PCI:0009:01:00: GPU-0C239AA8-F014-5BAA-5147-E54DED720F61",
     "uuid", None, "0009:01:00.0", {"uuid": "GPU-0c239aa8-f014-5baa-5147-e54ded720f61"}),
]

EVENT_DEFAULTS = {"pid": None, "process_name": "", "fatal": None, "recovery_action": ""}


def _check(parsed, kind, code, bus, extra, mono=None, wall=None):
    """Compare one parse result with its row of the table."""
    if kind == "uuid":
        assert isinstance(parsed, UuidMapping), parsed
        assert parsed.pci_bus_id == bus
        assert parsed.uuid == extra["uuid"]
        assert parsed.uuid.startswith("GPU-") and parsed.uuid[4:] == parsed.uuid[4:].lower()
        return
    assert isinstance(parsed, KernelEvent), parsed
    assert (parsed.kind, parsed.code, parsed.pci_bus_id) == (kind, code, bus)
    for field, want in {**EVENT_DEFAULTS, **extra}.items():
        assert getattr(parsed, field) == want, field
    if mono is None:
        assert parsed.monotonic_s is None
    else:
        assert parsed.monotonic_s == pytest.approx(mono, abs=1e-6)
    if wall is None:
        assert parsed.time is None
    else:
        assert parsed.time == pytest.approx(wall, abs=1e-6)


POSITIVE = [
    pytest.param(prefix + msg, kind, code, bus, extra, mono, wall, id=f"{mid}@{wid}")
    for mid, msg, kind, code, bus, extra in MESSAGES
    for wid, prefix, mono, wall in WRAPPERS
]


@pytest.mark.parametrize("line, kind, code, bus, extra, mono, wall", POSITIVE)
def test_real_line_parses_in_every_wrapper(line, kind, code, bus, extra, mono, wall):
    _check(parse_line(line, year=YEAR), kind, code, bus, extra, mono, wall)


@pytest.mark.parametrize("line, kind, code, bus, extra, mono, wall", POSITIVE[: len(WRAPPERS)] + [
    p for p in POSITIVE if p.id.endswith("@dmesg")])
def test_trailing_newline_and_crlf_are_ignored(line, kind, code, bus, extra, mono, wall):
    for ending in ("\n", "\r\n"):
        _check(parse_line(line + ending, year=YEAR), kind, code, bus, extra, mono, wall)


@pytest.mark.parametrize("mid, msg, kind, code, bus, extra", [pytest.param(*m, id=m[0]) for m in MESSAGES])
def test_parse_message_matches_plain_line(mid, msg, kind, code, bus, extra):
    """journald / kmsg hand over the bare message; it must parse exactly like a plain line."""
    _check(parse_message(msg), kind, code, bus, extra)
    want = parse_message(msg)
    if isinstance(want, KernelEvent):
        want = replace(want, origin=UNVERIFIED)      # a bare line proves nothing of its origin
    assert parse_line(msg) == want


# A few lines exactly as they were published, wrapper included.
VERBATIM = [
    ("[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, "
     "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
     "xid", 109, "0000:cb:00.0", datetime(2024, 8, 30, 11, 43, 14, tzinfo=timezone.utc).timestamp(), None),
    ("[24128.834365] NVRM: Xid (PCI:0000:01:00): 31, Ch 00000003, engmask 00000101, intr 10000000",
     "xid", 31, "0000:01:00.0", None, 24128.834365),
    ("[1231741.378609] NVRM: Xid (PCI:0009:01:00): 43, pid=3188489, name=trigger_xid, channel 0x0b00000a",
     "xid", 43, "0009:01:00.0", None, 1231741.378609),
    ("[   38.178720] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ "
     "interrupt", "sxid", 22013, "0000:04:00.0", None, 38.17872),
]


@pytest.mark.parametrize("line, kind, code, bus, wall, mono", VERBATIM)
def test_published_lines(line, kind, code, bus, wall, mono):
    ev = parse_line(line, year=YEAR)
    assert isinstance(ev, KernelEvent)
    assert (ev.kind, ev.code, ev.pci_bus_id) == (kind, code, bus)
    assert ev.time == (None if wall is None else pytest.approx(wall))
    assert ev.monotonic_s == (None if mono is None else pytest.approx(mono))


# --------------------------------------------------------------------------------------------------
# Bus ids and timestamps, one property at a time
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling, want", [
    ("PCI:0000:3B:00", "0000:3b:00.0"),
    ("PCI:0000:3b:00", "0000:3b:00.0"),
    ("PCI:00000000:3B:00", "0000:3b:00.0"),
    ("PCI:0009:01:00", "0009:01:00.0"),
    ("0000:3B:00", "0000:3b:00.0"),
    ("PCI:0000:3b:00.0", "0000:3b:00.0"),
])
def test_xid_bus_id_normalisation(spelling, want):
    ev = parse_line(f"[  5.000000] NVRM: Xid ({spelling}): 79, GPU has fallen off the bus.")
    assert ev.pci_bus_id == want


@pytest.mark.parametrize("spelling, want", [
    ("PCI:0000:05:00.0", "0000:05:00.0"),
    ("PCI:0000:C5:00.1", "0000:c5:00.1"),
    ("PCI:00000000:84:00.3", "0000:84:00.3"),
])
def test_sxid_bus_id_keeps_function(spelling, want):
    ev = parse_line(f"nvidia-nvswitch1: SXid ({spelling}): 12028, Non-fatal, Link 00 egress non-posted PRIV error")
    assert ev.kind == "sxid" and ev.pci_bus_id == want


def test_syslog_time_uses_the_given_year():
    line = "Oct  6 17:59:27 gpu-node-7 kernel: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."
    assert parse_line(line, year=2024).time == datetime(2024, 10, 6, 17, 59, 27, tzinfo=timezone.utc).timestamp()
    assert parse_line(line, year=2025).time == T0


def test_impossible_syslog_date_keeps_the_event_without_time():
    """Feb 29 in a non-leap year: the wall time is unknowable, the event itself is not lost."""
    ev = parse_line("Feb 29 01:02:03 gpu-node-7 kernel: [ 9.5] NVRM: Xid (PCI:0000:01:00): 79, "
                    "GPU has fallen off the bus.", year=2025)
    assert isinstance(ev, KernelEvent) and ev.code == 79
    assert ev.time is None and ev.monotonic_s == 9.5


def test_uuid_mapping_carries_no_time():
    got = parse_line("[  7.000000] NVRM: GPU at PCI:0000:06:00: GPU-604D7F6A-1C2B-4E3D-9F8A-0B1C2D3E4F50")
    assert got == UuidMapping("0000:06:00.0", UUID_A)


def test_boot_banner():
    assert isinstance(parse_line("[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) "
                                 "(x86_64-linux-gnu-gcc-13 (Ubuntu 13.2.0-23ubuntu4) 13.2.0) #45-Ubuntu SMP"),
                      BootBanner)
    assert parse_line("Oct  6 17:59:27 gpu-node-7 myapp[1]: Linux version 6.8.0") is None


# --------------------------------------------------------------------------------------------------
# Look-alikes that must not be events
# --------------------------------------------------------------------------------------------------
X79 = "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."

# A driver message that opens a wrapper which does not prove the kernel wrote it (another syslog tag,
# a user-space facility): in a saved log it is an event marked `origin: unverified` (the user asked
# for that log's analysis); the live path refuses it (tests/test_xid_check.py).
UNVERIFIED_WRAPPERS = [
    ("syslog-user-program", f"Oct  6 17:59:27 gpu-node-7 myapp[123]: {X79}"),
    ("syslog-user-program-1space", f"Oct 6 17:59:27 gpu-node-7 myapp[123]: {X79}"),
    ("journal-user-unit", "Oct 06 17:59:27.123456 gpu-node-7 python3[4242]: NVRM: Xid (PCI:0000:3b:00): 48, "
     "pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU"),
    ("rfc3339-logger", f"2025-10-06T17:59:27.123456+00:00 gpu-node-7 logger: {X79}"),
    # Plain dmesg prints a line user space wrote to /dev/kmsg exactly like the kernel's.
    ("dmesg", f"[  123.456789] {X79}"),
    ("dmesg-T", f"[Mon Oct  6 17:59:27 2025] {X79}"),
    ("bare", X79),
]
# Formats that show the facility, and it is not the kernel's: user space wrote the line.
USER_SPACE_WRAPPERS = [
    ("syslog-pri-user-program", f"<30>Oct  6 17:59:27 gpu-node-7 myapp: {X79}"),
    ("kmsg-user-facility", f"12,55,123456,-;{X79}"),
    ("kmsg-daemon-facility", "30,56,123456,-;nvidia-nvswitch0: SXid (PCI:0000:0a:00.0): 24007, Fatal, "
     "Link 08 sourcetrack TCEN0 crumbstore ECC DBE Error"),
    ("dmesg-x-user-facility", f"user  :warn  : [  123.456789] {X79}"),
    ("journal-json-stdout", '{"MESSAGE": "' + X79 + '", "_TRANSPORT": "stdout", "_BOOT_ID": "b"}'),
]


@pytest.mark.parametrize("line", [pytest.param(line, id=i) for i, line in UNVERIFIED_WRAPPERS])
def test_unproven_wrapper_is_an_unverified_event(line):
    ev = parse_line(line, year=YEAR)
    assert isinstance(ev, KernelEvent) and ev.origin == UNVERIFIED


@pytest.mark.parametrize("line", [pytest.param(line, id=i) for i, line in USER_SPACE_WRAPPERS])
def test_a_shown_user_space_facility_is_user_space(line):
    ev = parse_line(line, year=YEAR)
    assert isinstance(ev, KernelEvent) and ev.origin == USER_SPACE


def test_journal_json_without_transport_cannot_tell():
    ev = parse_line('{"MESSAGE": "' + X79 + '"}')
    assert isinstance(ev, KernelEvent) and ev.origin == UNVERIFIED


@pytest.mark.parametrize("line, code, bus", [
    ("NVRM: Xid (PCI:0000:zz:00): 79, GPU has fallen off the bus.", 79, ""),
    ("NVRM: Xid (PCI:...): 79, GPU has fallen off the bus.", 79, ""),
    ("NVRM: Xid ([...]): 48, An uncorrectable double bit error", 48, ""),
    ("NVRM: Xid (PCI:0000:xx:00): 13, Graphics Exception", 13, ""),
    ("NVRM: Xid (PCI:0000:01:00): 1079, a code nobody has published yet", 1079, "0000:01:00.0"),
    ("[  123.456789] NVRM: Xid (PCI:0000:01:00): 79 GPU has fallen off the bus.", 79, "0000:01:00.0"),
    ("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No", 94,
     "0000:01:00.0"),
    ("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception", 13, "0000:3b:00.0"),
])
def test_odd_driver_lines_are_events_never_dropped(line, code, bus):
    """Redacted bus ids give an event on an unknown GPU; MIG lines name the parent GPU."""
    ev = parse_line(line)
    assert isinstance(ev, KernelEvent) and (ev.code, ev.pci_bus_id) == (code, bus)


def test_pid_without_name_and_name_without_pid():
    a = parse_line("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9).")
    assert (a.pid, a.process_name, a.gpu_instance) == (7194, "", 5)
    assert a.message.startswith("Contained")
    b = parse_line("NVRM: Xid (PCI:0000:01:00): 31, name=python3, Ch 00000010")
    assert (b.pid, b.process_name, b.message) == (None, "python3", "Ch 00000010")


NOT_EVENTS = [
    # user space writing / quoting an XID
    ("dmesg-user-tag", f"[  123.456789] myapp: {X79}"),
    ("shell-history-grep", '  501  dmesg -T | grep "NVRM: Xid (PCI:0000:01:00): 79,"'),
    ("shell-history-echo", f"echo '{X79}' > /dev/kmsg"),
    ("grep-with-filename", f"/var/log/kern.log:Oct  6 17:59:27 gpu-node-7 kernel: {X79}"),
    ("containerd-quoting", 'Oct  6 17:59:27 gpu-node-7 containerd[1]: time="2025-10-06T17:59:27.123456Z" '
     f'level=error msg="{X79}"'),
    ("cri-container-log", f"2025-10-06T17:59:27.123456789Z stderr F {X79}"),
    ("docker-json-log", '{"log":"' + X79 + '\\n","stream":"stdout","time":"2025-10-06T17:59:27.123456789Z"}'),
    ("kubectl-event", f"  Warning  GpuXid  2m  gpu-npd  {X79}"),
    ("audit-quoting", '[  123.456789] audit: type=1400 audit(1759773567.123:42): apparmor="DENIED" '
     f'operation="open" comm="grep" name="{X79}"'),
    # malformed XID text
    ("xid-without-code", "NVRM: Xid (PCI:0000:01:00): GPU has fallen off the bus."),
    ("missing-colon-after-bus", "NVRM: Xid (PCI:0000:01:00) 79, GPU has fallen off the bus."),
    ("no-space-after-NVRM", "NVRM:Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."),
    ("negative-code", "NVRM: Xid (PCI:0000:01:00): -1, GPU has fallen off the bus."),
    ("xid-mid-line", f"[  123.456789] nvidia-peermem nv_get_p2p_free_callback:127 ERROR after {X79}"),
    # other NVRM / NVIDIA / PCIe kernel lines
    ("nvrm-loading", "[    5.123456] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 "
     "09:35:42 UTC 2024"),
    ("nvrm-rminitadapter", "[   12.345678] NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x25:0x65:1457)"),
    ("nvrm-uuid-truncated", "NVRM: GPU at PCI:0000:06:00: GPU-604d7f6a"),
    ("nvswitch-probing", "[    6.000001] nvidia-nvswitch0: Probing device 0000:05:00.0, Vendor Id = 0x10de, "
     "Device Id = 0x22a3, Class = 0x68000"),
    ("pcieport-aer", "[  200.000000] pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0"),
    ("nvidia-modeset", "[  300.000000] nvidia-modeset: ERROR: GPU:0: Idling display engine timed out: "
     "0x0000c67d:0:0:1128"),
    ("empty", ""),
]


@pytest.mark.parametrize("line", [pytest.param(line, id=i) for i, line in NOT_EVENTS])
def test_look_alike_is_not_an_event(line):
    assert parse_line(line, year=YEAR) is None


SXID_DETAILS = [
    ("sxid-detail-severity", "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Severity 1 Engine instance 32 "
     "Sub-engine instance 00"),
    ("sxid-detail-severity-dmesg", "[   38.180708] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Severity 0 "
     "Engine instance 44 Sub-engine instance 00"),
    ("sxid-detail-data", "[   38.175561] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Data {0x0000002b, "
     "0x0000002b, 0x00000000, 0x0000002b, 0x80005302, 0x00000000, 0x00000000, 0x00000000, 0x00000000}"),
]


@pytest.mark.parametrize("line", [pytest.param(line, id=i) for i, line in SXID_DETAILS])
def test_sxid_detail_line_is_a_detail_event(line):
    """The incidents fold it into the headline just before it, or report it alone (tests/test_xid_check.py)."""
    ev = parse_line(line, year=YEAR)
    assert isinstance(ev, KernelEvent) and ev.kind == "sxid" and ev.detail and ev.fatal is None
    assert ev.message.startswith(("Severity ", "Data {"))


# --------------------------------------------------------------------------------------------------
# Once bugs: user-space <PRI>, PCI domains above 0xffff
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line", [
    pytest.param(f"<12>[  123.456789] {X79}", id="dmesg-r-user-facility"),
    pytest.param(f"<14>{X79}", id="pri-user-facility"),
])
def test_raw_pri_with_user_facility_is_user_space(line):
    ev = parse_line(line, year=YEAR)
    assert isinstance(ev, KernelEvent) and ev.origin == USER_SPACE


def test_domain_above_ffff_is_an_event_with_the_full_domain():
    got = parse_line("[  123.456789] NVRM: Xid (PCI:10000:e1:00): 79, GPU has fallen off the bus.")
    assert isinstance(got, KernelEvent) and got.pci_bus_id == "10000:e1:00.0"


def test_scan_survives_domain_above_ffff():
    data = (f"[  1.0] {X79}\n"
            "[  2.0] NVRM: Xid (PCI:00010000:e1:00): 79, GPU has fallen off the bus.\n"
            f"[  3.0] {X79}\n").encode()
    got = []
    scan_stream(io.BytesIO(data), lambda n, p, t: got.append(n), year=YEAR)
    assert got == [1, 2, 3]


# --------------------------------------------------------------------------------------------------
# scan_stream
# --------------------------------------------------------------------------------------------------
NOISE = [
    "[    0.000000] Command line: BOOT_IMAGE=/vmlinuz-6.8.0-45-generic root=UUID=0d9e8f7a ro quiet",
    "[    3.486203] VBoxNetAdp: Successfully started.",
    "[    3.559343] usb 3-5: new high-speed USB device number 4 using xhci_hcd",
    "Oct  6 17:59:27 gpu-node-7 systemd[1]: Started Session 42 of User ubuntu.",
    "Oct  6 17:59:28 gpu-node-7 kernel: [  124.000001] mlx5_core 0000:0c:00.0: Port module event: "
    "module 0, Cable plugged",
    "2025-10-06T17:59:29.000000+00:00 gpu-node-7 kubelet[2211]: I1006 17:59:29.000000 2211 "
    "kubelet.go:2457] SyncLoop (PLEG)",
    "4,1235,5678999,-;EXT4-fs (nvme0n1p2): re-mounted. Quota mode: none.",
    " SUBSYSTEM=pci",                                                     # kmsg continuation line
    "",
    "[Mon Oct  6 17:59:30 2025] NVRM: nvidia-bug-report: collecting",   # NVRM, but not an event
    "[  125.000000] NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x25:0x65:1457)",
    "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
]


def _corpus(seed: int = 7) -> tuple[list[str], int]:
    """Shuffled log lines: every positive table row once, every look-alike, noise; and the positives' count."""
    rng = random.Random(seed)
    positives = [p.values[0] for p in POSITIVE[::3]]            # a third of the table: all messages, all wrappers
    lines = positives + [line for _, line in NOT_EVENTS] + NOISE * 5
    rng.shuffle(lines)
    return lines, len(positives)


def _reference(data: bytes) -> tuple[list[tuple[int, object, str]], int]:
    """What scanning `data` must give: parse_line on every line, and the line count."""
    if not data:
        return [], 0
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    out = []
    for lineno, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", "replace")
        parsed = parse_line(text, YEAR)
        if parsed is not None:
            out.append((lineno, parsed, text))
    return out, len(lines)


def _variant(name: str) -> bytes:
    lines, _ = _corpus()
    lf = "\n".join(lines).encode() + b"\n"
    if name == "lf":
        return lf
    if name == "no-final-newline":
        return lf[:-1]
    if name == "no-final-newline-xid-last":
        return lf + f"[  999.000000] {X79}".encode()
    if name == "crlf":
        return "\r\n".join(lines).encode() + b"\r\n"
    if name == "long-lines":
        long_noise = "[  126.000000] " + "audit: " + "x" * 9000
        long_xid = ("[  126.500000] NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a, Graphics Exception: "
                    + "ESR 0x57c730=0xc04000b " * 400)
        mid = len(lines) // 2
        return "\n".join(lines[:mid] + [long_noise, long_xid, long_noise] + lines[mid:]).encode() + b"\n"
    if name == "invalid-utf8":
        body = lf.split(b"\n")
        bad = [b"\xff\xfe\xfd garbage \xc3", b"[  127.000000] \xe2\x80 NVRM: Xid (PCI:0000:01:00): 79, x",
               b"[  127.100000] NVRM: Xid (PCI:0000:01:00): 31, pid=1, name=a\xffb, Ch 00000001, \xc0\xaf",
               b"\x80NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."]
        out = []
        for i, line in enumerate(body):
            out.append(line)
            if i % 11 == 0:
                out.extend(bad)
        return b"\n".join(out)
    if name == "empty":
        return b""
    if name == "only-newlines":
        return b"\n\n\n"
    if name == "single-xid-no-newline":
        return f"[  1.000000] {X79}".encode()
    raise AssertionError(name)


VARIANTS = ["lf", "no-final-newline", "no-final-newline-xid-last", "crlf", "long-lines", "invalid-utf8",
            "empty", "only-newlines", "single-xid-no-newline"]
CHUNKS = [1, 7, 64, 4096, 1024 * 1024]


def _scan(stream, chunk_size):
    got = []
    stats = scan_stream(stream, lambda n, p, t: got.append((n, p, t)), year=YEAR, chunk_size=chunk_size)
    return got, stats


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_finds_exactly_what_parse_line_finds(variant, chunk_size):
    data = _variant(variant)
    want, nlines = _reference(data)
    got, stats = _scan(io.BytesIO(data), chunk_size)
    assert [(n, t) for n, _, t in got] == [(n, t) for n, _, t in want]
    assert [p for _, p, _ in got] == [p for _, p, _ in want]
    assert stats.lines == nlines
    if variant not in ("empty", "only-newlines"):
        assert want, "the test log must hold events"


def test_corpus_is_not_vacuous():
    """The scan tests compare with parse_line; make sure parse_line finds each planted positive once."""
    data = _variant("lf")
    want, _ = _reference(data)
    _, positives = _corpus()
    assert len([p for _, p, _ in want if not isinstance(p, BootBanner)]) == positives
    long_want, _ = _reference(_variant("long-lines"))
    assert len([p for _, p, _ in long_want if not isinstance(p, BootBanner)]) == positives + 1
    assert any(len(t) > 4096 for _, _, t in long_want)
    utf_want, _ = _reference(_variant("invalid-utf8"))
    assert any(getattr(p, "process_name", "") == "a\ufffdb" for _, p, _ in utf_want)


class _ReadOnly:
    """A stream with read() but no readinto()."""

    def __init__(self, data: bytes):
        self._b = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._b.read(n)


class _Trickle(io.RawIOBase):
    """A pipe-like stream that hands over at most a few bytes per read."""

    def __init__(self, data: bytes, step: int = 5):
        self._b, self._step = io.BytesIO(data), step

    def readable(self) -> bool:
        return True

    def readinto(self, view) -> int:
        chunk = self._b.read(min(self._step, len(view)))
        view[:len(chunk)] = chunk
        return len(chunk)


@pytest.mark.parametrize("chunk_size", [7, 64, 4096])
@pytest.mark.parametrize("make", [_ReadOnly, _Trickle], ids=["read-only", "trickle"])
@pytest.mark.parametrize("variant", ["crlf", "long-lines", "no-final-newline-xid-last"])
def test_scan_other_stream_kinds(make, chunk_size, variant):
    data = _variant(variant)
    want, nlines = _reference(data)
    got, stats = _scan(make(data), chunk_size)
    assert [(n, p, t) for n, p, t in got] == want
    assert stats.lines == nlines


def test_scan_line_numbers_by_hand():
    data = (b"noise\r\n"
            b"[  1.0] NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\r\n"
            b"\xff\xfe\n"
            b"nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Severity 1 Engine instance 32 Sub-engine instance 00\n"
            b"\n"
            b"NVRM: GPU at PCI:0000:06:00: GPU-604D7F6A-1C2B-4E3D-9F8A-0B1C2D3E4F50")
    for chunk in CHUNKS:
        got, stats = _scan(io.BytesIO(data), chunk)
        assert [(n, type(p).__name__) for n, p, _ in got] == [(2, "KernelEvent"), (4, "KernelEvent"),
                                                               (6, "UuidMapping")]
        assert got[0][2].endswith("\r")              # the raw line is handed over as read
        assert got[0][1].monotonic_s == 1.0
        assert got[1][1].detail and got[2][1] == UuidMapping("0000:06:00.0", UUID_A)
        assert stats.lines == 6


def test_scan_reports_boot_banners_and_journal_markers():
    """Boots split a saved log, so the scanner finds banners and journalctl's boot markers too."""
    data = (f"[    0.000000] Linux version 6.8.0-45-generic #45-Ubuntu SMP\n[  1.0] {X79}\n"
            "-- Boot 0123456789abcdef0123456789abcdef --\n-- Reboot --\n-- No entries --\n").encode()
    got, _ = _scan(io.BytesIO(data), 4096)
    assert [(n, type(p).__name__) for n, p, _ in got] == [(1, "BootBanner"), (2, "KernelEvent"), (3, "BootBanner"),
                                                       (4, "BootBanner")]
    assert got[2][1].boot_id == "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("line, code, bus", [
    ("kern  :err   : 2025-01-25T10:34:54,859532+00:00 nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 12028, "
     "Non-fatal, Link 32 egress non-posted PRIV error (First)", 12028, "0000:05:00.0"),
    ("2025-01-25T10:34:54,859532+00:00 NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.", 79,
     "0000:01:00.0"),
    ("[  123.456789] [ T1234] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=x, Graphics Exception", 13,
     "0000:01:00.0"),
    ("Oct 6 17:59:27 host kernel: NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=x, MMU Fault", 31, "0000:3b:00.0"),
    ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", 79, "0000:01:00.0"),
])
def test_more_wrappers_and_spellings(line, code, bus):
    got = parse_line(line, year=YEAR)
    assert isinstance(got, KernelEvent) and (got.code, got.pci_bus_id) == (code, bus)
