"""The xid check end to end: kernel log and NVML events, deduplication, floods, escalation, reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from conftest import builtin_rules, REPO, diagnose_host, node_for
from detector.checks.xid import XidCheck
from detector.core.sweep import run_sweep
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.node import FakeNode, TimedFault

XID79_KERNEL = Fault("xid", 3, {"code": 79, "via": "kernel"})


def uuid_of(node: FakeNode, index: int) -> str:
    return node.snapshot().gpus[index].uuid


def test_xid79_from_the_kernel_log_is_one_critical_problem_naming_gpu_uuid_bus_and_action(registry):
    node = node_for("h100-sxm-8")
    node.inject(XID79_KERNEL)
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    [problem] = out.problems
    assert problem.rule == "xid-79" and problem.report == "condition" and problem.severity.value == "critical"
    [gpu] = problem.gpus
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (3, uuid_of(node, 3), "0000:5d:00.0")
    assert problem.action == "RESTART_BM"
    assert uuid_of(node, 3) in problem.message and "0000:5d:00.0" in problem.message
    assert "Recommended action: RESTART_BM" in problem.message


def test_xid79_from_an_nvml_event_alone_is_the_same_problem(registry):
    state = node_for("h100-sxm-8").snapshot()
    # NVML delivers only events after the listener registered (as the real one does): the XID comes a
    # second in, well after registration even on a loaded machine, and well inside the 3 s listen.
    node = FakeNode(state, [TimedFault(1.0, Fault("xid", 3, {"code": 79, "via": "nvml"}))])
    out = diagnose_host(fake_host(node), registry, checks=["xid"], settings={"xid": {"listen_s": 3.0}})
    assert node.kernel_records()[-1].message.startswith("NVRM: GPU at")      # nothing in the kernel log
    [problem] = out.problems
    assert problem.rule == "xid-79"
    [gpu] = problem.gpus
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (3, state.gpus[3].uuid, "0000:5d:00.0")
    run = out.sweep.runs[0]
    assert run.result["nvml_events"] == 1
    [obs] = run.observations
    assert obs.fields["source"] == "nvml"


def test_one_xid_seen_by_both_sources_counts_once(registry):
    state = node_for("h100-sxm-8").snapshot()
    node = FakeNode(state, [TimedFault(1.0, Fault("xid", 5, {"code": 48}))])     # kernel line and event
    host = fake_host(node)
    check = XidCheck({"listen_s": 3.0})
    sweep = run_sweep(host, [check])
    [obs] = sweep.runs[0].observations
    assert obs.fields["code"] == 48 and obs.fields["count"] == 1
    assert obs.fields["source"] == "both"
    assert [e["code"] for e in sweep.runs[0].result["kernel_events"]] == [48]


def test_the_other_source_arriving_a_run_later_is_not_counted_again(registry):
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    check = XidCheck()
    assert run_sweep(host, [check]).runs[0].observations == []          # registers for NVML events
    node.inject(Fault("xid", 5, {"code": 48, "via": "nvml"}))
    [first] = run_sweep(host, [check]).runs[0].observations
    assert first.fields["source"] == "nvml"
    node.inject(Fault("kernel_line", None, {"message": "NVRM: Xid (PCI:0000:ab:00): 48, pid=1, name=x, DBE"}))
    later = run_sweep(host, [check]).runs[0]
    assert later.observations == []                                     # the same XID, already counted
    assert [e["code"] for e in later.result["kernel_events"]] == [48]   # but still listed


def test_a_restarted_check_on_the_same_stream_reports_nothing_twice(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("xid", 1, {"code": 13}))
    host = fake_host(node)
    check = XidCheck()
    first = run_sweep(host, [check]).runs[0]
    assert [o.fields["code"] for o in first.observations] == [13]
    assert run_sweep(host, [check]).runs[0].observations == []          # nothing new
    node.inject(Fault("xid", 2, {"code": 31}))
    third = run_sweep(host, [check]).runs[0]
    assert [(o.fields["code"], o.gpu.index) for o in third.observations] == [(31, 2)]


def test_user_space_lines_in_kmsg_are_not_xids(registry):
    from fake_nvml.kmsg import FakeKmsgDevice
    node = node_for("h100-sxm-8")
    FakeKmsgDevice(node).write("NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus.")   # echo > /dev/kmsg
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    assert out.problems == []


def _log(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _kern(lines: list[str]) -> str:
    """`dmesg -x`: each line with the kernel's facility, so its XIDs are proven kernel lines."""
    return _log([f"kern  :err   : {line}" for line in lines])


