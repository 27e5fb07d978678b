"""Where an NVLink domain's fault started (core/domain_origin.py) and what a node knows of its domain
(core/nvlink_domain.py), on real driver lines (tests/fixtures/nvlink_domain/, each with its source) and on
the rack of marin-community/marin #9086, with the look-alikes that must name no origin."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from detector.checks.xid.incidents import nvlink_decode
from detector.checks.xid.parser import KernelEvent, parse_line
from detector.core.domain_origin import DomainGpu, judge_domain
from detector.core.nvlink_domain import (LINK_DOWN, LINK_DOWN_TEXT, DomainFacts, LinkXid, canonical_uuid, clique_text,
                                         link_down_of, link_xid_of, parse_clique)
from detector.core.types import GpuRef, Observation

FIXTURES = Path(__file__).parent / "fixtures" / "nvlink_domain"
LINES = yaml.safe_load((FIXTURES / "link_xid_lines.yaml").read_text())["lines"]
CLUSTER = "6f1c2b4e-8d3a-4c59-9e27-0b5d7a1f3c88"
T0 = 1789027726.0          # 2026-09-10T08:08:46Z: when marin #9086's GPU logged its XID 149


def fields_of(line: str) -> dict:
    """What the xid check's observation of this line carries (the parts the domain judgement reads)."""
    event = parse_line(line, kernel=True)
    assert isinstance(event, KernelEvent), line
    return {"kind": event.kind, "code": event.code, "fatal": event.fatal, **nvlink_decode(event)}


@pytest.mark.parametrize("case", LINES, ids=[f"{c['code']}-{c['kind']}-{i}" for i, c in enumerate(LINES)])
def test_each_real_line_is_judged_origin_downstream_or_neither(case):
    x = link_xid_of(fields_of(case["line"]), T0)
    if case["kind"] == "none":
        assert x is None
        return
    assert x is not None and x.code == case["code"] and x.fatal is case["fatal"] and x.link == case["link"]
    assert x.origin_class is (case["kind"] == "origin")
    assert x.downstream is (case["kind"] == "downstream")
    assert x.decoded == case["decoded"]                # the catalogue's sub-code from the xid check, else the code


def test_the_decoded_sub_code_is_used_where_the_xid_check_gives_it():
    assert link_xid_of(fields_of(LINES[0]["line"]), T0).describe() == "XID 149.37 link 0"
    bare = {k: v for k, v in fields_of(LINES[0]["line"]).items() if k != "xid_decoded"}
    assert link_xid_of(bare, T0).describe() == "XID 149 link 0"     # an older event without the decode


# -- the domain ----------------------------------------------------------------------------------------

def xid(code: int, fatal: bool | None, link: int | None = 14, at: float = T0, decoded: str = "") -> LinkXid:
    return LinkXid(code, decoded or str(code), fatal, link, at)


def rack(origin_at: dict[tuple[int, int], LinkXid] | None = None, nodes: int = 16) -> list[DomainGpu]:
    """marin #9086's rack: 16 trays of 4 GPUs, every GPU with the downstream XID 145 a few seconds after T0,
    except those given."""
    origin_at = origin_at or {}
    return [DomainGpu(f"tray-{n:02d}", g, f"00{n:02d}:01:00.0",
                      origin_at.get((n, g), xid(145, True, 13, T0 + 3)))
            for n in range(nodes) for g in range(4)]


def judge(gpus: list[DomainGpu], nodes: int = 16):
    return judge_domain(CLUSTER, 1, [f"tray-{n:02d}" for n in range(nodes)], gpus)


def test_marin_9086_one_149_and_63_downstream_145s_name_the_one_gpu():
    verdict = judge(rack({(9, 0): xid(149, True, 14, T0, "149.37")}))
    assert verdict.verdict == "origin" and verdict.origin is not None
    assert (verdict.origin.node, verdict.origin.gpu) == ("tray-09", 0)
    assert len(verdict.affected) == 64 and verdict.downstream_only == 63
    assert verdict.explain() == ("fault started on tray-09 GPU 0 (XID 149.37 link 14 at 2026-09-10T08:08:46Z); "
                                 "63 GPUs show only downstream XIDs")


