"""State files someone else planted or broke (issue 30, findings 11 and 12): gpu-npd runs as root and keeps
its state in a hostPath directory that another pod may write. A planted link is never written through, a
FIFO never hangs a read, a huge file is refused before it is read, a file of the wrong shape is one
warning and fresh state, and a kernel-log cursor beyond what the kernel has is dropped, so an XID 79
already in the ring is still reported."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import builtin_rules, node_for
from detector.agent.active import PROBLEMS_LIMIT, ActiveProblems, Latch, Verifying
from detector.agent.agent import (CLEAR_FILE, PROBLEMS_FILE, AgentSettings, NodeAgent, write_clear_request,
                                  write_json)
from detector.backends.kernlog import CursorStore, KmsgReader
from detector.checks.node.history import (HISTORY_FILE, HISTORY_LIMIT, MAX_BOOTS, MAX_GPUS, MAX_INCIDENTS, MAX_SEEN,
                                          MAX_PROBLEMS, GpuRecord, History, Incident, read_history)
from detector.cli.main import main
from detector.config import build_checks
from detector.core.types import GpuRef, Problem, Severity
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.kmsg import FakeKmsgDevice

BOOT = "6f1c2e0a-3b4d-4e5f-8a9b-0c1d2e3f4a5b"


def finishes(call: Callable[[], Any], within_s: float = 10.0) -> Any:
    """`call()`'s result, failing (not hanging the suite) when it blocks: a FIFO opened for reading
    waits for a writer forever."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:          # re-raised below, in the test's thread
            out["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"{call} blocked for {within_s}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def moved_aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.unreadable-*"))


@pytest.fixture
def rules(registry):
    return builtin_rules()


def agent_on(registry, rules, state_dir: Path, checks: tuple[str, ...] = ("visibility", "xid", "node"),
             node=None, **host) -> NodeAgent:
    node = node or node_for("h100-sxm-8")
    built = build_checks(registry, list(checks), {})
    return NodeAgent(fake_host(node, threaded=False, **host), built, rules,
                     settings=AgentSettings(start_spread_s=0.0, state_dir=state_dir))


# -- finding 11: no write through a planted link ---------------------------------------------------------------

@pytest.mark.parametrize("name", [f"{HISTORY_FILE}.tmp", f"{PROBLEMS_FILE}.tmp"])
def test_a_planted_tmp_link_is_never_written_through(registry, rules, tmp_path, name):
    """The daemon (root) used to save through NAME.tmp; a link there made it overwrite the link's target."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / name).symlink_to(victim)
    node = node_for("h100-sxm-8")
    node.inject(Fault("xid", 3, {"code": 79}))          # a held problem and an incident: both files are saved
    agent = agent_on(registry, rules, state, node=node)
    agent.run(agent.checks)
    assert victim.read_text() == "precious\n"
    assert (state / name).is_symlink()                  # left alone, unused
    for saved in (HISTORY_FILE, PROBLEMS_FILE):
        assert stat.S_ISREG(os.lstat(state / saved).st_mode)
        assert json.loads((state / saved).read_text())["version"] == 1


def test_the_clear_request_and_the_cursor_never_write_through_a_planted_tmp_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in (f"{CLEAR_FILE}.tmp", "kmsg-cursor.json.tmp", "clear-result.json.tmp"):
        (tmp_path / name).symlink_to(victim)
    write_clear_request(tmp_path, ["GpuXidError"], 1.0)
    write_json(tmp_path / "clear-result.json", {"cleared": [], "live": []})
    assert CursorStore(tmp_path / "kmsg-cursor.json").save({"boot_id": BOOT, "seq": 3})
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / CLEAR_FILE).is_symlink() and json.loads((tmp_path / CLEAR_FILE).read_text())["types"]


def test_a_link_at_the_state_file_itself_is_moved_aside_and_replaced_not_followed(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.write_text(json.dumps({"version": 1, "boots": [], "gpus": []}))
    state = tmp_path / "state"
    state.mkdir()
    (state / HISTORY_FILE).symlink_to(victim)
    history = History(state / HISTORY_FILE)
    warning = history.load()
    assert "symbolic link" in warning and "moved aside" in warning and "\n" not in warning
    [kept] = moved_aside(state / HISTORY_FILE)
    assert kept.is_symlink()                            # the link itself was renamed, its target untouched
    history.note_boot(BOOT, 1.0)
    history.save()
    assert not (state / HISTORY_FILE).is_symlink()
    assert json.loads(victim.read_text()) == {"version": 1, "boots": [], "gpus": []}


# -- finding 12: FIFOs, huge files, wrong shapes ------------------------------------------------------------------

def test_a_fifo_history_neither_hangs_the_sweep_nor_stops_the_history(registry, rules, tmp_path, caplog):
    fifo(tmp_path / HISTORY_FILE)
    agent = agent_on(registry, rules, tmp_path)
    with caplog.at_level(logging.WARNING, "gpu_npd"):
        finishes(lambda: agent.run(agent.checks))
    warnings = [r.getMessage() for r in caplog.records if "GPU history" in r.getMessage()]
    assert len(warnings) == 1 and "is a FIFO, not a regular file" in warnings[0]
    [kept] = moved_aside(tmp_path / HISTORY_FILE)
    assert stat.S_ISFIFO(os.lstat(kept).st_mode)          # renamed, never opened
    assert stat.S_ISREG(os.lstat(tmp_path / HISTORY_FILE).st_mode)     # a fresh history was saved


def test_a_fifo_problems_file_does_not_hang_start_up(registry, rules, tmp_path):
    fifo(tmp_path / PROBLEMS_FILE)
    agent = finishes(lambda: agent_on(registry, rules, tmp_path))
    [warning] = agent.warnings
    assert "is a FIFO" in warning and "moved aside" in warning
    finishes(lambda: agent.run(agent.checks))
    assert stat.S_ISFIFO(os.lstat(moved_aside(tmp_path / PROBLEMS_FILE)[0]).st_mode)


def test_gpu_npd_history_says_what_is_wrong_and_never_hangs(tmp_path, capsys):
    fifo(tmp_path / HISTORY_FILE)
    history, problem = finishes(lambda: read_history(tmp_path))
    assert problem and "is a FIFO, not a regular file" in problem and history.gpus == {}
    assert finishes(lambda: main(["history", "--state-dir", str(tmp_path)])) == 2
    assert "is a FIFO" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(tmp_path / HISTORY_FILE).st_mode)     # the command moves nothing
    os.unlink(tmp_path / HISTORY_FILE)
    with open(tmp_path / HISTORY_FILE, "wb") as f:
        f.truncate(100 << 20)                           # sparse: 100 MB that cost nothing to write
    _, problem = finishes(lambda: read_history(tmp_path))
    assert "104,857,600 bytes, over the" in problem


def test_a_100_mb_history_is_refused_unread(tmp_path):
    path = tmp_path / HISTORY_FILE
    with open(path, "wb") as f:
        f.truncate(100 << 20)
    warning = History(path).load()
    assert f"over the {HISTORY_LIMIT:,}-byte limit" in warning and "starting a new history" in warning
    assert len(moved_aside(path)) == 1 and not path.exists()


def test_the_fullest_history_fits_its_limit(tmp_path):
    """The limit is chosen from what the history can hold: it must never refuse a real one."""
    history = History(tmp_path / HISTORY_FILE)
    for b in range(MAX_BOOTS):
        boot = f"6f1c2e0a-3b4d-4e5f-8a9b-{b:012d}"
        history.note_boot(boot, 1.7e9 + b, "MaintenanceInProgress=True (FirmwareUpdate)")
        for k in range(MAX_PROBLEMS + 10):
            history.note_problem(boot, f"GpuNodeNeedsRemediation/SomeRatherLongReasonName{k}", 1.7e9 + b + 0.5)
    assert all(len(b.problems) == MAX_PROBLEMS for b in history.boots)
    for g in range(MAX_GPUS):
        record = GpuRecord(f"1654922{g:06d}", f"1654922{g:06d}", f"GPU-13719f71-412c-d11e-b236-a262f53{g:05d}",
                           f"00000000:{g:02x}:00.0", g)
        for i in range(MAX_INCIDENTS):
            history.note_incident(record, Incident(1.7e9 + i + 0.123456, f"6f1c2e0a-3b4d-4e5f-8a9b-{i:012d}",
                                                   "Xid79GpuFellOffBus", "RESTART_BM"))
    for g in range(MAX_SEEN + 10):
        history.note_seen(f"00000000:{g:02x}:00.0", f"1654922{g:06d}", f"GPU-13719f71-412c-d11e-b236-a262f53{g:05d}",
                          "6f1c2e0a-3b4d-4e5f-8a9b-000000000000", 1.7e9 + g)
    history.prune(1.7e9 + MAX_BOOTS)
    history.save()
    size = (tmp_path / HISTORY_FILE).stat().st_size
    assert size * 2 < HISTORY_LIMIT, size
    again = History(tmp_path / HISTORY_FILE)
    assert again.load() is None and len(again.boots) == MAX_BOOTS and len(again.gpus) == MAX_GPUS
    assert len(again.seen) == MAX_SEEN and "00000000:00:00.0" not in again.seen   # the oldest boards went


def test_every_bundled_rule_held_naming_64_gpus_fits_the_problems_limit(registry, rules, tmp_path):
    """Latches are kept per rule and check: every pair the bundled rules allow, each naming 64 GPUs."""
    gpus = tuple(GpuRef(i, f"GPU-13719f71-412c-d11e-b236-a262f53{i:05d}", f"00000000:{i:02x}:00.0")
                 for i in range(64))
    active = ActiveProblems(rules.rules)
    for rule in rules.rules:
        for check in sorted(rule.checks if rule.checks is not None else registry.fields_by_check()):
            problem = Problem(rule.name, check, "GpuSomeType", "SomeReason", "x" * 1024, Severity.CRITICAL,
                              "RESTART_BM", "condition", gpus, 1.7e9)
            active.latches[(rule.name, check)] = Latch(problem, BOOT, 1.7e9, 1.7e9, Verifying(1.7e9, True, 2))
    active.save(tmp_path / PROBLEMS_FILE)
    size = (tmp_path / PROBLEMS_FILE).stat().st_size
    assert len(active.latches) > len(rules.rules) and size * 1.5 < PROBLEMS_LIMIT, size
    again = ActiveProblems(rules.rules)
    assert again.load(tmp_path / PROBLEMS_FILE) is None and len(again.latches) == len(active.latches)


@pytest.mark.parametrize("doc", [
    [1, 2],
    {"version": 1, "boots": {"a": 1}, "gpus": []},
    {"version": 1, "boots": [{"boot": 5, "first_seen": 1.0}], "gpus": []},
    {"version": 1, "boots": [{"boot": "b", "first_seen": "soon"}], "gpus": []},
    {"version": 1, "boots": [{"boot": "b", "first_seen": 1.0, "problems": ["x"]}], "gpus": []},
    {"version": 1, "boots": [], "gpus": [{"key": "k", "index": "three", "incidents": []}]},
    {"version": 1, "boots": [], "gpus": [{"key": "k", "serial": {"a": 1}, "incidents": []}]},
    {"version": 1, "boots": [], "gpus": [{"key": "k", "incidents": [{"time": 1.0, "boot": "b", "reason": 7,
                                                                      "action": "NONE"}]}]},
    {"version": 1, "boots": [], "gpus": ["k"]},
])
def test_a_history_of_the_wrong_shape_is_one_warning_and_a_fresh_start(tmp_path, doc):
    path = tmp_path / HISTORY_FILE
    path.write_text(json.dumps(doc))
    history = History(path)
    warning = history.load()
    assert warning and "\n" not in warning and "starting a new history" in warning
    assert history.boots == [] and history.gpus == {} and len(moved_aside(path)) == 1


@pytest.mark.parametrize("latch", [
    {"message": 5}, {"gpus": "GPU 3"}, {"gpus": [{"index": 3, "uuid": 7}]}, {"gpus": [{"index": "3"}]},
    {"time": "now"}, {"verifying": 1}, {"severity": "dire"}, {"boot": None},
])
def test_problem_state_of_the_wrong_shape_is_one_warning(registry, rules, tmp_path, latch):
    good = {"rule": "xid-79", "check": "xid", "type": "GpuXidError", "reason": "Xid79GpuFellOffBus",
            "message": "m", "severity": "critical", "action": "RESTART_BM", "gpus": [], "time": 1.0,
            "boot": BOOT, "first": 1.0, "last": 1.0}
    (tmp_path / PROBLEMS_FILE).write_text(json.dumps({"version": 1, "latches": [good]}))
    assert agent_on(registry, rules, tmp_path).warnings == []             # the good one loads
    (tmp_path / PROBLEMS_FILE).write_text(json.dumps({"version": 1, "latches": [{**good, **latch}]}))
    agent = agent_on(registry, rules, tmp_path)
    [warning] = agent.warnings
    assert "cannot read problem state" in warning and "\n" not in warning
    agent.run(agent.checks)                                  # and the daemon goes on
    assert len(moved_aside(tmp_path / PROBLEMS_FILE)) == 1


@pytest.mark.parametrize("make", [
    lambda p: p.write_text("[1]"), lambda p: p.write_text('{"types": 5}'),
    lambda p: p.write_text('{"types": ["GpuXidError"], "time": "now"}'), lambda p: p.write_bytes(b"\xff\xfe"),
    lambda p: fifo(p), lambda p: p.mkdir(), lambda p: p.symlink_to("/etc/hostname"),
    lambda p: p.write_bytes(b" " * (1 << 20)),
])
def test_an_unusable_clear_request_is_one_warning_and_clears_nothing(registry, rules, tmp_path, caplog, make):
    node = node_for("h100-sxm-8")
    node.inject(Fault("xid", 3, {"code": 79}))
    agent = agent_on(registry, rules, tmp_path, node=node)
    agent.run(agent.checks)
    assert {s.type: s.active for s in agent.conditions()}["GpuXidError"]
    make(tmp_path / CLEAR_FILE)
    with caplog.at_level(logging.WARNING, "gpu_npd"):
        finishes(lambda: agent.run(agent.checks))
        finishes(lambda: agent.run(agent.checks))
    warnings = [r.getMessage() for r in caplog.records if "clear request" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert not os.path.lexists(tmp_path / CLEAR_FILE)
    assert {s.type: s.active for s in agent.conditions()}["GpuXidError"]      # nothing was cleared


# -- the kernel-log cursor ----------------------------------------------------------------------------------

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def kmsg_reader(node, cursor_file: Path, start: str = "end") -> KmsgReader:
    device = FakeKmsgDevice(node)
    return KmsgReader(device, device.boot_id, device.boot_time, CursorStore(cursor_file), start=start)


@pytest.mark.parametrize("seq", [10_000, 2**62])
def test_a_cursor_beyond_the_kernels_newest_record_is_reset_with_one_line(tmp_path, caplog, seq):
    """Its seq would skip every record of the boot: the XID 79 in the ring was never reported."""
    node = node_for("h100-sxm-8")
    node.log_kernel(XID, 3)
    cursor = tmp_path / "kmsg-cursor.json"
    cursor.write_text(json.dumps({"boot_id": node.boot_id, "seq": seq}))
    with caplog.at_level(logging.INFO):
        reader = kmsg_reader(node, cursor)
        lines = reader.read_available()
    assert XID in [line.text for line in lines]
    assert lines[0].seq == 0 and not reader.resumed and reader.stats.cursor_resets == 1
    [line] = [r for r in caplog.records if "cursor" in r.getMessage()]
    assert f"seq {seq}" in line.getMessage() and "beyond" in line.getMessage()
    assert json.loads(cursor.read_text())["seq"] == lines[-1].seq          # a true cursor again
    node.log_kernel("later", 6)
    assert [line.text for line in reader.read_available()] == ["later"]


def test_a_cursor_at_the_kernels_newest_record_resumes_as_before(tmp_path, caplog):
    """The look-alike: a cursor exactly at the newest record is right, and nothing is read twice."""
    node = node_for("h100-sxm-8")
    node.log_kernel(XID, 3)
    cursor = tmp_path / "kmsg-cursor.json"
    first = kmsg_reader(node, cursor, start="beginning")
    assert XID in [line.text for line in first.read_available()]
    with caplog.at_level(logging.INFO):
        again = kmsg_reader(node, cursor)
        assert again.read_available() == []
    assert again.resumed and again.stats.cursor_resets == 0 and "beyond" not in caplog.text


def test_a_cursor_beyond_the_kernel_no_longer_hides_an_xid_79_from_the_daemon(registry, rules, tmp_path):
    node = node_for("h100-sxm-8")
    node.inject(Fault("xid", 3, {"code": 79, "via": "kernel"}))
    cursor = tmp_path / "kmsg-cursor.json"
    cursor.write_text(json.dumps({"boot_id": node.boot_id, "seq": 1_000_000}))
    agent = agent_on(registry, rules, tmp_path, ("xid",), node=node, kernel_cursor=cursor)
    agent.run(agent.checks)
    condition = {s.type: s for s in agent.conditions()}["GpuXidError"]
    assert condition.active and "XID 79" in condition.message


@pytest.mark.parametrize("make, words", [(fifo, "is a FIFO"), (lambda p: p.symlink_to("/etc/hostname"),
                                                               "symbolic link"),
                                         (lambda p: p.write_bytes(b" " * (1 << 20)), "over the")])
def test_an_unusable_cursor_file_is_moved_aside_with_one_warning(tmp_path, caplog, make, words):
    node = node_for("h100-sxm-8")
    node.log_kernel("buffered", 6)
    cursor = tmp_path / "kmsg-cursor.json"
    make(cursor)
    with caplog.at_level(logging.WARNING):
        reader = finishes(lambda: kmsg_reader(node, cursor))
    [warning] = [r.getMessage() for r in caplog.records]
    assert words in warning and "moved aside" in warning
    assert reader.read_available() == []                 # started at the end, as with no cursor
    node.log_kernel("new", 6)
    assert [line.text for line in reader.read_available()] == ["new"]
    assert stat.S_ISREG(os.lstat(cursor).st_mode) and len(moved_aside(cursor)) == 1
