#!/usr/bin/env python3
"""The node's API traffic and reports under each API fault of issue 30, against the real `gpu-npd run`.

Each scenario gets a fresh Kubernetes API emulator (in this process, deploy/base's RBAC), a hostile proxy in
front of it (kube_emulator/hostile.py) that the daemon's kubeconfig points at, and `gpu-npd run` on a fake
8x H100 node in a child process, so the memory read from /proc/PID/status (VmHWM, the peak; VmRSS) is the
daemon's own. The daemon runs with its defaults (heartbeat, backoff, deadlines); only the fake node's
timeline (an XID 79 on GPU 5 at a chosen second) is set by the scenario.

- gone, ends-at-once, bookmark-then-end, 429, 5xx: every node watch answered 410 / ended at once / one
  bookmark then ended, or every node LIST and WATCH answered 429 (Retry-After: 1) / 503. Figure: the node
  LIST/WATCH requests in the busiest minute (bound: 12), and in the first and last minute of a longer run.
- retry-after-100000, retry-after-inf: the first request of each kind (method and path) answered 429 with
  that Retry-After, XID 79 at 5 s. Figure: seconds from the XID to its condition on the API server (bound:
  120), /healthz 200 (every loop alive).
- endless-line: every node watch is one line that never ends. Figure: the daemon's peak RSS (bound: 120
  MiB), and an XID 79 at 10 s still reaching the API server.
- trickle: once the daemon has reported, every answer comes at 1 byte/s (XID 79 at 20 s: a report is due).
  Figure: seconds from the first trickled answer to /readyz 503 (bound: 60); then the proxy heals, and the
  seconds to /readyz 200 and to the XID's condition on the API server (bound: 120).

Prints a table (scenario, figure, bound, verdict), then a JSON object of the figures as its last line.
Exits 1 when a bound is broken (the daemon's log is kept and named), 0 otherwise, 2 on bad usage.

    .venv/bin/python bench/api_faults.py                         # every scenario, 60 s each (about 12 minutes)
    .venv/bin/python bench/api_faults.py --scenario gone --seconds 180   # the rate as backoff grows
    .venv/bin/python bench/api_faults.py --quick                 # gone, 429 and endless-line for 5 s each
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kube_emulator import Emulator  # noqa: E402
from kube_emulator.hostile import (BOOKMARK, GONE, HostileApi, Seen, endless_line, node_watch, respond,  # noqa: E402
                                   too_many_requests, trickle, watch_lines)

NODE = "gpu-1"
XID_GPU = 5
RATE_BOUND = 12             # node LIST/WATCH requests in any minute
CONDITION_BOUND_S = 120.0   # a Retry-After of any size: the XID's condition on the API server within this
RSS_BOUND_MIB = 120.0       # an endless watch line: the daemon's peak RSS
READYZ_BOUND_S = 60.0       # a trickled answer: /readyz 503 within this
RESUME_WAIT_S = 120.0       # after the proxy heals: ready and reporting within this
UNAVAILABLE = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"ServiceUnavailable","code":503}'


@dataclass
class Result:
    """One scenario's line of the table, and its figures for the JSON line."""

    scenario: str
    figure: str
    bound: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)
    log: Path | None = None


