#!/usr/bin/env python3
"""The metrics port under a slowloris: `gpu-npd run`'s memory, threads and /healthz while 3,000
connections are held open without a complete request.

Starts `gpu-npd run --nvml fake:h100-sxm-8 --no-kube` (this checkout's) in a child process, lets it settle,
then opens --connections connections to its metrics port, half sending nothing and half half a request
line, and for --duration seconds opens again each one the daemon closes (a slowloris keeps its count up),
while asking /healthz every 0.2 s and sampling the daemon's RSS and thread count. Then it lets them all go
and checks the daemon answers. Acceptance (issue 30): RSS grows at most 30 MiB, every /healthz answers
200 within 1 s; the exit code is 1 when either is broken. The last line printed is a JSON object of the
figures.

    .venv/bin/python bench/endpoint_slowloris.py                       # 3,000 connections for 8 s
    .venv/bin/python bench/endpoint_slowloris.py --connections 10000 --duration 60
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RSS_GROWTH_MIB = 30.0
HEALTHZ_S = 1.0


@dataclass
class Samples:
    rss_mib: list[float] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    healthz_failures: list[str] = field(default_factory=list)

    def sample(self, proc: psutil.Process) -> None:
        self.rss_mib.append(proc.memory_info().rss / 2**20)
        self.threads.append(proc.num_threads())


def healthz(address: str) -> tuple[float, str]:
    """(seconds, '' or why it failed)."""
    start = time.monotonic()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{address}/healthz", timeout=5) as answer:
            ok = answer.status == 200 and answer.read() == b"ok\n"
            return time.monotonic() - start, "" if ok else f"status {answer.status}"
    except OSError as e:
        return time.monotonic() - start, f"{type(e).__name__}: {e}"


class Slowloris:
    """Connections that never finish their request; each one the server closes is opened again."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.selector = selectors.DefaultSelector()
        self.opened = self.closed_by_server = self.refused = 0

    def open(self, n: int) -> None:
        for _ in range(n):
            sock = socket.socket()
            sock.setblocking(False)
            if sock.connect_ex((self.host, self.port)) not in (0, 115):     # 115: EINPROGRESS
                sock.close()
                self.refused += 1
                continue
            self.opened += 1
            half = self.opened % 2 == 0
            self.selector.register(sock, selectors.EVENT_WRITE if half else selectors.EVENT_READ, half)

    def turn(self, timeout: float) -> None:
        """Half a request line once connected; a connection the server closed is opened again."""
        lost = 0
        for key, events in self.selector.select(timeout):
            sock: socket.socket = key.fileobj                                # type: ignore[assignment]
            if events & selectors.EVENT_WRITE:
                try:
                    sock.send(b"GET /metr")
                    self.selector.modify(sock, selectors.EVENT_READ, key.data)
                    continue
                except OSError:
                    pass
            else:
                try:
                    if sock.recv(4096):
                        continue                                             # a 408: the close follows
                except BlockingIOError:
                    continue
                except OSError:
                    pass
            self.selector.unregister(sock)
            sock.close()
            self.closed_by_server += 1
            lost += 1
        self.open(lost)

    def held(self) -> int:
        return len(self.selector.get_map())

    def close(self) -> None:
        if self.selector.get_map() is None:                                  # closed already
            return
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            key.fileobj.close()                                              # type: ignore[union-attr]
        self.selector.close()