def test_two_149s_on_different_nodes_are_no_single_origin_and_both_are_named():
    verdict = judge(rack({(3, 1): xid(149, True, 2), (11, 0): xid(149, True, 14)}))
    assert verdict.verdict == "several" and verdict.origin is None
    assert [(c.node, c.gpu) for c in verdict.candidates] == [("tray-03", 1), ("tray-11", 0)]
    assert verdict.explain().startswith("no single origin: 2 GPUs have a fatal link-level XID: tray-03 GPU 1")


def test_only_145s_name_no_origin():
    verdict = judge(rack())
    assert verdict.verdict == "none" and verdict.origin is None and verdict.candidates == ()
    assert verdict.explain().startswith("no origin found")


def test_a_fatal_145_alone_on_one_node_is_no_origin():
    alone = [DomainGpu("tray-04", 2, "0004:01:00.0", xid(145, True, 10))]
    verdict = judge(alone)
    assert verdict.verdict == "none" and verdict.downstream_only == 1 and len(verdict.affected) == 1


def test_a_nonfatal_149_or_144_is_no_origin():
    verdict = judge(rack({(2, 0): xid(149, False, 14), (5, 3): xid(144, False, 0)}))
    assert verdict.verdict == "none"


def test_a_149_two_days_before_the_145s_is_unrelated_not_their_origin():
    verdict = judge(rack({(7, 0): xid(149, True, 14, T0 - 2 * 86400)}))
    assert verdict.verdict == "none" and [(g.node, g.gpu) for g in verdict.unrelated] == [("tray-07", 0)]


def test_a_149_with_no_downstream_xids_is_still_the_origin_of_its_own_fault():
    verdict = judge([DomainGpu("tray-01", 3, "0019:01:00.0", xid(149, True, 14))])
    assert verdict.verdict == "origin" and verdict.downstream_only == 0


def test_a_domain_with_no_affected_gpu_is_healthy():
    verdict = judge([])
    assert verdict.verdict == "healthy" and verdict.origin is None and verdict.explain() == "no problem in the domain"


# -- what a node knows ---------------------------------------------------------------------------------

def test_the_cluster_uuid_reads_as_bare_hex_or_uuid_text_and_zero_is_none():
    assert canonical_uuid(CLUSTER.replace("-", "")) == CLUSTER == canonical_uuid(CLUSTER.upper())
    assert canonical_uuid("0" * 32) == "" and canonical_uuid("") == ""
    with pytest.raises(ValueError):
        canonical_uuid("not-a-uuid")
    assert clique_text(CLUSTER.replace("-", ""), 1) == f"{CLUSTER}.1"
    assert parse_clique(f"{CLUSTER}.32767") == (CLUSTER, 32767)
    for bad in ("", CLUSTER, f"{CLUSTER}.", f"{CLUSTER}.x", f"{'0' * 32}.1", f"{CLUSTER}.{2**32}"):
        with pytest.raises(ValueError):
            parse_clique(bad)


def fabric(bus: str, cluster: str, clique: int) -> Observation:
    return Observation("fabric", {"cluster_uuid": cluster, "clique_id": clique}, GpuRef(0, None, bus))


def kernel_xid(bus: str, line: str, at: float, boot: str = "b1") -> Observation:
    return Observation("xid", {**fields_of(line), "boot": boot}, GpuRef(0, None, bus), at)


