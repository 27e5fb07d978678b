"""A real, healthy H100 (driver 580.159.04) whose users' programs faulted: every fault is an event about
its application, none is a verdict on the GPU, and a line user space forged is never an XID.

The logs are in tests/fixtures/real_logs/h100-vm-580/ (see its README). Saved logs are replayed through
`diagnose --kernel-log`; the live path (kmsg lines plus NVML's XID events, as the real machine delivered
them) through the fake node with the same lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import builtin_rules, diagnose_host, node_for
from detector.checks.xid import XidCheck
from detector.cli.main import main
from detector.core.sweep import run_sweep
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host

HERE = Path(__file__).parent / "fixtures" / "real_logs" / "h100-vm-580"
BUS = "0000:00:06.0"
SECOND_BOOT = {(13, 571), (13, 599), (31, 682), (13, 764)}


def diagnose_json(capsys, name: str) -> tuple[int, dict]:
    code = main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "--checks", "xid", "-o", "json",
                 "--kernel-log", str(HERE / name)])
    return code, json.loads(capsys.readouterr().out)


def observations(name: str, registry) -> list:
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(HERE / name)}})
    return [o for o in out.sweep.runs[0].observations if o.fields["origin"] != "unverified"
            or o.fields["code"] != 79]


def faults(obs: list) -> set[tuple[int, int]]:
    return {(o.fields["code"], o.fields["pid"]) for o in obs}


def test_dmesg_x_application_faults_are_events_naming_their_process(capsys, registry):
    code, report = diagnose_json(capsys, "dmesg-x-2.txt")
    result = report["checks"][0]["result"]
    # Every fault is an event; nothing sets a condition or asks for a reset.
    assert {p["rule"] for p in report["problems"]} == {"xid-13", "xid-31"}
    assert all(p["report"] == "event" and p["action"] == "RESTART_APP" for p in report["problems"])
    # One event per process, each naming its own: pid 599's fault, 4.8 s after pid 571's, is its own.
    xid13 = [p["message"] for p in report["problems"] if p["rule"] == "xid-13"]
    assert len(xid13) == 3
    for pid, message in zip((571, 599, 764), xid13):
        assert f"(process python3, pid {pid})" in message and message.count("pid ") == 1
    assert "Misaligned Address" in xid13[1]
    xid31 = next(p for p in report["problems"] if p["rule"] == "xid-31")["message"]
    assert "(process python3, pid 682)" in xid31
    # The forged XID 79 (facility `user`) is no event: listed as ignored, with its count.
    assert result["ignored_events"] == 1
    assert result["ignored"] == [{"kind": "xid", "code": 79, "line": 347, "file": str(HERE / "dmesg-x-2.txt"),
                                  "message": "GPU has fallen off the bus."}]
    assert 79 not in {e["code"] for e in result["kernel_events"]}
    assert result["incidents"] == 4 and len(result["kernel_events"]) == 10
    assert code == 1                                     # problems were found: the four events
    main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q", "--checks", "xid", "--kernel-log",
          str(HERE / "dmesg-x-2.txt")])
    assert "ignored: 1 line(s) written by user space" in capsys.readouterr().out


def test_each_fault_is_one_incident_with_the_pid_of_whichever_line_had_it(registry):
    obs = observations("dmesg-x-2.txt", registry)
    assert [(o.fields["code"], o.fields["pid"], o.fields["process_name"], o.fields["count"], o.fields["line"])
            for o in obs] == [(13, 571, "python3", 3, 337), (13, 599, "python3", 3, 340),
                              (31, 682, "python3", 1, 343), (13, 764, "python3", 3, 344)]
    # The message is the first line's (what went wrong), the process the third line's.
    assert obs[0].fields["message"].endswith("Illegal Instruction Parameter")
    assert all(o.fields["incidents"] == 1 and o.gpu.pci_bus_id == BUS for o in obs)
    # Four faults, one application: no evidence against the GPU.
    assert [o.fields["applications"] for o in obs] == [1, 1, 1, 1]


@pytest.mark.parametrize("name", ["dmesg-2.txt", "dmesg-T-2.txt"])
def test_plain_dmesg_gives_the_same_events_and_the_forged_line_unverified(capsys, registry, name):
    code, report = diagnose_json(capsys, name)
    result = report["checks"][0]["result"]
    assert {p["rule"] for p in report["problems"]} == {"xid-13", "xid-31", "xid-unverified-origin"}
    assert all(p["report"] == "event" for p in report["problems"])      # no condition-level problem
    [forged] = [p for p in report["problems"] if p["rule"] == "xid-unverified-origin"]
    assert "79" in forged["message"] and forged["severity"] == "warning" and forged["action"] == "INSPECT"
    [x79] = [e for e in result["kernel_events"] if e["code"] == 79]
    assert x79["origin"] == "unverified" and x79["line"] == 347
    assert result["unverified_events"] == 11 and result["ignored_events"] == 0
    assert faults(observations(name, registry)) == SECOND_BOOT


def test_first_boot_replays_31_and_43_with_their_processes(capsys, registry):
    code, report = diagnose_json(capsys, "dmesg-1.txt")
    assert {p["rule"] for p in report["problems"]} == {"xid-31", "xid-43", "xid-unverified-origin"}
    assert all(p["report"] == "event" for p in report["problems"])
    messages = {p["rule"]: p["message"] for p in report["problems"]}
    assert "(process python3, pid 937)" in messages["xid-31"]
    assert "(process python3, pid 968)" in messages["xid-43"]
    assert faults(observations("dmesg-1.txt", registry)) == {(31, 937), (43, 968)}


def test_the_old_daemons_events_show_what_went_wrong():
    """The evidence the fixes answer: XID 13 without its process, and a reset asked for users' bugs."""
    events = json.loads((HERE / "events-at-cdcc1b8.json").read_text())
    by_reason = {e["reason"]: e["message"] for e in events}
    assert "process none, pid unknown" in by_reason["Xid13GraphicsEngineException"]
    assert "RESET_GPU" in by_reason["XidApplicationErrorsRepeated"]


