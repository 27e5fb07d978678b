"""The fleet file's `nvlink_domain` and `nvlink_domain_fault` (sim/fleetfile.py, sim/domain_fault.py): nodes of
groups naming one domain share it, the fault plays XID 149 on one GPU's link and the downstream XID 145 on
every other GPU of that domain, and each mistake is named by file, line and field."""

from __future__ import annotations

import pytest

from detector.checks.xid.incidents import nvlink_decode
from detector.checks.xid.parser import parse_line
from detector.sim.fleetfile import load_fleet
from detector.sim.timeline import plan_faults
from detector.yamlsource import SourceError
from fake_nvml.scenario import NvlinkDomain

RACKS = """\
version: 1
nodes:
  - {scenario: gb200-nvl72-4, count: 10, name: "a-{index:02d}", nvlink_domain: nvl72-a}
  - {scenario: gb200-nvl72-4, count: 8, name: "b-{index:02d}", nvlink_domain: nvl72-a}
  - {scenario: gb200-nvl72-4, count: 2, name: "c-{index:02d}", nvlink_domain: nvl72-b}
  - {scenario: h100-sxm-8, count: 1, name: "h-{index:02d}"}
faults:
  - {at: 30, kind: nvlink_domain_fault, node: b-03, gpu: 2, link: 14}
"""


def write(tmp_path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_groups_naming_one_domain_share_it_and_the_fault_reaches_exactly_that_domain(tmp_path):
    spec = load_fleet(write(tmp_path, RACKS))
    domains = {n.name: n.domain() for n in spec.nodes}
    assert domains["a-00"] == domains["b-07"] == NvlinkDomain.named("nvl72-a") != domains["c-00"]
    assert domains["h-00"] is None
    planned = plan_faults(spec, 3600)
    assert {p.node for p in planned} == {f"a-{i:02d}" for i in range(10)} | {f"b-{i:02d}" for i in range(8)}
    assert len(planned) == 72 and all(p.fault.kind == "kernel_line" for p in planned)
    first, rest = planned[0], planned[1:]
    assert (first.at_s, first.node) == (30.0, "b-03") and all(p.at_s == 31.0 for p in rest)
    event = parse_line(first.fault.params["message"], kernel=True)
    assert (event.code, event.fatal, event.pci_bus_id, nvlink_decode(event)["link"]) == (149, True, "0018:01:00.0", 14)
    assert "0x025001c6" in first.fault.params["message"]
    codes = {(parse_line(p.fault.params["message"], kernel=True).code, parse_line(p.fault.params["message"],
                                                                                 kernel=True).fatal) for p in rest}
    assert codes == {(145, True)}


@pytest.mark.parametrize("fault, field, says", [
    ("{at: 30, kind: nvlink_domain_fault, node: h-00, gpu: 0, link: 1}", "node", "is in no NVLink domain"),
    ("{at: 30, kind: nvlink_domain_fault, node: z-00, gpu: 0, link: 1}", "node", "no node named 'z-00'"),
    ("{at: 30, kind: nvlink_domain_fault, node: a-00, gpu: 4, link: 1}", "gpu", "it has GPUs 0 to 3"),
    ("{at: 30, kind: nvlink_domain_fault, node: a-00, gpu: 0, link: 18}", "link", "links 0 to 17"),
    ("{at: 30, kind: nvlink_domain_fault, node: a-00, gpu: 0}", "link", "missing"),
    ("{random: {rate: 1}, kind: nvlink_domain_fault, node: a-00, gpu: 0, link: 1}", "random", "unknown field"),
])
def test_a_bad_domain_fault_is_named_by_file_line_and_field(tmp_path, fault, field, says):
    path = write(tmp_path, RACKS.replace("{at: 30, kind: nvlink_domain_fault, node: b-03, gpu: 2, link: 14}", fault))
    with pytest.raises(SourceError) as e:
        load_fleet(path)
    text = str(e.value)
    assert str(path) in text and ":8: field" in text and field in text and says in text, text


def test_a_bad_domain_name_is_refused(tmp_path):
    with pytest.raises(SourceError, match=r":3: field .nodes\[0\]\.nvlink_domain.: expected a domain name"):
        load_fleet(write(tmp_path, RACKS.replace("nvlink_domain: nvl72-a}", "nvlink_domain: 'nvl 72'}", 1)))
