"""The serial of a GPU NVML lost, read from the kernel log: the driver prints `NVRM: GPU Board Serial Number:`
after `NVRM: GPU at PCI:...` before a GPU's first Xid of the boot, and `GPU serial number is` after an XID 79.
Real lines (tests/fixtures/board_serial/, each with its source) through `diagnose --kernel-log`, and the parser's
look-alikes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from detector.checks.xid.parser import BoardSerial, parse_message
from detector.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures" / "board_serial"
FILES = sorted(FIXTURES.glob("*.yaml"))


def test_the_corpus_has_a_source_per_file_and_a_board_with_and_without_a_serial():
    docs = [yaml.safe_load(f.read_text()) for f in FILES]
    assert len(docs) >= 2 and all(d["source"].startswith("https://") and d["log"] for d in docs)
    assert any(d["serials"] for d in docs) and any(not d["serials"] for d in docs)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_diagnose_reads_the_serials_the_driver_printed(path, tmp_path, capsys):
    doc = yaml.safe_load(path.read_text())
    log = tmp_path / "kern.log"
    log.write_text(doc["log"])
    code = main(["diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "xid", "--kernel-log", str(log), "-o", "json",
                 "-q"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    [xid] = [c for c in json.loads(out)["checks"] if c["name"] == "xid"]
    assert xid["result"].get("board_serials", {}) == doc["serials"]


@pytest.mark.parametrize("message,expected", [
    ("NVRM: GPU Board Serial Number: 1653723052734", BoardSerial("", "1653723052734")),
    ("NVRM: GPU 0000:91:00.0: GPU serial number is 1653723052734.", BoardSerial("0000:91:00.0", "1653723052734")),
    ("NVRM: GPU Board Serial Number: ", BoardSerial("", "")),           # a GeForce board: none
    ("NVRM: GPU Board Serial Number: 0", BoardSerial("", "")),
    ("NVRM: GPU Board Serial Number: [N/A]", BoardSerial("", "")),
    ("NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.", None),     # an XID 79, not a serial
])
def test_serial_lines_and_look_alikes(message, expected):
    parsed = parse_message(message)
    if expected is None:
        assert not isinstance(parsed, BoardSerial)
    else:
        assert parsed == expected


def test_a_serial_line_with_no_gpu_named_before_it_is_nobodys(tmp_path, capsys):
    log = tmp_path / "kern.log"
    log.write_text("[ 10.0] NVRM: GPU Board Serial Number: 1653723052734\n"
                   "[ 10.1] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
    main(["diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "xid", "--kernel-log", str(log), "-o", "json", "-q"])
    [xid] = [c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "xid"]
    assert "board_serials" not in xid["result"]