def test_saved_log_post_mortem_lists_every_xid_line_in_input_order(tmp_path, registry):
    log = tmp_path / "kern.log"
    log.write_text(_kern([
        "[    5.000000] NVRM: GPU at PCI:0000:5d:00: GPU-11111111-2222-3333-4444-555555555555",
        "[   10.000000] eth0: link up",
        "[   11.000000] NVRM: Xid (PCI:0000:5d:00): 13, pid=4242, name=python3, Graphics Exception",
        "[   12.000000] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        "[   13.000000] NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "[   14.000000] NVRM: Xid (PCI:0000:18:00): 999, something new",
    ]))
    proc = subprocess.run([sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", "fake:h100-sxm-8",
                           "--checks", "xid", "--kernel-log", str(log), "-o", "json"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    xid = report["checks"][0]
    events = xid["result"]["kernel_events"]
    assert [(e["kind"], e["code"], e["line"]) for e in events] == [
        ("xid", 13, 3), ("sxid", 20034, 4), ("xid", 79, 5), ("xid", 999, 6)]
    assert events[0]["pid"] == 4242 and events[0]["process_name"] == "python3"
    assert events[0]["pci_bus_id"] == "0000:5d:00.0" and events[0]["gpu"]["index"] == 3
    rules = {p["rule"]: p for p in report["problems"]}
    assert set(rules) == {"xid-13", "sxid-fatal", "xid-79", "xid-unknown"}
    assert rules["xid-13"]["report"] == "event" and rules["xid-79"]["report"] == "condition"
    assert "999" in rules["xid-unknown"]["message"] and "something new" in rules["xid-unknown"]["message"]


def test_stdin_post_mortem(registry):
    line = "Oct  6 17:59:27 host kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, name=x, DBE\n"
    proc = subprocess.run([sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", "fake:h100-sxm-8",
                           "--checks", "xid", "--kernel-log", "-", "-o", "json"], input=line,
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    report = json.loads(proc.stdout)
    assert [(p["rule"], p["gpus"]) for p in report["problems"]] == [("xid-48", [1])]


def test_a_flood_of_identical_lines_is_one_observation_and_a_few_problems(tmp_path, registry):
    flood = "kern  :err   : [ 100.000000] NVRM: Xid (PCI:0000:5d:00): 95, pid=7, name=python3, Uncontained: FBHUB. RST: Yes\n"
    path = tmp_path / "flood.log"
    with path.open("w") as f:
        for i in range(50):
            f.write("[  99.000000] noise line of some driver\n" * 100)
            f.write(flood * 4000)
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path), "max_kernel_events": 100}})
    run = out.sweep.runs[0]
    [obs] = run.observations
    assert obs.fields["count"] == 200_000 and obs.fields["line"] == 101
    assert len(run.result["kernel_events"]) == 100 and run.result["kernel_events_omitted"] == 199_900
    assert obs.fields["incidents"] == 1             # one incident, however many lines it printed
    assert out.rules() == {"xid-95"}


def test_application_xids_from_three_applications_escalate(tmp_path, registry):
    faults = ["[ 10.0] NVRM: Xid (PCI:0000:9a:00): 13, pid=1, name=a, Graphics Exception",
              "[ 20.0] NVRM: Xid (PCI:0000:9a:00): 31, pid=2, name=b, MMU Fault",
              "[ 30.0] NVRM: Xid (PCI:0000:9a:00): 13, pid=3, name=a, Graphics Exception",
              "[ 40.0] NVRM: Xid (PCI:0000:2a:00): 13, pid=4, name=c, Graphics Exception"]   # another GPU
    path = tmp_path / "k.log"
    path.write_text(_kern(faults))
    settings = {"xid": {"kernel_log_file": str(path)}}
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"], settings=settings)
    assert out.rules() == {"xid-13", "xid-31"}            # two applications on GPU 4: theirs to fix
    assert [o.fields["applications"] for o in out.sweep.runs[0].observations] == [1, 2, 2, 1]
    path.write_text(_kern([*faults, "[ 50.0] NVRM: Xid (PCI:0000:9a:00): 31, pid=5, name=c, MMU Fault"]))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"], settings=settings)
    assert out.rules() == {"xid-13", "xid-31", "xid-application-errors-repeated"}
    esc = out.by_rule()["xid-application-errors-repeated"]
    assert [g.index for g in esc.gpus] == [4] and esc.action == "INSPECT" and esc.report == "condition"
    # A shorter window keeps them apart.
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {**settings["xid"], "application_window_s": 15.0}})
    assert out.rules() == {"xid-13", "xid-31"}