def test_a_gpus_weightiest_link_xid_is_kept_and_a_new_boot_forgets_them():
    facts = DomainFacts()
    l149, l145 = LINES[0]["line"], LINES[5]["line"]
    assert facts.observe([kernel_xid("0008:01:00.0", l149, T0)], "b1")
    assert not facts.observe([kernel_xid("0008:01:00.0", l145, T0 + 5)], "b1")   # a later 145 does not outweigh it
    assert facts.link_xids["0008:01:00.0"].code == 149
    assert facts.observe([kernel_xid("0009:01:00.0", l145, T0 + 5)], "b1")
    assert facts.observe([kernel_xid("0009:01:00.0", l149, T0 + 9)], "b1")       # a 149 after a 145 does
    assert facts.link_xids["0009:01:00.0"].code == 149
    assert not facts.observe([kernel_xid("0018:01:00.0", l149, T0, boot="b0")], "b1")   # an older boot's line
    assert facts.observe([], "b2") and facts.link_xids == {}


def link_obs(bus: str, link: int, expected: bool = True, held: bool = True, at: float = T0) -> Observation:
    return Observation("nvlink", {"scope": "link", "link": link, "link_state": "inactive", "expected": expected,
                                  "held_down": held}, GpuRef(0, None, bus), at)


def test_a_link_held_down_is_a_falling_link_an_origin_class_fault_that_an_xid_outweighs():
    assert link_down_of(link_obs("0008:01:00.0", 14, held=False).fields, T0) is None      # still settling
    assert link_down_of(link_obs("0008:01:00.0", 14, expected=False).fields, T0) is None  # not meant to be up
    facts = DomainFacts()
    assert facts.observe([link_obs("0009:01:00.0", 14)], "b1")
    down = facts.link_xids["0009:01:00.0"]
    assert (down.code, down.decoded, down.link, down.origin_class, down.describe()) == \
        (LINK_DOWN, LINK_DOWN_TEXT, 14, True, "NVLink 14 down")
    assert not facts.observe([kernel_xid("0009:01:00.0", LINES[5]["line"], T0 + 2)], "b1")   # a 145 does not
    assert facts.observe([kernel_xid("0009:01:00.0", LINES[0]["line"], T0 + 3)], "b1")       # the 149 does
    assert facts.link_xids["0009:01:00.0"].code == 149


def test_a_falling_link_against_the_racks_145s_names_its_gpu_and_two_are_no_single_origin():
    fell = LinkXid(LINK_DOWN, LINK_DOWN_TEXT, True, 14, T0)
    verdict = judge(rack({(5, 1): fell}))
    assert verdict.verdict == "origin" and (verdict.origin.node, verdict.origin.gpu) == ("tray-05", 1)
    assert verdict.explain().startswith("fault started on tray-05 GPU 1 (NVLink 14 down at ")
    assert judge(rack({(5, 1): fell, (6, 0): fell})).verdict == "several"


def test_a_falling_link_survives_the_annotation_and_nothing_else_with_code_0_does():
    from detector.kube.annotations import link_xid_dict, link_xid_of_dict

    fell = LinkXid(LINK_DOWN, LINK_DOWN_TEXT, True, 14, T0)
    written = link_xid_dict(fell)
    assert written == {"xid": "link-down", "code": 0, "fatal": True, "link": 14, "at": "2026-09-10T08:08:46Z"}
    assert link_xid_of_dict(written) == fell
    assert link_xid_of_dict({**written, "xid": "0"}) is None          # code 0 is only ever a link held down


def test_the_nvlink_checks_own_observation_of_a_fake_trays_link_down_is_the_evidence(registry):
    from conftest import diagnose_host, node_for
    from fake_nvml.host import fake_host
    from fake_nvml.faults import Fault

    node = node_for("gb200-nvl72-4")
    node.inject(Fault("nvlink_down", 1, {"link": 14}))
    out = diagnose_host(fake_host(node), registry, checks=["nvlink", "fabric"])
    assert {p.rule for p in out.problems} == {"nvlink-link-down"}
    facts = DomainFacts()
    facts.observe(out.sweep.observations, "b1")
    assert {bus: x.describe() for bus, x in facts.link_xids.items()} == {"0009:01:00.0": "NVLink 14 down"}
    assert facts.node_clique() == "6f1c2b4e-8d3a-4c59-9e27-0b5d7a1f3c88.1"


