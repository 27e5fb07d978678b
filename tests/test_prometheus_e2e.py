"""A real Prometheus scrapes a real gpu-npd daemon on loopback and evaluates the shipped rules.

The daemon is `gpu-npd run`'s Daemon on a fake 8x H100 node, reporting to the Kubernetes API emulator, its
/metrics on 127.0.0.1. Prometheus is Debian's `prometheus` binary (the package `make test` installs), started
with a scratch data directory on a free loopback port, a 1 s scrape and evaluation interval, and the
PrometheusRule's groups of deploy/monitoring as its rule file (their `interval` set to 1 s, nothing else
changed). The scrape config gives the target the labels the PodMonitor's scrape would (the job
"gpu-npd/gpu-npd", `node`, `namespace`, `pod`, `container`, `endpoint`). Each test waits for what it asks
Prometheus's HTTP API, within a deadline, and stops Prometheus and the daemon whatever happens.

Without the binary the tests skip and say how to install it; everything else missing is a failure."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from detector.daemon.local import local_daemon
from detector.daemon.run import DaemonSettings

RULE_FILE = REPO / "deploy" / "monitoring" / "prometheusrule.yaml"
JOB = "gpu-npd/gpu-npd"
START_TIMEOUT_S = 30.0
WAIT_S = 60.0
INSTALL = ("prometheus not found on PATH: it is Debian's `prometheus` package (`apt-get install "
           "--no-install-recommends prometheus`, which `make test` runs as root)")


def fast_settings() -> DaemonSettings:
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    settings.reporter.backoff_base_s, settings.reporter.backoff_cap_s = 0.01, 0.2
    return settings


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_rules_every_second() -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all(RULE_FILE.read_text(encoding="utf-8")) if d is not None]
    spec = doc["spec"]
    for group in spec["groups"]:
        if "interval" in group:
            group["interval"] = "1s"
    return spec


@dataclass
class Prometheus:
    address: str
    process: subprocess.Popen
    log: Path

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant vector: [{"metric": {...}, "value": [time, "value"]}]."""
        return self.api("query", query=promql)["result"]

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited ({self.process.returncode}):\n{self.tail()}"
            try:
                last = predicate()
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:     # not serving yet
                last = e
            if last and not isinstance(last, Exception):
                return last
            time.sleep(0.25)
        pytest.fail(f"prometheus: no {what} within {timeout_s:.0f} s (last: {last!r})\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


@contextmanager
def prometheus(tmp_path: Path, target: str, node: str) -> Iterator[Prometheus]:
    """A Prometheus scraping `target` as gpu-npd's PodMonitor would, with the shipped rules; stopped on exit."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(INSTALL)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(shipped_rules_every_second(), sort_keys=False),
                                         encoding="utf-8")
    labels = {"node": node, "namespace": "gpu-npd", "pod": f"gpu-npd-{node}", "container": "gpu-npd",
              "endpoint": "metrics"}
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "rule_files": ["rules.yaml"],
              "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target], "labels": labels}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    server = Prometheus(address, process, log)
    try:
        server.wait_for("ready API", lambda: server.api("status/buildinfo"), timeout_s=START_TIMEOUT_S)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def value(sample: dict[str, Any]) -> float:
    return float(sample["value"][1])


def by_gpu(samples: list[dict[str, Any]]) -> dict[str, float]:
    return {s["metric"]["gpu"]: value(s) for s in samples}


def test_prometheus_scrapes_the_daemon_and_evaluates_the_shipped_rules(tmp_path):
    """up is 1, the GPUs' series arrive with the scrape's labels, and a recording rule and an alert of the
    shipped file are evaluated on them: 8 GPUs counted, none failed, GpuNpdDown and GpuNpdAbsent quiet."""
    local = local_daemon("h100-sxm-8", "gpu-e2e", checks=["pcie", "thermal"], settings=fast_settings(),
                         workdir=tmp_path / "daemon").start()
    try:
        with prometheus(tmp_path / "prometheus", local.daemon.endpoints.address, local.node_name) as prom:
            [up] = prom.wait_for("up == 1", lambda: prom.query(f'up{{job="{JOB}"}} == 1'))
            assert up["metric"]["instance"] == local.daemon.endpoints.address and up["metric"]["node"] == "gpu-e2e"
            health = prom.wait_for("GPU health series", lambda: prom.query('gpu_npd_gpu_health{node="gpu-e2e"}'))
            assert sorted(by_gpu(health), key=int) == [str(i) for i in range(8)]
            assert {s["metric"]["state"] for s in health} == {"healthy"} and {value(s) for s in health} == {0.0}
            [count] = prom.wait_for("cluster:gpu_npd_gpus:count", lambda: prom.query("cluster:gpu_npd_gpus:count"))
            assert value(count) == 8
            [failed] = prom.query("cluster:gpu_npd_gpus_failed:count")
            assert value(failed) == 0
            prom.wait_for("rule evaluation", lambda: all(g["rules"] and all(r["health"] == "ok" for r in g["rules"])
                                                         for g in prom.api("rules")["groups"]))
            groups = prom.api("rules")["groups"]
            assert sorted(g["name"] for g in groups) == ["gpu-npd.alerts", "gpu-npd.rules"]
            assert not [r["lastError"] for g in groups for r in g["rules"] if r.get("lastError")]
            # Absent before the first scrape (pending at the first evaluation), gone once `up` is there.
            quiet = {"GpuNpdDown", "GpuNpdAbsent", "GpuNpdGpuFailed", "GpuNpdGpuDegraded", "GpuSlowerThanFleetPeers"}
            prom.wait_for("the target's alerts to clear", lambda: not [
                a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] in quiet], timeout_s=10)
    finally:
        local.stop()


def test_prometheus_finds_the_slow_gpu_against_its_model_s_fleet(tmp_path):
    """fake:h100-sxm-8-slow-gpu: all 8 GPUs busy, GPU 5 at a 400 W power limit against 700 W. Prometheus's
    recording rules count 8 busy H100s, put GPU 5 under 80% of their median SM clock and the others near it,
    and GpuSlowerThanFleetPeers is pending (its `for` is 15m) for GPU 5 alone, its description quoting the
    power limits."""
    checks = {"performance": {"interval": 0.5, "window": 30.0, "min_span": 1.0, "min_samples": 2}}
    local = local_daemon("h100-sxm-8-slow-gpu", "gpu-slow", checks=["performance"], check_settings=checks,
                         settings=fast_settings(), workdir=tmp_path / "daemon").start()
    try:
        with prometheus(tmp_path / "prometheus", local.daemon.endpoints.address, local.node_name) as prom:
            prom.wait_for("up == 1", lambda: prom.query(f'up{{job="{JOB}"}} == 1'))
            [busy] = prom.wait_for("8 busy GPUs", lambda: [s for s in prom.query("model:gpu_npd_gpus_busy:count")
                                                           if value(s) == 8])
            model = busy["metric"]["model"]
            assert "H100" in model
            ratios = prom.wait_for("each GPU's clock against the median", lambda: by_gpu(prom.query(
                "gpu:gpu_npd_gpu_busy_sm_clock_mhz:ratio_to_model_median")) if len(prom.query(
                    "gpu:gpu_npd_gpu_busy_sm_clock_mhz:ratio_to_model_median")) == 8 else None)
            assert ratios["5"] < 0.8, ratios
            assert all(0.9 <= r <= 1.1 for gpu, r in ratios.items() if gpu != "5"), ratios
            pending = prom.wait_for("GpuSlowerThanFleetPeers pending", lambda: [
                a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == "GpuSlowerThanFleetPeers"])
            assert [(a["labels"]["gpu"], a["labels"]["node"], a["state"]) for a in pending] == [("5", "gpu-slow", "pending")]
            description = pending[0]["annotations"]["description"]
            assert "Its power limit: 400 W (the model's median: 700 W)" in description, description
            assert f"8 busy {model} GPUs" in description, description
    finally:
        local.stop()
