"""Files from outside that try to hang, exhaust or mislead `gpu-npd diagnose` (issue 30, findings 9 and 10):
a replay capture that is a FIFO, /dev/zero, nested too deep, too big, or points out of its folder; a saved
kernel log with an endless line. Each is refused with one line and exit code 2, or read in bounded memory.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from detector.checks.xid.scan import find_passes, scan_stream
from detector.backends.replay.limits import MAX_CAPTURE_BYTES, MAX_DEPTH, MAX_SIDE_FILE_BYTES
from detector.backends.replay.load import load_snapshot
from detector.backends.replay.raw import SnapshotError
from detector.backends.replay.side_files import read_side_files

H100 = REPO / "tests" / "fixtures" / "replay" / "h100-vm-580"
STAMP = "Oct  6 17:59:27 gpu-17 kernel: "
X79 = "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
X48 = ("NVRM: Xid (PCI:0000:2a:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
       "(DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.")
X13 = "NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a, Graphics Exception: ESR 0x50"


def gpu_npd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GPU_NPD_NVML"}
    return subprocess.run([sys.executable, "-m", "detector.cli.main", "diagnose", "-q", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=REPO)


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2 and one line on stderr naming the problem; no traceback."""
    line = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "\n" not in line, proc.stderr[-2000:]
    for word in words:
        assert word in line, line
    return line


# -- replay captures ------------------------------------------------------------------------------


def test_a_fifo_given_to_replay_exits_2_within_5_seconds(tmp_path):
    fifo = tmp_path / "nvidia-smi-q.xml"
    os.mkfifo(fifo)
    started = time.monotonic()
    proc = gpu_npd("--nvml", f"replay:{fifo}", timeout=5)           # no writer ever comes: a blocking open hangs
    assert time.monotonic() - started < 5
    refused(proc, str(fifo), "a FIFO, not a regular file")


def test_a_fifo_in_a_capture_folder_is_refused_too(tmp_path):
    os.mkfifo(tmp_path / "nvidia-smi-q.xml")
    with pytest.raises(SnapshotError, match="a FIFO, not a regular file"):
        load_snapshot(tmp_path)


def test_dev_zero_is_refused_at_once():
    proc = gpu_npd("--nvml", "replay:/dev/zero", timeout=20)
    refused(proc, "/dev/zero", "a character device, not a regular file")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_xml_nested_deeper_than_the_cap_is_refused_not_a_recursion_error(tmp_path, depth):
    path = tmp_path / "deep.xml"
    path.write_text("<nvidia_smi_log>" + "<a>" * depth + "</a>" * depth + "</nvidia_smi_log>")
    with pytest.raises(SnapshotError, match=f"nested deeper than {MAX_DEPTH} elements"):
        load_snapshot(path)


def test_xml_nested_1000_deep_exits_2_through_the_cli(tmp_path):
    path = tmp_path / "deep.xml"
    path.write_text("<nvidia_smi_log>" + "<a>" * 1000 + "</a>" * 1000 + "</nvidia_smi_log>")
    refused(gpu_npd("--nvml", f"replay:{path}", timeout=20), str(path), f"nested deeper than {MAX_DEPTH}")


def test_nesting_at_the_cap_is_still_read(tmp_path):
    """The cap counts <nvidia_smi_log> itself: MAX_DEPTH levels in all are accepted."""
    inner = MAX_DEPTH - 3                    # nvidia_smi_log > gpu > product_name's siblings
    path = tmp_path / "deep-ok.xml"
    path.write_text('<nvidia_smi_log><gpu id="00000000:3B:00.0"><product_name>NVIDIA H100</product_name>'
                    + "<a>" * inner + "</a>" * inner + "</gpu></nvidia_smi_log>")
    assert load_snapshot(path).gpus[0].name == "NVIDIA H100"


def test_text_indented_deeper_than_the_cap_is_refused(tmp_path):
    path = tmp_path / "deep.txt"
    path.write_text("==============NVSMI LOG==============\nGPU 00000000:3B:00.0\n"
                    + "".join(" " * (i + 1) + f"Label {i} : x\n" for i in range(1000)))
    with pytest.raises(SnapshotError, match=f"indented more than {MAX_DEPTH} levels"):
        load_snapshot(path)


