"""The node check: when the node (not one GPU) needs remediation, remediation loops over the boot history,
and flaky GPUs over their incident history, each kept in the state directory across daemon restarts and
reboots, bounded, and surviving a corrupt file. Driven through the node agent on fake nodes, the way the
daemon runs: one agent per boot, as a reboot restarts the daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import builtin_rules, Clock
from detector.agent.agent import AgentSettings, NodeAgent
from detector.agent.metrics import AgentMetrics
from detector.checks.node import NodeStateCheck, span
from detector.checks.node.history import HISTORY_FILE, MAX_BOOTS, History, read_history
from detector.cli.main import main
from detector.rules.sources import builtin_rules_dir
from detector.config import build_checks
from detector.rules.loader import RuleErrors, load_rules
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario

HOUR, DAY = 3600.0, 86400.0
DEFAULT_CHECKS = ["visibility", "xid", "node"]


@pytest.fixture
def rules(registry):
    return builtin_rules()


class Boots:
    """A fake node whose every boot gets a fresh agent over one state directory, as a daemon would."""

    def __init__(self, registry, rules, state_dir: Path | None, scenario: str = "h100-sxm-8",
                 checks: list[str] = DEFAULT_CHECKS, settings: dict | None = None):
        self.clock = Clock(1_764_000_000.0)                  # 2025-11-24T16:00Z
        self.node = load_scenario(scenario).build(clock=self.clock)
        self.registry, self.rules, self.state_dir = registry, rules, state_dir
        self.names, self.settings = checks, settings or {}
        self.agent = self._start()

    def _start(self) -> NodeAgent:
        checks = build_checks(self.registry, self.names, self.settings)
        return NodeAgent(fake_host(self.node, threaded=False), checks, self.rules,
                         settings=AgentSettings(start_spread_s=0.0, state_dir=self.state_dir), clock=self.clock)

    def sweep(self) -> dict[str, tuple[bool, str, str]]:
        self.agent.run(self.agent.checks)
        return {s.type: (s.active, s.reason, s.message) for s in self.agent.conditions()}

    def fail(self, *gpus: int, code: int = 79) -> dict[str, tuple[bool, str, str]]:
        for gpu in gpus:
            self.node.inject(Fault("xid", gpu, {"code": code}))
        return self.sweep()

    def reboot(self, after_s: float = HOUR) -> None:
        self.clock.now += after_s
        self.node.inject(Fault("reboot"))
        self.agent = self._start()


def test_one_failed_gpu_of_eight_is_fenced_and_the_node_is_not_asked_for(registry, rules):
    boots = Boots(registry, rules, None)
    conditions = boots.fail(3)
    assert conditions["GpuXidError"][0]
    assert conditions["GpuNodeNeedsRemediation"][:2] == (False, "NoGpuNodeNeedsRemediation")
    failed = [h for h in boots.agent.gpu_health() if h.state == "failed"]
    assert [h.gpu.index for h in failed] == [3]


def test_two_failed_gpus_ask_for_the_node_naming_them(registry, rules):
    conditions = Boots(registry, rules, None).fail(3, 5)
    active, reason, message = conditions["GpuNodeNeedsRemediation"]
    assert (active, reason) == (True, "GpusFailed")
    assert message.startswith("2 of 8 GPUs failed with a problem a reboot may cure (GPU 3 (") and "GPU 5 (" in message
    assert "Xid79GpuFellOffBus" in message and message.endswith("Recommended action: RESTART_BM "
                                                                  "(drain the node and reboot it; power-cycle it "
                                                                  "if the GPU does not come back).")


def test_gpus_to_replace_are_fenced_not_rebooted_for(registry, rules):
    """Two GPUs whose row remapping failed need replacing (CONTACT_SUPPORT): a reboot cures neither, so
    the node is not asked for one (it would only loop); both GPUs are failed and fenced."""
    boots = Boots(registry, rules, None, checks=["memory", "node"])
    for gpu in (2, 6):
        boots.node.inject(Fault("remap_failure", gpu))
    conditions = boots.sweep()
    assert conditions["GpuMemoryError"][0]
    assert conditions["GpuNodeNeedsRemediation"][0] is False
    failed = {h.gpu.index: h.action for h in boots.agent.gpu_health() if h.state == "failed"}
    assert failed == {2: "CONTACT_SUPPORT", 6: "CONTACT_SUPPORT"}


def test_a_node_wide_problem_asks_for_the_node_with_its_own_action(registry, rules):
    boots = Boots(registry, rules, None, scenario="h100-sxm-8-no-driver", checks=["visibility", "driver", "node"])
    active, reason, message = boots.sweep()["GpuNodeNeedsRemediation"]
    assert (active, reason) == (True, "NodeWideProblem")
    assert "GpuDriverUnhealthy NvmlUnavailable" in message and "CHECK_DRIVER" in message


def test_a_node_wide_problem_no_reboot_cures_asks_nothing_of_the_node(registry, rules):
    boots = Boots(registry, rules, None, scenario="h100-sxm-8-ib-port-down", checks=["infiniband", "node"])
    conditions = boots.sweep()
    assert conditions["InfiniBandPortDown"][0]                      # critical, names no GPU: a cable
    assert conditions["GpuNodeNeedsRemediation"][0] is False


def test_a_rule_with_scope_node_asks_for_the_node_for_one_gpu(registry, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("version: 1\nrules:\n  - name: site-xid-79-is-the-node\n    check: xid\n"
                    "    when: kind == \"xid\" and code == 79\n    type: SiteGpuLost\n    reason: SiteGpuLost\n"
                    "    severity: critical\n    action: RESTART_BM\n    scope: node\n    message: lost\n")
    rules = load_rules([builtin_rules_dir(), site], registry.fields_by_check())
    assert next(r for r in rules.rules if r.name == "site-xid-79-is-the-node").scope == "node"
    active, reason, message = Boots(registry, rules, None).fail(3)["GpuNodeNeedsRemediation"]
    assert (active, reason) == (True, "NodeWideProblem") and "SiteGpuLost" in message


def test_a_bad_scope_is_refused_with_file_line_and_field(registry, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - name: r\n    check: xid\n    when: code == 79\n    type: T\n"
                   "    reason: R\n    severity: critical\n    action: RESTART_BM\n    scope: rack\n    message: m\n")
    with pytest.raises(RuleErrors) as e:
        load_rules([bad], registry.fields_by_check())
    assert str(e.value) == f"{bad}:10: field 'rules[0].scope': 'rack' is not one of: gpu, node"


# -- remediation loops -------------------------------------------------------------------------------

def test_three_reboots_in_a_day_with_xid_79_returning_is_a_remediation_loop(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, 5)
    for _ in range(2):
        boots.reboot()
        conditions = boots.fail(3, 5)
        assert not conditions["GpuRemediationLoop"][0]            # 1, then 2 reboots: not yet
        assert conditions["GpuNodeNeedsRemediation"][0]
    boots.reboot()
    conditions = boots.fail(3, 5)
    active, reason, message = conditions["GpuRemediationLoop"]
    assert (active, reason) == (True, "RemediationLoop")
    assert "GpuXidError Xid79GpuFellOffBus" in message and "after each of 3 reboots within 24h" in message
    assert message.count("2025-11-24T") + message.count("2025-11-25T") == 4        # the four boots' starts
    assert "Recommended action: INSPECT" in message
    assert conditions["GpuNodeNeedsRemediation"][0] is False                    # remediators stop by themselves


def test_three_reboots_with_no_returning_problem_is_no_loop(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, 5)
    boots.reboot()
    conditions = boots.sweep()                     # the reboot cured it: the ask holds until three rounds of
    assert conditions["GpuNodeNeedsRemediation"][0] is True                   # every check passed
    assert "after a reboot; verifying: 1 of 3 rounds" in conditions["GpuNodeNeedsRemediation"][2]
    boots.sweep()
    assert boots.sweep()["GpuNodeNeedsRemediation"][0] is False
    for _ in range(2):
        boots.reboot()
        conditions = boots.sweep()
    assert conditions["GpuRemediationLoop"][0] is False


def test_a_different_problem_each_boot_is_no_loop(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, 5, code=79)
    for code in (48, 79, 48):
        boots.reboot()
        conditions = boots.fail(1, code=code)
    assert conditions["GpuRemediationLoop"][0] is False


def test_reboots_spread_over_more_than_the_window_are_no_loop(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, 5)
    for _ in range(3):
        boots.reboot(after_s=13 * HOUR)            # reboots 13 h apart: only two fall within 24 h
        conditions = boots.fail(3, 5)
    assert conditions["GpuRemediationLoop"][0] is False
    assert boots.agent.node_checks[0].config["loop_window"] == DAY


def test_the_loop_settings_are_the_node_checks(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path, settings={"node": {"loop_reboots": 2}})
    boots.fail(3, 5)
    boots.reboot()
    boots.fail(3, 5)
    boots.reboot()
    assert boots.fail(3, 5)["GpuRemediationLoop"][0] is True


# -- flaky GPUs ----------------------------------------------------------------------------------------

def test_incidents_on_three_boots_in_thirty_days_make_the_gpu_flaky_by_serial(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    serial = boots.node.read(lambda state: state.gpus[3].serial)
    boots.fail(3, code=48)                          # a double-bit ECC error: reset-class
    boots.reboot(after_s=9 * DAY)
    conditions = boots.fail(3, code=48)
    assert conditions["GpuFlaky"][0] is False
    assert {h.gpu.index: h.incidents for h in boots.agent.gpu_health()}[3] == 2
    boots.reboot(after_s=9 * DAY)
    active, reason, message = boots.fail(3, code=48)["GpuFlaky"]
    assert (active, reason) == (True, "FlakyGpu")
    assert message.startswith("GPU 3 (") and f"): serial {serial}, incidents on 3 boots within 30d (2025-11-24T" in message
    assert "Xid48DoubleBitEccError" in message and "REPLACE_GPU" in message
    boots.reboot()                                  # the reboot cured the XID; the GPU stays suspect
    conditions = [boots.sweep() for _ in range(3)][-1]     # verified over three rounds of every check
    assert conditions["GpuFlaky"][0] and not conditions["GpuXidError"][0]
    health = {h.gpu.index: h for h in boots.agent.gpu_health()}
    assert (health[3].state, health[3].action, health[3].incidents) == ("degraded", "REPLACE_GPU", 3)
    assert not conditions["GpuNodeNeedsRemediation"][0]        # a flaky GPU is fenced, not rebooted for


def test_a_gpu_lost_while_the_daemon_was_away_is_kept_by_the_serial_read_in_this_boot(registry, rules, tmp_path):
    """NVML has no handle for a GPU off the bus, so no serial: a daemon restarted after GPU 3 fell (a
    rollout, an OOM kill) takes the serial it read at that bus id earlier in the same boot."""
    boots = Boots(registry, rules, tmp_path)
    gpu3 = boots.node.read(lambda state: state.gpus[3])
    boots.sweep()                                   # every GPU read once
    boots.node.inject(Fault("xid", 3, {"code": 79}))
    boots.agent = boots._start()                    # the same boot: a new daemon, nothing in its memory
    boots.sweep()
    [record] = read_history(tmp_path)[0].gpus.values()
    assert (record.key, record.serial, record.uuid, record.index) == (gpu3.serial, gpu3.serial, gpu3.uuid, 3)
    assert record.pci_bus_id.lower().endswith(gpu3.pci_bus_id.lower()[-12:])


def test_a_gpu_lost_with_no_serial_anywhere_is_kept_without_one_and_the_earlier_board_is_a_hint(
        registry, rules, tmp_path, capsys):
    """Lost before this boot's first read, and no `GPU Board Serial Number` line (only NVML's XID event): after
    a reboot the board at a bus id may be another one (the RMA itself swaps it), so the serial read there in
    an earlier boot is a hint in `history --rma`, never the lost GPU's serial."""
    boots = Boots(registry, rules, tmp_path)
    gpu3 = boots.node.read(lambda state: state.gpus[3])
    boots.sweep()
    boots.reboot()
    boots.node.inject(Fault("xid", 3, {"code": 79, "via": "nvml"}))   # lost before the new boot's first read
    boots.sweep()
    [record] = read_history(tmp_path)[0].gpus.values()
    assert record.serial is None and record.key in (record.uuid, record.pci_bus_id)
    assert main(["history", "--state-dir", str(tmp_path), "--rma", "-o", "json"]) == 0
    [gpu] = json.loads(capsys.readouterr().out)["gpus"]
    assert gpu["serial"] is None and gpu["last_read_at_bus_id"]["serial"] == gpu3.serial
    assert gpu["note"].startswith("serial unknown") and f"last read serial {gpu3.serial}" in gpu["note"]
    assert "unless it was replaced since" in gpu["note"]
    assert main(["history", "--state-dir", str(tmp_path), "--rma"]) == 0
    assert f"last read serial {gpu3.serial}" in capsys.readouterr().out


