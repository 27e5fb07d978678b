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
    assert seqs == list(range(1 + 8 + 1))
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
