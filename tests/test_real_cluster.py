"""The daemon against a real cluster (kind, k3d, KWOK), when GPU_NPD_E2E_KUBECONFIG names a kubeconfig
with gpu-npd's permissions. GPU_NPD_E2E_NODE names the node to report on (default: the first node); the
GPUs are a fake 8x H100 node, so any node will do, a KWOK one best."""

from __future__ import annotations

import os
import time

import pytest
from detector.config import build_checks
from detector.core.check import CheckRegistry
from detector.daemon.run import Daemon, DaemonSettings
from detector.kube.api import KubeApi
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario
from conftest import builtin_rules

KUBECONFIG = os.environ.get("GPU_NPD_E2E_KUBECONFIG")
pytestmark = pytest.mark.skipif(not KUBECONFIG, reason="set GPU_NPD_E2E_KUBECONFIG to run against a real cluster")


def test_xid_condition_appears_and_clears_on_a_real_node():
    kubernetes = pytest.importorskip("kubernetes")
    client = kubernetes.config.new_client_from_config(config_file=KUBECONFIG)
    core = kubernetes.client.CoreV1Api(client)
    name = os.environ.get("GPU_NPD_E2E_NODE") or core.list_node(limit=1).items[0].metadata.name

    def conditions() -> dict:
        return {c.type: c for c in core.read_node_status(name).status.conditions or []}

    ready_before = conditions()["Ready"].status
    node = load_scenario("h100-sxm-8").build(name)
    registry = CheckRegistry.from_entry_points()
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    daemon = Daemon(fake_host(node), build_checks(registry, None, {"visibility": {"interval": 1}}),
                    builtin_rules(),
                    KubeApi.from_kubeconfig(KUBECONFIG), settings)
    import threading
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        def wait(type_: str, status: str) -> bool:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                c = conditions().get(type_)
                if c is not None and c.status == status:
                    return True
                time.sleep(0.2)
            return False
        assert wait("GpuXidError", "False")
        node.inject(Fault("xid", gpu=3, params={"code": 79}))
        assert wait("GpuXidError", "True") and wait("GpuMissing", "True")
        node.inject(Fault("reboot"))
        assert wait("GpuXidError", "False") and wait("GpuMissing", "False")
        assert conditions()["Ready"].status == ready_before
        assert daemon.fatal is None
    finally:
        daemon.stop.set()
        thread.join(10)
