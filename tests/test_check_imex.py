"""The imex check: nvidia-imex-ctl's outputs parsed (real and documented text, tests/fixtures/imex/SOURCE.md),
the tool run with a timeout and capped output, the host service read from a written tree, and every IMEX state
judged through the builtin rules: nothing where IMEX is not meant to run, whatever the tool says."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import builtin_rules, REPO, Clock, diagnose_scenario, node_for
from detector.backends.imex import (OUTPUT_CAP, CtlOutcome, HostImex, ImexParseError, SubprocessCtl, parse_domain,
                                    parse_local_addresses, parse_nodes_config, parse_query, read_service)
from detector.checks.imex import COMPUTE_DOMAIN_LABEL, ImexCheck
from detector.core.nodestatus import NodeStatus
from detector.core.sweep import run_sweep
from detector.core.types import Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.imex import write_imex

FIXTURES = REPO / "tests" / "fixtures" / "imex"


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- parsers -------------------------------------------------------------------------------------


def test_query_words():
    assert parse_query(CtlOutcome("ok", 0, text("query-ready.txt"))).daemon_state == "READY"
    assert parse_query(CtlOutcome("ok", 1, "WAITING_FOR_PEERS\n")).daemon_state == "WAITING_FOR_PEERS"
    assert parse_query(CtlOutcome("ok", 255, "", text("query-not-configured.txt"))).daemon_state == "not_configured"
    not_running = parse_query(CtlOutcome("ok", 1, "", "connect: Connection refused\n"))
    assert (not_running.daemon_state, not_running.detail) == ("not_running", "exit status 1: connect: Connection refused")
    assert parse_query(CtlOutcome("timeout", detail="hung")).daemon_state == "unresponsive"
    assert parse_query(CtlOutcome("not_found", detail="nvidia-imex-ctl not found")).daemon_state == "not_installed"
    # A word that is no daemon state, exit 0: an error, never READY.
    assert parse_query(CtlOutcome("ok", 0, "READYISH\n")).daemon_state == "error"


def test_dcgm_sample_domain_degraded():
    domain = parse_domain(text("dcgm-sample-degraded.json"), {"10.76.183.30"})
    assert (domain.state, domain.local_index, domain.local_state) == ("DEGRADED", "1", "READY")
    [peer] = domain.peers
    # Node 1's own connections list 10.76.179.115 and itself, not node 3: node 3 is not reached from here.
    assert (peer.index, peer.host, peer.node_state, peer.connection) == ("3", "10.76.186.255", "READY", "MISSING")
    assert not peer.reachable


def test_two_node_domain_up_and_peer_down():
    up = parse_domain(text("two-node-up.json"), {"10.0.0.1"})
    assert up.state == "UP" and up.local_index == "0" and all(p.reachable for p in up.peers)
    down = parse_domain(text("two-node-peer-down.json"), {"gpu-node-1"})       # found by its hostName too
    [peer] = down.peers
    assert (down.state, down.local_index, peer.host, peer.node_state, peer.connection) == \
        ("DOWN", "0", "10.0.0.2", "UNAVAILABLE", "INVALID")
    assert peer.describe() == "10.0.0.2 (node 1: UNAVAILABLE, INVALID)"


def test_local_node_unknown_judges_peers_by_their_state():
    domain = parse_domain(text("two-node-peer-down.json"), set())
    assert domain.local_index is None
    assert [(p.host, p.reachable) for p in domain.peers] == [("10.0.0.1", True), ("10.0.0.2", False)]


def test_malformed_output_is_a_clear_error():
    with pytest.raises(ImexParseError, match=r"-N -j: line 1 column 11: not JSON"):
        parse_domain(text("malformed.json"), set())
    with pytest.raises(ImexParseError, match=r"field 'nodes': expected an object keyed by node index, got list"):
        parse_domain(text("nodes-not-an-object.json"), set())
    with pytest.raises(ImexParseError, match=r"field 'status'"):
        parse_domain('{"nodes": {}}', set())


def test_config_and_addresses():
    assert parse_nodes_config("# the rack\n10.1.0.1\n\n10.1.0.2  # tray 2\n") == ["10.1.0.1", "10.1.0.2"]
    fib = ("Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 10.114.0.10\n        /32 host LOCAL\n"
           "     |-- 10.114.0.255\n        /32 link BROADCAST\n     |-- 127.0.0.1\n        /32 host LOCAL\n")
    assert parse_local_addresses(fib) == {"10.114.0.10"}


# -- running the tool ----------------------------------------------------------------------------


def test_missing_binary_is_not_installed():
    outcome = SubprocessCtl(["/nonexistent/nvidia-imex-ctl"]).run(["-q"], 2.0)
    assert outcome.status == "not_found"


def test_hung_tool_times_out_and_is_killed():
    t0 = time.monotonic()
    outcome = SubprocessCtl(["/bin/sh", "-c", "sleep 30", "stand-in"]).run(["-q"], 0.5)
    assert outcome.status == "timeout" and "0.5s" in outcome.detail
    assert time.monotonic() - t0 < 5


def test_output_is_capped():
    flood = f"import sys; sys.stdout.write('x' * {3 * OUTPUT_CAP})"
    outcome = SubprocessCtl([sys.executable, "-c", flood]).run([], 20.0)
    assert outcome.status == "ok" and outcome.truncated and len(outcome.stdout) == OUTPUT_CAP


# -- the host service, read from a written tree --------------------------------------------------


def test_service_read_from_the_fake_tree(tmp_path):
    node = node_for("gb200-nvl72-4")
    write_imex(node.snapshot(), tmp_path / "a")
    service = read_service(tmp_path / "a")
    assert (service.unit_enabled, service.nodes, service.configured) == (True, 18, True)
    write_imex(node_for("gb200-nvl72-4-imex-unconfigured").snapshot(), tmp_path / "b")
    assert read_service(tmp_path / "b").configured is False
    assert read_service(tmp_path / "nothing-mounted").configured is None     # no /etc here: unknown, not False


def test_host_reader_finds_the_local_node(tmp_path):
    node = node_for("gb200-nvl72-4")
    write_imex(node.snapshot(), tmp_path)
    from fake_nvml.imex import ctl

    class Runner:
        def run(self, args, timeout_s):
            code, out, err = node.read(lambda state: ctl(state, args))
            return CtlOutcome("ok", code, out, err)

    reading = HostImex(tmp_path, runner=lambda command: Runner()).read(2.0, ["nvidia-imex-ctl"])
    assert reading.service.configured and reading.status.daemon_state == "READY"
    assert reading.status.domain.local_index == "0" and len(reading.status.domain.peers) == 17


# -- the check, through the builtin rules --------------------------------------------------------


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


class Judge:
    """One fake node, one imex check on a hand-moved clock: each call is a sweep and its problems."""

    def __init__(self, scenario: str, engine: RuleEngine, labels: dict | None = None, **settings):
        self.node = node_for(scenario)
        self.host = fake_host(self.node, threaded=False)
        if labels is not None:
            self.host.node_status = lambda: NodeStatus("n", 0.0, labels=labels)
        self.clock = Clock()
        self.check = ImexCheck(settings, clock=self.clock)
        self.engine = engine

    def __call__(self, after_s: float = 0.0):
        self.clock.now += after_s
        sweep = run_sweep(self.host, [self.check])
        [obs] = [o for o in sweep.observations if o.check == "imex" and "imex_expected" in o.fields]
        return obs.fields, {p.reason: p for p in self.engine.evaluate(sweep.observations) if p.type == "GpuImexUnhealthy"}


def test_healthy_tray_raises_nothing(engine):
    fields, problems = Judge("gb200-nvl72-4", engine)()
    assert fields["imex_expected"] is True and fields["daemon_state"] == "READY"
    assert (fields["domain_state"], fields["peers"], fields["peers_unreachable"]) == ("UP", 17, 0)
    assert problems == {}


@pytest.mark.parametrize("fault", [Fault("imex_down"), Fault("imex_peers_unreachable"), Fault("imex_hang", params={"seconds": 9.0})])
def test_not_expected_raises_nothing_whatever_the_tool_says(engine, fault):
    judge = Judge("gb200-nvl72-4-imex-unconfigured", engine, call_timeout=0.2, startup_grace=10, debounce=10)
    judge.node.inject(fault)
    for _ in range(3):
        fields, problems = judge(after_s=600)
        assert fields["imex_expected"] is False and problems == {}
    assert "no host IMEX service" in fields["expected_why"]


def test_h100_without_imex_stays_clean(registry):
    outcome = diagnose_scenario("h100-sxm-8", registry, checks=["imex"])
    assert outcome.problems == []


def test_daemon_down_is_immediate_and_critical(engine):
    judge = Judge("gb200-nvl72-4", engine)
    judge.node.inject(Fault("imex_down"))
    fields, problems = judge()
    p = problems["ImexDaemonDown"]
    assert (p.severity, p.action) == (Severity.CRITICAL, "RESTART_IMEX")
    assert "its daemon is UNAVAILABLE" in p.message and fields["domain_state"] == "DOWN"
    assert set(problems) == {"ImexDaemonDown"}       # its unreachable peers are its own doing: one problem


def test_startup_state_counts_only_after_the_grace(engine):
    judge = Judge("gb200-nvl72-4", engine, startup_grace=300)
    judge.node.inject(Fault("imex_down", params={"state": "WAITING_FOR_PEERS"}))
    assert judge()[1] == {}
    assert judge(after_s=200)[1] == {}
    assert "ImexDaemonDown" in judge(after_s=101)[1]


def test_domain_down_short_of_and_past_the_debounce(engine):
    judge = Judge("gb200-nvl72-4", engine, debounce=120)
    judge.node.inject(Fault("imex_peers_unreachable"))          # all 17 peers: the domain reads DOWN
    fields, problems = judge()
    assert fields["domain_state"] == "DOWN" and fields["peers_unreachable"] == 17 and problems == {}
    assert judge(after_s=119)[1] == {}
    problems = judge(after_s=2)[1]
    assert set(problems) == {"ImexDomainDown"} and problems["ImexDomainDown"].severity == Severity.CRITICAL


def test_peers_unreachable_short_of_and_past_the_debounce(engine):
    judge = Judge("gb200-nvl72-4", engine, debounce=120)
    judge.node.inject(Fault("imex_peers_unreachable", params={"count": 2}))
    fields, problems = judge()
    assert fields["domain_state"] == "DEGRADED" and problems == {}
    assert judge(after_s=100)[1] == {}
    fields, problems = judge(after_s=30)
    p = problems["ImexPeersUnreachable"]
    assert p.severity == Severity.WARNING
    assert "2 of 17 IMEX peer(s) unreachable" in p.message
    assert "10.114.0.11 (node 1: UNAVAILABLE, INVALID), 10.114.0.12 (node 2: UNAVAILABLE, INVALID)" in p.message
    judge.node.inject(Fault("recover"))                          # back whole: the debounce starts again
    assert judge(after_s=1)[1] == {}


def test_hung_tool_returns_and_says_unresponsive(engine):
    judge = Judge("gb200-nvl72-4", engine, call_timeout=0.2, startup_grace=60)
    judge.node.inject(Fault("imex_hang", params={"seconds": 30.0}))
    t0 = time.monotonic()
    fields, problems = judge()
    assert time.monotonic() - t0 < 3
    assert fields["daemon_state"] == "unresponsive" and problems == {}
    problems = judge(after_s=61)[1]
    assert set(problems) == {"ImexUnresponsive"} and problems["ImexUnresponsive"].severity == Severity.WARNING


def test_missing_tool_where_the_host_service_is_set_up(engine):
    judge = Judge("gb200-nvl72-4", engine)
    judge.node.read(lambda state: setattr(state, "imex_installed", False))
    fields, problems = judge()
    assert fields["daemon_state"] == "not_installed" and fields["ctl_missing"] is True
    assert set(problems) == {"ImexCtlMissing"}


def test_kubernetes_intent_from_the_compute_domain_label(engine, tmp_path):
    scenario = tmp_path / "cd.yaml"
    scenario.write_text("extends: gb200-nvl72-4\nimex: {managed_by: compute_domain}\n"
                        "faults: [{at: 0, kind: imex_down}]\n")
    labelled = Judge(str(scenario), engine, labels={COMPUTE_DOMAIN_LABEL: "7f3a9e2c-0d4b-4c1e-9a53-2b8e6f01d7c4"})
    fields, problems = labelled()
    assert fields["imex_expected"] is True and "ComputeDomain 7f3a9e2c" in fields["expected_why"]
    assert "ImexDaemonDown" in problems
    # The same node without the label: its host unit is disabled and no ComputeDomain runs here: nothing.
    fields, problems = Judge(str(scenario), engine, labels={})()
    assert fields["imex_expected"] is False and problems == {}


def test_expected_setting_overrides(engine):
    fields, problems = Judge("gb200-nvl72-4-imex-down", engine, expected="false")()
    assert fields["imex_expected"] is False and problems == {}
    with pytest.raises(ValueError, match="expected must be auto, true or false"):
        ImexCheck({"expected": "maybe"})


def test_acceptance_scenarios(registry):
    assert diagnose_scenario("gb200-nvl72-4", registry).problems == []
    assert diagnose_scenario("gb200-nvl72-4-imex-unconfigured", registry).problems == []
    down = diagnose_scenario("gb200-nvl72-4-imex-down", registry)
    assert [(p.type, p.reason) for p in down.problems] == [("GpuImexUnhealthy", "ImexDaemonDown")]