class Rig:
    """A fresh emulator, hostile proxy and `gpu-npd run` child: one scenario's world, torn down on exit."""

    def __init__(self, workdir: Path, xid_at_s: float | None) -> None:
        self.workdir = workdir
        self.xid_at_s = xid_at_s
        self.emulator = Emulator(rbac_paths=(ROOT / "deploy" / "base",))
        self.hostile: HostileApi | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.log = workdir / "daemon.log"
        self.port = _free_port()
        self.spawned = 0.0

    def __enter__(self) -> "Rig":
        self.emulator.start()
        self.emulator.create_node(NODE, labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "8"})
        self.hostile = HostileApi(upstream=self.emulator.url).start()
        return self

    def start_daemon(self) -> None:
        """Start `gpu-npd run` through the proxy; the fake node's XID 79 is `xid_at_s` after this."""
        assert self.hostile is not None
        kubeconfig = self.emulator.write_kubeconfig(self.workdir / "kubeconfig")
        config = yaml.safe_load(kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = self.hostile.url
        kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        scenario = self.workdir / "node.yaml"
        faults = "" if self.xid_at_s is None else \
            f"faults:\n  - {{at: {self.xid_at_s}, kind: xid, gpu: {XID_GPU}, code: 79}}\n"
        scenario.write_text(f"description: the api_faults bench's node\nextends: h100-sxm-8\n{faults}")
        command = [sys.executable, "-m", "detector.cli.main", "run", "--nvml", f"fake:{scenario}",
                   "--node-name", NODE, "--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{self.port}",
                   "--state-dir", str(self.workdir / "state"), "--log-format", "json"]
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "NODE_NAME")}
        self.spawned = time.monotonic()
        self.child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), cwd=ROOT,
                                      env=env)

    @property
    def xid_at(self) -> float:
        """When the XID fired (monotonic), near enough: the fake node's clock starts as the child does."""
        assert self.xid_at_s is not None
        return self.spawned + self.xid_at_s

    def get(self, path: str) -> int:
        """The daemon's answer to GET path: its status, or 0 when it does not answer."""
        return self.get_text(path)[0]

    def get_text(self, path: str) -> tuple[int, str]:
        """The daemon's status and body for GET path; (0, why) when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except OSError as e:
            return 0, str(e)

    def alive(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def xid_condition(self) -> bool:
        return any(c["type"] == "GpuXidError" and c["status"] == "True"
                   for c in self.emulator.node(NODE)["status"].get("conditions", []))

    def reported(self) -> bool:
        """The daemon's conditions are on the node (kubelet's own are Ready and the pressures)."""
        return any(c["type"].startswith("Gpu") for c in self.emulator.node(NODE)["status"].get("conditions", []))

    def memory_mib(self) -> dict[str, float]:
        """VmHWM (the peak resident set since start) and VmRSS of the child, MiB."""
        assert self.child is not None
        found: dict[str, float] = {}
        try:
            for line in Path(f"/proc/{self.child.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    found[key] = round(int(value.split()[0]) / 1024, 1)
        except OSError:
            pass
        return found

    def wait(self, predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.25) -> float | None:
        """Seconds until predicate() held, None if it never did (or the daemon died) within timeout_s."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if predicate():
                return time.monotonic() - start
            if not self.alive():
                return None
            time.sleep(poll_s)
        return None

    def sleep_until(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.alive():
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def log_summary(self) -> dict[str, Any]:
        """What the daemon said about the API (gpu_npd.kube), its other warnings and errors (conditions aside)
        and tracebacks: how many, and the first of each kind (digits aside)."""
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        said: list[str] = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"level": "raw", "logger": "", "msg": line}
            msg = str(entry.get("msg"))
            if entry.get("logger") == "gpu_npd.kube" or (
                    entry.get("level") in ("warning", "error", "critical", "raw") and not msg.startswith("condition ")):
                said.append(f"{entry.get('level')}: {msg[:160]}")
        kinds: dict[str, str] = {}
        for line in said:
            kinds.setdefault(re.sub(r"[0-9.]+", "N", line), line)
        return {"api_or_error_lines": len(said), "tracebacks": sum("Traceback" in line for line in lines),
                "first_of_each": list(kinds.values())[:8]}

    def __exit__(self, *exc: object) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        if self.hostile is not None:
            self.hostile.stop()
        self.emulator.stop()


# -- scenarios ---------------------------------------------------------------------------------------

def node_list_or_watch(seen: Seen) -> bool:
    return seen.is_node_list_or_watch()