def test_a_gpu_lost_before_it_was_read_is_kept_by_the_serial_the_driver_printed(registry, rules, tmp_path):
    """The driver prints a GPU's UUID and board serial before its first Xid of the boot
    (`NVRM: GPU Board Serial Number: ...`): a GPU lost before gpu-npd ever read it is still kept by serial."""
    boots = Boots(registry, rules, tmp_path)
    gpu3 = boots.node.read(lambda state: state.gpus[3])
    boots.node.inject(Fault("xid", 3, {"code": 79}))     # before the daemon's first read, in a new state dir
    boots.sweep()
    [record] = read_history(tmp_path)[0].gpus.values()
    assert (record.key, record.serial, record.uuid) == (gpu3.serial, gpu3.serial, gpu3.uuid)


def test_a_failed_read_does_not_forget_the_serial_read_before():
    history = History(None)
    history.note_seen("0000:5d:00.0", "1650000000003", "GPU-3", "boot-1", 10.0)
    history.note_seen("0000:5d:00.0", None, "GPU-3", "boot-1", 20.0)    # the serial call failed this time
    assert history.seen_in_boot("0000:5d:00.0", "boot-1").serial == "1650000000003"
    assert history.seen_in_boot("0000:5d:00.0", "boot-2") is None
    history.note_seen("0000:5d:00.0", "1650000000099", "GPU-9", "boot-2", 30.0)   # another board, a new boot
    assert history.seen_in_boot("0000:5d:00.0", "boot-2").serial == "1650000000099"


