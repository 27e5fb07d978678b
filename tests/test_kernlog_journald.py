"""Kernel lines from `journalctl -k -o json`: parsing real-shaped output, the cursor, and every way running
journalctl can fail without hurting the caller."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest

from detector.backends.kernlog import CursorStore, JournaldReader, is_kernel

BOOT_HEX = "6f1c2e0a3b4d4e5f8a9b0c1d2e3f4a5b"
BOOT = "6f1c2e0a-3b4d-4e5f-8a9b-0c1d2e3f4a5b"
OTHER_BOOT = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
BASE = ["journalctl", "-k", "-o", "json", "--no-pager", "--quiet"]


def cursor(i: int) -> str:
    return (f"s=8e2c5d0f1a3b4c6d9e7f0a1b2c3d4e5f;i={0x1a2b00 + i:x};b={BOOT_HEX};m={0x53d8f2a1 + i:x};"
            f"t={0x605f1e2d3c4b5 + i:x};x={0x9a8b7c6d5e4f3a2b + i:x}")


def entry(i: int, message: object = XID, **extra: object) -> dict:
    """Shaped like journald's record of a kernel message read from /dev/kmsg."""
    e = {
        "__CURSOR": cursor(i),
        "__REALTIME_TIMESTAMP": str(1696615167123456 + i),
        "__MONOTONIC_TIMESTAMP": str(1406726817 + i),
        "_BOOT_ID": BOOT_HEX,
        "_MACHINE_ID": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
        "_HOSTNAME": "gpu-node-1",
        "PRIORITY": "4",
        "_TRANSPORT": "kernel",
        "SYSLOG_IDENTIFIER": "kernel",
        "_SOURCE_MONOTONIC_TIMESTAMP": str(1406725001 + i),
        "MESSAGE": message,
    }
    e.update(extra)
    return e


def output(*entries: dict) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in entries)


@dataclass
class FakeJournalctl:
    """Stands in for subprocess.run: records each call, answers from a script."""

    script: list[object] = field(default_factory=list)
    calls: list[tuple[list[str], dict]] = field(default_factory=list)

    def __call__(self, argv, **kwargs):
        self.calls.append((argv, kwargs))
        answer = self.script.pop(0) if self.script else b""
        if isinstance(answer, BaseException):
            raise answer
        rc, stdout, stderr = answer if isinstance(answer, tuple) else (0, answer, b"")
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    @property
    def argv(self) -> list[list[str]]:
        return [argv for argv, _ in self.calls]


def reader(runner: FakeJournalctl, store: CursorStore | None = None, **kwargs) -> JournaldReader:
    return JournaldReader(store or CursorStore(None), runner=runner, **kwargs)


def test_parses_canned_output():
    runner = FakeJournalctl([output(
        entry(1),
        entry(2, "pcieport 0000:3a:00.0: AER: Corrected error received: 0000:3b:00.0",
              PRIORITY="3", _KERNEL_SUBSYSTEM="pci", _KERNEL_DEVICE="+pci:0000:3a:00.0"),
        entry(3, "NVRM: Xid (PCI:0000:3b:00): 79, pretend", PRIORITY="5", SYSLOG_FACILITY="1",
              SYSLOG_IDENTIFIER="evil", _SOURCE_MONOTONIC_TIMESTAMP=None),
    )])
    lines = reader(runner, start="beginning").read_available()
    first, aer, fake = lines
    assert first.text == XID
    assert first.priority == 4 and is_kernel(first)
    assert first.realtime == pytest.approx(1696615167.123457)
    assert first.monotonic_us == 1406725002
    assert first.boot_id == BOOT
    assert dict(aer.fields) == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3a:00.0"}
    assert aer.priority == 3
    assert fake.priority == 1 * 8 + 5 and not is_kernel(fake)
    assert fake.monotonic_us == 1406726817 + 3       # no source timestamp: journald's own


def test_message_as_byte_list_and_multiple_values():
    raw = "NVRM: Xid (PCI:0000:3b:00): 13, caf\u00e9 ".encode() + b"\xff"
    runner = FakeJournalctl([output(entry(1, list(raw)), entry(2, ["first value", "second value"]))])
    lines = reader(runner, start="beginning").read_available()
    assert lines[0].text == "NVRM: Xid (PCI:0000:3b:00): 13, caf\u00e9 \ufffd"
    assert lines[1].text == "first value"