RATE_FAULTS: dict[str, tuple[Callable[[Seen], bool], Callable[[], Any], str]] = {
    "gone": (node_watch, lambda: watch_lines(GONE), "410 Gone on every node watch"),
    "ends-at-once": (node_watch, lambda: watch_lines(), "every node watch ends at once"),
    "bookmark-then-end": (node_watch, lambda: watch_lines(BOOKMARK), "every node watch: one bookmark, then ends"),
    "429": (node_list_or_watch, lambda: too_many_requests("1"), "429 (Retry-After: 1) on every node LIST/WATCH"),
    "5xx": (node_list_or_watch, lambda: respond(503, UNAVAILABLE, {"Content-Type": "application/json"}),
            "503 on every node LIST/WATCH"),
}


def rate(name: str, rig: Rig, seconds: float) -> Result:
    """Node LIST/WATCH requests per minute while every one of them fails (or ends at once)."""
    assert rig.hostile is not None
    matches, behaviour, what = RATE_FAULTS[name]
    rig.hostile.when(matches, behaviour())
    rig.start_daemon()
    rig.sleep_until(rig.spawned + seconds)
    end = time.monotonic()
    times = [s.at - rig.spawned for s in rig.hostile.requests if s.is_node_list_or_watch() and s.at <= end]
    window = end - rig.spawned
    busiest = max((sum(1 for u in times if t <= u < t + 60) for t in times), default=0)
    figures: dict[str, Any] = {"fault": what, "window_s": round(window, 1), "requests": len(times),
                               "busiest_minute": busiest, "at_s": [round(t, 1) for t in times],
                               "healthz": rig.get("/healthz"), "alive": rig.alive()}
    text = f"{busiest} node LIST/WATCH in the busiest minute ({len(times)} in {window:.0f} s"
    if window > 60:
        first = sum(1 for t in times if t < 60)
        last = sum(1 for t in times if t >= window - 60)
        figures |= {"first_minute": first, "last_minute": last}
        text += f"; first minute {first}, last minute {last}"
    ok = busiest <= RATE_BOUND and figures["alive"]
    return Result(name, text + ")" + ("" if figures["alive"] else "; the daemon exited"), f"<= {RATE_BOUND}/min",
                  ok, figures)


class FirstOfEachKind:
    """Matches the first request of each (method, path without query, watch or not): one 429 on every path."""

    def __init__(self) -> None:
        self.kinds: set[tuple[str, str, bool]] = set()
        self.given: list[Seen] = []

    def __call__(self, seen: Seen) -> bool:
        key = (seen.method, seen.path.split("?", 1)[0], seen.watch)
        if key in self.kinds:
            return False
        self.kinds.add(key)
        self.given.append(seen)
        return True


def retry_after(name: str, rig: Rig, seconds: float) -> Result:
    """A huge or infinite Retry-After once on every path: the XID's condition still arrives, every loop lives.

    The 429s of a path the report needs (GET node at start, then PATCH nodes/status) come one after another,
    so the condition is timed from the XID and from the first 429."""
    assert rig.hostile is not None
    value = name.removeprefix("retry-after-")
    first = FirstOfEachKind()
    rig.hostile.when(first, too_many_requests(value))
    rig.start_daemon()
    rig.sleep_until(rig.xid_at)
    arrived = rig.wait(rig.xid_condition, CONDITION_BOUND_S + 5)
    healthz = rig.get("/healthz")
    given = [(round(s.at - rig.spawned, 1), f"{s.method} {s.path.split('?', 1)[0]}{' (watch)' if s.watch else ''}")
             for s in first.given]
    since_first = None if arrived is None or not first.given else rig.xid_at + arrived - first.given[0].at
    figures = {"retry_after": value, "condition_after_xid_s": None if arrived is None else round(arrived, 1),
               "condition_after_first_429_s": None if since_first is None else round(since_first, 1),
               "healthz": healthz, "alive": rig.alive(), "429_at_s": given}
    ok = arrived is not None and arrived <= CONDITION_BOUND_S and healthz == 200
    if arrived is None:
        text = f"XID condition not on the API server after {CONDITION_BOUND_S + 5:.0f} s"
    else:
        text = f"XID condition on the API server {arrived:.1f} s after the XID"
        if since_first is not None:
            text += f" ({since_first:.1f} s after the first 429)"
    return Result(name, f"{text}; /healthz {healthz}; {len(given)} paths got one 429",
                  f"<= {CONDITION_BOUND_S:.0f} s, /healthz 200", ok, figures)