def test_the_incident_count_is_a_per_gpu_metric(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    metrics = AgentMetrics()
    boots.agent.sinks.append(metrics)
    boots.fail(3, code=48)
    boots.reboot()
    boots.agent.sinks.append(metrics)
    boots.fail(3, code=48)
    samples = {s.labels["gpu"]: s.value for f in metrics.registry.collect() if f.name == "gpu_npd_gpu_incidents"
               for s in f.samples}
    assert len(samples) == 8 and samples["3"] == 2 and {v for g, v in samples.items() if g != "3"} == {0}


def test_incidents_older_than_the_window_age_out(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, code=48)
    boots.reboot(after_s=20 * DAY)
    boots.fail(3, code=48)
    boots.reboot(after_s=20 * DAY)                  # the first incident is now 40 days old
    assert boots.fail(3, code=48)["GpuFlaky"][0] is False


def test_warnings_and_application_errors_are_no_incidents(registry, rules, tmp_path):
    boots = Boots(registry, rules, tmp_path)
    for _ in range(3):
        boots.fail(3, code=13)                      # application error: RESTART_APP, an event
        boots.reboot()
    boots.sweep()
    assert read_history(tmp_path)[0].gpus == {}


def test_gpu_npd_history_prints_a_gpus_incidents(registry, rules, tmp_path, capsys):
    boots = Boots(registry, rules, tmp_path)
    serial = boots.node.read(lambda state: state.gpus[3].serial)
    boots.fail(3, code=48)
    boots.reboot()
    boots.fail(3, code=48)
    assert main(["history", "--state-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert serial in table and "Xid48DoubleBitEccError" in table and table.count("RESET_GPU") >= 2
    assert main(["history", "--state-dir", str(tmp_path), "--gpu", serial, "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [gpu] = data["gpus"]
    assert gpu["serial"] == serial and len(gpu["incidents"]) == 2 and len({i["boot"] for i in gpu["incidents"]}) == 2
    assert len(data["boots"]) == 2
    assert main(["history", "--state-dir", str(tmp_path), "--gpu", "NOPE"]) == 1
    assert "no GPU NOPE in" in capsys.readouterr().err
    assert main(["history", "--state-dir", str(tmp_path / "absent")]) == 2
    assert "absent: no such directory" in capsys.readouterr().err
    (tmp_path / HISTORY_FILE).write_text("{torn")
    assert main(["history", "--state-dir", str(tmp_path)]) == 2
    assert f"cannot read {tmp_path / HISTORY_FILE}" in capsys.readouterr().err
    assert (tmp_path / HISTORY_FILE).read_text() == "{torn"                  # reading never moves it


# -- the state file ------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99}), json.dumps({"version": 1})])
def test_a_corrupt_history_is_reported_set_aside_and_the_daemon_runs(registry, rules, tmp_path, content):
    (tmp_path / HISTORY_FILE).write_text(content)
    boots = Boots(registry, rules, tmp_path)
    conditions = boots.fail(3, code=48)
    assert conditions["GpuXidError"][0]                            # the checks ran
    check = boots.agent.node_checks[0]
    assert len(check.warnings) == 1 and "cannot read the GPU history" in check.warnings[0]
    [aside] = list(tmp_path.glob(f"{HISTORY_FILE}.unreadable-*"))
    assert aside.read_text() == content                            # the evidence is kept
    history, warning = read_history(tmp_path)                      # and a new history is written
    assert warning is None and len(history.boots) == 1 and len(history.gpus) == 1


def test_an_unwritable_state_dir_costs_the_history_not_the_daemon(registry, rules, tmp_path):
    (tmp_path / HISTORY_FILE).mkdir()                              # a directory where the file should be
    boots = Boots(registry, rules, tmp_path)
    assert boots.fail(3, 5)["GpuNodeNeedsRemediation"][0]


def test_the_history_is_bounded():
    history = History(None, retention_s=30 * DAY)
    now = 1_764_000_000.0
    for n in range(MAX_BOOTS + 50):
        history.note_problem(f"boot-{n}", "GpuXidError/Xid79GpuFellOffBus", now - 20 * DAY + n * 60)
    history.prune(now)
    assert len(history.boots) == MAX_BOOTS and history.boots[-1].boot == f"boot-{MAX_BOOTS + 49}"
    history.prune(now + 11 * DAY)
    assert history.boots == []


def test_window_text():
    assert [span(s) for s in (DAY, 30 * DAY, 2 * HOUR, 90 * 60, 45)] == ["24h", "30d", "2h", "90m", "45s"]
    assert NodeStateCheck().config["flaky_window"] == 30 * DAY