def test_cursor_is_passed_on_the_next_call(tmp_path):
    store = CursorStore(tmp_path / "journald.json")
    runner = FakeJournalctl([output(entry(1), entry(2)), output(entry(3)), b""])
    r = reader(runner, store, start="beginning", max_entries=500)
    assert len(r.read_available()) == 2
    assert len(r.read_available()) == 1
    assert r.read_available() == []
    assert runner.argv == [
        BASE,
        BASE + ["--after-cursor", cursor(2), "-n", "500"],
        BASE + ["--after-cursor", cursor(3), "-n", "500"],
    ]
    for _, kwargs in runner.calls:
        assert kwargs["timeout"] == 10 and not kwargs.get("shell")
    assert json.loads((tmp_path / "journald.json").read_text()) == {"cursor": cursor(3), "boot_id": BOOT}

    again = FakeJournalctl([output(entry(4))])          # a restarted daemon picks up from the file
    assert [line.text for line in reader(again, CursorStore(tmp_path / "journald.json")).read_available()] == [XID]
    assert again.argv == [BASE + ["--after-cursor", cursor(3), "-n", "5000"]]


def test_a_full_run_is_followed_at_once_so_a_flood_is_read_in_one_go():
    """A run that returns max_entries entries means more are waiting: the reader runs journalctl again
    within the same read, until a run comes back short (or MAX_ENTRIES_PER_READ in all)."""
    runner = FakeJournalctl([output(entry(1)), output(entry(2), entry(3)), output(entry(4), entry(5)),
                             output(entry(6)), output(entry(7))])
    r = reader(runner, start="beginning", max_entries=2)
    assert [line.monotonic_us - 1406725001 for line in r.read_available()] == [1]      # the first run: no cursor
    assert [line.monotonic_us - 1406725001 for line in r.read_available()] == [2, 3, 4, 5, 6]
    assert runner.argv[1:] == [BASE + ["--after-cursor", cursor(i), "-n", "2"] for i in (1, 3, 5)]
    assert [line.monotonic_us - 1406725001 for line in r.read_available()] == [7]


def test_the_runs_of_one_read_are_capped(monkeypatch):
    from detector.backends.kernlog import journald
    monkeypatch.setattr(journald, "MAX_ENTRIES_PER_READ", 4)
    runner = FakeJournalctl([output(entry(i), entry(i + 1)) for i in range(1, 20, 2)])
    r = reader(runner, start="beginning", max_entries=2)
    r.read_available()                                   # entries 1-2 (a full run, but no cursor yet: one run)
    assert len(r.read_available()) == 4                  # two full runs, then the cap
    assert len(runner.calls) == 3


def test_start_end_learns_the_end_first():
    runner = FakeJournalctl([output(entry(7)), output(entry(8))])
    r = reader(runner, start="end")
    assert r.read_available() == []                  # entry 7 was there before we started
    assert [line.monotonic_us for line in r.read_available()] == [1406725001 + 8]
    assert runner.argv == [BASE + ["-n", "1"], BASE + ["--after-cursor", cursor(7), "-n", "5000"]]


def test_start_end_on_an_empty_journal_then_reads_this_boot():
    runner = FakeJournalctl([b"", output(entry(1))])
    r = reader(runner, start="end")
    assert r.read_available() == []
    assert len(r.read_available()) == 1
    assert runner.argv == [BASE + ["-n", "1"], BASE]


def test_cursor_of_another_boot_is_ignored(tmp_path):
    store = CursorStore(tmp_path / "journald.json")
    store.save({"cursor": cursor(1), "boot_id": OTHER_BOOT})
    runner = FakeJournalctl([output(entry(9))])
    r = reader(runner, CursorStore(tmp_path / "journald.json"), start="end", boot_id=BOOT_HEX)
    assert r.read_available() == []
    assert runner.argv == [BASE + ["-n", "1"]]
    same = FakeJournalctl()
    reader(same, CursorStore(tmp_path / "journald.json"), boot_id=BOOT).read_available()
    assert same.argv == [BASE + ["--after-cursor", cursor(9), "-n", "5000"]]


