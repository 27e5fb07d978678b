#!/usr/bin/env python3
"""The daemon's live kernel-log path under a flood: lines a second per CPU-second of `gpu-npd run`.

Starts the Kubernetes API emulator in this process and the daemon, `gpu-npd run --nvml fake:h100-sxm-8
--checks xid`, in a child process (through gpu-npd's own command line; only its kernel-log source is
swapped for the flood's), waits until it reads the kernel log, then floods that log with ordinary kernel
lines and a real XID line every --xid-every lines (five shapes from tests/fixtures/real_logs), and
measures the child process:

- lines/s per core: flood lines / the daemon process's CPU time (user + system, its own threads only:
  kernel-log watcher, scheduler, xid check, rules, event sender) from the first line to the moment its
  cursor says it has read the last one. Budget (DESIGN section 8): >= 100,000 lines/s per core.
- wall lines/s: flood lines / the seconds from the first line to that moment.
- XIDs in vs out: the XID lines injected against the counts the Kubernetes events for them reached the
  emulator with (the event reporter folds identical events into one with a count; compared per XID code),
  and against the XIDs the xid check counted. Nothing may be lost: the reader's lost, overrun and
  malformed record counts must be 0 too.
- peak RSS of the daemon process (sampled every 0.1 s) over the whole run.

Sources (--source):
  kmsg     the daemon's /dev/kmsg reader, unchanged (DevKmsg: one read(2) per record, poll(2) to wait,
           a self-pipe to wake; KmsgReader: batches, sequence numbers, cursor), over a SOCK_SEQPACKET
           socket instead of the device: one record per read like /dev/kmsg, EAGAIN when caught up, and
           this process writes the flood into it as fast as the daemon takes it (the socket buffer is the
           ring: a writer that is ahead blocks, so the figure is what the reader can take, with no loss).
           Records are formatted as fake_nvml/kmsg.py formats them.
  journal  the daemon's journald reader, unchanged (JournaldReader: `journalctl -k -o json` run as a
           process, --after-cursor, at most 5,000 entries a run), with bench/fake_journalctl.py first on
           the daemon's PATH as `journalctl`; the whole flood is in the journal at once. The fake
           journalctl's CPU time is reported apart (journalctl_cpu_s), not counted as the daemon's.
  both     one after the other, each with a fresh daemon (the default).

The last line printed is a JSON object of the figures: {"kmsg": {...}, "journal": {...}, "budget_...": ...}.

    .venv/bin/python bench/flood.py                          # both sources, the default sizes (< 60 s)
    .venv/bin/python bench/flood.py --source kmsg --lines 1000000
    .venv/bin/python bench/flood.py --source journal --lines 50000 --xid-every 100
    .venv/bin/python bench/flood.py --xid-every 0            # no XIDs at all: the noise alone
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fake_journalctl import PRE, expected_xids, flood_line  # noqa: E402

BUDGET_LINES_PER_S = 100_000
DEFAULT_LINES = {"kmsg": 300_000, "journal": 20_000}
FIRST_SEQ = 1000                 # the kmsg sequence number of the flood's first record
XID_REASON = re.compile(r"^Xid(\d+)[A-Z]")    # per-code rules' event reasons: Xid13GraphicsEngineException


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--daemon-child":
        return _daemon_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=("kmsg", "journal", "both"), default="both",
                        help="which kernel-log reader to flood (default: both, one after the other)")
    parser.add_argument("--lines", type=int, default=None,
                        help=f"flood lines per source (default: {DEFAULT_LINES['kmsg']:,} for kmsg, "
                             f"{DEFAULT_LINES['journal']:,} for journal: the journal reader takes at most 5,000 "
                             f"entries per xid run, so it is slow on the wall clock by design)")
    parser.add_argument("--xid-every", type=int, default=1000, metavar="N",
                        help="every N-th line is a real XID line (default 1000; 0: none)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="give up on a source when the daemon has not read the flood after S seconds")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (daemon logs, state)")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile the daemon's scheduler thread (where the xid check, the rules and the kernel-log "
                             "reads run) with cProfile; writes DIR/SOURCE.prof (read it with python -m pstats)")
    args = parser.parse_args()
    if args.lines is not None and args.lines < 1:
        parser.error("--lines must be at least 1")
    if args.xid_every < 0:
        parser.error("--xid-every must be 0 or more")

    from kube_emulator import Emulator

    sources = ("kmsg", "journal") if args.source == "both" else (args.source,)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-npd-flood-"))
    figures: dict[str, Any] = {}
    with Emulator(rbac_paths=(ROOT / "deploy" / "base",)) as emulator:
        for source in sources:
            lines = args.lines if args.lines is not None else DEFAULT_LINES[source]
            profile = str(Path(args.profile).resolve() / f"{source}.prof") if args.profile else ""
            if profile:
                Path(profile).parent.mkdir(parents=True, exist_ok=True)
            figures[source] = _flood(emulator, source, lines, args.xid_every, args.timeout, workdir / source, profile)
            _say(source, figures[source])
    figures["budget_lines_per_cpu_s"] = BUDGET_LINES_PER_S
    figures["nothing_lost"] = all(f["nothing_lost"] for f in figures.values() if isinstance(f, dict))
    if args.keep:
        print(f"work directory: {workdir}")
    else:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures))
    return 0 if figures["nothing_lost"] else 1


def _say(source: str, f: dict[str, Any]) -> None:
    print(f"{source}: {f['lines']:,} lines ({f['xid_lines_in']:,} XID) read by the daemon in {f['daemon_cpu_s']:.2f} s "
          f"of its CPU: {f['lines_per_cpu_s']:,} lines/s per core (budget >= {BUDGET_LINES_PER_S:,}); "
          f"wall {f['wall_lines_per_s']:,} lines/s over {f['wall_s']:.2f} s; XIDs in {f['xid_lines_in']:,}, "
          f"in events {f['xid_events_out']:,}, counted by the check {f['xid_counted_by_check']:,}; "
          f"lost {f['lost_records']}; peak RSS {f['peak_rss_mib']} MiB"
          + (f"; fake journalctl CPU {f['journalctl_cpu_s']:.2f} s" if "journalctl_cpu_s" in f else ""))


# -- the parent: emulator, flood, measurements -------------------------------------------------------------


def _flood(emulator: Any, source: str, lines: int, xid_every: int, timeout_s: float, workdir: Path,
           profile: str = "") -> dict[str, Any]:
    workdir.mkdir(parents=True)
    node = f"flood-{source}"
    emulator.create_node(node, labels={"nvidia.com/gpu.present": "true"})
    kubeconfig = emulator.write_kubeconfig(workdir / "kubeconfig")
    state = workdir / "state"
    cursor_file = state / "kmsg-cursor.json"
    stats_file = workdir / "child-stats.json"
    env = dict(os.environ)
    pass_fds: tuple[int, ...] = ()
    child_arg = ""
    sock = None
    journal_file = workdir / "journal.json"
    journal = {"pre": len(PRE), "total": len(PRE), "xid_every": xid_every,
               "boot_id": "0f5e1d2c3b4a49788796a5b4c3d2e1f0", "t0": time.time()}
    if source == "kmsg":
        sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pass_fds, child_arg = (theirs.fileno(),), str(theirs.fileno())
    else:
        _write_json(journal_file, journal)
        bindir = workdir / "bin"
        bindir.mkdir()
        fake = bindir / "journalctl"
        fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S -E {ROOT / 'bench' / 'fake_journalctl.py'} \"$@\"\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
        env["FLOOD_JOURNAL"] = str(journal_file)
    command = [sys.executable, str(Path(__file__).resolve()), "--daemon-child", source, child_arg, str(stats_file), profile,
               "--",
               "run", "--nvml", "fake:h100-sxm-8", "--node-name", node, "--kubeconfig", str(kubeconfig),
               "--listen", "127.0.0.1:0", "--state-dir", str(state), "--checks", "xid", "--log-format", "json",
               "--start-spread", "0", "--qps", "50", "--burst", "100",
               "--event-burst", "1000", "--event-refill", "0.01"]   # events: not the bench's bottleneck
    with open(workdir / "daemon.log", "wb") as log:
        child = subprocess.Popen(command, stderr=log, env=env, pass_fds=pass_fds)
    if sock is not None:
        theirs.close()
    proc = psutil.Process(child.pid)
    sampler = _RssSampler(proc)
    sampler.start()
    try:
        _wait(lambda: cursor_file.exists() or child.poll() is not None, 60, "the daemon to read the kernel log")
        if child.poll() is not None:
            raise SystemExit(f"the daemon exited with {child.returncode}; see {workdir / 'daemon.log'}")
        time.sleep(1.0)                                   # let it settle: the first sweep's cost is not the flood's
        cpu0, t0 = _cpu_s(proc), time.monotonic()
        if source == "kmsg":
            assert sock is not None
            feeder = threading.Thread(target=_feed_kmsg, args=(sock, lines, xid_every), daemon=True)
            feeder.start()
            last = FIRST_SEQ + lines - 1
            done = lambda: (_load(cursor_file) or {}).get("seq") == last  # noqa: E731
        else:
            journal["total"] = journal["pre"] + lines
            _write_json(journal_file, journal)
            tail = f"i={journal['total'] - 1}"
            done = lambda: str((_load(cursor_file) or {}).get("cursor", "")).endswith(tail)  # noqa: E731
        _wait(lambda: done() or child.poll() is not None, timeout_s, "the daemon to read the flood", poll_s=0.005)
        cpu1, t1 = _cpu_s(proc), time.monotonic()
        journalctl_cpu = _children_cpu_s(proc)
        expected = expected_xids(lines, xid_every)
        _wait(lambda: _xid_events(emulator, node) == expected or child.poll() is not None, 30,
              "the XID events to reach the emulator", fail=False)
        events = _xid_events(emulator, node)
        conditions = [c["type"] for c in emulator.node(node)["status"].get("conditions", [])
                      if c.get("status") == "True"]
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=30)
        sampler.stop()
        if sock is not None:
            sock.close()
    child_stats = _load(stats_file) or {}
    reader = child_stats.get("reader", {})
    lost = sum(reader.get(k, 0) for k in ("lost_records", "overruns", "malformed", "errors", "timeouts", "failures"))
    xid_in = sum(expected.values())
    counted = child_stats.get("xid_counted", 0)
    cpu = max(cpu1 - cpu0, 0.01)                      # psutil counts CPU time in 10 ms ticks
    figures = {
        "source": source, "lines": lines, "xid_every": xid_every,
        "lines_read": reader.get("records", reader.get("entries", 0)),
        "daemon_cpu_s": round(cpu, 3), "lines_per_cpu_s": round(lines / cpu), "wall_s": round(t1 - t0, 3),
        "wall_lines_per_s": round(lines / max(t1 - t0, 1e-9)),
        "xid_lines_in": xid_in, "xid_events_out": sum(events.values()), "xid_counted_by_check": counted,
        "xid_by_code_in": {str(k): v for k, v in sorted(expected.items())},
        "xid_by_code_out": {str(k): v for k, v in sorted(events.items())},
        "lost_records": lost, "reader_stats": reader, "xid_runs": child_stats.get("xid_runs", 0),
        "peak_rss_mib": round(sampler.peak / 2**20, 1), "conditions_true": conditions,
        "daemon_exit_code": code,
    }
    if source == "journal":
        figures["journalctl_cpu_s"] = round(journalctl_cpu, 3)
    figures["nothing_lost"] = (lost == 0 and events == expected and counted == xid_in
                               and figures["lines_read"] >= lines and code == 0)
    return figures


def _feed_kmsg(sock: socket.socket, lines: int, xid_every: int) -> None:
    """The flood as /dev/kmsg records, as fast as the daemon reads them (send blocks while it is behind)."""
    from fake_nvml.kmsg import format_record
    from fake_nvml.node import KernelRecord

    send = sock.send
    try:
        for i in range(lines):
            text, level, _ = flood_line(i, xid_every)
            seq = FIRST_SEQ + i
            send(format_record(KernelRecord(seq, 5_000_000 + i * 10, level, text)))
    except OSError:
        pass                                  # the daemon went away: the parent reports it


def _xid_events(emulator: Any, node: str) -> dict[int, int]:
    """Counts of the per-code XID events on `node`, by code (escalations and condition flips left out:
    they have their own reasons)."""
    out: dict[int, int] = {}
    for e in emulator.events():
        if e.get("involvedObject", {}).get("name") != node:
            continue
        m = XID_REASON.match(e.get("reason", ""))
        if m:
            code = int(m.group(1))
            out[code] = out.get(code, 0) + int(e.get("count") or 1)
    return out


class _RssSampler(threading.Thread):
    def __init__(self, proc: psutil.Process):
        super().__init__(daemon=True)
        self.proc, self.peak, self._done = proc, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.1):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> None:
        self._done.set()
        self.join()


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _children_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.children_user + t.children_system


def _wait(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05, fail: bool = True) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            if fail:
                raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}")
            return
        time.sleep(poll_s)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# -- the child: gpu-npd run, with the flood as its kernel log -----------------------------------------------


def _daemon_child(argv: list[str]) -> int:
    """`--daemon-child SOURCE FD STATS PROFILE -- run ...`: gpu-npd's own `run` command, its host opened as
    usual and only its kernel-log reader replaced by the flood's; the reader's and the xid check's counts are
    written to STATS when it stops (and the scheduler thread's profile to PROFILE, unless empty)."""
    source, fd, stats_path, profile = argv[0], argv[1], Path(argv[2]), argv[3]
    run_args = argv[argv.index("--") + 1:]

    import detector.cli.hosts as select_mod
    from detector.backends.kernlog import CursorStore, JournaldReader, KmsgReader, boot_time, read_boot_id
    from detector.checks.xid.check import XidCheck
    from detector.cli.main import main as gpu_npd

    readers: list[Any] = []
    totals = {"xid_counted": 0, "xid_runs": 0, "lines_scanned": 0}
    open_host = select_mod.open_host

    def flood_host(spec: str, **kw: Any) -> Any:
        host = open_host(spec, **kw)
        cursor = CursorStore(kw.get("kernel_cursor"))
        if source == "kmsg":
            boot = read_boot_id() or "5a0c1e2d-3b4a-4978-8796-a5b4c3d2e1f0"
            host.kernel_log = KmsgReader(_SocketKmsg(int(fd)), boot, boot_time(), cursor, start="beginning")
        else:
            host.kernel_log = JournaldReader(cursor)      # as live_kernel_log builds it: journalctl on PATH
        readers.append(host.kernel_log)
        return host

    run = XidCheck.run

    def counted_run(self: XidCheck, ctx: Any) -> Any:
        out = run(self, ctx)
        totals["xid_runs"] += 1
        totals["lines_scanned"] += out.result.get("lines_scanned", 0)
        totals["xid_counted"] += len(out.result.get("kernel_events", ())) + out.result.get("kernel_events_omitted", 0)
        return out

    if profile:
        import cProfile

        from detector.daemon.run import Daemon

        loop = Daemon._schedule_loop

        def profiled_loop(self: Any) -> None:
            profiler = cProfile.Profile()
            profiler.enable()
            try:
                loop(self)
            finally:
                profiler.disable()
                profiler.dump_stats(profile)

        Daemon._schedule_loop = profiled_loop                         # type: ignore[method-assign]
    select_mod.open_host = flood_host
    XidCheck.run = counted_run                                       # type: ignore[method-assign]
    code = gpu_npd(run_args)
    from dataclasses import asdict
    _write_json(stats_path, {**totals, "reader": asdict(readers[0].stats) if readers else {}})
    return code


def _socket_kmsg_class() -> Any:
    from detector.backends.kernlog.kmsg import DevKmsg

    class SocketKmsg(DevKmsg):
        """DevKmsg over an inherited SOCK_SEQPACKET socket: the same reads, waits and wakes as over
        /dev/kmsg. A socket has no position to seek: the reader starts at the flood's first record."""

        def __init__(self, fd: int):                  # noqa: super().__init__ opens a path; this has an fd
            import select as select_
            self.path = f"socket fd {fd}"
            self._fd = fd
            os.set_blocking(fd, False)
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._poller = select_.poll()
            self._poller.register(self._wake_r, select_.POLLIN)
            self._poller.register(self._fd, select_.POLLIN)

        def seek_end(self) -> None:
            pass

        def seek_beginning(self) -> None:
            pass

    return SocketKmsg


def _SocketKmsg(fd: int) -> Any:  # noqa: N802 - a factory standing for the class
    return _socket_kmsg_class()(fd)


if __name__ == "__main__":
    sys.exit(main())