def endless(name: str, rig: Rig, seconds: float) -> Result:
    """Every node watch one endless line: memory stays bounded and reports go on."""
    assert rig.hostile is not None
    rig.hostile.when(node_watch, endless_line(for_s=max(600.0, seconds + 60)))
    rig.start_daemon()
    peak = 0.0
    arrived_at: float | None = None
    deadline = rig.spawned + seconds
    while time.monotonic() < deadline and rig.alive():
        peak = max(peak, rig.memory_mib().get("VmHWM", 0.0))
        if arrived_at is None and time.monotonic() >= rig.xid_at and rig.xid_condition():
            arrived_at = time.monotonic()
        time.sleep(0.5)
    memory = rig.memory_mib()
    peak = max(peak, memory.get("VmHWM", 0.0))
    watches = rig.hostile.count(node_watch, since=rig.spawned)
    figures = {"peak_rss_mib": peak, "rss_mib": memory.get("VmRSS"), "node_watches": watches,
               "condition_after_xid_s": None if arrived_at is None else round(arrived_at - rig.xid_at, 1),
               "healthz": rig.get("/healthz"), "alive": rig.alive(), "window_s": seconds}
    reported = "XID condition arrived" if arrived_at is not None else "XID condition never arrived"
    if arrived_at is not None:
        reported += f" {arrived_at - rig.xid_at:.1f} s after the XID"
    ok = figures["alive"] and peak < RSS_BOUND_MIB and arrived_at is not None
    return Result(name, f"peak RSS {peak:.1f} MiB (now {memory.get('VmRSS')}), {reported}; {watches} node watches",
                  f"< {RSS_BOUND_MIB:.0f} MiB, reporting", ok, figures)


def trickled(name: str, rig: Rig, seconds: float) -> Result:
    """Every answer at 1 byte/s once the daemon has reported: /readyz says so; reports resume after healing.

    The XID fires while the answers trickle, so a report is due; its condition must arrive once healed."""
    assert rig.hostile is not None and rig.xid_at_s is not None
    rig.start_daemon()
    ready = rig.wait(lambda: rig.get("/readyz") == 200 and rig.reported(), rig.xid_at_s - 5)
    if ready is None:
        return Result(name, f"the daemon had not reported within {rig.xid_at_s - 5:.0f} s of starting: nothing "
                      "measured", "-", False, {"alive": rig.alive()})
    trickle_from = time.monotonic()
    rig.hostile.when(lambda seen: True, trickle(1.0))
    reasons: dict[str, float] = {}                          # each distinct 503 reason: seconds into the trickle

    def unready() -> bool:
        code, text = rig.get_text("/readyz")
        if code != 503:
            return False
        if re.sub(r"\d+", "N", text) not in {re.sub(r"\d+", "N", r) for r in reasons}:   # first of each kind
            reasons[text.strip()[:200]] = round(time.monotonic() - trickle_from, 1)
        return True

    unready_s = rig.wait(unready, READYZ_BOUND_S + 30, poll_s=0.5)
    rig.sleep_until(rig.xid_at + 1)                         # the XID is in the daemon before the proxy heals
    figures: dict[str, Any] = {"ready_after_start_s": round(ready, 1),
                               "readyz_503_after_trickle_s": None if unready_s is None else round(unready_s, 1),
                               "readyz_503_reasons": reasons,
                               "xid_after_trickle_s": round(rig.xid_at - trickle_from, 1),
                               "trickled_requests": rig.hostile.count(lambda seen: True, since=trickle_from)}
    rig.hostile.clear()
    healed = time.monotonic()
    back = rig.wait(lambda: rig.get("/readyz") == 200, RESUME_WAIT_S)
    reported = rig.wait(rig.xid_condition, max(0.0, RESUME_WAIT_S - (time.monotonic() - healed)))
    reported_s = None if reported is None else time.monotonic() - healed
    figures |= {"readyz_200_after_heal_s": None if back is None else round(back, 1),
                "condition_after_heal_s": None if reported_s is None else round(reported_s, 1),
                "healthz": rig.get("/healthz"), "alive": rig.alive()}
    ok = unready_s is not None and unready_s <= READYZ_BOUND_S and back is not None and reported_s is not None
    text = (f"/readyz 503 {unready_s:.1f} s into the trickle" if unready_s is not None else
            f"/readyz never 503 in {READYZ_BOUND_S + 30:.0f} s of trickle")
    text += "; healed: " + (f"/readyz 200 after {back:.1f} s" if back is not None else "/readyz never 200")
    text += ", " + (f"XID condition after {reported_s:.1f} s" if reported_s is not None else "XID condition never")
    return Result(name, text, f"503 <= {READYZ_BOUND_S:.0f} s, resumes", ok, figures)


