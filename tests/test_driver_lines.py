"""The typed driver events of issue 31 on the real lines of tests/fixtures/driver_lines/: each line, read
through the saved-log scanner in its file's order, gives exactly the finding its file says (kind, the bus
it names, an AER line's severity and port), and every look-alike gives none."""

from __future__ import annotations

import io
import json

import pytest

from detector.backends.kernlog.driverlines import (
    FALLEN_OFF_BUS,
    AerReports,
    DriverEvent,
    parse_driver_line,
    parse_driver_message,
)
from detector.checks.xid.parser import KernelEvent
from detector.checks.xid.scan import scan_stream
from detector.cli.main import main
from tests.test_driver_lines_corpus import DOCS


def as_logged(line: str) -> str:
    """The line as the log held it: without the markdown quote (`> `) a source put before a log excerpt."""
    return line[2:] if line.startswith("> ") else line


def findings(lines: list[str]) -> dict[int, tuple]:
    """line number (1-based) -> (kind, bus, severity, port), as the xid check reads a saved log."""
    events: list[tuple[int, object]] = []
    data = "".join(as_logged(x) + "\n" for x in lines).encode()
    scan_stream(io.BytesIO(data), lambda n, p, t: events.append((n, p)), year=2025, drivers=True)
    aer = AerReports()
    got: dict[int, tuple] = {}

    def keep(event: DriverEvent, n: int | None) -> None:
        got[n] = (event.kind, event.pci_bus_id, event.severity, event.port) if event.kind == "pcie_aer" \
            else (event.kind, event.pci_bus_id)

    for n, p in events:
        if isinstance(p, KernelEvent) and p.kind == "xid" and p.code == 79 and "Xid" not in lines[n - 1]:
            got[n] = (FALLEN_OFF_BUS, p.pci_bus_id or None)
        elif isinstance(p, DriverEvent) and p.kind == "pcie_aer":
            for e, at in aer.feed(p, n):
                keep(e, at)
        elif isinstance(p, DriverEvent):
            keep(p, n)
    for e, at in aer.finish():
        keep(e, at)
    return got


def expected(expect) -> tuple | None:
    if expect == "none":
        return None
    if expect["kind"] == "pcie_aer":
        return ("pcie_aer", expect["bus"], expect["severity"], expect.get("port", False))
    return (expect["kind"], expect["bus"])


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_every_line_gives_its_finding(stem, doc):
    got = findings([e["line"] for e in doc["lines"]])
    for n, entry in enumerate(doc["lines"], 1):
        assert got.get(n) == expected(entry["expect"]), (n, entry["line"])


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_every_line_alone(stem, doc):
    """Read alone (no burst around it), a line still has its kind; an AER line has one only on a GPU."""
    for entry in doc["lines"]:
        event = parse_driver_line(as_logged(entry["line"]))
        want = expected(entry["expect"])
        if want is None:
            assert event is None or event.kind == "pcie_aer", entry["line"]
        elif want[0] != "pcie_aer":
            assert event is not None and (event.kind, event.pci_bus_id) == want, entry["line"]


@pytest.mark.parametrize("msg,kind,bus", [
    ("NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)", "rm_init_failed", "0000:3b:00.0"),
    ("nvidia: probe of 0000:5d:00.0 failed with error -1", "rm_init_failed", "0000:5d:00.0"),
    ("NVRM: GPU1 _kgspLogRpcTimeout: Timeout after 45s of waiting for RPC response from GPU1 GSP! Expected "
     "function 10 (FREE) (0x0 0x0).", "gsp_timeout", None),
    ("NVRM: Xid (PCI:0000:18:00): 119, pid=1234, name=python3, Timeout after 6s of waiting for RPC response "
     "from GPU0 GSP!", None, None),
    ("nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  550.90.07", None, None),
    ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.144.03  Mon Dec 30 17:44:08 UTC 2024", None, None),
    ("nvidia-persistenced: Started (1234)", None, None),
    ("NVRM: RmInitX86EmuState: BAR 0 is not mapped, using fallback", None, None),
    ("NVRM: GPU 0000:18:00.0: RmInitX86EmuState: BAR 5 is invalid", None, None),
])
def test_messages(msg, kind, bus):
    event = parse_driver_message(msg)
    assert (event.kind, event.pci_bus_id) == (kind, bus) if kind else event is None, event


def test_minute_stamp_times_dmesg_H_delta_lines():
    lines = ["[May19 19:57] nvidia 0000:03:00.0: enabling device (0000 -> 0003)",
             "[  +0.000127] usb 3-5: new high-speed USB device number 4 using xhci_hcd",
             "[  +2.500000] NVRM: GPU 0000:03:00.0: RmInitAdapter failed! (0x22:0x56:667)"]
    got = []
    scan_stream(io.BytesIO("".join(x + "\n" for x in lines).encode()), lambda n, p, t: got.append(p), year=2025, drivers=True)
    [event] = [p for p in got if getattr(p, "kind", "") == "rm_init_failed"]
    from datetime import datetime, timezone
    assert event.time == datetime(2025, 5, 19, 19, 57, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_each_excerpt_through_diagnose_gives_its_findings(stem, doc, tmp_path, capsys):
    """`diagnose --checks xid --kernel-log EXCERPT` reports exactly the file's findings, each on its GPU (by
    bus id: the excerpts come from other machines than the fake node's), and nothing on a look-alike."""
    path = tmp_path / "kern.log"
    path.write_text("".join(as_logged(e["line"]) + "\n" for e in doc["lines"]))
    code = main(["diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "xid", "-q", "-o", "json",
                 "--kernel-log", str(path)])
    report = json.loads(capsys.readouterr().out)
    got = {(p["rule"], g["pci_bus_id"]) for p in report["problems"] for g in (p["gpu_details"] or [{"pci_bus_id": None}])}
    assert got == {(f["rule"], f["gpu"]) for f in doc["findings"]}
    assert code == (1 if doc["findings"] else 0)


def test_lines_read_around_a_driver_line_are_read_once_with_their_own_numbers():
    """A port's AER lines before a GPU's, a candidate line between them, and the probe failures before the
    driver's summary: each line once, numbered as in the file."""
    lines = ["[  1.0] pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:03:00.0",
             "[  1.0] nvidia 0000:03:00.0: enabling device (0000 -> 0003)",
             "[  1.0] pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer",
             "[  1.0] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)",
             "[  1.0] pcieport 0000:00:03.0: AER: Root Port link has been reset (0)",
             "[  2.0] nvidia: probe of 0000:14:00.0 failed with error -1",
             "[  2.0] nvidia 0000:1b:00.0: vgaarb: changed VGA decodes",
             "[  2.0] NVRM: The NVIDIA probe routine failed for 1 device(s)."]
    got = []
    scan_stream(io.BytesIO("".join(x + "\n" for x in lines).encode()), lambda n, p, t: got.append((n, t)),
                year=2025, drivers=True)
    assert sorted(got) == [(n, lines[n - 1]) for n in (1, 3, 4, 5, 6, 8)]
    assert len(got) == len(set(got))
