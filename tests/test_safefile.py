"""detector/backends/safefile.py: planted FIFOs, devices, links and oversized files are refused at once,
and an atomic write never writes through a link planted at the target or a temporary name."""

import os
import threading
from pathlib import Path

import pytest

from detector.backends.safefile import UnsafeFile, read_bounded, read_text_bounded, write_atomic


def test_reads_a_regular_file_whole(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_bounded(tmp_path / "f", 100) == b"x" * 100
    assert read_text_bounded(tmp_path / "f", 100) == "x" * 100


def test_a_file_over_the_limit_is_refused_not_truncated(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 101)
    with pytest.raises(UnsafeFile, match=r"101 bytes, over the 100-byte limit"):
        read_bounded(tmp_path / "f", 100, "capture")


def test_a_fifo_is_refused_at_once_without_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    result: list[BaseException] = []
    reader = threading.Thread(target=lambda: _catch(result, tmp_path / "fifo"), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "opening a FIFO blocked"
    assert isinstance(result[0], UnsafeFile) and "a FIFO, not a regular file" in str(result[0])


def _catch(into: list[BaseException], path: Path) -> None:
    try:
        read_bounded(path, 10)
    except BaseException as e:  # noqa: BLE001
        into.append(e)


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/", "a directory")])
def test_devices_and_directories_are_refused(path: str, kind: str) -> None:
    with pytest.raises(UnsafeFile, match=kind):
        read_bounded(path, 1 << 20)


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("root's")
    (tmp_path / "state.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_bounded(tmp_path / "state.json", 100, "state file")


def test_absent_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "nope", 100)


def test_write_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "history.json").symlink_to(victim)
    (tmp_path / "history.json.tmp").symlink_to(victim)      # the old fixed temporary name
    write_atomic(tmp_path / "history.json", '{"version": 1}')
    assert victim.read_text() == "untouched"
    assert not (tmp_path / "history.json").is_symlink()
    assert (tmp_path / "history.json").read_text() == '{"version": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.json", "history.json.tmp", "victim"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("old")
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "f", 42)  # type: ignore[arg-type]
    assert (tmp_path / "f").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