# --- The live path: kmsg lines and NVML's XID events, in the order the real machine delivered them ------

def _nvml_timeline() -> tuple[list[str], list[str]]:
    """The XID 31 and XID 13 faults' kernel lines from nvml-answers.txt, split per fault."""
    lines = [line for line in (HERE / "nvml-answers.txt").read_text().splitlines() if "NVRM: Xid" in line]
    messages = [line.split("] ", 1)[1] for line in lines]
    return [m for m in messages if "): 31," in m], [m for m in messages if "): 13," in m]


def _on_gpu(message: str, bus: str) -> str:
    """The real line, with the fake node's GPU in place of the VM's 0000:00:06."""
    return re.sub(r"\(PCI:0000:00:06\)", f"(PCI:{bus[:-2]})", message)


def test_live_kmsg_and_nvml_give_one_incident_per_fault_with_its_process(registry):
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    gpu = node.snapshot().gpus[3]
    check = XidCheck()
    try:
        assert run_sweep(host, [check]).runs[0].observations == []        # registers for NVML events
        xid31, xid13 = _nvml_timeline()
        # XID 31: the kernel line first, NVML's event about 2 s later (the next run).
        for m in xid31:
            node.inject(Fault("kernel_line", None, {"message": _on_gpu(m, gpu.pci_bus_id)}))
        [o31] = run_sweep(host, [check]).runs[0].observations
        assert (o31.fields["code"], o31.fields["pid"], o31.fields["process_name"]) == (31, 509, "python3")
        node.inject(Fault("xid", 3, {"code": 31, "via": "nvml"}))
        assert run_sweep(host, [check]).runs[0].observations == []        # the same fault: counted once
        # XID 13: three kernel lines and one NVML event in the same run.
        for m in xid13:
            node.inject(Fault("kernel_line", None, {"message": _on_gpu(m, gpu.pci_bus_id)}))
        node.inject(Fault("xid", 3, {"code": 13, "via": "nvml"}))
        [o13] = run_sweep(host, [check]).runs[0].observations
        assert (o13.fields["code"], o13.fields["pid"], o13.fields["process_name"], o13.fields["count"]) == \
               (13, 536, "python3", 3)
        assert o13.fields["source"] == "both" and o13.fields["incidents"] == 1
        assert o13.fields["message"].endswith("Illegal Instruction Parameter") and o13.gpu.index == 3
    finally:
        host.close()