def test_timeout_gives_the_whole_lines_written_before_it():
    partial = output(entry(1)) + output(entry(2))[:40]
    runner = FakeJournalctl([
        subprocess.TimeoutExpired(BASE, 10, output=b""),
        subprocess.TimeoutExpired(BASE, 10, output=partial),
        output(entry(2)),
    ])
    r = reader(runner, start="beginning")
    assert r.read_available() == []
    assert r.stats.timeouts == 1 and r.cursor is None
    assert [line.realtime for line in r.read_available()] == [pytest.approx(1696615167.123457)]
    assert r.stats.timeouts == 2 and r.stats.malformed == 0
    assert len(r.read_available()) == 1
    assert runner.argv[-1] == BASE + ["--after-cursor", cursor(1), "-n", "5000"]


def test_missing_binary(tmp_path):
    missing = str(tmp_path / "no-journalctl")
    r = JournaldReader(CursorStore(None), journalctl=missing, start="beginning")
    assert r.available() is False
    assert r.read_available() == []
    assert r.stats.failures == 1
    assert JournaldReader(CursorStore(None), journalctl="journalctl-does-not-exist").available() is False


def test_a_binary_that_cannot_run_does_not_cost_the_cursor():
    runner = FakeJournalctl([output(entry(1))] + [FileNotFoundError(2, "No such file", "journalctl")] * 5)
    r = reader(runner, start="beginning")
    assert len(r.read_available()) == 1
    for _ in range(5):
        assert r.read_available() == []
    assert r.stats.failures == 5 and r.stats.cursor_resets == 0 and r.cursor == cursor(1)


def test_bad_lines_and_null_messages_are_skipped():
    bad = (output(entry(1)) + b"{\"__CURSOR\": \"s=trunc\n" + b"[1, 2]\n" + b"-- No entries --\n"
           + output(entry(2, None)) + output(entry(3)))
    r = reader(FakeJournalctl([bad, b""]), start="beginning")
    lines = r.read_available()
    assert len(lines) == 2
    assert r.stats.malformed == 3                  # the broken line, the list, the null MESSAGE
    assert r.cursor == cursor(3)


def test_failing_exit_keeps_the_cursor_then_gives_up_on_it():
    refused = (1, b"", b"Failed to seek to cursor: Invalid argument\n")
    runner = FakeJournalctl([output(entry(1)), refused, refused, refused, output(entry(5)), output(entry(6))])
    r = reader(runner, start="beginning")
    assert len(r.read_available()) == 1
    for _ in range(3):
        assert r.read_available() == []
    assert r.stats.failures == 3 and r.stats.cursor_resets == 1
    assert r.read_available() == []               # relearn the end, so nothing is reported twice
    assert len(r.read_available()) == 1
    assert runner.argv[1] == BASE + ["--after-cursor", cursor(1), "-n", "5000"]
    assert runner.argv[4] == BASE + ["-n", "1"]
    assert runner.argv[5] == BASE + ["--after-cursor", cursor(5), "-n", "5000"]


def test_nonzero_exit_with_output_still_uses_it():
    runner = FakeJournalctl([(1, output(entry(1)), b"Warning: journal file corrupted, ignoring\n")])
    r = reader(runner, start="beginning")
    assert len(r.read_available()) == 1 and r.stats.failures == 1


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="no journalctl here")
def test_real_journalctl_never_raises():
    r = JournaldReader(CursorStore(None), start="end", timeout_s=20)
    assert r.available()
    for _ in range(2):
        assert isinstance(r.read_available(), list)


@pytest.mark.parametrize("raw", [
    b'{"MESSAGE": "x"}', b'{"MESSAGE": "x"}  ', b'{"MESSAGE": "x"} {"MESSAGE": "y"}', b'{"MESSAGE": "x"},',
    b'{"MESSAGE": "caf\xc3\xa9"}', b'{"MESSAGE": "\xff"}', b'{"MESSAGE": "x"', b'["MESSAGE"]', b'{"a": 1e999}',
    b'{"MESSAGE": "\\ud800"}', b'{"MESSAGE": "x"}\x0b',
])
def test_fast_line_decoding_is_json_loads(raw):
    from detector.backends.kernlog.journald import _loads

    try:
        expected: object = json.loads(raw)
    except ValueError:
        expected = ValueError                   # refused (JSONDecodeError or UnicodeDecodeError)
    try:
        got: object = _loads(raw)
    except ValueError:
        got = ValueError
    assert got == expected
