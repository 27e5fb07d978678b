"""The node label `nvidia.com/gpu.clique` (kube/conditions.py, kube/reporter.py): written in the status PATCH
gpu-npd already sends, only where the node had none when read, so the DRA driver's or GPU feature
discovery's value is reused and never overwritten; and the emulator (deploy/base's RBAC, nodes/status only)
takes it."""

from __future__ import annotations

import random

from conftest import Clock
from detector.core.gpu_health import GpuHealth
from detector.core.nvlink_domain import CLIQUE_LABEL
from detector.core.types import GpuRef
from detector.daemon.local import REPO_DEPLOY
from detector.kube.api import KubeApi
from detector.kube.reporter import KubeReporter
from kube_emulator import Emulator
from test_kube_reporters import ScriptedApi, reporter, xid

CLIQUE = "6f1c2b4e-8d3a-4c59-9e27-0b5d7a1f3c88.1"


def patches(api: ScriptedApi) -> list[dict]:
    return [body for verb, body in api.calls if verb == "patch-status"]


def test_written_once_where_the_node_has_none():
    api, clock = ScriptedApi(), Clock()
    out = reporter(api, clock)
    out.adopt(api.node)
    assert out.clique(CLIQUE) and out.update([xid(True)])     # a condition to carry it (a False one never
    #                                                            True is not written: issue 34)
    assert out.flush()
    assert patches(api)[0]["metadata"]["labels"] == {CLIQUE_LABEL: CLIQUE}
    assert not out.clique(CLIQUE)                            # on the node now: not sent again
    clock.now += 400
    out.flush()                                              # a heartbeat carries no label
    assert all("metadata" not in body for body in patches(api)[1:]) and len(patches(api)) == 2


def test_a_label_already_there_is_reused_never_overwritten():
    api, clock = ScriptedApi(node={"metadata": {"labels": {CLIQUE_LABEL: "0b5d7a1f-0000-4c59-9e27-6f1c2b4e8d3a.7"}},
                                   "status": {"conditions": []}}), Clock()
    out = reporter(api, clock)
    out.adopt(api.node)
    assert not out.clique(CLIQUE)
    out.update([xid(True)])
    out.flush()
    assert all("labels" not in body.get("metadata", {}) for body in patches(api))


def test_nothing_is_written_before_the_node_was_read_or_when_the_gpus_disagree():
    api, clock = ScriptedApi(), Clock()
    out = reporter(api, clock)
    assert not out.clique(CLIQUE)                            # the node's labels are not known yet
    out.update([xid(False)])
    out.flush()
    assert all("labels" not in body.get("metadata", {}) for body in patches(api))


def health(bus: str, clique: str) -> GpuHealth:
    return GpuHealth(GpuRef(0, None, bus), "healthy", "NONE", clique=clique)


def test_the_daemons_own_rbac_and_the_emulator_take_it(tmp_path):
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        emulator.create_node("gb200-1")
        daemon = emulator.write_kubeconfig(tmp_path / "daemon.kubeconfig", user="system:serviceaccount:gpu-npd:gpu-npd")
        out = KubeReporter(KubeApi.from_kubeconfig(str(daemon)), "gb200-1", ["GpuXidError"], rng=random.Random(1))
        out.conditions([xid(False)])
        out.flush()                                          # reads the node
        out.gpus([health("0008:01:00.0", CLIQUE), health("0009:01:00.0", CLIQUE)])
        out.flush()
        assert emulator.node("gb200-1")["metadata"]["labels"].get(CLIQUE_LABEL) == CLIQUE
        other = KubeReporter(KubeApi.from_kubeconfig(str(daemon)), "gb200-1", ["GpuXidError"], rng=random.Random(2))
        other.conditions([xid(False)])
        other.flush()
        other.gpus([health("0008:01:00.0", CLIQUE.replace(".1", ".2")), health("0009:01:00.0", "")])
        other.flush()
        assert emulator.node("gb200-1")["metadata"]["labels"][CLIQUE_LABEL] == CLIQUE   # kept as it was
