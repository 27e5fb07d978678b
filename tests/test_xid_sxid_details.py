"""NVSwitch SXid detail lines (`Severity N Engine instance ...`, `Data {...}`), from real logs: folded into
their headline's incident only when that headline (same switch, same code) came just before them; an
orphan detail line is an incident of its own, reported, never folded into another switch's incident."""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import diagnose_host, node_for
from fake_nvml.host import fake_host

REAL = Path(__file__).parent / "fixtures" / "real_logs"


def real_lines(name: str) -> list[str]:
    """The fixture's lines as its source printed them; a markdown quote's `> ` is the document's, not the log's."""
    doc = yaml.safe_load((REAL / name).read_text())
    return [e["line"].removeprefix("> ") for e in doc["lines"]]


def sxid_observations(tmp_path: Path, registry, lines: list[str], kernel: bool = True) -> tuple[list, set]:
    path = tmp_path / "dmesg.txt"
    path.write_text("".join((f"kern  :err   : {line}" if kernel else line) + "\n" for line in lines))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path)}})
    return [o for o in out.sweep.runs[0].observations if o.fields["kind"] == "sxid"], out.rules()


def test_detail_lines_right_after_their_headline_fold_into_it(tmp_path, registry):
    """nvtrust#124: headline, Severity, Data of one switch and code, then the next link's headline."""
    lines = [line for line in real_lines("gh-nvidia-nvtrust-124.yaml") if "SXid" in line]
    assert len(lines) == 5
    obs, rules = sxid_observations(tmp_path, registry, lines)
    [o] = obs                                     # one switch, one code, 7 ms: one incident of 5 lines
    assert (o.fields["code"], o.fields["pci_bus_id"], o.fields["count"], o.fields["detail"]) == \
           (22013, "0000:02:00.0", 5, False)
    assert o.fields["message"].startswith("Non-fatal, Link 00")
    assert rules == {"sxid-nonfatal"}


def test_a_detail_line_after_another_switchs_line_is_an_incident_of_its_own(tmp_path, registry):
    """gpud's SXid README quotes a dmesg where three switches' SXid 20034 lines interleave."""
    lines = [line for line in real_lines("src-gpud-sxid-readme.yaml") if "SXid (" in line]
    assert len(lines) == 8
    obs, rules = sxid_observations(tmp_path, registry, lines)
    summary = [(o.fields["pci_bus_id"], o.fields["detail"], o.fields["count"], o.fields["line"]) for o in obs]
    assert summary == [
        ("0000:06:00.0", False, 1, 1),           # switch 1's headline
        ("0000:05:00.0", False, 2, 2),           # switch 0's headline, and its Link 62 headline (line 6)
        ("0000:07:00.0", True, 1, 3),            # switch 2's Severity after switch 0's headline: orphan
        ("0000:05:00.0", True, 1, 4),            # switch 0's Data after switch 2's line: orphan
        ("0000:07:00.0", False, 1, 5),           # switch 2's headline
        ("0000:07:00.0", True, 1, 7),            # its Severity, but switch 0's headline came between
        ("0000:05:00.0", True, 1, 8),            # switch 0's Severity after switch 2's line: orphan
    ]
    assert all(o.fields["message"].startswith(("Severity ", "Data {")) for o in obs if o.fields["detail"])
    assert rules == {"sxid-fatal", "sxid-detail-without-headline"}


def test_a_log_that_starts_with_a_detail_line_reports_it(tmp_path, registry):
    """A rotated log can begin mid-burst: the detail line is still reported, on its own."""
    lines = [line for line in real_lines("gh-nvidia-nvtrust-124.yaml") if "SXid" in line]
    obs, rules = sxid_observations(tmp_path, registry, lines[1:3], kernel=False)
    [o] = obs                                     # Severity then Data of one switch and code: one orphan
    assert (o.fields["detail"], o.fields["count"], o.fields["origin"]) == (True, 2, "unverified")
    assert rules == {"sxid-detail-without-headline"}
