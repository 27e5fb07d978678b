"""The daemon on a fake GPU node against an in-process Kubernetes API emulator, all in one process.

`make demo`, the latency and footprint benchmarks and the end-to-end tests share this: the same
Daemon as `gpu-npd run`, with the fake node in hand so faults can be injected on purpose.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from detector.rules.sources import builtin_rules_dir
from detector.config import build_checks
from detector.core.check import CheckRegistry
from detector.daemon.run import Daemon, DaemonSettings
from detector.kube.api import KubeApi
from detector.rules.loader import load_rules
from fake_nvml.host import fake_host
from fake_nvml.node import FakeNode
from fake_nvml.scenario import load_scenario
from kube_emulator import Emulator
from kube_emulator.rbac import deploy_rbac

SERVICE_ACCOUNT = "system:serviceaccount:gpu-npd:gpu-npd"
# deploy/base's RBAC as packaged with gpu-npd (kube_emulator/deploy/base/rbac.yaml, identical to the
# repository's), so this works from any directory and installed; its parent holds kwok/ and
# overlays/dra-taints/ the same way.
REPO_DEPLOY = deploy_rbac("base")
DRA_TAINTS_RBAC = deploy_rbac("overlays/dra-taints")
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"


@dataclass
class LocalDaemon:
    emulator: Emulator
    node: FakeNode
    daemon: Daemon
    workdir: Path
    thread: threading.Thread | None = None
    exit_code: int | None = None
    _owns_emulator: bool = True

    @property
    def node_name(self) -> str:
        return self.node.name

    def start(self) -> "LocalDaemon":
        def target() -> None:
            self.exit_code = self.daemon.run()
        self.thread = threading.Thread(target=target, name=f"daemon-{self.node_name}", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.daemon.stop.set()
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self._owns_emulator:
            self.emulator.stop()

    def conditions(self) -> dict[str, dict[str, Any]]:
        node = self.emulator.node(self.node_name)
        return {c["type"]: c for c in node.get("status", {}).get("conditions", [])}

    def settled(self, *types: str) -> bool:
        """The daemon judged these condition types and the API server shows what it decided: True, False,
        or, for a problem never seen on this node, no condition at all."""
        reporter = self.daemon.reporter
        return reporter is not None and reporter.settled(list(types))

    def events(self) -> list[dict[str, Any]]:
        return [e for e in self.emulator.events() if e.get("involvedObject", {}).get("name") == self.node_name]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.005) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(poll_s)
        return predicate()


def local_daemon(scenario: str = "h100-sxm-8", node_name: str = "gpu-node-1", *,
                 settings: DaemonSettings | None = None, check_settings: dict[str, Any] | None = None,
                 checks: list[str] | None = None, emulator: Emulator | None = None,
                 state_dir: Path | None = None, workdir: Path | None = None,
                 user: str = SERVICE_ACCOUNT, rbac: Path = REPO_DEPLOY, node: FakeNode | None = None,
                 api_server: str | None = None, clock: Callable[[], float] | None = None) -> LocalDaemon:
    """Build (not start) a daemon for a fresh fake node registered on an emulator (started if not given).
    `api_server`: talk to this URL instead of the emulator's own (a proxy in front of it, in the tests).
    `clock`: the fake node's and the checks' time (a ScaledClock fills ten-minute windows in seconds); the
    daemon's own loops keep real time."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="gpu-npd-local-"))
    owns = emulator is None
    if emulator is None:
        emulator = Emulator(rbac_paths=(rbac,))
        emulator.start()
    node = node or load_scenario(scenario).build(node_name, **({"clock": clock} if clock else {}))
    if not _has_node(emulator, node.name):
        emulator.create_node(node.name, labels={"nvidia.com/gpu.present": "true"},
                             capacity={"nvidia.com/gpu": str(len(node.snapshot().gpus))})
    kubeconfig = emulator.write_kubeconfig(workdir / f"{node.name}.kubeconfig", user=user)
    settings = settings or DaemonSettings(listen="127.0.0.1:0")
    if state_dir is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
        settings.agent.state_dir = state_dir
    host = fake_host(node, kernel_cursor=state_dir / "kmsg-cursor.json" if state_dir else None, clock=clock)
    registry = CheckRegistry.from_entry_points()
    ruleset = load_rules([builtin_rules_dir()], registry.fields_by_check())
    api = KubeApi.from_kubeconfig(str(kubeconfig), qps=50.0, burst=100)
    if api_server is not None:
        api = KubeApi(replace(api.connection, server=api_server), qps=50.0, burst=100)
    checks_built = build_checks(registry, checks, check_settings or {}, clock=host.clock)
    daemon = Daemon(host, checks_built, ruleset, api, settings)
    return LocalDaemon(emulator, node, daemon, workdir, _owns_emulator=owns)


def publish_gpu_slice(emulator: Emulator, node: FakeNode, bus_id_only: frozenset[int] = frozenset()) -> dict:
    """What the NVIDIA DRA driver publishes for a node: one ResourceSlice, one pool named after the node,
    devices gpu-<minor> with the GPU's uuid and PCI bus id (GPUs in `bus_id_only` without a uuid)."""
    devices = []
    for gpu in node.snapshot().gpus:
        attributes = {"resource.kubernetes.io/pciBusID": {"string": gpu.pci_bus_id},
                      "productName": {"string": gpu.model.name}, "index": {"int": gpu.index}}
        if gpu.index not in bus_id_only:
            attributes["uuid"] = {"string": gpu.uuid}
        device = {"name": f"gpu-{gpu.minor}", "attributes": attributes}
        devices.append(device if emulator.dra_version != "v1alpha3" else {"name": device["name"], "basic": {
            "attributes": attributes}})
    return emulator.create_resource_slice({
        "metadata": {"name": f"{node.name}-{NVIDIA_DRA_DRIVER}-abcde"},
        "spec": {"driver": NVIDIA_DRA_DRIVER, "nodeName": node.name,
                 "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1}, "devices": devices}})


def _has_node(emulator: Emulator, name: str) -> bool:
    return any(n["metadata"]["name"] == name for n in emulator.nodes())