@dataclass(frozen=True)
class Scenario:
    run: Callable[[str, Rig, float], Result]
    xid_at_s: float | None


SCENARIOS: dict[str, Scenario] = {
    **{name: Scenario(rate, None) for name in RATE_FAULTS},
    "retry-after-100000": Scenario(retry_after, 5.0),
    "retry-after-inf": Scenario(retry_after, 5.0),
    "endless-line": Scenario(endless, 10.0),
    "trickle": Scenario(trickled, 20.0),
}
QUICK = ("gone", "429", "endless-line")
QUICK_SECONDS = 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"how long a rate or endless-line scenario is measured (default 60; {QUICK_SECONDS:g} "
                             "with --quick)")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), metavar="NAME",
                        help=f"run only this scenario, repeatable (default: all): {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK)} for {QUICK_SECONDS:g} s each (unless --scenario/--seconds say)")
    parser.add_argument("--keep", action="store_true", help="keep every scenario's work directory (daemon log)")
    args = parser.parse_args()
    names = args.scenario or (list(QUICK) if args.quick else list(SCENARIOS))
    seconds = args.seconds if args.seconds is not None else QUICK_SECONDS if args.quick else 60.0
    if not (math.isfinite(seconds) and seconds > 0):
        parser.error("--seconds must be a positive number")

    results: list[Result] = []
    for name in names:
        print(f"{name}: running ...", file=sys.stderr, flush=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"gpu-npd-api-faults-{name}-"))
        scenario = SCENARIOS[name]
        xid_at_s = None if scenario.xid_at_s is None else \
            min(scenario.xid_at_s, seconds * 0.4) if scenario.run is endless else scenario.xid_at_s
        try:
            with Rig(workdir, xid_at_s) as rig:
                result = scenario.run(name, rig, seconds)
            result.figures["daemon_log"] = rig.log_summary()
            result.log = rig.log
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # a bench that broke is a failed scenario, said in one line
            result = Result(name, f"the bench failed: {type(e).__name__}: {e}", "-", False, {})
        if result.ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        results.append(result)

    _table(results)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"{r.scenario}: bound broken; the daemon's log is {r.log or 'not kept'}")
    print(json.dumps({"seconds": seconds, "ok": not failed,
                      "scenarios": {r.scenario: {"ok": r.ok, "figure": r.figure, **r.figures} for r in results}}))
    return 1 if failed else 0


def _table(results: list[Result]) -> None:
    rows = [("scenario", "figure", "bound", "verdict")] + [
        (r.scenario, r.figure, r.bound, "ok" if r.ok else "BROKEN") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
