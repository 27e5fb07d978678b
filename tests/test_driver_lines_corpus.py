"""Real non-Xid GPU driver failure lines and their look-alikes (tests/fixtures/driver_lines/, issue 31).

This checks the corpus itself and that none of its look-alikes is taken for an XID or SXid event by the
saved-log parser; tests/test_driver_lines.py holds the driver-line parser and the xid check to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from detector.checks.xid.parser import KernelEvent, parse_line

ROOT = Path(__file__).parent / "fixtures" / "driver_lines"
KINDS = {
    "rm_init_failed",
    "fallen_off_bus",
    "gsp_timeout",
    "pcie_aer",
    "peermem_failed",
    "driver_assert",
    "crash_dump",
}
KEYS = {"kind", "bus", "severity", "port"}
SEVERITIES = {"fatal", "uncorrected", "corrected"}
BUS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _docs() -> list[tuple[str, dict]]:
    return [(path.stem, yaml.safe_load(path.read_text())) for path in sorted(ROOT.glob("*.yaml"))]


DOCS = _docs()
CASES = [(f"{stem}:{i}", e["line"], e["expect"]) for stem, doc in DOCS for i, e in enumerate(doc["lines"])]


@pytest.mark.parametrize("stem,doc", DOCS, ids=[d[0] for d in DOCS])
def test_file_shape(stem, doc):
    assert isinstance(doc, dict), stem
    assert set(doc) == {"source", "what", "lines", "findings"}, set(doc)
    assert isinstance(doc["findings"], list)
    for finding in doc["findings"]:
        assert set(finding) == {"rule", "gpu"} and (finding["gpu"] is None or BUS.match(finding["gpu"])), finding
    lookalikes_only = all(e["expect"] == "none" for e in doc["lines"])
    assert (doc["findings"] == []) == lookalikes_only, "a file of look-alikes gives nothing, any other something"
    assert re.match(r"^https?://\S+$", doc["source"]), doc["source"]
    assert isinstance(doc["what"], str) and doc["what"].strip()
    assert isinstance(doc["lines"], list) and doc["lines"]
    for entry in doc["lines"]:
        assert set(entry) == {"line", "expect"}, entry
        assert isinstance(entry["line"], str) and entry["line"].strip(), entry
        expect = entry["expect"]
        if expect == "none":
            continue
        assert isinstance(expect, dict) and set(expect) <= KEYS and {"kind", "bus"} <= set(expect), expect
        assert expect["kind"] in KINDS, expect
        assert expect["bus"] is None or BUS.match(expect["bus"]), expect
        if expect["kind"] == "pcie_aer":
            assert expect.get("severity") in SEVERITIES, expect
            assert expect.get("port", False) in (True, False), expect
        else:
            assert "severity" not in expect and "port" not in expect, expect


def test_corpus_size_and_coverage():
    """At least 40 sources, every kind present, look-alikes in at least 8 files."""
    assert len(DOCS) >= 40, len(DOCS)
    kinds = {e["kind"] for _, _, e in CASES if e != "none"}
    assert kinds == KINDS, KINDS - kinds
    with_lookalikes = [stem for stem, doc in DOCS if any(e["expect"] == "none" for e in doc["lines"])]
    assert len(with_lookalikes) >= 8, with_lookalikes


def test_sources_unique():
    sources = [doc["source"] for _, doc in DOCS]
    dupes = {s for s in sources if sources.count(s) > 1}
    assert not dupes, dupes


LOOKALIKES = [c for c in CASES if c[2] == "none"]


@pytest.mark.parametrize("case_id,line,expect", LOOKALIKES, ids=[c[0] for c in LOOKALIKES])
def test_lookalike_is_not_an_xid_event(case_id, line, expect):
    parsed = parse_line(line)
    assert not isinstance(parsed, KernelEvent), parsed