def start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    log = workdir / "daemon.log"
    command = [sys.executable, "-m", "detector.cli.main", "run", "--nvml", "fake:h100-sxm-8", "--no-kube",
               "--node-name", "slowloris-node", "--listen", "127.0.0.1:0", "--state-dir", str(workdir / "state"),
               "--log-format", "json"]
    child = subprocess.Popen(command, stderr=open(log, "wb"), stdout=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        found = re.search(r"metrics and health on http://([\d.]+:\d+)", log.read_text(errors="replace"))
        if found:
            return child, found[1]
        time.sleep(0.1)
    child.kill()
    sys.exit(f"the daemon did not start; its log:\n{log.read_text(errors='replace')[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=3000, help="held open at once (default 3000)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of the attack (default 8)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before measuring (default 2)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.connections + 64
    if hard != resource.RLIM_INFINITY and hard < want:
        sys.exit(f"RLIMIT_NOFILE's hard limit is {hard}: {args.connections} connections need {want} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))     # the daemon inherits it

    workdir = Path(tempfile.mkdtemp(prefix="gpu-npd-slowloris-"))
    child, address = start_daemon(workdir)
    host, port = address.rsplit(":", 1)
    proc = psutil.Process(child.pid)
    attack = Slowloris(host, int(port))
    try:
        time.sleep(args.settle)
        before = Samples()
        before.sample(proc)
        cpu0 = sum(proc.cpu_times()[:2])
        during = Samples()
        attack.open(args.connections)
        end = time.monotonic() + args.duration
        next_probe = time.monotonic()
        while time.monotonic() < end:
            attack.turn(0.05)
            if time.monotonic() >= next_probe:
                took, failure = healthz(address)
                during.healthz_s.append(took)
                if failure:
                    during.healthz_failures.append(failure)
                during.sample(proc)
                next_probe = time.monotonic() + 0.2
        cpu_s = sum(proc.cpu_times()[:2]) - cpu0
        held = attack.held()
        attack.close()
        time.sleep(1.0)
        after = Samples()
        after.sample(proc)
        took, failure = healthz(address)
        after.healthz_s.append(took)
        after.healthz_failures += [failure] if failure else []
    finally:
        attack.close()
        child.terminate()
        child.wait(timeout=15)

    growth = max(during.rss_mib) - before.rss_mib[0]
    slowest = max(during.healthz_s)
    figures = {
        "connections": args.connections, "duration_s": args.duration,
        "opened": attack.opened, "closed_by_daemon": attack.closed_by_server, "refused": attack.refused,
        "held_at_end": held,
        "rss_before_mib": round(before.rss_mib[0], 1), "rss_peak_mib": round(max(during.rss_mib), 1),
        "rss_after_mib": round(after.rss_mib[0], 1), "rss_growth_mib": round(growth, 1),
        "threads_before": before.threads[0], "threads_peak": max(during.threads), "threads_after": after.threads[0],
        "healthz_probes": len(during.healthz_s), "healthz_max_ms": round(slowest * 1000, 1),
        "healthz_slowest_probe": during.healthz_s.index(slowest),
        "healthz_p50_ms": round(sorted(during.healthz_s)[len(during.healthz_s) // 2] * 1000, 1),
        "healthz_failures": len(during.healthz_failures), "healthz_after_ms": round(after.healthz_s[0] * 1000, 1),
        "daemon_cpu_s": round(cpu_s, 2),
    }
    print(f"daemon RSS {figures['rss_before_mib']} MiB before, {figures['rss_peak_mib']} MiB at peak under "
          f"{args.connections} half-open connections, {figures['rss_after_mib']} MiB after "
          f"(+{figures['rss_growth_mib']} MiB; at most +{RSS_GROWTH_MIB:g})")
    print(f"threads {figures['threads_before']} before, {figures['threads_peak']} at peak, "
          f"{figures['threads_after']} after")
    print(f"/healthz during the attack: {figures['healthz_probes']} probes, median {figures['healthz_p50_ms']} ms, "
          f"slowest {figures['healthz_max_ms']} ms (at most {HEALTHZ_S * 1000:g}), {figures['healthz_failures']} "
          f"failed; after: {figures['healthz_after_ms']} ms")
    print(f"the daemon closed {attack.closed_by_server} connections (opened again), {held} held at the end, "
          f"{figures['daemon_cpu_s']} CPU-seconds in {args.duration:g} s")
    for failure in sorted(set(during.healthz_failures + after.healthz_failures))[:5]:
        print(f"  /healthz failed: {failure}")
    print(json.dumps(figures))
    broken = growth > RSS_GROWTH_MIB or slowest > HEALTHZ_S or during.healthz_failures or after.healthz_failures
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
