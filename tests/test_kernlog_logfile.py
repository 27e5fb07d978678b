"""Tailing a kernel log file through everything logrotate does to it, and through reader restarts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from detector.backends.kernlog import CursorStore, LogFileTail, LogLine

XID = "Oct  6 17:59:27 gpu-node-1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def append(path: Path, data: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def pairs(lines: list[LogLine]) -> list[tuple[int | None, str]]:
    return [(line.lineno, line.text) for line in lines]


def tail(path: Path, cursor: Path | None = None, **kwargs) -> LogFileTail:
    return LogFileTail(path, CursorStore(cursor), **kwargs)


def test_start_end_follows_new_lines_with_true_line_numbers(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("boot line 1\nboot line 2\n")
    reader = tail(log, start="end")
    assert reader.read_available() == []
    append(log, XID + "\nnext\n")
    assert pairs(reader.read_available()) == [(3, XID), (4, "next")]
    assert reader.read_available() == []
    assert reader.stats.lines == 2


def test_start_beginning_reads_the_whole_file(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("one\ntwo\r\nthree\n")
    lines = tail(log, start="beginning").read_available()
    assert pairs(lines) == [(1, "one"), (2, "two"), (3, "three")]
    assert all(line.priority is None and line.seq is None for line in lines)


def test_partial_line_waits_for_its_newline(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    reader = tail(log)
    append(log, "NVRM: Xid (PCI:0000:3b:00): 7")
    assert reader.read_available() == []
    append(log, "9, GPU has fallen off the bus.\npart")
    assert pairs(reader.read_available()) == [(1, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")]
    append(log, "ial\n")
    assert pairs(reader.read_available()) == [(2, "partial")]


def test_start_end_does_not_cut_a_line_in_half(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("old\nbeing writ")
    reader = tail(log, start="end")
    append(log, "ten\n")
    assert pairs(reader.read_available()) == [(2, "being written")]


def test_invalid_utf8_is_replaced(tmp_path):
    log = tmp_path / "kern.log"
    log.write_bytes(b"caf\xc3\xa9 \xff\xfe end\n")
    assert tail(log, start="beginning").read_available()[0].text == "café \ufffd\ufffd end"


def test_rotation_by_rename_keeps_the_old_files_last_lines(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a1\n")
    clock = Clock()
    reader = tail(log, start="beginning", clock=clock, rotate_wait_s=5)
    assert pairs(reader.read_available()) == [(1, "a1")]
    append(log, "a2\na3\n")                       # written just before logrotate renames the file
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("b1\n")
    assert pairs(reader.read_available()) == [(2, "a2"), (3, "a3"), (1, "b1")]
    assert reader.stats.rotations == 1
    append(tmp_path / "kern.log.1", "a4\n")       # the writer has not reopened the path yet
    append(log, "b2\n")
    assert pairs(reader.read_available()) == [(4, "a4"), (2, "b2")]
    clock.t = 10                                  # the old file has been quiet long enough
    assert reader.read_available() == []
    append(tmp_path / "kern.log.1", "too late\n")
    append(log, "b3\n")
    assert pairs(reader.read_available()) == [(3, "b3")]


def test_rotated_file_hands_out_its_unterminated_last_line_when_retired(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a1\n")
    clock = Clock()
    reader = tail(log, start="beginning", clock=clock, rotate_wait_s=5)
    reader.read_available()
    append(log, "cut off")
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("b1\n")
    assert pairs(reader.read_available()) == [(1, "b1")]
    clock.t = 10
    assert pairs(reader.read_available()) == [(2, "cut off")]


def test_renamed_away_then_recreated(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a1\n")
    reader = tail(log, start="beginning", rotate_wait_s=0)
    reader.read_available()
    os.rename(log, tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", "a2\n")
    assert pairs(reader.read_available()) == [(2, "a2")]     # still the open file
    log.write_text("b1\n")
    assert pairs(reader.read_available()) == [(1, "b1")]
    assert reader.stats.rotations == 1


def test_copytruncate(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a long first line that makes the offset big\nanother long line\n")
    reader = tail(log, start="beginning")
    assert len(reader.read_available()) == 2
    with open(log, "r+b") as f:                   # logrotate copytruncate: copy, then truncate in place
        f.truncate(0)
    append(log, "after\n")
    assert pairs(reader.read_available()) == [(1, "after")]
    assert reader.stats.truncations == 1 and reader.stats.rotations == 0


def test_copytruncate_then_regrown_past_the_old_offset(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("Oct  6 17:59:27 first line\n")
    reader = tail(log, start="beginning")
    assert len(reader.read_available()) == 1
    with open(log, "r+b") as f:
        f.truncate(0)
    append(log, "Oct  7 00:00:01 a new day, and a line longer than the old file\nsecond\n")
    assert pairs(reader.read_available()) == [
        (1, "Oct  7 00:00:01 a new day, and a line longer than the old file"), (2, "second")]
    assert reader.stats.truncations == 1


def test_restart_continues_from_the_cursor(tmp_path):
    log, cursor = tmp_path / "kern.log", tmp_path / "state" / "kern.json"
    log.write_text("old\n")
    first = tail(log, cursor, start="end")
    append(log, "l2\nl3\npart")
    assert pairs(first.read_available()) == [(2, "l2"), (3, "l3")]
    first.close()
    saved = json.loads(cursor.read_text())
    assert saved["inode"] == log.stat().st_ino and saved["offset"] == len("old\nl2\nl3\n")
    append(log, "ial\nl5\n")                      # written while the reader was down
    second = tail(log, cursor, start="end")
    assert pairs(second.read_available()) == [(4, "partial"), (5, "l5")]


def test_restart_after_a_limited_read_resumes_exactly(tmp_path):
    log, cursor = tmp_path / "kern.log", tmp_path / "kern.json"
    log.write_text("".join(f"line {i}\n" for i in range(1, 11)))
    first = tail(log, cursor, start="beginning")
    assert [line.text for line in first.read_available(max_lines=3)] == ["line 1", "line 2", "line 3"]
    assert [line.lineno for line in first.read_available(max_lines=2)] == [4, 5]
    first.close()
    second = tail(log, cursor, start="beginning")
    assert pairs(second.read_available()) == [(i, f"line {i}") for i in range(6, 11)]


def test_cursor_of_another_file_is_ignored(tmp_path):
    log, cursor = tmp_path / "kern.log", tmp_path / "kern.json"
    log.write_text("x" * 100 + "\nsecond\n")
    ino = log.stat().st_ino
    # Same inode number (as after an inode is reused), but the start of the file is not what it was.
    cursor.write_text(json.dumps({"inode": ino, "offset": 3, "lineno": 1, "head": "0" * 16, "head_len": 64}))
    assert tail(log, cursor, start="beginning").read_available()[0].text == "x" * 100
    cursor.write_text(json.dumps({"inode": ino + 1, "offset": 3}))
    assert tail(log, cursor, start="end").read_available() == []


def test_corrupt_cursor_means_a_fresh_start(tmp_path):
    log, cursor = tmp_path / "kern.log", tmp_path / "kern.json"
    log.write_text("old\n")
    cursor.write_text("{not json")
    reader = tail(log, cursor, start="end")
    append(log, "new\n")
    assert pairs(reader.read_available()) == [(2, "new")]


def test_missing_file_is_read_from_its_start_once_it_appears(tmp_path):
    log = tmp_path / "later" / "kern.log"
    reader = tail(log, tmp_path / "kern.json", start="end")
    assert reader.read_available() == []
    log.parent.mkdir()
    log.write_text("first\nsecond\n")
    assert pairs(reader.read_available()) == [(1, "first"), (2, "second")]
    assert reader.stats.errors == 0


def test_io_errors_are_counted_not_raised(tmp_path):
    directory = tmp_path / "kern.log"
    directory.mkdir()
    reader = tail(directory)
    assert reader.read_available() == []
    assert reader.stats.errors >= 1


def test_many_lines_in_bounded_batches(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(f"{XID} #{i}\n" for i in range(25_000)))
    reader = tail(log, start="beginning", batch_limit=10_000, chunk_size=4096)
    sizes = []
    while batch := reader.read_available():
        sizes.append(len(batch))
        last = batch[-1]
    assert sizes == [10_000, 10_000, 5_000]
    assert last.lineno == 25_000 and last.text.endswith("#24999")
