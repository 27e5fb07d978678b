"""/dev/kmsg reading: record parsing, the fake device's ring buffer, and restarts that neither repeat nor
miss a record."""

from __future__ import annotations

import errno
import json
import logging
import os
import time

import pytest

from detector.backends.kernlog import (
    CursorStore, DevKmsg, KmsgReader, KmsgUnavailable, LogLine, boot_time, is_kernel, parse_record,
    read_boot_id,
)
from fake_nvml.kmsg import FakeKmsgDevice, format_record
from fake_nvml.node import FakeNode, KernelRecord, NodeState

BOOT_A = "6f1c2e0a-3b4d-4e5f-8a9b-0c1d2e3f4a5b"
BOOT_B = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_node(boot_id: str = BOOT_A) -> FakeNode:
    state = NodeState(name="gpu-node-1", driver_version="550.90.07", cuda_version=12040, gpus=[],
                      boot_id=boot_id)
    return FakeNode(state, clock=Clock())


def log_lines(node: FakeNode, texts: list[str], priority: int = 3) -> None:
    for text in texts:
        node.log_kernel(text, priority)


def texts(lines: list[LogLine]) -> list[str]:
    return [line.text for line in lines]


def reader_for(node: FakeNode, store: CursorStore, start: str = "end", ring_size: int = 1024,
               boot_id: str | None = None) -> KmsgReader:
    device = FakeKmsgDevice(node, ring_size)
    return KmsgReader(device, boot_id or device.boot_id, device.boot_time, store, start=start)


class ScriptedDevice:
    """A device that returns (or raises) exactly what a test lists, then EAGAIN."""

    def __init__(self, items: list[bytes | BaseException]):
        self.items = list(items)

    def read_record(self) -> bytes:
        if not self.items:
            raise BlockingIOError(errno.EAGAIN, "no more")
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def seek_end(self) -> None:
        pass

    def seek_beginning(self) -> None:
        pass


# -- parsing ---------------------------------------------------------------------------------------

def test_parse_plain_record():
    line = parse_record(b"4,1205,88234567,-;" + XID.encode() + b"\n", BOOT_A, 1_700_000_000.0)
    assert line is not None
    assert line.text == XID
    assert (line.priority, line.seq, line.monotonic_us, line.boot_id) == (4, 1205, 88234567, BOOT_A)
    assert line.realtime == pytest.approx(1_700_000_000.0 + 88.234567)
    assert line.lineno is None and dict(line.fields) == {}


def test_parse_continuation_lines_become_fields():
    raw = (b"6,197,174867,-;acpi PNP0A08:00: _OSC: OS supports [ExtendedConfig ASPM ClockPM Segments MSI]\n"
           b" SUBSYSTEM=acpi\n DEVICE=+acpi:PNP0A08:00\n")
    line = parse_record(raw)
    assert line is not None
    assert line.text == "acpi PNP0A08:00: _OSC: OS supports [ExtendedConfig ASPM ClockPM Segments MSI]"
    assert dict(line.fields) == {"SUBSYSTEM": "acpi", "DEVICE": "+acpi:PNP0A08:00"}


def test_parse_decodes_escapes():
    # What the kernel writes for "first\nsecond", a backslash, a tab and UTF-8 "é" (all escaped as \xNN).
    raw = b"12,346,927795686,-;first\\x0asecond back\\x5cslash tab\\x09here caf\\xc3\\xa9\n DEVICE=+pci:0000\\x3a3b\n"
    line = parse_record(raw)
    assert line is not None
    assert line.text == "first\nsecond back\\slash tab\there café"
    assert line.fields["DEVICE"] == "+pci:0000:3b"


def test_parse_ignores_extra_header_fields_and_tolerates_bad_utf8():
    line = parse_record(b"3,7,8,-,caller=T412;NVRM: bad \\xff byte\n")
    assert line is not None and line.seq == 7 and line.text == "NVRM: bad \ufffd byte"


@pytest.mark.parametrize("raw", [
    b"", b"no separator at all\n", b"6,1;too few header fields\n", b"6,abc,1,-;seq not a number\n",
    b"-1,2,3,-;negative priority\n", b"6,2,,-;empty usec\n",
])
def test_malformed_records_parse_to_none(raw):
    assert parse_record(raw) is None


