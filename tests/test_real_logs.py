"""Real kernel-log lines from public sources (tests/fixtures/real_logs/, each file naming its source),
parsed as a saved log is read: every XID/SXid/UUID line must give exactly what the line says, and
every look-alike must give nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from detector.checks.xid.parser import KernelEvent, UuidMapping, parse_line

ROOT = Path(__file__).parent / "fixtures" / "real_logs"
KINDS = {"xid", "sxid", "uuid", "none"}
KEYS = {"kind", "code", "bus", "pid", "name", "fatal", "recovery_action", "origin", "uuid", "detail"}


def _corpus() -> list[tuple[str, str, object]]:
    cases = []
    for path in sorted(ROOT.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert isinstance(doc, dict) and doc.get("source") and doc.get("what"), f"{path.name}: source and what"
        for i, entry in enumerate(doc["lines"]):
            cases.append((f"{path.stem}:{i}", entry["line"], entry["expect"]))
    return cases


CASES = _corpus()


def test_corpus_size():
    """At least 300 real lines, at least 60 of them look-alikes that must not fire."""
    lookalikes = sum(1 for _, _, e in CASES if e == "none")
    assert len(CASES) >= 300 and lookalikes >= 60, (len(CASES), lookalikes)


@pytest.mark.parametrize("case_id,line,expect", CASES, ids=[c[0] for c in CASES])
def test_real_line(case_id, line, expect):
    parsed = parse_line(line)
    if expect == "none":
        assert parsed is None or not isinstance(parsed, (KernelEvent, UuidMapping)), parsed
        return
    assert isinstance(expect, dict) and expect["kind"] in KINDS and set(expect) <= KEYS, expect
    if expect["kind"] == "uuid":
        assert isinstance(parsed, UuidMapping), parsed
        assert parsed.pci_bus_id == expect["bus"]
        assert parsed.uuid == expect["uuid"].replace("GPU-", "GPU-", 1).lower().replace("gpu-", "GPU-", 1)
        return
    assert isinstance(parsed, KernelEvent), parsed
    assert (parsed.kind, parsed.code) == (expect["kind"], expect["code"])
    assert (parsed.pci_bus_id or None) == expect["bus"]
    if "pid" in expect:
        assert parsed.pid == expect["pid"]
    if "name" in expect:
        assert (parsed.process_name or None) == expect["name"]
    for key, attr in (("fatal", "fatal"), ("recovery_action", "recovery_action"), ("origin", "origin")):
        if key in expect:
            assert getattr(parsed, attr) == expect[key], key
    assert parsed.detail == expect.get("detail", False), "detail"