def test_a_fatal_xid_recurring_after_a_reboot_escalates(tmp_path, registry):
    path = tmp_path / "k.log"
    path.write_text(_kern([
        "[ 500.0] NVRM: Xid (PCI:0000:ab:00): 48, pid=1, name=a, DBE",
        "[   0.0] Linux version 6.8.0 (builder@host) #1 SMP",
        "[ 300.0] NVRM: Xid (PCI:0000:ab:00): 48, pid=1, name=a, DBE",
    ]))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path)}})
    boots = {o.fields["boot"] for o in out.sweep.runs[0].observations}
    assert len(boots) == 2
    assert "xid-48-recurring-after-reboot" in out.rules()
    assert out.by_rule()["xid-48-recurring-after-reboot"].action == "CONTACT_SUPPORT"


def test_xid_154_takes_its_action_from_the_line(tmp_path, registry):
    path = tmp_path / "k.log"
    path.write_text(_log(["kernel: NVRM: Xid (PCI:0000:db:00): 154, GPU recovery action changed from 0x0 (None) to "
                          "0x2 (Node Reboot Required)"]))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path)}})
    [problem] = out.problems
    assert problem.rule == "xid-154" and problem.action == "RESTART_BM" and problem.gpus[0].index == 7


def test_unreadable_saved_log_is_a_check_error_not_a_crash(tmp_path, registry):
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(tmp_path / "missing.log")}})
    assert out.sweep.runs[0].status == "error"
    assert "cannot read kernel log" in out.sweep.runs[0].error
    assert out.rules() == {"check-failed"}


def test_cli_refuses_a_missing_kernel_log_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", "fake:h100-sxm-8",
                           "--kernel-log", str(tmp_path / "nope.log")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "no such file" in proc.stderr


class _LogFileLines:
    """A live reader of a log file: lines with their wrapper, no facility (as LogFileReader gives them)."""

    name = "kern.log"

    def __init__(self, texts: list[str]):
        from detector.backends.kernlog.records import LogLine
        self._lines = [LogLine(t, lineno=i) for i, t in enumerate(texts, 1)]

    def read_available(self):
        lines, self._lines = self._lines, []
        return lines


def test_live_log_file_counts_only_lines_the_kernel_provably_wrote(registry):
    """Live, user space can write to syslog: only a `kernel:` tag (or a kmsg/journald facility) counts.
    The same lines in a saved log would all count, the first marked unverified."""
    host = fake_host(node_for("h100-sxm-8"))
    host.kernel_log = _LogFileLines([
        "Oct  6 17:59:27 gpu-node-7 myapp[42]: NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:2a:00): 48, pid=1, name=x, DBE",
        "Oct  6 17:59:28 gpu-node-7 kernel: NVRM: Xid (PCI:0000:9a:00): 13, pid=1, name=x, Graphics Exception",
    ])
    out = diagnose_host(host, registry, checks=["xid"], settings={"xid": {"nvml_events": False}})
    assert [(o.fields["code"], o.gpu.index, o.fields["origin"]) for o in out.sweep.runs[0].observations] == [
        (13, 4, "kernel")]


def test_live_kmsg_events_are_marked_kernel(registry):
    node = node_for("h100-sxm-8")
    node.inject(XID79_KERNEL)
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    [obs] = out.sweep.runs[0].observations
    assert obs.fields["origin"] == "kernel" and obs.fields["incidents"] == 1


def test_an_xid_after_a_quick_reboot_is_a_new_one_not_a_duplicate_of_the_last_boots(registry):
    """The kernel line and the NVML event of one XID count once (within dedupe_window_s), but never across
    a reboot: a fake node the simulator reboots under a running agent, with the same XID 79 back within
    seconds, must show it again in every boot (it did not: only the first boot's was reported)."""
    from detector.agent.agent import AgentSettings, NodeAgent
    from detector.config import build_checks

    node = node_for("h100-sxm-8")
    checks = build_checks(registry, ["visibility", "xid"], {})
    agent = NodeAgent(fake_host(node, threaded=False), checks,
                      builtin_rules(),
                      settings=AgentSettings(start_spread_s=0.0))
    agent.run(agent.checks)
    for boot in range(3):
        node.inject(Fault("xid", 3, {"code": 79}))
        node.inject(Fault("xid", 5, {"code": 79}))
        [xid79] = [p for p in agent.run(agent.checks) if p.rule == "xid-79"]
        assert sorted(g.index for g in xid79.gpus) == [3, 5], boot
        assert xid79.occurrences == 2, boot           # kernel line and NVML event: still once per GPU
        node.inject(Fault("reboot"))
        agent.run(agent.checks)


