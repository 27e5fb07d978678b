"""The infiniband check: sysfs parsing on real texts, the reader on trees, the check and its rules on
scenarios and faults, the fake and real readers agreeing, diagnose and the daemon end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from conftest import builtin_rules, REPO, Clock, diagnose_host, diagnose_scenario, node_for
from test_cli import diagnose_json, gpu_npd
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.backends.infiniband import (IbPort, SysfsInfiniband, counter_max, parse_counter, parse_rate,
                                          parse_state, read_port, sysfs_infiniband)
from detector.checks.infiniband import InfinibandCheck
from detector.core.sweep import run_sweep
from detector.core.types import Observation, Severity
from detector.rules.engine import RuleEngine
from detector.yamlsource import SourceError
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.ib_port import FakeIbPort
from fake_nvml.infiniband import fake_infiniband, write_sysfs
from fake_nvml.node import NodeState
from fake_nvml.scenario import load_scenario

FIXTURES = REPO / "tests" / "fixtures" / "infiniband"
VALUES = yaml.safe_load((FIXTURES / "values.yaml").read_text())


def ports_of(tree: str) -> dict[str, IbPort]:
    snapshot = sysfs_infiniband(FIXTURES / tree).read()
    assert snapshot.present and snapshot.errors == ()
    return {p.name: p for p in snapshot.ports}


def run_ib(host, registry, settings: dict | None = None):
    return diagnose_host(host, registry, checks=["infiniband"], settings={"infiniband": settings or {}})


def port_fields(outcome, name: str) -> dict:
    run = outcome.sweep.runs[0]
    return next(o.fields for o in run.observations if o.fields.get("port_name") == name)


def node_fields(outcome) -> dict:
    return next(o.fields for o in outcome.sweep.runs[0].observations if o.fields["scope"] == "node")


# ---- parsers on real text ----------------------------------------------------------------------


@pytest.mark.parametrize("text,gbps", VALUES["rate"].items())
def test_rate_texts(text, gbps):
    assert parse_rate(text) == gbps


@pytest.mark.parametrize("text,expected", [*VALUES["state"].items(), *VALUES["phys_state"].items()])
def test_state_texts(text, expected):
    assert parse_state(text) == tuple(expected)


@pytest.mark.parametrize("text,value", VALUES["counter"].items())
def test_counter_texts(text, value):
    assert parse_counter(text) == value


@pytest.mark.parametrize("kind,text", [(k, t) for k, texts in VALUES["not_parsed"].items() for t in texts])
def test_odd_texts_are_refused_with_a_reason(kind, text):
    parse = {"rate": parse_rate, "state": parse_state, "counter": parse_counter}[kind]
    with pytest.raises(ValueError, match="expected"):
        parse(text)


def test_counter_widths_saturate_where_the_field_data_stops():
    assert (counter_max("link_downed"), counter_max("symbol_error"), counter_max("excessive_buffer_overrun_errors")) \
        == (255, 65535, 15)


# ---- the reader on real trees ------------------------------------------------------------------


def test_h100_node_tree_reads_eight_ndr_rails_and_a_roce_bond():
    ports = ports_of("h100-gpud")
    assert list(ports) == ["mlx5_0/1", "mlx5_1/1", "mlx5_4/1", "mlx5_5/1", "mlx5_6/1", "mlx5_7/1", "mlx5_8/1",
                           "mlx5_9/1", "mlx5_bond_0/1"]
    rail = ports["mlx5_0/1"]
    assert (rail.state_code, rail.state, rail.phys_state_code, rail.phys_state) == (4, "ACTIVE", 5, "LinkUp")
    assert (rail.rate_gbps, rail.rate, rail.link_layer, rail.board_id) == \
        (400.0, "400 Gb/sec (4X NDR)", "InfiniBand", "MT_0000000838")
    bond = ports["mlx5_bond_0/1"]
    assert (bond.link_layer, bond.rate_gbps, bond.board_id) == ("Ethernet", 200.0, "MT_0000000884")
    assert ports["mlx5_1/1"].counters["link_downed"] == 255 and rail.counters["port_rcv_errors"] == 14
    assert all(p.errors == () for p in ports.values())


def test_older_hardware_tree_and_its_look_alike_phys_state():
    ports = ports_of("procfs")
    assert ports["mlx4_0/2"].link_layer == "InfiniBand"               # the file ends in a blank line
    assert ports["hfi1_0/1"].rate_gbps == 100.0 and ports["mlx5_0/1"].rate_gbps == 25.0
    odd = ports["mlx5_0/1"]
    assert odd.phys_state_code == 4 and odd.phys_state == "ACTIVE"    # code 4 is training, whatever the name


def test_look_alike_tree_reads_every_state_and_no_pma():
    ports = ports_of("lookalikes")
    assert [(n, p.state_code, p.phys_state_code) for n, p in ports.items()] == [
        ("efa_0/1", 4, 5), ("mlx5_2/1", 1, 3), ("mlx5_3/1", 2, 5), ("mlx5_4/1", 3, 5), ("mlx5_5/1", 4, 5),
        ("mlx5_6/1", 4, 6), ("mlx5_7/1", 1, 5), ("mlx5_10/1", 1, 2), ("rocep1s0f0/1", 4, 5)]
    assert ports["mlx5_5/1"].counters["link_downed"] is None and ports["mlx5_5/1"].errors == ()
    assert ports["efa_0/1"].counters == {} and ports["efa_0/1"].link_layer == "Unknown"
    assert ports["mlx5_10/1"].rate == "10 Gb/sec (4X SDR)"


def test_no_class_directory_means_not_present(tmp_path):
    snapshot = sysfs_infiniband(tmp_path).read()
    assert (snapshot.present, snapshot.ports, snapshot.errors) == (False, [], ())


def _port(root: Path, device: str, **files: str) -> Path:
    port = root / "class" / "infiniband" / device / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    defaults = {"state": "4: ACTIVE\n", "phys_state": "5: LinkUp\n", "rate": "400 Gb/sec (4X NDR)\n",
                "link_layer": "InfiniBand\n", "counters/symbol_error": "0\n"}
    for name, text in {**defaults, **files}.items():
        (port / name).write_text(text)
    return port


def test_an_odd_or_unreadable_file_is_that_ports_error_only(tmp_path):
    _port(tmp_path, "mlx5_0", rate="fast\n", **{"counters/symbol_error": "lots\n"})
    bad = _port(tmp_path, "mlx5_1")
    (bad / "state").unlink()
    (bad / "state").mkdir()                                 # reading it fails, as rate_show's EINVAL would
    _port(tmp_path, "mlx5_2")
    (tmp_path / "class" / "infiniband" / "mlx5_9").mkdir()  # a device without ports/
    snapshot = SysfsInfiniband(tmp_path, clock=lambda: 5.0).read()
    ports = {p.name: p for p in snapshot.ports}
    assert ports["mlx5_0/1"].rate_gbps is None and ports["mlx5_0/1"].counters["symbol_error"] is None
    assert [e.split(":")[0] for e in ports["mlx5_0/1"].errors] == ["rate", "counters/symbol_error"]
    assert ports["mlx5_1/1"].state_code is None and ports["mlx5_1/1"].errors[0].startswith("state: ")
    assert ports["mlx5_2/1"].errors == () and ports["mlx5_2/1"].active
    assert snapshot.errors and snapshot.errors[0].startswith("mlx5_9: ") and snapshot.taken_at == 5.0


def test_devices_sort_naturally(tmp_path):
    for name in ("mlx5_10", "mlx5_2", "mlx5_1"):
        _port(tmp_path, name)
    assert [p.device for p in sysfs_infiniband(tmp_path).read().ports] == ["mlx5_1", "mlx5_2", "mlx5_10"]


def test_read_port_alone(tmp_path):
    port = read_port(_port(tmp_path, "mlx5_0", state="2: INIT\n"), "mlx5_0", 1)
    assert (port.state, port.active, port.name) == ("INIT", False, "mlx5_0/1")


# ---- the check and its rules on real trees -----------------------------------------------------


def test_real_h100_tree_is_healthy_but_its_saturated_counters_are_reported(tmp_path, registry):
    out = run_ib(fake_host(node_for("h100-sxm-8"), sysfs_root=FIXTURES / "h100-gpud"), registry)
    assert out.rules() == {"ib-counters-saturated"}
    problem = out.problems[0]
    assert problem.severity is Severity.INFO and problem.type == "InfiniBandCountersSaturated"
    assert "mlx5_1/1" in problem.message and "link_downed,excessive_buffer_overrun_errors" in problem.message
    assert "perfquery -C mlx5_1 -P 1 -R" in problem.message
    assert port_fields(out, "mlx5_1/1")["link_downed_increase"] is None
    assert node_fields(out)["ports_active"] == 9 and out.sweep.runs[0].status == "ok"


def test_look_alikes_fire_only_where_they_should(registry):
    out = run_ib(fake_host(node_for("h100-sxm-8"), sysfs_root=FIXTURES / "lookalikes"), registry)
    hits = {p.rule: p for p in out.problems}
    assert set(hits) == {"ib-port-down", "ib-port-not-active", "ib-rate-degraded", "ib-counters-saturated"}
    down = hits["ib-port-down"].message
    assert "mlx5_10/1 is DOWN, physical state Polling" in down and "mlx5_2/1 is DOWN, physical state Disabled" in down
    assert "mlx5_7/1" not in down                 # down with no ACTIVE peer of its kind: not expected up
    assert port_fields(out, "mlx5_7/1")["expected"] is False
    assert "mlx5_3/1 is INIT" in hits["ib-port-not-active"].message
    assert "mlx5_4/1 is ARMED" in hits["ib-port-not-active"].message
    assert "mlx5_5/1 runs at 200 Gb/s (200 Gb/sec (2X NDR)), expected 400" in hits["ib-rate-degraded"].message
    assert "mlx5_6/1" not in hits["ib-rate-degraded"].message     # ACTIVE while LinkErrorRecovery
    for quiet in ("rocep1s0f0/1", "efa_0/1"):
        assert quiet not in " ".join(p.message for p in out.problems)


def test_older_hardware_raises_nothing(registry):
    out = run_ib(fake_host(node_for("h100-sxm-8"), sysfs_root=FIXTURES / "procfs"), registry)
    assert out.problems == [] and node_fields(out)["ports_present"] == 4


# ---- the check on scenarios --------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-roce", "h100-sxm-8-ib-symbol-errors"])
def test_healthy_at_a_single_look(scenario, registry):
    out = run_ib(fake_host(node_for(scenario)), registry)
    assert out.problems == [] and node_fields(out)["ports_active"] == 8


def test_roce_ports_are_ethernet(registry):
    out = run_ib(fake_host(node_for("h100-sxm-8-roce")), registry)
    assert port_fields(out, "mlx5_7/1")["link_layer"] == "Ethernet"


@pytest.mark.parametrize("scenario", ["h100-sxm-8-no-ib", "a100-pcie-4", "rtx-4090-1"])
def test_a_node_without_an_hca_is_not_applicable(scenario, registry):
    out = run_ib(fake_host(node_for(scenario)), registry)
    run = out.sweep.runs[0]
    assert out.problems == [] and run.status == "ok" and run.result == {"state": "not_applicable", "ports": []}
    assert "not applicable" in run.summary and node_fields(out)["applicable"] is False


def test_port_down_scenario_is_critical_and_names_the_port(registry):
    out = run_ib(fake_host(node_for("h100-sxm-8-ib-port-down")), registry)
    assert out.rules() == {"ib-port-down"}
    problem = out.problems[0]
    assert (problem.severity, problem.action, problem.type) == (Severity.CRITICAL, "CHECK_NETWORK", "InfiniBandPortDown")
    assert "mlx5_3/1 is DOWN" in problem.message and problem.gpus == ()
    assert port_fields(out, "mlx5_3/1")["link_downed"] == 1


def test_rate_degraded_scenario_warns(registry):
    out = run_ib(fake_host(node_for("h100-sxm-8-ib-rate-degraded")), registry)
    assert out.rules() == {"ib-rate-degraded"} and out.problems[0].severity is Severity.WARNING
    assert port_fields(out, "mlx5_5/1")["expected_rate_gbps"] == 400.0


def sweeper(scenario: str, registry, settings: dict | None = None):
    """(node, clock, sweep()) with the node on a hand clock and one check instance kept across sweeps."""
    clock = Clock(0.0)
    node = load_scenario(scenario).build(clock=clock)
    host = fake_host(node, threaded=False)
    check = InfinibandCheck(settings or {})
    engine = RuleEngine(builtin_rules())

    def sweep(at: float):
        clock.now = at
        result = run_sweep(host, [check])
        return result, {p.rule: p for p in engine.evaluate(result.observations)}
    return node, sweep


def test_symbol_errors_are_judged_as_a_rate_over_the_window(registry):
    node, sweep = sweeper("h100-sxm-8-ib-symbol-errors", registry)
    assert sweep(0)[1] == {}
    result, problems = sweep(30)                                  # 15 errors: a rate, but too few yet
    assert problems == {}
    result, problems = sweep(60)
    assert set(problems) == {"ib-symbol-errors"}
    assert "mlx5_1/1: 30 symbol errors in 60 s (30/min)" in problems["ib-symbol-errors"].message
    node.inject(Fault("ib_errors", params={"device": "mlx5_1", "counter": "symbol_error", "per_min": 0.0}))
    assert set(sweep(60 + 601)[1]) == set()                        # quiet for longer than the window


def test_saturation_stops_the_rate_and_is_reported(registry):
    node, sweep = sweeper("h100-sxm-8", registry)
    sweep(0)
    node.inject(Fault("ib_errors", params={"device": "mlx5_0", "counter": "link_downed", "add": 300}))
    result, problems = sweep(60)                                  # clamps at 255; it did rise in the window
    assert set(problems) == {"ib-link-flapped", "ib-counters-saturated"}
    assert "went down 255 time(s)" in problems["ib-link-flapped"].message
    result, problems = sweep(60 + 700)                            # stuck at the top a whole window
    assert set(problems) == {"ib-counters-saturated"}
    node.inject(Fault("recover"))                                 # the repair clears the counters
    assert sweep(60 + 760)[1] == {}


def test_a_port_that_vanishes_is_missing_and_a_count_setting_is_enforced(registry):
    node, sweep = sweeper("h100-sxm-8", registry, {"expected_ports": 8})
    assert sweep(0)[1] == {}
    node.inject(Fault("ib_missing", params={"device": "mlx5_2"}))
    result, problems = sweep(60)
    assert set(problems) == {"ib-port-missing", "ib-too-few-ports"}
    assert "mlx5_2/1 is gone from /sys/class/infiniband" in problems["ib-port-missing"].message
    assert "only 7 of the 8 expected" in problems["ib-too-few-ports"].message
    node.inject(Fault("recover"))
    assert sweep(120)[1] == {}


def test_a_port_seen_active_stays_expected_and_init_is_a_warning(registry):
    node, sweep = sweeper("h100-sxm-8", registry)
    sweep(0)
    node.inject(Fault("ib_port_state", params={"device": "mlx5_4", "state": "INIT", "phys_state": "LinkUp"}))
    assert set(sweep(30)[1]) == {"ib-port-not-active"}
    node.inject(Fault("ib_port_down", params={"device": "mlx5_4", "phys_state": "Disabled"}))
    result, problems = sweep(60)
    assert set(problems) == {"ib-port-down"} and "disabled by software or firmware" in problems["ib-port-down"].message
    assert "seen ACTIVE since the check started" in problems["ib-port-down"].message


def test_a_port_down_from_the_start_without_peers_is_reported_but_not_judged(tmp_path, registry):
    state = load_scenario("h100-sxm-8").build().snapshot()
    state.ib_ports = [FakeIbPort("mlx5_0", 1), FakeIbPort("mlx5_0", 2, state=1, phys_state=2)]   # a dual-port card
    write_sysfs(state, tmp_path)
    out = run_ib(fake_host(node_for("h100-sxm-8"), sysfs_root=tmp_path), registry)
    assert out.problems == [] and port_fields(out, "mlx5_0/2")["expected"] is False
    assert "not ACTIVE: mlx5_0/2 DOWN/Polling" in out.sweep.runs[0].summary


def test_settings_name_ports_pick_devices_and_set_the_rate(registry):
    host = fake_host(node_for("h100-sxm-8"))
    out = run_ib(host, registry, {"ports": ["mlx5_9"], "devices": "mlx5_[0-3]", "expected_rate_gbps": 800})
    assert {port_fields(out, f"mlx5_{i}/1")["port_name"] for i in range(4)} == {f"mlx5_{i}/1" for i in range(4)}
    assert node_fields(out)["ports_present"] == 4
    assert out.rules() == {"ib-port-missing", "ib-rate-degraded"}
    assert "mlx5_9/1 is gone" in out.by_rule()["ib-port-missing"].message
    with pytest.raises(ValueError, match="window"):
        InfinibandCheck({"window": 0})


def test_an_unreadable_file_fails_the_run_but_keeps_the_observations(tmp_path, registry):
    _port(tmp_path, "mlx5_0", rate="garbage\n")
    out = run_ib(fake_host(node_for("h100-sxm-8"), sysfs_root=tmp_path), registry)
    run = out.sweep.runs[0]
    assert run.status == "error" and run.error.startswith("mlx5_0/1: rate: expected")
    assert out.rules() == {"check-failed"} and port_fields(out, "mlx5_0/1")["read_error"]


def test_no_reader_on_the_host_is_unavailable(registry):
    host = fake_host(node_for("h100-sxm-8"))
    host.infiniband = None
    run = run_ib(host, registry).sweep.runs[0]
    assert run.status == "ok" and run.result["state"] == "unavailable"


# ---- rule thresholds, at and around each boundary ----------------------------------------------


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


def judge(engine, **fields) -> set[str]:
    base = dict.fromkeys(InfinibandCheck.fields)
    base.update(scope="port", device="mlx5_0", port=1, port_name="mlx5_0/1", link_layer="InfiniBand",
                present=True, expected=True, expected_because="seen", state="ACTIVE", state_code=4,
                phys_state="LinkUp", phys_state_code=5, rate_gbps=400.0, expected_rate_gbps=400.0,
                saturated_counters="", read_error="", rate_window_s=600.0)
    return {p.rule for p in engine.evaluate([Observation("infiniband", {**base, **fields})])}


@pytest.mark.parametrize("fields,expected", [
    ({}, set()),
    ({"symbol_error_per_min": 2.0, "symbol_error_increase": 20}, set()),
    ({"symbol_error_per_min": 2.1, "symbol_error_increase": 19}, set()),
    ({"symbol_error_per_min": 2.1, "symbol_error_increase": 21}, {"ib-symbol-errors"}),
    ({"link_error_recovery_per_min": 5.0}, set()),
    ({"link_error_recovery_per_min": 5.1}, {"ib-link-error-recovery"}),
    ({"port_rcv_errors_per_min": 600.0}, set()),
    ({"port_rcv_errors_per_min": 600.5}, {"ib-receive-errors"}),
    ({"port_xmit_discards_per_min": 6000.0}, set()),
    ({"port_xmit_discards_per_min": 6001.0}, {"ib-transmit-discards"}),
    ({"link_downed_increase": 0}, set()),
    ({"link_downed_increase": 1}, {"ib-link-flapped"}),
    ({"link_downed_increase": 1, "state_code": 1, "state": "DOWN"}, {"ib-port-down"}),
    ({"local_link_integrity_errors_increase": 1}, {"ib-link-integrity-errors"}),
    ({"excessive_buffer_overrun_errors_increase": 1}, {"ib-buffer-overruns"}),
    ({"rate_gbps": 400.0}, set()),
    ({"rate_gbps": 200.0}, {"ib-rate-degraded"}),
    ({"rate_gbps": 10.0, "state_code": 1}, {"ib-port-down"}),                  # a down port's rate is not judged
    ({"state_code": 1, "expected": False}, set()),
    ({"state_code": 2}, {"ib-port-not-active"}),
    ({"state_code": 3}, {"ib-port-not-active"}),
    ({"state_code": 5}, {"ib-port-not-active"}),
    ({"state_code": 2, "expected": False}, set()),
    ({"present": False, "state_code": None}, {"ib-port-missing"}),
    ({"saturated_counters": "link_downed"}, {"ib-counters-saturated"}),
])
def test_port_rule_boundaries(engine, fields, expected):
    assert judge(engine, **fields) == expected


@pytest.mark.parametrize("active,expected_ports,fires", [(8, 8, False), (7, 8, True), (8, 0, False), (0, 0, False)])
def test_port_count_boundary(engine, active, expected_ports, fires):
    node = {"scope": "node", "applicable": True, "ports_present": 8, "ports_active": active, "ports_expected": 8,
            "expected_ports": expected_ports, "missing_ports": "", "down_ports": ""}
    got = {p.rule for p in engine.evaluate([Observation("infiniband", node)])}
    assert got == ({"ib-too-few-ports"} if fires else set())


# ---- the fake: state, faults, and agreement with the real reader on its written tree --------------


def test_fake_and_real_readers_agree_on_the_same_state(tmp_path):
    clock = Clock(0.0)
    node = load_scenario("h100-sxm-8").build(clock=clock)
    for fault in (Fault("ib_port_down", params={"device": "mlx5_1"}),
                  Fault("ib_rate", params={"device": "mlx5_2", "rate_gbps": 200.0}),
                  Fault("ib_errors", params={"device": "mlx5_3", "counter": "symbol_error", "per_min": 12.0}),
                  Fault("ib_errors", params={"device": "mlx5_4", "counter": "excessive_buffer_overrun_errors",
                                             "add": 40}),
                  Fault("ib_missing", params={"device": "mlx5_7"})):
        node.inject(fault)
    clock.now = 150.0
    fake = fake_infiniband(node).read()
    write_sysfs(node.snapshot(), tmp_path, elapsed_s=clock.now)
    real = sysfs_infiniband(tmp_path).read()
    assert real.ports == fake.ports and len(real.ports) == 7
    by_name = {p.name: p for p in real.ports}
    assert by_name["mlx5_3/1"].counters["symbol_error"] == 30
    assert by_name["mlx5_4/1"].counters["excessive_buffer_overrun_errors"] == 15
    assert (by_name["mlx5_1/1"].state, by_name["mlx5_1/1"].phys_state, by_name["mlx5_1/1"].rate) == \
        ("DOWN", "Polling", "10 Gb/sec (4X SDR)")
    assert (tmp_path / "class" / "infiniband" / "mlx5_0").is_symlink()


def test_fake_counters_move_with_node_time_and_clamp():
    clock = Clock(0.0)
    node = load_scenario("h100-sxm-8").build(clock=clock)
    node.inject(Fault("ib_errors", params={"device": "mlx5_0", "counter": "link_error_recovery", "per_min": 6.0}))
    reader = fake_infiniband(node)
    clock.now = 600.0
    assert reader.read().ports[0].counters["link_error_recovery"] == 60
    clock.now = 6000.0
    assert reader.read().ports[0].counters["link_error_recovery"] == 255
    node.inject(Fault("recover", 0))                          # a GPU reset leaves the network alone
    assert reader.read().ports[0].counters["link_error_recovery"] == 255


def test_ib_faults_refuse_what_the_node_does_not_have():
    node = load_scenario("h100-sxm-8").build()
    with pytest.raises(ValueError, match="has no port mlx5_9/\\*"):
        node.inject(Fault("ib_port_down", params={"device": "mlx5_9"}))
    with pytest.raises(ValueError, match="counter must be one of"):
        node.inject(Fault("ib_errors", params={"device": "mlx5_0", "counter": "bogus"}))
    with pytest.raises(ValueError, match="phys_state must be one of"):
        node.inject(Fault("ib_port_down", params={"device": "mlx5_0", "phys_state": "Gone"}))
    with pytest.raises(ValueError, match="needs parameter 'device'"):
        Fault("ib_missing")


def test_node_state_round_trips_its_ports():
    state = load_scenario("h100-sxm-8").build().snapshot()
    state.ib_ports[2].rising = {"symbol_error": 3.0}
    again = NodeState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again.ib_ports == state.ib_ports and isinstance(again.ib_ports[0], FakeIbPort)


def test_scenario_field_inherits_and_names_each_bad_field(tmp_path):
    assert load_scenario("h100-sxm-8").infiniband.ports == 8
    roce = load_scenario("h100-sxm-8-roce").infiniband
    assert (roce.ports, roce.link_layer, roce.rate_gbps) == (8, "Ethernet", 400.0)
    assert load_scenario("h100-sxm-8-no-ib").infiniband.ports == 0
    assert load_scenario("a100-pcie-4").infiniband.ports == 0
    for body, field in (("{ports: -1}", "ports"), ("{link_layer: Omni}", "link_layer"), ("{width: 3}", "width"),
                        ("{rate_gbps: 0}", "rate_gbps"), ("{speed: 400}", "speed"), ("[8]", "infiniband")):
        path = tmp_path / "bad.yaml"
        path.write_text(f"extends: h100-sxm-8\ninfiniband: {body}\n")
        with pytest.raises(SourceError) as e:
            load_scenario(str(path))
        assert e.value.field is not None and e.value.field.endswith(field) and e.value.line == 2, str(e.value)


def test_fake_port_is_a_plain_dataclass():
    assert {f.name for f in dataclasses.fields(FakeIbPort)} >= {"device", "port", "state", "phys_state", "counters"}


# ---- end to end --------------------------------------------------------------------------------


def test_diagnose_json_names_the_down_port():
    code, report = diagnose_json("h100-sxm-8-ib-port-down", "--checks", "infiniband")
    assert code == 1 and [p["rule"] for p in report["problems"]] == ["ib-port-down"]
    assert report["problems"][0]["severity"] == "critical" and report["problems"][0]["gpus"] == []
    ports = {p["port_name"]: p for p in report["checks"][0]["result"]["ports"]}
    assert ports["mlx5_3/1"]["state"] == "DOWN" and ports["mlx5_0/1"]["counters"]["symbol_error"] == 0
    code, report = diagnose_json("h100-sxm-8-no-ib", "--checks", "infiniband")
    assert code == 0 and report["checks"][0]["result"]["state"] == "not_applicable"


def test_diagnose_reads_a_written_tree_with_sysfs_root(tmp_path):
    node = load_scenario("h100-sxm-8-ib-rate-degraded").build()
    write_sysfs(node.snapshot(), tmp_path)
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8", "--sysfs-root", str(tmp_path), "--checks",
                   "infiniband", "-o", "json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and [p["rule"] for p in report["problems"]] == ["ib-rate-degraded"]
    assert "mlx5_5/1 runs at 200 Gb/s" in report["problems"][0]["message"]


def test_daemon_sets_and_clears_the_port_down_condition(running):  # noqa: F811 - fixture
    local = running(name="gpu-ib", checks=["infiniband"], check_settings={"infiniband": {"interval": 0.3}})

    def status() -> str | None:
        return local.conditions().get("InfiniBandPortDown", {}).get("status")
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("InfiniBandPortDown") and status() is None, 10), local.conditions()
    local.node.inject(Fault("ib_port_down", params={"device": "mlx5_6"}))
    assert local.wait_for(lambda: status() == "True", 10), local.conditions()
    condition = local.conditions()["InfiniBandPortDown"]
    assert condition["reason"] == "IbPortDown" and "mlx5_6/1 is DOWN" in condition["message"]
    local.node.inject(Fault("recover"))
    assert local.wait_for(lambda: status() == "False", 10), local.conditions()


def test_a_devices_glob_matching_nothing_is_not_applicable(registry):
    run = run_ib(fake_host(node_for("h100-sxm-8")), registry, {"devices": "bnxt_*"}).sweep.runs[0]
    assert run.result["state"] == "not_applicable" and "none on a device matching devices 'bnxt_*'" in run.summary
