"""Saved-log formats of issue 31: `dmesg -H`/`-wH` stamps and month names in the locale's language
(journalctl, syslog, dmesg -T and -H print the local %b). Each line here is constructed in the shape those
tools print (real lines of each shape are in tests/fixtures/real_logs/ where a public source had them)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from detector.checks.xid.logfiles import looks_like_kernel_log
from detector.checks.xid.parser import KERNEL, UNVERIFIED, KernelEvent, parse_line
from detector.backends.kernlog.wrappers import peel
from tests.test_saved_logs import X79, diagnose, rules, xid_run


def ts(month: int, day: int, h: int, m: int, s: int = 0) -> float:
    return datetime(2025, month, day, h, m, s, tzinfo=timezone.utc).timestamp()


FORMATS = [
    # dmesg -H / -wH: the first line of a minute carries the minute, the others the delta since the last line
    ("dmesg-H-minute", f"[Oct06 17:59] {X79}", UNVERIFIED, ts(10, 6, 17, 59)),
    ("dmesg-H-minute-space", f"[Mar 3 14:53] {X79}", UNVERIFIED, ts(3, 3, 14, 53)),
    ("dmesg-H-minute-cjk", f"[4月21 11:15] {X79}", UNVERIFIED, ts(4, 21, 11, 15)),
    ("dmesg-H-delta", f"[  +0.000127] {X79}", UNVERIFIED, None),
    ("dmesg-H-delta-wide", f"[ +14.754175] {X79}", UNVERIFIED, None),
    ("dmesg-xH", f"kern  :err   : [  +0.000127] {X79}", KERNEL, None),
    # journalctl / syslog under other locales
    ("journal-zh", f"11月 16 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(11, 16, 11, 33, 45)),
    ("journal-zh-jan", f"1月 06 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(1, 6, 11, 33, 45)),
    ("journal-ko", f"11월 16 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(11, 16, 11, 33, 45)),
    ("journal-fr-aout", f"août 16 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(8, 16, 11, 33, 45)),
    ("journal-fr-dec", f"déc. 16 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(12, 16, 11, 33, 45)),
    ("journal-fr-fevr-precise", f"févr. 06 11:33:45.250000 gpu-node-7 kernel: {X79}", KERNEL,
     ts(2, 6, 11, 33, 45) + 0.25),
    ("journal-de-maerz", f"Mär 06 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(3, 6, 11, 33, 45)),
    ("journal-de-okt", f"Okt 06 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(10, 6, 11, 33, 45)),
    ("journal-es-ene", f"ene 06 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(1, 6, 11, 33, 45)),
    ("journal-ru", f"ноя 16 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, ts(11, 16, 11, 33, 45)),
    ("journal-no-hostname", f"Oct  6 17:59:27 kernel: {X79}", KERNEL, ts(10, 6, 17, 59, 27)),
    ("journal-unknown-month", f"Xyz 06 11:33:45 gpu-node-7 kernel: {X79}", KERNEL, None),
    # dmesg -T under other locales
    ("dmesg-T-zh", f"[四 11月 16 11:33:45 2025] {X79}", UNVERIFIED, ts(11, 16, 11, 33, 45)),
    ("dmesg-T-de", f"[Do Okt 16 11:33:45 2025] {X79}", UNVERIFIED, ts(10, 16, 11, 33, 45)),
]


@pytest.mark.parametrize("line, origin, wall", [pytest.param(*f[1:], id=f[0]) for f in FORMATS])
def test_each_format_gives_the_xid_its_origin_and_time(line, origin, wall):
    ev = parse_line(line, year=2025)
    assert isinstance(ev, KernelEvent), ev
    assert (ev.kind, ev.code, ev.pci_bus_id, ev.origin) == ("xid", 79, "0000:5d:00.0", origin)
    assert ev.message == "GPU has fallen off the bus."
    assert ev.time == (None if wall is None else pytest.approx(wall))


@pytest.mark.parametrize("line", [
    "[step 0001] target(deg)=[  +0.0,   +0.0] qpos(rad)=[+0.000, +0.000]",    # brackets, no dmesg stamp
    "[Init] active joints: ['joint_1', 'joint_2']",
    "[May19] nothing",
    "Xid 79 seen on 11月 16",
])
def test_lookalike_stamps_are_not_wrappers(line):
    assert not peel(line).wrapped


@pytest.mark.parametrize("fid", [f[0] for f in FORMATS])
def test_a_file_of_each_format_is_a_kernel_log(fid):
    """The sniffing that stands between a file and "no kernel-log lines recognised" accepts every format,
    also from its noise lines alone (no NVRM line in the head)."""
    line = dict((f[0], f[1]) for f in FORMATS)[fid]
    noise = line.replace(X79, "usb 3-5: new high-speed USB device number 4 using xhci_hcd")
    assert looks_like_kernel_log(f"{noise}\n".encode())


def the_one_kernel_event(capsys, path) -> tuple:
    """diagnose --kernel-log PATH: its exit code, its report, and the one kernel event its xid check read
    (the check itself ran: no GpuHealthCheckFailing)."""
    code, report = diagnose(capsys, "--kernel-log", str(path))
    run = xid_run(report)
    assert run["status"] == "ok", run
    [event] = run["result"]["kernel_events"]
    return code, report, event


def test_dmesg_H_log_through_diagnose(tmp_path, capsys):
    """A `dmesg -H` capture: the XID on a delta line, read as an XID (unverified, like plain dmesg), not a
    check failure."""
    path = tmp_path / "dmesg-H.txt"
    path.write_text("[Oct 6 17:59] nvidia-uvm: Loaded the UVM driver, major device number 510.\n"
                    "[  +0.000127] usb 3-5: new high-speed USB device number 4 using xhci_hcd\n"
                    f"[  +2.500000] {X79}\n")
    code, report, event = the_one_kernel_event(capsys, path)
    assert (event["code"], event["gpu"]["index"], event["origin"]) == (79, 3, UNVERIFIED)
    assert code == 1 and rules(report) == {"xid-unverified-origin"}


@pytest.mark.parametrize("month", ["11月", "août", "Okt", "ene"])
def test_locale_journal_through_diagnose(tmp_path, capsys, month):
    path = tmp_path / "journal.txt"
    path.write_text(f"{month} 06 11:33:40 gpu-node-7 kernel: usb 3-5: new high-speed USB device\n"
                    f"{month} 06 11:33:45 gpu-node-7 kernel: {X79}\n")
    code, report, event = the_one_kernel_event(capsys, path)
    assert (event["code"], event["gpu"]["index"], event["origin"]) == (79, 3, KERNEL)
    assert event["time"] is not None
    assert code == 1 and rules(report) == {"xid-79"}


def test_dmesg_H_delta_line_takes_the_minute_before_it(tmp_path, capsys):
    """A delta line happened in the minute of the last minute stamp (dmesg -H prints one whenever the
    minute changes): a saved log gives the XID on it that minute, read as UTC."""
    path = tmp_path / "dmesg-H.txt"
    path.write_text("[Oct 6 17:59] nvidia-uvm: Loaded the UVM driver, major device number 510.\n"
                    "[  +0.000127] usb 3-5: new high-speed USB device number 4 using xhci_hcd\n"
                    f"[  +2.500000] {X79}\n")
    _, _, event = the_one_kernel_event(capsys, path)
    assert event["time"] is not None and event["time"][4:] == "-10-06T17:59:00.000000Z", event["time"]


@pytest.mark.parametrize("line", [
    "[  123.456789] NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)",
    "[Mon Oct  6 17:59:27 2025] nvidia: probe of 0000:5d:00.0 failed with error -1",
    "Oct  6 17:59:27 gpu-node-7 kernel: NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)",
    "11月 16 11:33:45 gpu-node-7 kernel: NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)",
    "kern  :err   : [  +0.000127] NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)",
    '{"MESSAGE" : "NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)", "_TRANSPORT" : "kernel"}',
    "6,1234,5678901,-;NVRM: GPU 0000:5d:00.0: RmInitAdapter failed! (0x22:0x56:667)",
])
def test_driver_lines_are_read_in_every_format(line):
    from detector.backends.kernlog.driverlines import parse_driver_line
    event = parse_driver_line(line, year=2025)
    assert event is not None and (event.kind, event.pci_bus_id) == ("rm_init_failed", "0000:5d:00.0"), line
