"""`gpu-npd clear` does what it says, and only that: it releases problems held until a reboot or a
clear, leaves a problem that reflects what a check sees now (a GPU missing), says which is which, and
`--list` shows what is held, since when and until what."""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import builtin_rules, node_for
from detector.agent.agent import AgentSettings, NodeAgent
from detector.cli.main import main
from detector.config import build_checks
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host


def _agent(registry, tmp_path):
    node = node_for("h100-sxm-8")
    node.inject(Fault("xid", 3, {"code": 79}))        # XID 79 (held till reboot) and GPU 3 lost (live)
    rules = builtin_rules()
    checks = build_checks(registry, ["visibility", "xid"], {})
    agent = NodeAgent(fake_host(node, threaded=False), checks, rules,
                      settings=AgentSettings(start_spread_s=0.0, state_dir=tmp_path))
    agent.run(checks)
    return agent, checks


def _active(agent) -> dict[str, bool]:
    return {s.type: s.active for s in agent.conditions()}


def test_clear_releases_the_held_xid_and_leaves_the_live_gpu_missing(registry, tmp_path, capsys):
    agent, checks = _agent(registry, tmp_path)
    assert _active(agent)["GpuXidError"] and _active(agent)["GpuMissing"]

    assert main(["clear", "--list", "--state-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "GpuXidError/Xid79GpuFellOffBus" in listing and "held until a reboot or a clear" in listing
    assert "GpuMissing/GpuFellOffBus" in listing and "live: ends when the fault does" in listing

    def daemon_turn():                               # the daemon takes the request at its next run
        while not (tmp_path / "clear-request.json").exists():
            time.sleep(0.05)
        agent.run([c for c in checks if c.name == "xid"])
    turn = threading.Thread(target=daemon_turn)
    turn.start()
    assert main(["clear", "--state-dir", str(tmp_path), "--wait", "10"]) == 0
    turn.join(10)
    out = capsys.readouterr().out
    assert "cleared GpuXidError/Xid79GpuFellOffBus (rule xid-79)" in out
    assert "left GpuMissing/GpuFellOffBus (rule gpu-fell-off-bus): it reflects what the visibility check " \
           "sees now" in out
    assert not _active(agent)["GpuXidError"] and _active(agent)["GpuMissing"]   # never flipped off


def test_clear_says_when_the_daemon_has_not_answered(registry, tmp_path, capsys):
    _agent(registry, tmp_path)
    assert main(["clear", "GpuXidError", "--state-dir", str(tmp_path), "--wait", "0.3"]) == 0
    assert "has not taken the request yet" in capsys.readouterr().out


def test_clear_list_with_nothing_held(tmp_path, capsys):
    assert main(["clear", "--list", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "nothing is held"


@pytest.mark.parametrize("plant", ["fifo", "junk"])
def test_clear_list_neither_hangs_nor_crashes_on_a_planted_state_file(tmp_path, capsys, plant):
    """`gpu-npd clear --list` reads problems.json as the daemon does: a FIFO is refused at once (exit 2,
    one line), latches of the wrong shape are left out or shown with what they hold."""
    path = tmp_path / "problems.json"
    if plant == "fifo":
        os.mkfifo(path)
        assert main(["clear", "--list", "--state-dir", str(tmp_path)]) == 2
        assert "a FIFO, not a regular file" in capsys.readouterr().err
    else:
        path.write_text('{"version": 1, "latches": [5, "x", {"type": "GpuXidError", "first": "soon"}]}')
        assert main(["clear", "--list", "--state-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "GpuXidError/None  since ?" in out and "Traceback" not in out