def test_live_two_processes_faulting_close_together_are_two_incidents(registry):
    """dmesg-2.txt's pids 571 and 599, 4.8 s apart, read in one run with NVML's two events."""
    node = node_for("h100-sxm-8")
    host = fake_host(node)
    gpu = node.snapshot().gpus[3]
    check = XidCheck()
    try:
        run_sweep(host, [check])
        lines = [line.split("] ", 1)[1] for line in (HERE / "dmesg-2.txt").read_text().splitlines()[336:342]]
        assert all(": 13, " in line for line in lines)
        for m in lines:
            node.inject(Fault("kernel_line", None, {"message": _on_gpu(m, gpu.pci_bus_id)}))
        node.inject(Fault("xid", 3, {"code": 13, "via": "nvml"}))
        node.inject(Fault("xid", 3, {"code": 13, "via": "nvml"}))
        obs = run_sweep(host, [check]).runs[0].observations
        assert [(o.fields["pid"], o.fields["source"], o.fields["incidents"]) for o in obs] == \
               [(571, "both", 1), (599, "both", 1)]
        # Read in one sweep, they are still two events (one Problem each), not one naming both.
        engine = RuleEngine(builtin_rules())
        events = [p for p in engine.evaluate(obs) if p.rule == "xid-13"]
        assert [("pid 571" in p.message, "pid 599" in p.message) for p in events] == [(True, False), (False, True)]
    finally:
        host.close()


def test_an_events_count_is_faults_not_the_lines_a_fault_printed(registry):
    """Three XID 13 faults print nine lines: the events count three faults (one each), not nine."""
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(HERE / "dmesg-x-2.txt")}})
    assert [(p.rule, p.occurrences) for p in out.problems] == [("xid-13", 1)] * 3 + [("xid-31", 1)]
    assert [o.fields["faults"] for o in out.sweep.runs[0].observations if o.fields["code"] == 13] == [1, 1, 1]


GPU_CHECK_RUNS = {"h100-vm-580-gpucheck": (643, 673, 696, 719),      # the last two XID 13 0.9 s apart
                  "h100-vm-580-gpucheck-2": (600, 632, 656, 679)}    # another VM and GPU: 1.3 s apart


@pytest.mark.parametrize("run", sorted(GPU_CHECK_RUNS))
@pytest.mark.parametrize("name", ["dmesg.txt", "dmesg-x.txt"])
def test_the_gpu_check_machines_four_faults_are_four_incidents(run, name, registry):
    """`make gpu-check` on real H100 VMs (tests/fixtures/real_logs/h100-vm-580-gpucheck*): XID 31, 43 and
    two XID 13 from four processes; four events, each naming its process."""
    log = HERE.parent / run / name
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(log)}})
    obs = out.sweep.runs[0].observations
    pids = GPU_CHECK_RUNS[run]
    assert [(o.fields["code"], o.fields["pid"], o.fields["process_name"]) for o in obs] == [
        (31, pids[0], "python3"), (43, pids[1], "python3"), (13, pids[2], "python3"), (13, pids[3], "python3")]
    assert all(p.report == "event" for p in out.problems)           # about applications: no condition
    assert [(p.rule, p.occurrences) for p in out.problems if p.rule == "xid-13"] == [("xid-13", 1)] * 2