def test_userland_priorities_are_not_kernel():
    assert is_kernel(LogLine("kernel", priority=3))             # kern.err
    assert is_kernel(LogLine("unknown origin"))                 # a plain log file line
    assert not is_kernel(LogLine("from a program", priority=12))  # user.warning, what `echo > /dev/kmsg` gives
    assert not is_kernel(LogLine("daemon", priority=3 * 8 + 6))


def test_userland_writes_through_the_fake_device_are_flagged():
    node = make_node()
    device = FakeKmsgDevice(node)
    reader = KmsgReader(device, BOOT_A, device.boot_time, CursorStore(None), start="end")
    device.write(XID)                    # a program pretending to be the driver
    device.write("<0>" + XID)            # ... even with an explicit kernel priority
    device.write("<14>two\nlines\n")
    log_lines(node, [XID])               # the real thing
    lines = reader.read_available()
    assert [(line.text, line.priority) for line in lines] == [
        (XID, 12), (XID, 8), ("two", 14), ("lines", 12), (XID, 3)]
    assert [is_kernel(line) for line in lines] == [False, False, False, False, True]


# -- the fake device -------------------------------------------------------------------------------

def test_fake_device_formats_records_like_the_kernel():
    record = KernelRecord(seq=5, usec=1234567, priority=3, message="a\nb\\c é\t")
    assert format_record(record) == b"3,5,1234567,-;a\\x0ab\\x5cc \\xc3\\xa9\\x09\n"
    parsed = parse_record(format_record(record))
    assert parsed is not None and parsed.text == record.message


def test_fake_device_semantics_match_dev_kmsg():
    node = make_node()
    before = len(node.kernel_records())
    log_lines(node, [f"line {i}" for i in range(6)])
    device = FakeKmsgDevice(node, ring_size=4)
    newest = before + 5
    # open(): the first read returns the oldest record still in the ring
    assert device.read_record().split(b",")[1] == str(newest - 3).encode()
    device.seek_end()
    with pytest.raises(BlockingIOError):
        device.read_record()
    device.seek_beginning()
    assert device.read_record().split(b",")[1] == str(newest - 3).encode()
    log_lines(node, ["x1", "x2", "x3", "x4", "x5"])      # overwrites what this reader has not read yet
    with pytest.raises(BrokenPipeError):
        device.read_record()
    assert device.read_record().endswith(b";x2\n")        # then the oldest record present
    other = FakeKmsgDevice(node, ring_size=4)             # a second open has its own position
    assert other.read_record().endswith(b";x2\n")
    assert [device.read_record()[-3:] for _ in range(3)] == [b"x3\n", b"x4\n", b"x5\n"]


# -- reading and restarting ------------------------------------------------------------------------

def test_start_end_skips_what_is_buffered(tmp_path):
    node = make_node()
    log_lines(node, ["old 1", "old 2"])
    reader = reader_for(node, CursorStore(tmp_path / "kmsg.json"), start="end")
    assert reader.read_available() == []
    log_lines(node, ["new 1", "new 2"])
    lines = reader.read_available()
    assert texts(lines) == ["new 1", "new 2"]
    assert all(line.boot_id == BOOT_A and line.realtime is not None for line in lines)
    assert reader.stats.lost_records == 0


def test_start_beginning_hands_out_the_whole_buffer(tmp_path):
    node = make_node()
    log_lines(node, ["old 1", "old 2"])
    reader = reader_for(node, CursorStore(tmp_path / "kmsg.json"), start="beginning")
    lines = reader.read_available()
    assert texts(lines)[-2:] == ["old 1", "old 2"]
    assert [line.seq for line in lines] == list(range(len(lines)))   # the driver load lines come first


