"""XID 144-150 decoded on real lines (tests/fixtures/nvlink5_lines/): each line gives the sub-code, unit,
resolution, investigatory action, severity and link its file says (worked out by hand from NVIDIA's "XID
144-150 Decode" table), look-alikes give no event or no decode, and each file read as a `dmesg -x` log
through `diagnose --checks xid --kernel-log` gives exactly its findings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from detector.checks.xid.incidents import nvlink_decode
from detector.checks.xid.parser import KernelEvent, parse_line
from detector.cli.main import main

CORPUS = Path(__file__).resolve().parent / "fixtures" / "nvlink5_lines"
DOCS = [(p.stem, yaml.safe_load(p.read_text())) for p in sorted(CORPUS.glob("*.yaml"))]
DMESG_X = "kern  :err   : "          # dmesg -x: the kernel's facility, so the line provably is the kernel's


def as_logged(line: str) -> str:
    """The line as the log held it: without the markdown quote (`> `) a source put before it."""
    return line[2:] if line.startswith("> ") else line


def test_corpus_shape():
    assert len(DOCS) >= 5
    sources = [doc["source"] for _, doc in DOCS]
    assert len(sources) == len(set(sources)), "two files share a source"
    decoded = set()
    for stem, doc in DOCS:
        assert set(doc) == {"source", "what", "lines", "findings"}, stem
        assert doc["source"].startswith("https://") and doc["what"], stem
        for entry in doc["lines"]:
            assert entry["expect"] == "none" or {"xid", "bus", "decoded"} <= set(entry["expect"]), (stem, entry)
            if entry["expect"] != "none" and entry["expect"]["decoded"]:
                decoded.add(entry["expect"]["resolution"])
    # Real lines of every resolution the rules act on, and look-alikes of both kinds.
    assert decoded == {"RESET_GPU", "IGNORE", "XID_154_EVAL"}
    assert any(e["expect"] == "none" for _, d in DOCS for e in d["lines"])
    assert any(e["expect"] != "none" and not e["expect"]["decoded"] for _, d in DOCS for e in d["lines"])


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_every_line_gives_its_decode(stem, doc):
    for entry in doc["lines"]:
        event = parse_line(as_logged(entry["line"]))
        want = entry["expect"]
        if want == "none":
            assert not isinstance(event, KernelEvent), entry["line"]
            continue
        assert isinstance(event, KernelEvent) and (event.kind, event.code, event.pci_bus_id) == \
            ("xid", want["xid"], want["bus"]), entry["line"]
        fields = nvlink_decode(event)
        assert fields["xid_decoded"] == want["decoded"], entry["line"]
        if not want["decoded"]:
            assert fields["nvlink_resolution"] == "" and fields["intrinfo"] == "", entry["line"]
            continue
        got = {k: fields[f] for k, f in (("unit", "nvlink_decoded_unit"), ("resolution", "nvlink_resolution"),
                                         ("investigation", "nvlink_investigation"),
                                         ("severity", "nvlink_severity"), ("link", "link"))}
        assert got == {k: want[k] for k in got}, entry["line"]


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_each_file_as_dmesg_x_through_diagnose_gives_its_findings(stem, doc, tmp_path, capsys):
    path = tmp_path / "kern.log"
    path.write_text("".join(f"{DMESG_X}{as_logged(e['line'])}\n" for e in doc["lines"]))
    code = main(["diagnose", "--nvml", "fake:h100-sxm-8", "--checks", "xid", "-q", "-o", "json",
                 "--kernel-log", str(path)])
    report = json.loads(capsys.readouterr().out)
    got = {(p["rule"], g["pci_bus_id"]) for p in report["problems"]
           for g in (p["gpu_details"] or [{"pci_bus_id": None}])}
    assert got == {(f["rule"], f["gpu"]) for f in doc["findings"]}
    assert code == (1 if doc["findings"] else 0)