def test_the_node_clique_is_given_only_when_every_gpu_with_a_fabric_agrees():
    facts = DomainFacts()
    facts.observe([fabric("0008:01:00.0", CLUSTER.replace("-", ""), 1), fabric("0009:01:00.0", CLUSTER, 1),
                   fabric("0018:01:00.0", "", 0)], "b1")
    assert facts.node_clique() == f"{CLUSTER}.1" and "0018:01:00.0" not in facts.cliques
    facts.observe([fabric("0019:01:00.0", str(uuid.UUID(int=7)), 1)], "b1")
    assert facts.node_clique() == ""


# -- the node's own remediation ask (checks/node/check.py) ---------------------------------------------

from detector.checks.node.check import domain_fields  # noqa: E402
from detector.core.gpu_health import GpuHealth  # noqa: E402


def tray(links: dict[int, LinkXid | None], reasons: tuple[str, ...] = ("XidNvlinkUnitErrorFatal",)) -> list[GpuHealth]:
    return [GpuHealth(GpuRef(i, None, f"00{i}8:01:00.0"), "failed", "RESET_GPU", reasons, clique=f"{CLUSTER}.1",
                      link_xid=links.get(i)) for i in range(4)]


def test_a_tray_with_the_149_says_it_holds_the_origin_and_does_not_hold_its_ask():
    gpus = tray({0: xid(145, True), 1: xid(149, True, 14, decoded="149.37"), 2: xid(145, True), 3: xid(145, True)})
    f = domain_fields(gpus, gpus, T0 + 60, 1800)
    assert (f["downstream_only"], f["downstream_hold"], f["link_origin"]) == (False, False, "GPU 1 XID 149.37 link 14")
    assert f["domain_note"] == (f"; domain {CLUSTER}/1: this node holds the likely origin of a fault in its NVLink "
                                "domain: GPU 1 (XID 149.37 link 14); remediate this tray, not the rack")


def test_a_tray_with_only_145s_holds_its_ask_for_the_hold_then_asks():
    gpus = tray({i: xid(145, True, 13, T0) for i in range(4)})
    assert domain_fields(gpus, gpus, T0 + 60, 1800)["downstream_hold"] is True
    late = domain_fields(gpus, gpus, T0 + 1801, 1800)
    assert late["downstream_only"] is True and late["downstream_hold"] is False
    assert "shows only the downstream XID 145 (GPU 0, 1, 2, 3)" in late["domain_note"]
    assert domain_fields(gpus, gpus, T0 + 60, 0)["downstream_hold"] is False       # the hold switched off


def test_no_hold_when_a_gpu_failed_for_anything_else_or_the_node_is_in_no_domain():
    gpus = tray({i: xid(145, True) for i in range(4)})
    gpus[2] = GpuHealth(gpus[2].gpu, "failed", "RESTART_BM", ("Xid79GpuFellOffBus",), clique=f"{CLUSTER}.1")
    assert domain_fields(gpus, gpus, T0 + 60, 1800)["downstream_only"] is False
    both = tray({i: xid(145, True) for i in range(4)}, ("XidNvlinkUnitErrorFatal", "Xid145RecurringAfterReboot"))
    assert domain_fields(both, both, T0 + 60, 1800)["downstream_only"] is False
    alone = [GpuHealth(h.gpu, h.state, h.action, h.reasons, link_xid=h.link_xid) for h in tray({i: xid(145, True)
                                                                                                for i in range(4)})]
    f = domain_fields(alone, alone, T0 + 60, 1800)
    assert f == {"nvlink_domain": "", "link_origin": "", "downstream_only": False, "downstream_hold": False,
                 "domain_note": ""}