def test_restart_reports_nothing_twice_and_misses_nothing(tmp_path):
    node = make_node()
    cursor_file = tmp_path / "state" / "kmsg.json"
    first = reader_for(node, CursorStore(cursor_file), start="end")
    log_lines(node, ["a1", "a2", "a3"])
    assert texts(first.read_available(max_records=2)) == ["a1", "a2"]
    assert texts(first.read_available()) == ["a3"]
    log_lines(node, ["b1", "b2"])
    assert texts(first.read_available()) == ["b1", "b2"]
    saved = json.loads(cursor_file.read_text())
    assert saved["boot_id"] == BOOT_A
    del first                                       # the daemon stops ...
    log_lines(node, ["down 1", "down 2", "down 3"])  # ... the kernel goes on logging ...
    second = reader_for(node, CursorStore(cursor_file), start="end")   # ... and it starts again
    assert second.resumed
    log_lines(node, ["after"])
    lines = second.read_available()
    assert texts(lines) == ["down 1", "down 2", "down 3", "after"]
    assert [line.seq for line in lines] == sorted(line.seq for line in lines)
    assert second.stats.lost_records == 0
    assert second.stats.skipped > 0                 # what the first reader had already handed out


def test_restart_before_the_first_read_still_misses_nothing(tmp_path):
    node = make_node()
    cursor_file = tmp_path / "kmsg.json"
    reader_for(node, CursorStore(cursor_file), start="end")   # started, then stopped before reading
    log_lines(node, ["while down"])
    again = reader_for(node, CursorStore(cursor_file), start="end")
    assert texts(again.read_available()) == ["while down"]


def test_ring_overwrite_while_down_counts_the_lost_records(tmp_path):
    node = make_node()
    cursor_file = tmp_path / "kmsg.json"
    first = reader_for(node, CursorStore(cursor_file), ring_size=8)
    log_lines(node, ["seen"])
    assert texts(first.read_available()) == ["seen"]
    log_lines(node, [f"down {i}" for i in range(20)])
    second = reader_for(node, CursorStore(cursor_file), ring_size=8)
    lines = second.read_available()
    assert texts(lines) == [f"down {i}" for i in range(12, 20)]
    assert second.stats.lost_records == 12


def test_epipe_mid_read_is_counted_and_reading_goes_on(tmp_path):
    node = make_node()
    reader = reader_for(node, CursorStore(None), ring_size=4)
    log_lines(node, ["p1", "p2", "p3", "p4"])
    assert texts(reader.read_available(max_records=2)) == ["p1", "p2"]
    log_lines(node, [f"q{i}" for i in range(6)])       # p3, p4, q0, q1 are overwritten before being read
    lines = reader.read_available()
    assert texts(lines) == ["q2", "q3", "q4", "q5"]
    assert reader.stats.overruns == 1
    assert reader.stats.lost_records == 4


def test_cursor_of_another_boot_is_ignored(tmp_path):
    cursor_file = tmp_path / "kmsg.json"
    cursor_file.write_text(json.dumps({"boot_id": BOOT_B, "seq": 10_000}))
    node = make_node(BOOT_A)
    log_lines(node, ["this boot"])
    reader = reader_for(node, CursorStore(cursor_file), start="beginning")
    assert not reader.resumed
    assert "this boot" in texts(reader.read_available())     # seq 10,000 of the other boot skips nothing
    assert reader.stats.lost_records == 0
    assert json.loads(cursor_file.read_text())["boot_id"] == BOOT_A

    cursor_file.write_text(json.dumps({"boot_id": BOOT_B, "seq": 0}))
    ended = reader_for(node, CursorStore(cursor_file), start="end")
    assert not ended.resumed and ended.read_available() == []


def test_corrupt_cursor_file_means_a_fresh_start(tmp_path, caplog):
    cursor_file = tmp_path / "kmsg.json"
    cursor_file.write_bytes(b'{"boot_id": "6f1c2e0a-3b4d-4e5f-8a9b-0c1d2e3f4a5b", "se\x00')
    node = make_node()
    log_lines(node, ["buffered"])
    with caplog.at_level(logging.WARNING):
        reader = reader_for(node, CursorStore(cursor_file), start="end")
    assert "corrupt" in caplog.text
    [kept] = list(tmp_path.glob("kmsg.json.unreadable-*"))               # the evidence is kept
    assert kept.read_bytes().endswith(b'"se\x00') and f"moved aside to {kept}" in caplog.text
    assert reader.read_available() == []
    log_lines(node, ["new"])
    assert texts(reader.read_available()) == ["new"]
    assert json.loads(cursor_file.read_text())["boot_id"] == BOOT_A     # rewritten whole