def test_xml_bombs_and_external_entities_are_still_refused(tmp_path):
    laughs = "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))
    bomb = f'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY l0 "lol">{laughs}]><nvidia_smi_log>&l9;</nvidia_smi_log>'
    xxe = ('<?xml version="1.0"?><!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/hostname">]>'
           '<nvidia_smi_log><gpu id="00000000:3B:00.0"><product_name>&x;</product_name></gpu></nvidia_smi_log>')
    for name, content, why in (("bomb.xml", bomb, "amplification"), ("xxe.xml", xxe, "undefined entity")):
        (tmp_path / name).write_text(content)
        with pytest.raises(SnapshotError, match=why):
            load_snapshot(tmp_path / name)


@pytest.mark.parametrize("as_folder", [False, True], ids=["file", "folder"])
def test_an_oversize_capture_is_refused_before_reading(tmp_path, as_folder):
    path = tmp_path / "nvidia-smi-q.xml"
    with path.open("wb") as f:
        f.truncate(500 << 20)                   # sparse: 500 MB long, nothing written
    started = time.monotonic()
    proc = gpu_npd("--nvml", f"replay:{tmp_path if as_folder else path}", timeout=20)
    refused(proc, str(path), "524,288,000 bytes", f"over the {MAX_CAPTURE_BYTES:,}-byte limit")
    assert time.monotonic() - started < 5


def test_a_capture_just_under_the_cap_is_read_for_what_it_is(tmp_path):
    """Size alone refuses nothing below the cap: a real capture padded with blank lines still replays."""
    data = (H100 / "nvidia-smi-q.txt").read_bytes()
    path = tmp_path / "nvidia-smi-q.txt"
    path.write_bytes(data + b"\n" * (MAX_CAPTURE_BYTES - len(data)))
    assert load_snapshot(path).gpus[0].uuid == "GPU-bff4f743-db36-25ae-6681-309f14ae3866"


def _capture_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "capture"
    folder.mkdir()
    shutil.copy(H100 / "nvidia-smi-q.xml", folder)
    return folder


def test_a_side_file_linked_out_of_the_folder_is_refused_and_its_target_never_read(tmp_path):
    folder = _capture_folder(tmp_path)
    target = tmp_path / "outside"
    os.mkfifo(target)                          # were it opened, the open would wait for a writer for ever
    (folder / "proc-modules.txt").symlink_to(target)
    started = time.monotonic()
    proc = gpu_npd("--nvml", f"replay:{folder}", timeout=20)
    refused(proc, str(folder / "proc-modules.txt"), "symbolic link", "side files must be regular files")
    assert time.monotonic() - started < 5


def test_a_side_file_linked_with_dotdot_is_refused_even_to_a_harmless_file(tmp_path):
    folder = _capture_folder(tmp_path)
    shutil.copy(H100 / "proc-modules.txt", tmp_path)
    (folder / "proc-modules.txt").symlink_to("../proc-modules.txt")
    with pytest.raises(SnapshotError, match="symbolic link"):
        read_side_files(folder)


def test_the_snapshot_in_a_folder_may_not_be_a_link_either(tmp_path):
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / "nvidia-smi-q.xml").symlink_to(H100 / "nvidia-smi-q.xml")
    with pytest.raises(SnapshotError, match="symbolic link"):
        load_snapshot(folder)


def test_the_users_own_link_to_a_capture_is_followed(tmp_path):
    link = tmp_path / "latest.xml"
    link.symlink_to(H100 / "nvidia-smi-q.xml")
    assert load_snapshot(link).gpus[0].uuid == "GPU-bff4f743-db36-25ae-6681-309f14ae3866"


@pytest.mark.parametrize("kind", ["fifo", "oversize", "folder"])
def test_a_side_file_that_is_not_a_small_regular_file_is_refused(tmp_path, kind):
    folder = _capture_folder(tmp_path)
    side = folder / "nvidia-smi-nvlink.txt"
    if kind == "fifo":
        os.mkfifo(side)
    elif kind == "oversize":
        with side.open("wb") as f:
            f.truncate(MAX_SIDE_FILE_BYTES + 1)
    else:
        side.mkdir()
    with pytest.raises(SnapshotError, match={"fifo": "a FIFO", "oversize": "limit", "folder": "a directory"}[kind]):
        read_side_files(folder)


def test_regular_side_files_are_still_read(tmp_path):
    folder = _capture_folder(tmp_path)
    for name in ("proc-modules.txt", "proc-driver-nvidia-version.txt", "dev-nvidia.txt"):
        shutil.copy(H100 / name, folder)
    side = read_side_files(folder)
    assert side.modules == {"nvidia_uvm": "Live", "nvidia": "Live"}
    assert set(side.read) == {"proc-modules.txt", "proc-driver-nvidia-version.txt", "dev-nvidia.txt"}


