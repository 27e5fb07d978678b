"""The fake node's `reboot` fault: a new boot with a fresh kernel log, the driver loaded again, healthy GPUs,
and readers opened before it that carry on with the new boot instead of crashing or repeating lines."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from detector.backends.kernlog import CursorStore, KmsgReader, LogLine
from detector.core.sweep import Host
from fake_nvml.faults import FAULT_KINDS, Fault
from fake_nvml.host import fake_host
from fake_nvml.kmsg import FakeKmsgDevice
from fake_nvml.node import FakeNode, TimedFault
from fake_nvml.scenario import load_scenario
from conftest import builtin_rules

XID = "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
REBOOT = Fault("reboot")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_node(clock: Clock | None = None) -> FakeNode:
    return load_scenario("h100-sxm-8").build(clock=clock or Clock())


def messages(node: FakeNode) -> list[str]:
    return [r.message for r in node.kernel_records()]


def texts(lines: list[LogLine]) -> list[str]:
    return [line.text for line in lines]


def test_reboot_is_a_node_wide_fault_without_parameters():
    assert not FAULT_KINDS["reboot"].needs_gpu and FAULT_KINDS["reboot"].params == {}
    assert REBOOT.describe() == "reboot"


def test_reboot_starts_a_new_boot_with_a_fresh_kernel_log():
    clock = Clock()
    node = make_node(clock)
    load_lines = messages(node)
    assert load_lines[0].startswith("NVRM: loading") and len(load_lines) == 1 + 8
    old_boot = node.boot_id
    clock.t += 500
    node.log_kernel(XID)
    node.inject(REBOOT)
    assert node.boot_id != old_boot and uuid.UUID(node.boot_id).version == 4
    records = node.kernel_records()
    assert [r.message for r in records] == load_lines         # the old boot's records are gone
    assert [r.seq for r in records] == list(range(len(records)))
    assert all(r.usec == 0 for r in records)                  # uptime starts again
    clock.t += 2
    node.log_kernel("after")
    assert node.kernel_records()[-1].usec == 2_000_000
    node.inject(REBOOT)
    assert len({old_boot, node.boot_id}) == 2 and messages(node) == load_lines


def test_reboot_brings_every_gpu_and_the_driver_back():
    node = make_node()
    node.inject(Fault("xid", 3, {"code": 79}))
    node.inject(Fault("pcie", 1, {"width": 8}))
    node.inject(Fault("nvml_invisible", 2))
    node.inject(Fault("nvlink_down", 4, {"link": 2}))
    node.inject(Fault("driver_unloaded"))
    node.inject(REBOOT)
    state = node.snapshot()
    assert state.driver_loaded and state.nccl_busbw_factor == 1.0
    for gpu in state.gpus:
        assert not gpu.lost and gpu.nvml_visible and not gpu.nvlinks_down
        assert (gpu.pcie_gen, gpu.pcie_width) == (gpu.pcie_max_gen, gpu.pcie_max_width)
    assert messages(node)[0].startswith("NVRM: loading")      # the driver logged its load lines again
    assert [m.rsplit(" ", 1)[-1] for m in messages(node)[1:]] == [g.uuid for g in state.gpus]


def test_reboot_as_a_timeline_fault_gives_each_node_its_own_boot():
    clock = Clock()
    twins = [FakeNode(make_node(clock).snapshot(), [TimedFault(5.0, REBOOT)], clock=clock) for _ in range(2)]
    booted = {node.boot_id for node in twins}
    assert len(booted) == 1                      # built alike: the same boot id
    twins[0].log_kernel("before")
    clock.t += 5
    assert twins[0].boot_id != twins[1].boot_id and not booted & {n.boot_id for n in twins}
    assert "before" not in messages(twins[0])


def test_host_current_boot_follows_the_node():
    node = make_node()
    host = fake_host(node)
    first = host.current_boot()
    assert first == host.boot_id == node.boot_id
    node.inject(REBOOT)
    assert host.current_boot() == node.boot_id != first
    assert host.boot_id == first                  # the static id is what the host was built with
    host.close()
    plain = Host("n", None, None, None, boot_id="b-1")   # type: ignore[arg-type]
    assert plain.current_boot() == "b-1"


def test_fake_device_opened_before_a_reboot_reads_the_new_boot():
    node = make_node()
    device = FakeKmsgDevice(node)
    old_boot, old_boot_time = device.boot_id, device.boot_time
    device.seek_end()
    node.inject(REBOOT)
    node.log_kernel(XID)
    assert device.boot_id == node.boot_id != old_boot
    with pytest.raises(BrokenPipeError):        # the first read after a reboot reports the gap, once
        device.read_record()
    seqs = []
    while True:
        try:
            seqs.append(int(device.read_record().split(b",")[1]))
        except BlockingIOError:
            break
    assert seqs == list(range(1 + 8 + 2 + 1))   # load, 8 GPUs, the XID's GPU named with its serial, the XID
    assert device.boot_time >= old_boot_time


def test_kmsg_reader_carries_on_into_the_new_boot_without_repeating(tmp_path):
    node = make_node()
    store = CursorStore(tmp_path / "kmsg.json")
    device = FakeKmsgDevice(node)
    reader = KmsgReader(device, device.boot_id, device.boot_time, store, start="end")
    old_boot = reader.boot_id
    node.log_kernel("before")
    assert texts(reader.read_available()) == ["before"]
    node.inject(REBOOT)
    node.log_kernel(XID)
    lines = reader.read_available()
    load_lines = messages(node)[:-1]
    assert texts(lines) == load_lines + [XID]
    assert [line.seq for line in lines] == list(range(len(lines)))
    assert {line.boot_id for line in lines} == {node.boot_id} != {old_boot}
    assert reader.boot_id == node.boot_id and reader.boot_time == device.boot_time
    assert reader.read_available() == []
    assert (reader.stats.reboots, reader.stats.overruns, reader.stats.lost_records) == (1, 0, 0)
    assert store.load() == {"boot_id": node.boot_id, "seq": len(lines) - 1}
    node.log_kernel("later")
    assert texts(reader.read_available()) == ["later"]


def test_kmsg_reader_catches_a_reboot_in_the_middle_of_a_read():
    node = make_node()
    device = FakeKmsgDevice(node)
    reader = KmsgReader(device, device.boot_id, device.boot_time, CursorStore(None), start="end")
    node.log_kernel("before")
    real_read = device.read_record
    calls = 0

    def read_then_reboot() -> bytes:
        nonlocal calls
        calls += 1
        raw = real_read()
        if calls == 1:                          # after the reader checked the boot: the EPIPE path
            node.inject(REBOOT)
            node.log_kernel("new boot")
        return raw

    device.read_record = read_then_reboot       # type: ignore[method-assign]
    lines = reader.read_available()
    assert texts(lines) == ["before"] + messages(node)
    assert lines[0].boot_id != node.boot_id and {line.boot_id for line in lines[1:]} == {node.boot_id}
    assert (reader.stats.reboots, reader.stats.overruns) == (1, 0)


def test_kmsg_reader_and_a_rebooting_node_in_two_threads():
    node = make_node()
    device = FakeKmsgDevice(node)
    reader = KmsgReader(device, device.boot_id, device.boot_time, CursorStore(None), start="end")
    done = threading.Event()

    def kernel() -> None:
        for i in range(200):
            node.log_kernel(f"a{i}")
        node.inject(REBOOT)
        for i in range(200):
            node.log_kernel(f"b{i}")
        done.set()

    worker = threading.Thread(target=kernel)
    worker.start()
    seen: list[LogLine] = []
    deadline = time.monotonic() + 20
    while not (done.is_set() and seen and seen[-1].text == "b199"):
        assert time.monotonic() < deadline, texts(seen[-5:])
        reader.wait(0.5)
        seen.extend(reader.read_available(max_records=7))
    worker.join()
    old = [line.text for line in seen if line.text.startswith("a")]
    new = [line for line in seen if line.boot_id == node.boot_id]
    assert len(old) == len(set(old))                          # nothing of the old boot twice
    assert texts(new) == messages(node)                       # the whole new boot, once, in order
    assert reader.stats.reboots == 1



def _agent_on(node: FakeNode, names: list[str], state_dir=None):
    from conftest import Clock as ManualClock
    from detector.agent.agent import AgentSettings, NodeAgent
    from detector.config import build_checks
    from detector.core.check import CheckRegistry
    from fake_nvml.host import fake_host

    registry = CheckRegistry.from_entry_points()
    checks = {c.name: c for c in build_checks(registry, names, {})}
    rules = builtin_rules()
    host = fake_host(node, threaded=False)
    agent = NodeAgent(host, list(checks.values()), rules,
                      settings=AgentSettings(start_spread_s=0.0, state_dir=state_dir), clock=ManualClock())
    return agent, checks, host


def _unhealthy(agent) -> list[tuple[int | None, str | None, str]]:
    return [(h.gpu.index, h.gpu.uuid, h.state) for h in agent.gpu_health() if h.state != "healthy"]


def _held(agent) -> set[str]:
    return {s.type for s in agent.conditions() if s.active}


def test_a_sweep_a_reboot_cuts_across_holds_nothing_in_the_boot_that_began(tmp_path):
    """A fake node can reboot while the agent's sweep reads it (a real one takes the daemon with it).
    What that sweep saw before the reboot (a GPU off the bus) belongs to the ended boot: it must not be
    held, or written in the history, as the new boot's; and the GPU keeps its full identity meanwhile."""
    from detector.checks.node.history import read_history

    node = make_node()
    first, _, host = _agent_on(node, ["visibility", "xid", "node"], tmp_path)
    first.run_due()
    uuid3 = next(h.gpu.uuid for h in first.gpu_health() if h.gpu.index == 3)
    node.inject(Fault("xid", 3, {"code": 79}))
    first.clock.now += 60
    first.run_due()
    assert _unhealthy(first) == [(3, uuid3, "failed")]
    host.close()

    # A restart after the fall: NVML no longer tells GPU 3's UUID, the held XID 79 problem does.
    agent, checks, host = _agent_on(node, ["visibility", "xid", "node"], tmp_path)
    agent.run_due()
    assert _unhealthy(agent) == [(3, uuid3, "failed")] and {"GpuXidError", "GpuMissing"} <= _held(agent)

    visibility = checks["visibility"]
    read = visibility.run
    visibility.run = lambda ctx: (node.inject(REBOOT), read(ctx))[1]   # after the inventory, before the check
    agent.run([visibility, checks["xid"]])
    xid = [l for l in agent.active.latches.values() if l.problem.type == "GpuXidError"]
    assert xid and all(l.verifying and l.verifying.rebooted for l in xid)   # it ended with its boot, and the
    assert _unhealthy(agent) == [(3, uuid3, "failed")]                   # GPU stays failed until verified,
    boots = {b.boot: b.problems for b in read_history(tmp_path)[0].boots}  # by the name it had
    assert node.boot_id not in boots or boots[node.boot_id] == {}       # nothing charged to the new boot

    visibility.run = read
    for _ in range(agent.settings.verify_sweeps):                       # every check passed, round after round
        assert _unhealthy(agent) == [(3, uuid3, "failed")]
        agent.clock.now += 60
        agent.run_due()
    assert _unhealthy(agent) == [] and not _held(agent)
    assert read_history(tmp_path)[0].boots[-1].problems == {}
    host.close()


def test_an_inventory_read_before_a_reboot_is_not_reused_after_it():
    node = make_node()
    agent, checks, host = _agent_on(node, ["pcie", "xid"])
    reads = []
    count = host.nvml.nvmlDeviceGetCount
    host.nvml.nvmlDeviceGetCount = lambda: reads.append(1) or count()
    agent.run([checks["pcie"]])
    agent.run([checks["xid"]])
    assert len(reads) == 1                                              # reused while young ...
    node.inject(REBOOT)
    agent.run([checks["xid"]])
    assert len(reads) == 2                                              # ... but never across a reboot
    host.close()
