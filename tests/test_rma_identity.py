"""Identity for an RMA ticket: every GPU's serial number, board part number and VBIOS version next to
its UUID and bus id, in `diagnose` (table and JSON) and in the daemon's `gpu_npd_gpu_info` metric."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from conftest import node_for
from test_cli import diagnose_json, gpu_npd
from test_daemon_e2e import emulator, fast_settings, running  # noqa: F401 - fixtures
from detector.agent.metrics import AgentMetrics
from detector.core.inventory import read_inventory
from detector.core.sweep import SweepResult
from fake_nvml.faults import Fault
from fake_nvml.nvml import FakeNvml

IDENTITY = ("serial", "board_part_number", "vbios_version")


def test_diagnose_json_maps_each_uuid_to_its_serial():
    code, report = diagnose_json("h100-sxm-8")
    assert code == 0
    gpus = report["gpus"]
    assert all(set(IDENTITY) <= set(g) for g in gpus)
    serials = {g["uuid"]: g["serial"] for g in gpus}
    assert len(set(serials.values())) == 8 and all(re.fullmatch(r"\d{13}", s) for s in serials.values())
    assert {g["board_part_number"] for g in gpus} == {"692-2G520-0200-000"}
    assert {g["vbios_version"] for g in gpus} == {"96.00.A5.00.16"}


def test_geforce_serial_is_null_not_invented():
    code, report = diagnose_json("rtx-4090-1")
    assert code == 0
    gpu = report["gpus"][0]
    assert gpu["serial"] is None and gpu["vbios_version"] and gpu["board_part_number"]


def test_missing_gpu_row_carries_the_identity_keys_empty():
    code, report = diagnose_json("h100-sxm-8-gpu-missing")
    unseen = [g for g in report["gpus"] if g["error"] == "NotSeenByNvml"]
    assert code == 1 and unseen
    assert all(g[k] is None for g in unseen for k in IDENTITY)


def test_diagnose_table_shows_the_serial_column():
    proc = gpu_npd("diagnose", "--nvml", "fake:h100-sxm-8")
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("GPU "))
    header, first = lines[at:at + 2]
    assert "SERIAL" in header.split()
    node = node_for("h100-sxm-8")
    assert node.snapshot().gpus[0].serial in first.split()


def _info_lines(metrics: AgentMetrics) -> list[str]:
    return [l for l in generate_latest(metrics.registry).decode().splitlines() if l.startswith("gpu_npd_gpu_info{")]


def test_gpu_info_metric_one_series_per_gpu_and_a_vbios_update_replaces_it():
    node = node_for("h100-sxm-8")
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    metrics = AgentMetrics()
    metrics.sweep(SweepResult("n", read_inventory(nvml, 5.0), [], 0.0), [])
    lines = _info_lines(metrics)
    assert len(lines) == 8
    gpu3 = node.snapshot().gpus[3]
    assert any(f'serial="{gpu3.serial}"' in l and f'uuid="{gpu3.uuid}"' in l and 'gpu="3"' in l for l in lines)
    node.inject(Fault("vbios", 3, {"version": "96.00.A5.00.20"}))
    metrics.sweep(SweepResult("n", read_inventory(nvml, 5.0), [], 0.0), [])
    lines = _info_lines(metrics)
    assert len(lines) == 8                                    # replaced, not added
    assert [l for l in lines if 'vbios_version="96.00.A5.00.20"' in l and f'serial="{gpu3.serial}"' in l]


def test_daemon_exports_identity_against_the_emulator(running):
    local = running(name="gpu-ident")
    gpu = local.node.snapshot().gpus[6]
    registry = local.daemon.metrics.registry
    labels = {"gpu": "6", "uuid": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "name": "NVIDIA H100 80GB HBM3",
              "serial": gpu.serial, "board_part_number": "692-2G520-0200-000", "vbios_version": "96.00.A5.00.16"}
    assert local.wait_for(lambda: registry.get_sample_value("gpu_npd_gpu_info", labels) == 1.0, 10)