class _ArrivingLines:
    """A live kmsg reader whose lines arrive in the batches given: `wait` says when more have come."""

    name = "kmsg"

    def __init__(self, batches: list[list[str]]):
        from detector.backends.kernlog.records import LogLine
        self._batches = [[LogLine(t, priority=4, realtime=time.time()) for t in b] for b in batches]
        self.waits = 0

    def read_available(self):
        return self._batches.pop(0) if self._batches else []

    def wait(self, timeout_s: float) -> bool:
        self.waits += 1
        return bool(self._batches)


# A real H100's XID 13 (driver 580.159.04, tests/fixtures/real_logs/h100-vm-580-gpucheck-2/dmesg.txt): the
# process is named on the third line only, 3.1 ms after the first.
XID13_THREE_LINES = [
    "NVRM: Xid (PCI:0000:00:06): 13, Graphics SM Warp Exception on (GPC 1, TPC 4, SM 0): Illegal Instruction "
    "Parameter",
    "NVRM: Xid (PCI:0000:00:06): 13, Graphics Exception: ESR 0x519730=0xb 0x519734=0x0 0x519728=0x1f81fb60 "
    "0x51972c=0x1174",
    "NVRM: Xid (PCI:0000:00:06): 13, pid=656, name=python3, Graphics Exception: channel 0x0000000a, Class 0000cbc0, "
    "Offset 00000510, Data 0017e2ac",
]


def test_a_read_that_ends_before_an_xid13_names_its_process_waits_for_that_line(registry):
    """Live, the daemon read a real H100's first two XID 13 lines before the driver printed the third: one
    fault became an event naming no process and a second naming it. The check now waits (briefly) for the
    process line, so the fault is one incident naming pid 656."""
    host = fake_host(node_for("h100-sxm-8"))
    host.kernel_log = reader = _ArrivingLines([XID13_THREE_LINES[:2], XID13_THREE_LINES[2:]])
    out = diagnose_host(host, registry, checks=["xid"], settings={"xid": {"nvml_events": False}})
    obs = out.sweep.runs[0].observations
    assert [(o.fields["code"], o.fields["pid"], o.fields["process_name"], o.fields["count"]) for o in obs] == [
        (13, 656, "python3", 3)]
    assert [p.rule for p in out.problems] == ["xid-13"] and "pid 656" in out.problems[0].message
    assert reader.waits == 1


def test_an_xid13_that_never_names_a_process_is_reported_after_the_short_wait(registry):
    """Older drivers print XID 13 with no pid at all: waiting ends (at once here: nothing more arrives) and
    the fault is still one event, naming no process."""
    host = fake_host(node_for("h100-sxm-8"))
    host.kernel_log = reader = _ArrivingLines([XID13_THREE_LINES[:1]])
    out = diagnose_host(host, registry, checks=["xid"], settings={"xid": {"nvml_events": False}})
    assert [(o.fields["code"], o.fields["pid"]) for o in out.sweep.runs[0].observations] == [(13, None)]
    assert reader.waits == 1


def test_a_complete_fault_is_not_waited_for(registry):
    host = fake_host(node_for("h100-sxm-8"))
    host.kernel_log = reader = _ArrivingLines([XID13_THREE_LINES])
    out = diagnose_host(host, registry, checks=["xid"], settings={"xid": {"nvml_events": False}})
    assert [o.fields["pid"] for o in out.sweep.runs[0].observations] == [656]
    assert reader.waits == 0


def test_a_line_that_says_the_process_is_unknown_is_not_waited_on(registry):
    """`pid='<unknown>', name=<unknown>` is the driver saying who it was (nobody it knows): nothing more comes."""
    host = fake_host(node_for("h100-sxm-8"))
    host.kernel_log = reader = _ArrivingLines([[
        "NVRM: Xid (PCI:0000:00:06): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ChID 0010"]])
    out = diagnose_host(host, registry, checks=["xid"], settings={"xid": {"nvml_events": False}})
    assert [(o.fields["code"], o.fields["pid"]) for o in out.sweep.runs[0].observations] == [(13, None)]
    assert reader.waits == 0