# -- saved kernel logs ----------------------------------------------------------------------------


def test_a_line_over_the_cap_is_cut_keeping_its_start_and_the_line_numbers_after_it():
    cap = 256
    data = (f"{STAMP}{X79}\n{STAMP}{X13} " + "x" * 10_000 + f"\n{STAMP}{X48}\n").encode()
    for chunk in (16, 100, 256, 4096):
        got: list[tuple[int, int, int]] = []
        stats = scan_stream(io.BytesIO(data), lambda n, p, t: got.append((n, p.code, len(t))),
                            chunk_size=chunk, max_line=cap, finder=find_passes)
        assert [(n, code) for n, code, _ in got] == [(1, 79), (2, 13), (3, 48)], chunk
        assert got[1][2] < max(cap, chunk)          # the long line's start only
        assert (stats.lines, stats.long_lines) == (3, 1), chunk


def test_a_saved_log_may_not_be_a_fifo_or_a_device(tmp_path):
    fifo = tmp_path / "kern.log"
    os.mkfifo(fifo)
    refused(gpu_npd("--kernel-log", str(fifo), timeout=5), "a FIFO, not a regular file")
    refused(gpu_npd("--kernel-log", "/dev/zero", timeout=20), "a character device, not a regular file")


def _peak_rss_mib(log: Path) -> tuple[float, dict]:
    """`gpu-npd diagnose --kernel-log LOG -o json` in a process of its own: its peak RSS and its report."""
    probe = ("import resource, subprocess, sys\n"
             "p = subprocess.run([sys.executable, '-m', 'detector.cli.main', 'diagnose', '-q', '-o', 'json',\n"
             "                    '--kernel-log', sys.argv[1]], capture_output=True, text=True)\n"
             "sys.stderr.write(p.stderr)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "print(p.stdout)\n")
    env = {k: v for k, v in os.environ.items() if k != "GPU_NPD_NVML"}
    proc = subprocess.run([sys.executable, "-c", probe, str(log)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    rss_kib, _, report = proc.stdout.partition("\n")
    return int(rss_kib) / 1024, json.loads(report)


def _events(report: dict) -> list[tuple[int, int]]:
    xid = next(c for c in report["checks"] if c["name"] == "xid")
    return [(e["code"], e["line"]) for e in xid["result"]["kernel_events"]]


@pytest.fixture(scope="module")
def small_log_rss(tmp_path_factory) -> float:
    log = tmp_path_factory.mktemp("small") / "kern.log"
    log.write_text(f"{STAMP}{X79}\n{STAMP}{X48}\n")
    rss, report = _peak_rss_mib(log)
    assert _events(report) == [(79, 1), (48, 2)]
    return rss


# Without the cap the scanner's buffer doubles until the line fits: 104 MiB for the 50 MB line, 574 MiB for
# 256 MiB of zeros (both measured before the fix), against about 40 MiB for a two-line log.
GROWTH_MIB = 24


def test_a_50_mb_line_is_read_in_bounded_memory_and_the_xids_around_it_are_found(tmp_path, small_log_rss):
    log = tmp_path / "kern.log"
    with log.open("wb") as f:
        f.write(f"{STAMP}{X79}\n{STAMP}{X13} ".encode())
        f.write(b"A" * (50 << 20) + b"\n")
        f.write(f"{STAMP}{X48}\n".encode())
    rss, report = _peak_rss_mib(log)
    assert _events(report) == [(79, 1), (13, 2), (48, 3)]       # the cut line's XID too: its start is kept
    assert rss - small_log_rss < GROWTH_MIB, (rss, small_log_rss)


def test_gzipped_zeros_inflating_1000_fold_are_read_in_bounded_memory(tmp_path, small_log_rss):
    """A multi-member gzip (as `cat a.gz b.gz` makes): one 1 MiB member of zeros, about 1 KiB compressed,
    repeated: 256 KiB on disk inflate to 256 MiB of one line."""
    zeros = gzip.compress(b"\0" * (1 << 20), compresslevel=9)
    log = tmp_path / "kern.log.1.gz"
    with log.open("wb") as f:
        f.write(gzip.compress(f"{STAMP}{X79}\n".encode()))
        for _ in range(256):
            f.write(zeros)
        f.write(gzip.compress(f"\n{STAMP}{X48}\n".encode()))
    assert log.stat().st_size < 512 << 10
    rss, report = _peak_rss_mib(log)
    assert _events(report) == [(79, 1), (48, 3)]
    assert rss - small_log_rss < GROWTH_MIB, (rss, small_log_rss)

