"""Post-mortem analysis of saved kernel logs (`gpu-npd diagnose --kernel-log`), end to end through the
CLI: every wrapper and output mode real tools print, compressed and rotated pieces, files nobody can
read as a kernel log, times and boots taken from the log, one incident counted once, and no driver.

The driver messages are real lines (tests/fixtures/real_logs/ holds them with their sources); the
wrappers are the documented output formats of dmesg, journalctl, rsyslog and talosctl.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from datetime import datetime, timezone

import pytest

from detector.checks.xid.parser import KERNEL, UNVERIFIED, USER_SPACE, KernelEvent, parse_line
from detector.cli.main import main

X79 = "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FELL = "NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus."
X13 = ("NVRM: Xid (PCI:0000:5d:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
       "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")
X48 = ("NVRM: Xid (PCI:0000:2a:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
       "(DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.")
T0 = datetime(2025, 10, 6, 17, 59, 27, tzinfo=timezone.utc).timestamp()
DAY = 86400


def diagnose(capsys, *args: str) -> tuple[int, dict]:
    code = main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "-o", "json", *args])
    return code, json.loads(capsys.readouterr().out)


def xid_run(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "xid")


def rules(report: dict) -> set[str]:
    return {p["rule"] for p in report["problems"]}


def syslog(t: float, msg: str, host: str = "gpu-node-7", tag: str = "kernel") -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime(f"%b %e %H:%M:%S {host} {tag}: ") + msg


# --------------------------------------------------------------------------------------------------
# 1. Every wrapper real tools print: (id, line, origin, wall time, seconds since boot)
# --------------------------------------------------------------------------------------------------
FACILITIES = ["kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv",
              "ftp", "res0", "res1", "res2", "res3", *[f"local{i}" for i in range(8)]]
LEVELS = ["emerg", "alert", "crit", "err", "warn", "notice", "info", "debug"]
ISO = "2025-10-06T17:59:27,123456+00:00"
JOURNAL = {"__REALTIME_TIMESTAMP": str(int(T0 * 1e6) + 123456), "__MONOTONIC_TIMESTAMP": "123456789",
           "_BOOT_ID": "0d1c6bd9f1b14d7a8d8f2b5c3e4a5b6c", "SYSLOG_IDENTIFIER": "kernel", "PRIORITY": "3"}

WRAPPED = [
    ("bare-kernel-prefix", f"kernel: {X79}", KERNEL, None, None),
    ("syslog-no-host", f"Oct  6 17:59:27 kernel: {X79}", KERNEL, T0, None),
    ("syslog-host", f"Oct  6 17:59:27 gpu-node-7 kernel: {X79}", KERNEL, T0, None),
    ("syslog-host-mono", f"Oct  6 17:59:27 gpu-node-7 kernel: [  123.456789] {X79}", KERNEL, T0, 123.456789),
    ("rfc3339-host", f"2025-10-06T17:59:27.123456+00:00 gpu-node-7 kernel: {X79}", KERNEL, T0 + 0.123456, None),
    ("rfc3339-no-host", f"2025-10-06T17:59:27.123456+00:00 kernel: {X79}", KERNEL, T0 + 0.123456, None),
    ("journalctl-default", f"Oct 06 17:59:27 gpu-node-7 kernel: {X79}", KERNEL, T0, None),
    ("journalctl-short-iso", f"2025-10-06T17:59:27+0000 gpu-node-7 kernel: {X79}", KERNEL, T0, None),
    ("journalctl-short-iso-precise", f"2025-10-06T17:59:27.123456+0000 gpu-node-7 kernel: {X79}", KERNEL,
     T0 + 0.123456, None),
    ("journalctl-short-precise", f"Oct 06 17:59:27.123456 gpu-node-7 kernel: {X79}", KERNEL, T0 + 0.123456, None),
    ("journalctl-short-monotonic", f"[  123.456789] gpu-node-7 kernel: {X79}", KERNEL, None, 123.456789),
    ("journalctl-cat", X79, UNVERIFIED, None, None),
    ("journalctl-json", json.dumps({**JOURNAL, "MESSAGE": X79, "_TRANSPORT": "kernel"}), KERNEL,
     T0 + 0.123456, 123.456789),
    ("journalctl-json-bytes", json.dumps({**JOURNAL, "MESSAGE": list(X79.encode()), "_TRANSPORT": "kernel"}),
     KERNEL, T0 + 0.123456, 123.456789),
    ("journalctl-json-not-kernel", json.dumps({**JOURNAL, "MESSAGE": X79, "_TRANSPORT": "syslog"}), USER_SPACE,
     T0 + 0.123456, 123.456789),
    # Plain dmesg prints what user space wrote to /dev/kmsg like the kernel's lines: it cannot tell.
    ("dmesg", f"[  123.456789] {X79}", UNVERIFIED, None, 123.456789),
    ("dmesg-caller-id", f"[  123.456789] [ T1234] {X79}", UNVERIFIED, None, 123.456789),
    ("dmesg-T", f"[Mon Oct  6 17:59:27 2025] {X79}", UNVERIFIED, T0, None),
    ("dmesg-iso", f"{ISO} {X79}", UNVERIFIED, T0 + 0.123456, None),
    ("dmesg-xT", f"kern  :err   : [Mon Oct  6 17:59:27 2025] {X79}", KERNEL, T0, None),
    ("dmesg-x-iso", f"kern  :err   : {ISO} {X79}", KERNEL, T0 + 0.123456, None),
    ("talos", f"172.20.0.2: kern:    info: [2025-10-06T17:59:27.123456789Z]: {X79}", KERNEL, T0 + 0.123456, None),
    ("talos-no-ip", f"kern:     err: [2025-10-06T17:59:27.123456789Z]: {X79}", KERNEL, T0 + 0.123456, None),
    ("kmsg", f"3,1234,123456789,-;{X79}", KERNEL, None, 123.456789),
    ("syslog-other-tag", syslog(T0, X79, tag="myapp[42]"), UNVERIFIED, T0, None),
] + [
    (f"dmesg-x-{fac}-{level}", f"{fac:<6}:{level:<6}: [  123.456789] {X79}", KERNEL if fac == "kern" else USER_SPACE,
     None, 123.456789)
    for fac in FACILITIES for level in LEVELS
]


@pytest.mark.parametrize("line, origin, wall, mono", [pytest.param(*w[1:], id=w[0]) for w in WRAPPED])
def test_every_wrapper_gives_the_event_its_origin_and_times(line, origin, wall, mono):
    ev = parse_line(line, year=2025)
    assert isinstance(ev, KernelEvent)
    assert (ev.kind, ev.code, ev.pci_bus_id) == ("xid", 79, "0000:5d:00.0")
    assert ev.message == "GPU has fallen off the bus."
    assert ev.origin == origin
    assert ev.time == (None if wall is None else pytest.approx(wall))
    assert ev.monotonic_s == (None if mono is None else pytest.approx(mono))


def test_each_output_mode_through_diagnose(tmp_path, capsys):
    """A whole file in each mode: one XID 79 on GPU 3, its time in the JSON."""
    for wid, line, origin, wall, mono in WRAPPED[:25]:
        path = tmp_path / f"{wid}.log"
        path.write_text(f"{line}\n")
        code, report = diagnose(capsys, "--kernel-log", str(path))
        run = xid_run(report)
        assert run["status"] == "ok", (wid, run)
        if origin == USER_SPACE:                  # the format shows user space wrote it: no event at all
            assert run["result"]["kernel_events"] == [] and run["result"]["ignored_events"] == 1, wid
            assert run["result"]["ignored"] == [{"kind": "xid", "code": 79, "line": 1, "file": str(path),
                                                 "message": "GPU has fallen off the bus."}], wid
            assert code == 0 and not report["problems"], wid
            continue
        assert code == 1, (wid, run)
        [event] = run["result"]["kernel_events"]
        assert (event["code"], event["gpu"]["index"], event["origin"]) == (79, 3, origin), wid
        assert event["monotonic_s"] == (None if mono is None else pytest.approx(mono)), wid
        assert (event["time"] is None) == (wall is None), wid
        # Only a line the kernel provably wrote sets a condition; an unverified one is reported for a person.
        expected = "xid-79" if origin == KERNEL else "xid-unverified-origin"
        assert rules(report) == {expected}, wid
        assert all(p["report"] == "event" for p in report["problems"]) == (origin != KERNEL), wid


def test_event_times_are_rfc3339_in_json_and_shown_in_the_table(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text(f"2025-10-06T17:59:27.123456+00:00 gpu-node-7 kernel: {X79}\n[   42.500000] {X48}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    events = xid_run(report)["result"]["kernel_events"]
    assert events[0]["time"] == "2025-10-06T17:59:27.123456Z" and events[0]["monotonic_s"] is None
    assert events[1]["time"] is None and events[1]["monotonic_s"] == 42.5
    main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "--kernel-log", str(path)])
    table = capsys.readouterr().out
    assert "2025-10-06T17:59:27.123456Z  boot-0  line 1  XID 79  GPU 3 (0000:5d:00.0)" in table
    assert "+42.500000s  boot-0  line 2  XID 48  GPU 1 (0000:2a:00.0)" in table


# --------------------------------------------------------------------------------------------------
# Compressed, rotated, globbed, unrecognised
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opener", [gzip.open, bz2.open, lzma.open], ids=["gz", "bz2", "xz"])
def test_compressed_log_is_read_transparently(tmp_path, capsys, opener):
    path = tmp_path / "kern.log.2.gz"
    with opener(path, "wt") as f:
        f.write(syslog(T0, "usb 3-5: new high-speed USB device") + "\n" + syslog(T0 + 1, X79) + "\n")
    code, report = diagnose(capsys, "--kernel-log", str(path))
    run = xid_run(report)
    assert code == 1 and run["status"] == "ok"
    assert [(e["code"], e["line"]) for e in run["result"]["kernel_events"]] == [(79, 2)]


def _rotated(tmp_path):
    """logrotate's pieces: kern.log.2.gz (oldest), kern.log.1, kern.log (newest)."""
    d = tmp_path / "logs"
    d.mkdir()
    with gzip.open(d / "kern.log.2.gz", "wt") as f:
        f.write(syslog(T0, X13) + "\n")
    (d / "kern.log.1").write_text(syslog(T0 + 3600, X48) + "\n")
    (d / "kern.log").write_text(syslog(T0 + 7200, X79) + "\n")
    return d