def test_cursor_with_a_nonsense_seq_is_ignored(tmp_path):
    cursor_file = tmp_path / "kmsg.json"
    cursor_file.write_text(json.dumps({"boot_id": BOOT_A, "seq": "seven"}))
    node = make_node()
    log_lines(node, ["buffered"])
    reader = reader_for(node, CursorStore(cursor_file), start="end")
    assert not reader.resumed and reader.read_available() == []


def test_malformed_records_and_device_errors_never_raise():
    device = ScriptedDevice([
        b"6,10,100,-;fine\n",
        b"garbage without a header\n",
        BrokenPipeError(errno.EPIPE, "overwritten"),
        b"6,14,200,-;after the overrun\n",
        OSError(errno.EIO, "I/O error"),
        b"6,15,300,-;next time\n",
    ])
    reader = KmsgReader(device, BOOT_A, 0.0, CursorStore(None), start="beginning")
    assert texts(reader.read_available()) == ["fine", "after the overrun"]
    assert (reader.stats.malformed, reader.stats.overruns, reader.stats.errors) == (1, 1, 1)
    assert reader.stats.lost_records == 3           # 11, 12, 13 (one of them the malformed record)
    assert texts(reader.read_available()) == ["next time"]


def test_batch_limit_bounds_one_call():
    device = ScriptedDevice([b"6,%d,1,-;r%d\n" % (i, i) for i in range(10)])
    reader = KmsgReader(device, None, 0.0, CursorStore(None), start="beginning", batch_limit=4)
    assert len(reader.read_available()) == 4
    assert len(reader.read_available(max_records=100)) == 6


# -- the real device -------------------------------------------------------------------------------

def test_dev_kmsg_missing_path_names_it(tmp_path):
    path = tmp_path / "no-such-kmsg"
    with pytest.raises(KmsgUnavailable) as info:
        DevKmsg(path)
    assert info.value.errno == errno.ENOENT
    assert str(path) in str(info.value)


def test_dev_kmsg_permission_denied_names_the_path(tmp_path, monkeypatch):
    path = tmp_path / "kmsg"
    path.write_bytes(b"")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(KmsgUnavailable) as info:
        DevKmsg(path)
    assert info.value.errno == errno.EACCES and str(path) in str(info.value)
    assert isinstance(info.value, OSError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_dev_kmsg_unreadable_file(tmp_path):
    path = tmp_path / "kmsg"
    path.write_bytes(b"")
    path.chmod(0)
    with pytest.raises(KmsgUnavailable, match="kmsg"):
        DevKmsg(path)


def test_real_dev_kmsg_when_readable():
    try:
        device = DevKmsg()
    except KmsgUnavailable as e:
        pytest.skip(f"/dev/kmsg not usable here: {e}")
    with device:
        try:
            raw = device.read_record()
        except OSError as e:           # EPERM under dmesg_restrict, EAGAIN on an empty buffer
            pytest.skip(f"/dev/kmsg not readable here: {e}")
        line = parse_record(raw)
        assert line is not None and line.seq is not None
        device.seek_end()
        reader = KmsgReader(device, read_boot_id(), boot_time(), CursorStore(None), start="end")
        assert reader.stats.errors == 0


def test_boot_id_and_boot_time(tmp_path):
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    assert read_boot_id(path) == BOOT_A
    assert read_boot_id(tmp_path / "missing") is None
    assert 0 < boot_time() <= time.time()


def test_cursor_store_round_trip_and_failures(tmp_path):
    store = CursorStore(tmp_path / "deep" / "dir" / "c.json")
    assert store.load() is None
    assert store.save({"boot_id": BOOT_A, "seq": 3})
    assert CursorStore(store.path).load() == {"boot_id": BOOT_A, "seq": 3}
    assert [p.name for p in store.path.parent.iterdir()] == ["c.json"]      # no temp files left behind
    (tmp_path / "list.json").write_text("[1, 2]")
    assert CursorStore(tmp_path / "list.json").load() is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert CursorStore(blocker / "c.json").save({"seq": 1}) is False        # parent is a file: no raise
    memory = CursorStore(None)
    assert memory.load() is None
    memory.save({"seq": 1})
    assert memory.load() == {"seq": 1}
