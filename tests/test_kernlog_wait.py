"""Waiting for new kernel-log lines: every reader blocks until something may be new (so the daemon reacts
within milliseconds without polling fast), times out when nothing comes, and can be woken for shutdown."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from detector.backends.kernlog import CursorStore, DevKmsg, JournaldReader, KmsgReader, LogFileTail
from fake_nvml.faults import Fault
from fake_nvml.kmsg import FakeKmsgDevice
from fake_nvml.node import FakeNode, NodeState, TimedFault

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
PROMPT_S = 0.5       # "at once": far above the few milliseconds it takes, far below any timeout used


def make_node(timeline: list[TimedFault] | None = None) -> FakeNode:
    state = NodeState(name="gpu-node-1", driver_version="550.90.07", cuda_version=12040, gpus=[])
    return FakeNode(state, timeline)


def timed_wait(wait: Callable[[float], bool], timeout_s: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    result = wait(timeout_s)
    return result, time.monotonic() - t0


def later(delay_s: float, fn: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(delay_s, fn)
    timer.start()
    return timer


# -- the fake device -------------------------------------------------------------------------------

def test_fake_device_wait_returns_when_a_line_is_logged_from_another_thread():
    node = make_node()
    device = FakeKmsgDevice(node)
    device.seek_end()
    timer = later(0.05, lambda: node.log_kernel(XID))
    woken, took = timed_wait(device.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert device.read_record().endswith(XID.encode() + b"\n")


def test_fake_device_wait_times_out_when_nothing_is_logged():
    device = FakeKmsgDevice(make_node())
    device.seek_end()
    woken, took = timed_wait(device.wait, 0.1)
    assert not woken and took >= 0.09


def test_fake_device_wait_returns_at_once_when_records_are_unread():
    device = FakeKmsgDevice(make_node())          # positioned at the driver's load line, not yet read
    woken, took = timed_wait(device.wait, 5.0)
    assert woken and took < PROMPT_S


def test_fake_device_wake_interrupts_a_wait():
    device = FakeKmsgDevice(make_node())
    device.seek_end()
    timer = later(0.05, device.wake)
    woken, took = timed_wait(device.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert timed_wait(device.wait, 0.05)[0] is False      # a wake ends one wait, not every later one


def test_fake_device_wait_sees_a_timeline_fault_come_due():
    node = make_node([TimedFault(0.2, Fault("kernel_line", None, {"message": XID}))])
    device = FakeKmsgDevice(node)
    device.seek_end()
    woken, took = timed_wait(device.wait, 5.0)
    assert woken and took < 0.2 + PROMPT_S
    assert device.read_record().endswith(XID.encode() + b"\n")


def test_kmsg_reader_waits_on_its_device_then_reads_the_line():
    node = make_node()
    reader = KmsgReader(FakeKmsgDevice(node), None, 0.0, CursorStore(None), start="end")
    assert reader.read_available() == []
    timer = later(0.05, lambda: node.log_kernel(XID))
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert [line.text for line in reader.read_available()] == [XID]
    timer = later(0.05, reader.wake)
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S


class SilentDevice:
    """A device with no way to block on it: the reader sleeps instead."""

    def read_record(self) -> bytes:
        raise BlockingIOError(errno.EAGAIN, "no more")

    def seek_end(self) -> None:
        pass

    def seek_beginning(self) -> None:
        pass


def test_kmsg_reader_sleeps_over_a_device_that_cannot_wait():
    reader = KmsgReader(SilentDevice(), None, 0.0, CursorStore(None), start="end")
    woken, took = timed_wait(reader.wait, 0.1)
    assert woken and took >= 0.09             # it may have something: the caller looks
    timer = later(0.05, reader.wake)
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S


# -- the real device's poll, over a FIFO -----------------------------------------------------------

@pytest.fixture
def fifo(tmp_path: Path):
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    device = DevKmsg(path)                 # O_RDONLY | O_NONBLOCK: opens without a writer
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    yield device, writer
    os.close(writer)
    device.close()


def test_dev_kmsg_wait_polls_its_descriptor(fifo):
    device, writer = fifo
    woken, took = timed_wait(device.wait, 0.1)
    assert not woken and took >= 0.09
    record = b"3,7,8,-;" + XID.encode() + b"\n"
    timer = later(0.05, lambda: os.write(writer, record))
    woken, took = timed_wait(device.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert device.read_record() == record


def test_dev_kmsg_wake_interrupts_a_wait(fifo):
    device, _ = fifo
    timer = later(0.05, device.wake)
    woken, took = timed_wait(device.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert timed_wait(device.wait, 0.05)[0] is False      # the wake was consumed


def test_kmsg_reader_wakes_through_dev_kmsg(fifo):
    device, writer = fifo
    reader = KmsgReader(device, None, 0.0, CursorStore(None), start="beginning")
    timer = later(0.05, lambda: os.write(writer, b"3,7,8,-;" + XID.encode() + b"\n"))
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert [line.text for line in reader.read_available()] == [XID]


def test_dev_kmsg_over_a_regular_file_waits_instead_of_spinning(tmp_path):
    path = tmp_path / "kmsg"
    path.write_bytes(b"3,7,8,-;old\n")
    with DevKmsg(path) as device:
        woken, took = timed_wait(device.wait, 0.1)
    assert not woken and took >= 0.09


def test_kmsg_reader_wait_on_a_closed_device_does_not_raise(fifo):
    device, _ = fifo
    reader = KmsgReader(device, None, 0.0, CursorStore(None), start="end")
    device.close()
    woken, took = timed_wait(reader.wait, 0.05)
    assert woken and took >= 0.04 and reader.stats.errors >= 1


# -- a log file ------------------------------------------------------------------------------------

def test_logfile_wait_notices_an_append(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("boot\n")
    reader = LogFileTail(log, CursorStore(None), start="end")
    woken, took = timed_wait(reader.wait, 0.12)
    assert not woken and took >= 0.11

    def append() -> None:
        with open(log, "a") as f:
            f.write(XID + "\n")

    timer = later(0.05, append)
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    assert [line.text for line in reader.read_available()] == [XID]
    assert timed_wait(reader.wait, 0.06)[0] is False      # all read: nothing new


def test_logfile_wait_ignores_a_partial_line_but_notices_rotation_and_creation(tmp_path):
    log = tmp_path / "kern.log"
    reader = LogFileTail(log, CursorStore(None), start="end", rotate_wait_s=60)
    assert timed_wait(reader.wait, 0.06)[0] is False      # no file yet
    log.write_text("first\npartial")
    assert reader.wait(5.0)                               # the path appeared
    assert [line.text for line in reader.read_available()] == ["first"]
    assert timed_wait(reader.wait, 0.06)[0] is False      # a partial line is not a line yet
    log.rename(tmp_path / "kern.log.1")
    log.write_text("")
    assert reader.wait(5.0)                               # a new file at the path
    reader.read_available()
    reader.close()


def test_logfile_wake_interrupts_a_wait(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    reader = LogFileTail(log, CursorStore(None))
    timer = later(0.05, reader.wake)
    woken, took = timed_wait(reader.wait, 5.0)
    timer.join()
    assert woken and took < PROMPT_S
    reader.close()


# -- the journal -----------------------------------------------------------------------------------

def test_journald_wait_sleeps_at_most_a_second_and_can_be_woken():
    reader = JournaldReader(CursorStore(None), runner=lambda *a, **k: None)
    woken, took = timed_wait(reader.wait, 0.05)
    assert woken and 0.04 <= took < PROMPT_S                # no way to block on journalctl: look anyway
    woken, took = timed_wait(reader.wait, 30.0)
    assert woken and took < 1.0 + PROMPT_S
    timer = later(0.05, reader.wake)
    woken, took = timed_wait(reader.wait, 30.0)
    timer.join()
    assert woken and took < PROMPT_S