def test_directory_of_rotated_pieces_is_read_oldest_first(tmp_path, capsys):
    d = _rotated(tmp_path)
    _, report = diagnose(capsys, "--kernel-log", str(d))
    result = xid_run(report)["result"]
    assert [f["name"].rsplit("/", 1)[1] for f in result["files"]] == ["kern.log.2.gz", "kern.log.1", "kern.log"]
    assert [(e["code"], e["file"].rsplit("/", 1)[1]) for e in result["kernel_events"]] == [
        (13, "kern.log.2.gz"), (48, "kern.log.1"), (79, "kern.log")]


def test_glob_of_rotated_pieces(tmp_path, capsys):
    d = _rotated(tmp_path)
    _, report = diagnose(capsys, "--kernel-log", str(d / "kern.log*"))
    assert [e["code"] for e in xid_run(report)["result"]["kernel_events"]] == [13, 48, 79]


def test_a_file_in_no_known_format_is_an_error_never_healthy(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("shopping list\nmilk\neggs\n")
    code, report = diagnose(capsys, "--kernel-log", str(path))
    run = xid_run(report)
    assert run["status"] == "error" and f"no kernel-log lines recognised in {path}" in run["error"]
    assert code == 1 and "check-failed" in rules(report) and not report["healthy"]


def test_a_healthy_kernel_log_is_healthy(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text(syslog(T0, "usb 3-5: new high-speed USB device number 4 using xhci_hcd") + "\n")
    code, report = diagnose(capsys, "--kernel-log", str(path))
    assert code == 0 and xid_run(report)["status"] == "ok" and report["healthy"]


def test_one_bad_piece_is_reported_and_the_others_still_count(tmp_path, capsys):
    d = _rotated(tmp_path)
    (d / "kern.log.3").write_bytes(bytes(range(256)) * 10)
    _, report = diagnose(capsys, "--kernel-log", str(d))
    run = xid_run(report)
    assert run["status"] == "error" and "kern.log.3" in run["error"]
    assert {"xid-79", "xid-48", "xid-13"} <= rules(report)


def test_missing_log_is_a_usage_error(tmp_path, capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "--kernel-log", str(tmp_path / "nope.log")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# 2. Origin: counted and marked in a saved log
# --------------------------------------------------------------------------------------------------
def test_unverified_line_is_counted_and_marked(tmp_path, capsys):
    path = tmp_path / "syslog"
    path.write_text(syslog(T0, X79, tag="myapp[42]") + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    result = xid_run(report)["result"]
    [event] = result["kernel_events"]
    assert event["origin"] == "unverified" and result["unverified_events"] == 1
    assert rules(report) == {"xid-unverified-origin"}       # reported for a person, not acted on
    assert all(p["report"] == "event" for p in report["problems"])


# --------------------------------------------------------------------------------------------------
# 4. Times from the log: windows judged at each incident's own time
# --------------------------------------------------------------------------------------------------
def test_same_xid_three_days_apart_is_not_twice_in_24h(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text(syslog(T0, X13) + "\n" + syslog(T0 + 3 * DAY, X13) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert "xid-application-errors-repeated" not in rules(report)
    assert xid_run(report)["result"]["incidents"] == 2


def x13(pid: int, name: str) -> str:
    return X13.replace("pid='<unknown>', name=<unknown>", f"pid={pid}, name={name}")


def test_three_applications_within_a_day_point_at_the_gpu(tmp_path, capsys):
    path = tmp_path / "kern.log"
    faults = [(T0, x13(100, "train.py")), (T0 + 3600, x13(200, "pt_main_thread")), (T0 + 7200, x13(300, "bench"))]
    path.write_text("\n".join(syslog(t, line) for t, line in faults) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    [esc] = [p for p in report["problems"] if p["rule"] == "xid-application-errors-repeated"]
    assert (esc["report"], esc["action"]) == ("condition", "INSPECT")
    assert "3 different applications" in esc["message"]


def test_one_application_faulting_all_day_is_its_own_bug(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text("\n".join(syslog(T0 + 600 * i, x13(100 + i, "python3")) for i in range(20)) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert rules(report) == {"xid-13"} and xid_run(report)["result"]["incidents"] == 20


def test_applications_days_apart_are_not_together(tmp_path, capsys):
    path = tmp_path / "kern.log"
    faults = [(T0, x13(1, "a")), (T0 + 2 * DAY, x13(2, "b")), (T0 + 4 * DAY, x13(3, "c"))]
    path.write_text("\n".join(syslog(t, line) for t, line in faults) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert rules(report) == {"xid-13"}


def test_dmesg_seconds_since_boot_are_windows_too(tmp_path, capsys):
    """dmesg has only seconds since boot: 3 days apart within one boot is still 3 days apart."""
    path = tmp_path / "dmesg.txt"
    lines = [(100, x13(1, "a")), (200, x13(2, "b")), (100 + 3 * DAY, x13(3, "c"))]
    path.write_text("".join(f"kern  :warn  : [{t:12.6f}] {line}\n" for t, line in lines))
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert rules(report) == {"xid-13"}
    assert xid_run(report)["result"]["times"].startswith("seconds since boot")


def test_lines_without_time_are_one_instant_and_the_output_says_so(tmp_path, capsys):
    path = tmp_path / "cat.log"
    path.write_text(f"{X13}\n{X13.replace('GPC 7', 'GPC 3')}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    result = xid_run(report)["result"]
    assert result["times"] == "none in the log: every line judged as one instant"
    assert result["incidents"] == 1                    # identical key, one instant: one incident
    main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "--kernel-log", str(path)])
    assert "every line judged as one instant" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# 5. Boots in a saved log
# --------------------------------------------------------------------------------------------------
BANNER = "Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP PREEMPT_DYNAMIC"
CMDLINE = "Command line: BOOT_IMAGE=/vmlinuz-6.8.0-45-generic root=UUID=0d9e8f7a ro quiet"


def test_boot_banners_split_a_syslog_and_recurrence_after_reboot_escalates(tmp_path, capsys):
    lines = []
    for boot in range(3):
        t = T0 + boot * 2 * DAY
        lines += [syslog(t, BANNER), syslog(t, CMDLINE), syslog(t + 600, X79), syslog(t + 600, FELL)]
    path = tmp_path / "kern.log"
    path.write_text("\n".join(lines) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    result = xid_run(report)["result"]
    assert result["boots"] == 3
    assert [e["boot"] for e in result["kernel_events"]] == ["boot-1"] * 2 + ["boot-2"] * 2 + ["boot-3"] * 2
    assert "xid-79-recurring-after-reboot" in rules(report)
    main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "--kernel-log", str(path)])
    assert "3 boot(s)" in capsys.readouterr().out


def test_journal_boot_markers_split_boots(tmp_path, capsys):
    path = tmp_path / "journal.txt"
    path.write_text("\n".join([
        "-- Boot 6f1c0a2b9d8e4f7a8b6c5d4e3f2a1b0c --", f"Oct 06 17:59:27 gpu-node-7 kernel: {X79}",
        "-- Boot 7a2b3c4d5e6f40718293a4b5c6d7e8f9 --", f"Oct 07 17:59:27 gpu-node-7 kernel: {X79}"]) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 2
    assert "xid-79-recurring-after-reboot" in rules(report)
    path.write_text(f"Oct 06 17:59:27 gpu-node-7 kernel: {X79}\n-- Reboot --\n"
                    f"Oct 07 17:59:27 gpu-node-7 kernel: {X79}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 2


def test_dmesg_time_going_back_to_zero_is_a_new_boot(tmp_path, capsys):
    path = tmp_path / "dmesg.txt"
    path.write_text(f"kern  :err   : [ 5000.000000] {X79}\nkern  :info  : [    3.000000] usb 3-5: new device\n"
                    f"kern  :err   : [   60.000000] {X79}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 2
    assert "xid-79-recurring-after-reboot" in rules(report)
    # Plain dmesg splits the boots the same way, but its lines set no condition.
    path.write_text(f"[ 5000.000000] {X79}\n[    3.000000] usb 3-5: new device\n[   60.000000] {X79}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 2 and rules(report) == {"xid-unverified-origin"}


def test_journal_json_boot_ids_split_boots(tmp_path, capsys):
    entries = [{**JOURNAL, "MESSAGE": X79, "_TRANSPORT": "kernel", "_BOOT_ID": b} for b in ("a" * 32, "b" * 32)]
    path = tmp_path / "journal.json"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 2
    assert "xid-79-recurring-after-reboot" in rules(report)


def test_one_boot_is_one_boot(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text("\n".join([syslog(T0, BANNER), syslog(T0, CMDLINE), syslog(T0 + 5, X79)]) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["boots"] == 1
    assert "xid-79-recurring-after-reboot" not in rules(report)


# --------------------------------------------------------------------------------------------------
# 6. One incident, counted once
# --------------------------------------------------------------------------------------------------
def _observations(report: dict) -> list[dict]:
    return [p for p in report["problems"]]


def test_xid79_and_its_fallen_off_the_bus_line_are_one_incident(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text(f"{syslog(T0, X79)}\n{syslog(T0, FELL)}\n{syslog(T0 + 1, FELL)}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    result = xid_run(report)["result"]
    assert len(result["kernel_events"]) == 3 and result["incidents"] == 1
    assert [p["rule"] for p in report["problems"] if p["rule"].startswith("xid-79")] == ["xid-79"]


def test_repeated_rules_count_79_pairs_once(tmp_path, capsys):
    """Three XID 79 incidents in a day, each with its fallen-off line: six lines, three incidents, not
    "five times in 24 h"; five incidents are."""
    def log(n: int) -> str:
        return "".join(f"{syslog(T0 + i * 3600, X79)}\n{syslog(T0 + i * 3600, FELL)}\n" for i in range(n))
    path = tmp_path / "kern.log"
    path.write_text(log(3))
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["incidents"] == 3 and "xid-fatal-repeated" not in rules(report)
    path.write_text(log(5))
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert "xid-fatal-repeated" in rules(report)
    [p] = [p for p in report["problems"] if p["rule"] == "xid-fatal-repeated"]
    assert " 5 " in p["message"] or "5 times" in p["message"] or "(5" in p["message"]


@pytest.mark.parametrize("first, companion, follows", [
    ("NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     "NVRM: Xid (PCI:0000:5d:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
     79),
    ("NVRM: Xid (PCI:0000:5d:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000)",
     "NVRM: Xid (PCI:0000:5d:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149", 149),
    ("NVRM: Xid (PCI:0000:5d:00): 144, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000)",
     "NVRM: Xid (PCI:0000:5d:00): 145, RLW_REMAP  Fatal   XC0 i0 Link 01 (0x00000001 0x00000008)", 144),
])
def test_companion_lines_follow_their_incident(tmp_path, capsys, first, companion, follows):
    path = tmp_path / "kern.log"
    path.write_text(f"{syslog(T0, first)}\n{syslog(T0 + 1, companion)}\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    assert xid_run(report)["result"]["incidents"] == 1
    path.write_text(f"{syslog(T0, first)}\n{syslog(T0 + 2 * DAY, companion)}\n")     # days later: its own
    _, report = diagnose(capsys, "--kernel-log", str(path))
    expected = 1 if "caused by previous" in companion else 2                         # 45 names its cause
    assert xid_run(report)["result"]["incidents"] == expected
    del follows


# --------------------------------------------------------------------------------------------------
# 8. No driver on the machine reading the log
# --------------------------------------------------------------------------------------------------
def test_post_mortem_without_a_driver_names_gpus_by_bus_id_and_uuid(tmp_path, capsys, monkeypatch):
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError_LibraryNotFound()
    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    path = tmp_path / "kern.log"
    path.write_text(f"kern  :warn  : [    5.000000] NVRM: GPU at PCI:0000:5d:00: GPU-604d7f6a-1c2b-4e3d-9f8a-0b1c2d3e4f50\n"
                    f"kern  :err   : [  900.000000] {X79}\n")
    code = main(["diagnose", "--nvml", "real", "-q", "-o", "json", "--checks", "xid", "--kernel-log", str(path)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and xid_run(report)["status"] == "ok"
    [p] = [p for p in report["problems"] if p["rule"] == "xid-79"]
    assert p["gpu_details"] == [{"index": None, "uuid": "GPU-604d7f6a-1c2b-4e3d-9f8a-0b1c2d3e4f50",
                                 "pci_bus_id": "0000:5d:00.0"}]
    assert "0000:5d:00.0" in p["message"] and "GPU-604d7f6a" in p["message"]
    # Without a saved log, no driver is still a clear one-line error.
    assert main(["diagnose", "--nvml", "real", "--checks", "xid"]) == 2
    assert "no NVIDIA driver" in capsys.readouterr().err


def test_nvlink5_lines_are_decoded_and_171_follows_its_48(tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text("\n".join([
        syslog(T0, "NVRM: Xid (PCI:0000:5d:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000)"),
        syslog(T0 + 100, X48),
        syslog(T0 + 100, "NVRM: Xid (PCI:0000:2a:00): 171, Uncorrectable DRAM error"),
    ]) + "\n")
    _, report = diagnose(capsys, "--kernel-log", str(path))
    [p149] = [p for p in report["problems"] if p["rule"] == "xid-144-150-reset"]
    # 0x021425c6: sub-code (0x021425c6 >> 20) & 0x3F = 33, the catalogue's 149.33 row (RESET_GPU)
    assert "XID 149.33 NETIR_LINK_EVT on link 1: Link Fatal; catalogue resolution RESET_GPU" in p149["message"]
    assert xid_run(report)["result"]["incidents"] == 2          # 149, and 48 with its 171 details
    assert {"xid-48", "xid-171"} <= rules(report)
