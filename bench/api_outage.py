#!/usr/bin/env python3
"""The API-outage drill at full length and default settings: the API server unreachable for the first
three minutes after `gpu-npd run` starts, an XID 79 at minute one.

Starts the Kubernetes API emulator in this process, takes it down, and starts `gpu-npd run` on a fake
8x H100 node whose timeline fires XID 79 on GPU 5 at `--xid-at` seconds, in a child process with
default backoff, outage logging and heartbeat. Polls /healthz and /readyz every second, watches
/metrics for the XID while the API server is away, brings the API server back at `--outage` seconds and
measures how long the condition takes to reach the node. Counts the daemon's warning lines about the
outage. The test suite runs the same drill scaled by 1/20 (tests/test_daemon_e2e.py); this is the real
clock. The last line printed is a JSON object of the figures.

    .venv/bin/python bench/api_outage.py                  # 180 s outage, XID at 60 s (about 4 minutes)
    .venv/bin/python bench/api_outage.py --outage 30 --xid-at 10
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kube_emulator import Emulator  # noqa: E402

NODE = "outage-node"
XID_GAUGE = 'gpu_npd_problem_gauge{reason="Xid79GpuFellOffBus",type="GpuXidError"} 1.0'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage", type=float, default=180.0, help="seconds the API server is away (default 180)")
    parser.add_argument("--xid-at", type=float, default=60.0, help="when XID 79 fires, seconds (default 60)")
    parser.add_argument("--wait", type=float, default=120.0, help="give up on the condition after this (default 120)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gpu-npd-outage-"))
    scenario = workdir / "scenario.yaml"
    scenario.write_text(f"description: XID 79 on GPU 5 at {args.xid_at:g} s\nextends: h100-sxm-8\n"
                        f"faults:\n  - {{at: {args.xid_at}, kind: xid, gpu: 5, code: 79}}\n")
    log_path = workdir / "daemon.log"
    with Emulator(rbac_paths=(ROOT / "deploy" / "base",)) as emulator:
        emulator.create_node(NODE, labels={"nvidia.com/gpu.present": "true"})
        kubeconfig = emulator.write_kubeconfig(workdir / "kubeconfig")
        emulator.down(duration_s=args.outage)
        started = time.monotonic()
        gpu_npd = Path(sys.executable).with_name("gpu-npd")
        child = subprocess.Popen([str(gpu_npd), "run", "--nvml", f"fake:{scenario}", "--node-name", NODE,
                                  "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0",
                                  "--state-dir", str(workdir / "state"), "--log-format", "json"],
                                 stderr=open(log_path, "wb"))
        try:
            address = _address(log_path)
            health: list[int] = []
            ready: list[int] = []
            xid_in_metrics_s = None
            while time.monotonic() - started < args.outage:
                health.append(_get(address, "/healthz")[0])
                ready.append(_get(address, "/readyz")[0])
                if xid_in_metrics_s is None and XID_GAUGE in _get(address, "/metrics")[1]:
                    xid_in_metrics_s = time.monotonic() - started
                time.sleep(1.0)
            while not emulator.is_up:
                time.sleep(0.05)
            back = time.monotonic()
            condition_s = None
            while time.monotonic() - back < args.wait:
                health.append(_get(address, "/healthz")[0])
                if _xid_condition(emulator):
                    condition_s = time.monotonic() - back
                    break
                time.sleep(0.1)
            ready_after = _get(address, "/readyz")
        finally:
            child.send_signal(signal.SIGTERM)
            code = child.wait(timeout=30)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    outage_lines = [e for e in lines if e["logger"] == "gpu_npd.kube" and e["level"] in ("warning", "error")]
    result = {
        "outage_s": args.outage, "xid_at_s": args.xid_at,
        "xid_in_metrics_after_start_s": None if xid_in_metrics_s is None else round(xid_in_metrics_s, 1),
        "condition_after_api_back_s": None if condition_s is None else round(condition_s, 2),
        "healthz_polls": len(health), "healthz_non_200": sum(1 for c in health if c != 200),
        "readyz_503_during_outage": sum(1 for c in ready if c == 503), "readyz_polls": len(ready),
        "readyz_after": ready_after[0], "outage_warning_lines": len(outage_lines),
        "outage_lines": [e["msg"][:160] for e in outage_lines],
        "recovery_lines": [e["msg"][:160] for e in lines if e["logger"] == "gpu_npd.kube" and e["level"] == "info"],
        "exit_code": code,
    }
    print(f"API server away {args.outage:g} s, XID 79 at {args.xid_at:g} s: in /metrics at "
          f"{result['xid_in_metrics_after_start_s']} s, condition on the node "
          f"{result['condition_after_api_back_s']} s after the API server returned; /healthz non-200 "
          f"{result['healthz_non_200']} of {len(health)}; {len(outage_lines)} outage warning lines")
    print(json.dumps(result))
    return 0 if condition_s is not None and result["healthz_non_200"] == 0 else 1


def _address(log_path: Path, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if "http://" in line:
                return json.loads(line)["msg"].rsplit("http://", 1)[1]
        time.sleep(0.1)
    raise SystemExit(f"the daemon never said where it listens; see {log_path}")


def _get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _xid_condition(emulator: Emulator) -> bool:
    return any(c["type"] == "GpuXidError" and c["status"] == "True"
               for c in emulator.node(NODE)["status"].get("conditions", []))


if __name__ == "__main__":
    sys.exit(main())
