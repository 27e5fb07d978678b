"""`gpu-npd fleet --flaky`: the GPUs, by serial, whose incidents recur across boots, from what the daemons
write on their nodes: the annotation entry's `boots` (written from 2 on) and the GpuFlaky condition naming a
serial. Written by the real node check over fake boots, then read back from the emulator as a person with the
read-only fleet-viewer RBAC reads it; with look-alikes that must not be listed (one boot only, a GpuFlaky
condition naming another serial, a `boots` gpu-npd never writes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from detector.core.gpu_health import DEGRADED, FAILED, GpuHealth
from detector.core.types import GpuRef
from detector.kube.annotations import UNHEALTHY_GPUS, read_unhealthy_gpus, unhealthy_gpus_annotation
from detector.kube.api import KubeApi
from detector.kube.conditions import MARKER
from test_fleet_cli import GPU_LABELS, emulator, fleet, own_condition, viewer  # noqa: F401 - fixtures
from test_node_check import DAY, Boots, rules  # noqa: F401 - fixture

GPU3 = GpuRef(3, "GPU-3", "0000:5d:00.0")


def test_the_annotation_says_boots_only_when_incidents_recur():
    once = GpuHealth(GPU3, FAILED, "RESTART_BM", ("Xid79GpuFellOffBus",), incidents=1, boots=1, serial="165")
    again = GpuHealth(GPU3, FAILED, "RESTART_BM", ("Xid79GpuFellOffBus",), incidents=2, boots=2, serial="165")
    assert '"boots"' not in unhealthy_gpus_annotation([once])
    value = unhealthy_gpus_annotation([again])
    assert value.endswith('"state":"failed","action":"RESTART_BM","boots":2}]')
    assert read_unhealthy_gpus(value)[0].boots == 2


@pytest.mark.parametrize("planted", ['"3"', "true", "1", "0", "-4", "2.5", "100000", "null"])
def test_a_boots_gpu_npd_never_writes_reads_as_unknown(planted):
    [gpu] = read_unhealthy_gpus(f'[{{"index":3,"state":"failed","boots":{planted}}}]')
    assert gpu.boots is None and gpu.state == "failed"


def test_the_node_check_over_real_boots_writes_boots(registry, rules, tmp_path):
    """Incidents on GPU 3 in two boots: its entry says boots 2; GPU 5, failed in the second boot only, none."""
    boots = Boots(registry, rules, tmp_path)
    boots.fail(3, code=48)
    boots.reboot(after_s=DAY)
    boots.fail(3, 5, code=48)
    entries = {g.index: g for g in read_unhealthy_gpus(unhealthy_gpus_annotation(boots.agent.gpu_health()))}
    assert entries[3].boots == 2 and entries[5].boots is None
    assert entries[3].serial == boots.node.read(lambda state: state.gpus[3].serial)


def entry(index: int, serial: str | None, state: str, action: str, boots: int | None = None) -> dict:
    fields = {"index": index, "pciBusId": f"0000:{index + 0x18:02x}:00.0", "uuid": f"GPU-{index}", "serial": serial,
              "state": state, "action": action, "since": "2026-03-02T10:41:07Z", "boots": boots}
    return {k: v for k, v in fields.items() if v is not None}


def flaky_condition(message: str, now: float) -> dict:
    return {**own_condition("GpuFlaky", "True", now, "FlakyGpu"), "message": MARKER + message}


def test_fleet_flaky_lists_recurring_gpus_by_serial(emulator, viewer, capsys):
    now = time.time()
    admin = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(Path(viewer).parent / "admin.kc", user="admin")))

    def node(name: str, entries: list[dict], *conditions: dict) -> None:
        emulator.create_node(name, labels=GPU_LABELS, capacity={"nvidia.com/gpu": "8"},
                             conditions=[own_condition("GpuXidError", "False", now - 30), *conditions])
        if entries:
            admin.patch_node_annotations(name, {UNHEALTHY_GPUS: json.dumps(entries, separators=(",", ":"))})

    # gpu-a: GPU 3 flaky (3 boots, GpuFlaky names its serial); GPU 5 failed in this boot only: not listed.
    node("gpu-a", [entry(3, "1650000000003", DEGRADED, "REPLACE_GPU", 3), entry(5, "1650000000005", FAILED, "RESTART_BM")],
         flaky_condition("GPU 3 (GPU-3, 0000:1b:00.0): serial 1650000000003, incidents on 3 boots within 30d "
                         "(2026-02-10T08:00:00Z, 2026-02-20T08:00:00Z, 2026-03-02T10:41:07Z: Xid48DoubleBitEccError)",
                         now - 30))
    # gpu-b: GPU 1 failing for the second boot, its serial never read (lost before the daemon saw it work).
    node("gpu-b", [entry(1, None, FAILED, "RESTART_BM", 2)])
    # gpu-c: an older daemon (no boots): GpuFlaky names GPU 2's serial.
    node("gpu-c", [entry(2, "1650000000222", DEGRADED, "REPLACE_GPU")],
         flaky_condition("GPU 2 (GPU-2, 0000:1a:00.0): serial 1650000000222, incidents on 4 boots within 30d "
                         "(…: Xid79GpuFellOffBus)", now - 30))
    # gpu-d: GpuFlaky names a serial its annotation does not carry (a look-alike): nothing listed.
    node("gpu-d", [entry(4, "1650000000444", FAILED, "RESTART_BM")],
         flaky_condition("GPU 6 (GPU-6, 0000:1e:00.0): serial 16500000004445, incidents on 3 boots", now - 30))
    node("gpu-e", [])                                      # healthy

    code, out = fleet(viewer, "--flaky", capsys=capsys)
    assert code == 1, out
    lines = out.strip().splitlines()
    assert lines[0].split() == ["NODE", "GPU", "SERIAL", "BUS", "ID", "UUID", "BOOTS", "FLAKY", "STATE", "ACTION",
                                "SINCE"]
    assert [line.split()[:8] for line in lines[1:-1]] == [
        ["gpu-a", "3", "1650000000003", "0000:1b:00.0", "GPU-3", "3", "yes", "degraded"],
        ["gpu-b", "1", "-", "0000:19:00.0", "GPU-1", "2", "no", "failed"],
        ["gpu-c", "2", "1650000000222", "0000:1a:00.0", "GPU-2", "?", "yes", "degraded"]]
    assert lines[-1] == "3 GPUs failing on more than one boot (2 flaky) on 3 of 5 GPU nodes"

    code, out = fleet(viewer, "--flaky", "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 1 and doc["nodes"] == 5 and doc["malformed"] == {"nodes": 0, "first": None}
    assert doc["gpus"][0] == {"node": "gpu-a", "index": 3, "serial": "1650000000003", "pciBusId": "0000:1b:00.0",
                              "uuid": "GPU-3", "boots": 3, "flaky": True, "state": "degraded",
                              "action": "REPLACE_GPU", "since": "2026-03-02T10:41:07Z"}
    assert [(g["node"], g["serial"], g["boots"], g["flaky"]) for g in doc["gpus"][1:]] == [
        ("gpu-b", None, 2, False), ("gpu-c", "1650000000222", None, True)]


def test_fleet_flaky_with_nothing_recurring_exits_0(emulator, viewer, capsys):
    now = time.time()
    emulator.create_node("gpu-1", labels=GPU_LABELS, capacity={"nvidia.com/gpu": "8"},
                         conditions=[own_condition("GpuXidError", "True", now - 30, "Xid79GpuFellOffBus")])
    admin = KubeApi.from_kubeconfig(str(emulator.write_kubeconfig(Path(viewer).parent / "admin.kc", user="admin")))
    admin.patch_node_annotations("gpu-1", {UNHEALTHY_GPUS: json.dumps([entry(3, "165", FAILED, "RESTART_BM")])})
    code, out = fleet(viewer, "--flaky", capsys=capsys)
    assert code == 0 and out.strip() == "no GPU's incidents recur across boots: 1 GPU node read"
    code, out = fleet(viewer, "--flaky", "-o", "json", capsys=capsys)
    assert code == 0 and json.loads(out)["gpus"] == []
    code, _ = fleet(viewer, capsys=capsys)                 # the plain view still lists the failed GPU
    assert code == 1
