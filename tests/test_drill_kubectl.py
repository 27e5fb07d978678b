"""The fault drill of docs/simulation.md, end to end with the real kubectl: a simulated fleet on the emulator (HTTPS,
the simulator's own RBAC), a node broken with `kubectl annotate`, the condition seen with `kubectl get -o
custom-columns` and `kubectl describe node` (with its events), the annotation removed, the condition
cleared. kubectl comes from `make kubectl` (which `make test` runs)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from detector.cli.simulate import SIMULATOR_USER
from detector.core.check import CheckRegistry
from detector.daemon.local import REPO_DEPLOY
from detector.kube.api import KubeApi
from detector.sim.faultlog import FaultLog
from detector.agent.agent import AgentSettings
from detector.sim.fleet import Fleet, FleetSettings
from detector.sim.fleetfile import fleet_from_dict
from kube_emulator import Emulator
from kube_emulator.rbac import ADMIN
from test_deploy_render import require_kubectl
from conftest import builtin_rules

NODE = "gpu-h100-0007"
XID79 = '{"kind": "xid", "gpu": 3, "params": {"code": 79}}'
COLUMNS = ('custom-columns=NAME:.metadata.name,'
           'XID:.status.conditions[?(@.type=="GpuXidError")].status,'
           'GPU_MISSING:.status.conditions[?(@.type=="GpuMissing")].status')

# A cure is trusted after one round of every check (a reboot makes every check due at once), not the
# daemon's three: these tests are about the drill, not the verification (tests/test_lifecycle.py).
QUICK_CURES = AgentSettings(start_spread_s=0.0, verify_sweeps=1)


@pytest.fixture
def drill(tmp_path):
    kubectl_path = require_kubectl()
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok"), https=True) as emulator:
        simulator = emulator.write_kubeconfig(tmp_path / "simulator.kubeconfig", user=SIMULATOR_USER)
        admin = emulator.write_kubeconfig(tmp_path / "admin.kubeconfig", user=ADMIN)
        registry = CheckRegistry.from_entry_points()
        fleet = Fleet(fleet_from_dict({"version": 1, "seed": 7, "nodes": [
                          {"scenario": "h100-sxm-8", "count": 12, "name": "gpu-h100-{index:04d}"}]}),
                      KubeApi.from_kubeconfig(str(simulator), qps=500.0, burst=500),
                      builtin_rules(), registry,
                      FleetSettings(workers=2, start_spread_s=0.0, agent=QUICK_CURES), FaultLog(tmp_path / "faults.jsonl"))
        fleet.start()
        home = tmp_path / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(HOME=str(home), KUBECONFIG=str(admin), NO_PROXY="127.0.0.1,localhost")

        def kubectl(*args: str) -> str:
            done = subprocess.run([kubectl_path, *args], capture_output=True, text=True, env=env, timeout=60)
            assert done.returncode == 0 and done.stderr == "", f"kubectl {' '.join(args)}: {done.stderr}"
            return done.stdout

        try:
            yield kubectl, fleet
        finally:
            fleet.stop()


def eventually(probe, timeout_s: float = 30.0):
    """probe() until it returns something true; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def columns(kubectl) -> dict[str, list[str]]:
    rows = [line.split() for line in kubectl("get", "nodes", "-o", COLUMNS).splitlines()]
    assert rows[0] == ["NAME", "XID", "GPU_MISSING"]
    return {row[0]: row[1:] for row in rows[1:]}


def test_break_a_node_with_kubectl_see_it_and_heal_it(drill):
    kubectl, fleet = drill
    # healthy first: judged, and a problem never seen on a node is not written there (issue 34)
    assert eventually(lambda: all(n.reporter.settled(["GpuXidError", "GpuMissing"]) for n in fleet.nodes.values())
                      and columns(kubectl).get(NODE) == ["<none>", "<none>"]), "the node reports healthy first"

    assert kubectl("annotate", "node", NODE, f"gpu-npd.io/inject-fault={XID79}").strip() == f"node/{NODE} annotated"
    assert eventually(lambda: columns(kubectl)[NODE] == ["True", "True"]), columns(kubectl)
    assert all(state == ["<none>", "<none>"] for name, state in columns(kubectl).items() if name != NODE)

    described = eventually(lambda: (lambda out: out if "Xid79GpuFellOffBus" in out.split("Events:")[-1] else "")(
        kubectl("describe", "node", NODE)))
    conditions, events = described.split("Conditions:")[1].split("Addresses:")[0], described.split("Events:")[1]
    assert any(line.split()[:2] == ["GpuXidError", "True"] and "Xid79GpuFellOffBus" in line
               for line in conditions.splitlines()), conditions
    assert any(line.split()[:2] == ["Warning", "Xid79GpuFellOffBus"] for line in events.splitlines()), events
    status = json.loads(kubectl("get", "node", NODE, "-o", "jsonpath={.metadata.annotations.gpu-npd\\.io/fault-status}"))
    assert status["applied"] == ["xid on GPU 3 (code=79)"]

    assert kubectl("annotate", "node", NODE, "gpu-npd.io/inject-fault-").strip() == f"node/{NODE} annotated"
    assert eventually(lambda: columns(kubectl)[NODE] == ["False", "False"]), columns(kubectl)
    cleared = eventually(lambda: (lambda out: out if "GpuXidError cleared" in out else "")(
        kubectl("describe", "node", NODE)))
    assert "Normal" in cleared.split("Events:")[1]
    assert [(r["kind"], r["source"]) for r in fleet.fault_log.records()] == [("xid", "annotation"), ("reboot", "annotation")]


def test_a_bad_annotation_is_an_event_on_the_node_and_changes_nothing(drill):
    kubectl, fleet = drill
    kubectl("annotate", "node", NODE, 'gpu-npd.io/inject-fault={"kind": "xid", "gpu": 3}')
    described = eventually(lambda: (lambda out: out if "InvalidFaultAnnotation" in out else "")(
        kubectl("describe", "node", NODE)))
    assert "needs parameter 'code'" in described.split("Events:")[1].replace("\n", " ")
    assert fleet.fault_log.records() == []
    assert columns(kubectl)[NODE] == ["<none>", "<none>"]          # never True: not written (issue 34)
