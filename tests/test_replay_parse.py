"""The replay parsers on real nvidia-smi outputs (tests/fixtures/replay/README.md names each source)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from detector.backends.replay.load import load_snapshot
from detector.backends.replay.raw import SnapshotError
from detector.backends.replay.side_files import parse_dev_listing, parse_nvlink_status, read_side_files

FIXTURES = Path(__file__).parent / "fixtures" / "replay"
H100 = FIXTURES / "h100-vm-580"
ALL_SNAPSHOTS = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".xml", ".txt") and "nvlink" not in p.name) \
    + [H100 / "nvidia-smi-q.txt", H100 / "nvidia-smi-q.xml"]


@pytest.mark.parametrize("path", ALL_SNAPSHOTS, ids=lambda p: p.name)
def test_every_fixture_parses_to_at_least_one_gpu_record(path):
    snapshot = load_snapshot(path)
    assert snapshot.gpus, path
    assert snapshot.form == ("xml" if path.suffix == ".xml" else "text")


def test_text_and_xml_of_the_real_h100_agree():
    text, xml = load_snapshot(H100 / "nvidia-smi-q.txt"), load_snapshot(H100 / "nvidia-smi-q.xml")
    assert (text.driver_version, text.attached_gpus, text.complete) == (xml.driver_version, 1, True) \
        == ("580.159.04", 1, True)
    t, x = text.gpus[0], xml.gpus[0]
    # Captured seconds apart: power draw and PCIe throughput moved; the XML prints <mig_devices>None</mig_devices>.
    differ = {f.name for f in dataclasses.fields(t) if getattr(t, f.name) != getattr(x, f.name)}
    assert differ == {"power_w", "mig_devices"}
    assert (t.bus_id, t.uuid, t.serial) == ("0000:00:06.0", "GPU-bff4f743-db36-25ae-6681-309f14ae3866", "1653024107109")
    assert (t.pcie_current_gen, t.pcie_max_gen, t.pcie_current_width, t.pcie_max_width) == (5, 5, 16, 16)
    assert t.ecc_mode == (True, True) and t.ecc_volatile.total(uncorrected=True) == 0
    assert t.reasons.active["gpu_idle"] and not t.reasons.active["hw_slowdown"]
    assert (t.remap_pending, t.remap_failure, t.retired_sbe) == (False, False, None)    # Hopper: no page retirement


def test_tlimit_margins_become_the_h100_thresholds():
    """580 prints only T.Limit margins; 36 C with 51 C left to T.Limit, slowdown at -2, shutdown at -8."""
    gpu = load_snapshot(H100 / "nvidia-smi-q.xml").gpus[0]
    assert (gpu.temperature_c, gpu.gpu_max_c, gpu.slowdown_c, gpu.shutdown_c) == (36, 87, 89, 95)
    assert gpu.thresholds_from_tlimit and gpu.memory_max_c is None


def test_mig_xml_counts_its_mig_devices_and_is_one_gpu_of_four():
    snapshot = load_snapshot(FIXTURES / "telegraf-a100-sxm4-v12.xml")
    assert (snapshot.attached_gpus, len(snapshot.gpus), snapshot.complete) == (4, 1, False)
    gpu = snapshot.gpus[0]
    assert gpu.mig_mode == (True, True) and gpu.mig_devices == 4
    assert (gpu.shutdown_c, gpu.slowdown_c, gpu.gpu_max_c, gpu.memory_max_c) == (92, 89, 85, 95)


def test_windows_wddm_and_passthrough_are_read():
    gpu = load_snapshot(FIXTURES / "telegraf-rtx-3080-v12.xml").gpus[0]
    assert gpu.driver_model == "WDDM" and gpu.virtualization_mode == "Pass-Through"
    assert gpu.ecc_mode is None and gpu.ecc_volatile is None       # GeForce: N/A everywhere, not 0


def test_old_throttle_reasons_and_retired_pages():
    old = load_snapshot(FIXTURES / "telegraf-gtx-1660-ti.xml")
    assert old.driver_version == "418.43" and old.gpus[0].reasons.active["gpu_idle"] is True
    t4 = load_snapshot(FIXTURES / "telegraf-tesla-t4.xml").gpus[0]
    assert (t4.retired_sbe, t4.retired_dbe, t4.retired_pending) == (0, 0, False)
    assert t4.pcie_current_width == 8 and t4.pcie_max_width == 16


def test_driver_595_parity_and_secded_counts_are_summed_as_uncorrectable():
    gpu = load_snapshot(FIXTURES / "telegraf-rtx-3080-v13.xml").gpus[0]
    assert gpu.reason_counters_us == {"sw_power_cap": 0, "sync_boost": 0, "sw_thermal_slowdown": 0,
                                      "hw_thermal_slowdown": 0, "hw_power_brake_slowdown": 0}
    assert gpu.ecc_volatile is None                  # every ECC field N/A on this GeForce


def test_old_text_headers_from_drivers_384_and_390():
    gtx = load_snapshot(FIXTURES / "text-384-gtx1080ti-head.txt")
    assert (gtx.driver_version, gtx.complete) == ("384.130", True)
    assert gtx.gpus[0].bus_id == "0000:06:00.0" and gtx.gpus[0].persistence_mode is False
    k80 = load_snapshot(FIXTURES / "text-390-k80-head.txt").gpus[0]
    assert (k80.bus_id, k80.name, k80.minor_number) == ("0000:00:1e.0", "Tesla K80", 0)
    assert k80.reasons is None and k80.temperature_c is None        # the head of the output: not printed


def test_fragments_are_read_for_what_they_hold_and_nothing_else():
    fabric = load_snapshot(FIXTURES / "fragment-fabric-in-progress-gpu-operator-2511.txt")
    assert fabric.complete is False and fabric.gpus[0].bus_id is None
    assert fabric.gpus[0].fabric_state == "In Progress" and fabric.gpus[0].fabric_status is None
    old = load_snapshot(FIXTURES / "fragment-old-ecc-dcgm-exporter-16.txt").gpus[0]
    assert (old.retired_sbe, old.retired_dbe, old.retired_pending) == (0, 0, False)
    assert (old.temperature_c, old.shutdown_c, old.slowdown_c, old.gpu_max_c) == (24, 85, 82, None)
    assert (old.power_w, old.power_limit_w) == (25.33, 250.0)
    assert old.ecc_mode is None and old.reasons is None and old.remapped_corrected is None
    mig = load_snapshot(FIXTURES / "fragment-mig-a100-nvidia-docker-1473.txt").gpus[0]
    assert mig.ecc_volatile is None and mig.ecc_aggregate.total(uncorrected=True) == 0


def test_a_power_brake_fragment_sets_both_hw_reasons():
    gpu = load_snapshot(FIXTURES / "fragment-power-brake-v100-c4130.txt").gpus[0]
    assert gpu.reasons.active == {"hw_slowdown": True, "hw_power_brake_slowdown": True}


def test_side_files_of_the_real_vm():
    side = read_side_files(H100)
    assert side.modules == {"nvidia_uvm": "Live", "nvidia": "Live"}
    assert (side.kernel_module_version, side.kernel_module_flavor) == ("580.159.04", "open")
    assert side.device_files == {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"}
    assert side.nvlink is None


def test_nvlink_status_by_uuid_and_an_empty_listing():
    listing = parse_nvlink_status((FIXTURES / "nvlink-s-h100-bottlerocket-4418.txt").read_text())
    links = listing.links(1, "GPU-dd3b269a-8f3a-d2d5-1518-2713ba03fcf7")
    assert links == {i: True for i in range(18)}
    assert listing.links(0, "GPU-not-in-the-listing") is None
    assert parse_nvlink_status("").empty


def test_plain_ls_of_dev():
    assert parse_dev_listing("/dev/nvidia0  /dev/nvidiactl  /dev/nvidia-uvm\n") == {"nvidia0", "nvidiactl", "nvidia-uvm"}


@pytest.mark.parametrize("content, expected", [
    ("", "empty file"),
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-4039dfe4-0c97-4b1e-683e-eb7d42699053)\n", "not nvidia-smi -q output"),
    ("<?xml version='1.0'?><gpus><gpu/></gpus>", "expected <nvidia_smi_log>"),
    ("<nvidia_smi_log><gpu id='x'>", "not well-formed XML"),
    ("================ HL-SMI LOG ================\n\nDriver Version : 1.12.1\n", "a HL-SMI log"),
])
def test_bad_input_is_a_clear_error_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "capture.txt"
    path.write_text(content)
    with pytest.raises(SnapshotError, match=expected) as e:
        load_snapshot(path)
    assert str(path) in str(e.value)


def test_missing_path_and_folder_without_a_snapshot(tmp_path):
    with pytest.raises(SnapshotError, match="no such file or folder"):
        load_snapshot(tmp_path / "nope")
    with pytest.raises(SnapshotError, match="neither nvidia-smi-q.xml nor nvidia-smi-q.txt"):
        load_snapshot(tmp_path)


@pytest.mark.parametrize("path,printed,brand", [
    (H100 / "nvidia-smi-q.txt", "NVIDIA", "NVML_BRAND_NVIDIA"),
    (FIXTURES / "telegraf-tesla-t4.xml", "NVIDIA", "NVML_BRAND_NVIDIA"),
    (FIXTURES / "telegraf-quadro-p400.xml", "Quadro", "NVML_BRAND_QUADRO"),
    (FIXTURES / "telegraf-rtx-3080-v12.xml", "GeForce", "NVML_BRAND_GEFORCE"),
    (FIXTURES / "text-390-k80-head.txt", "Tesla", "NVML_BRAND_TESLA"),
])
def test_the_product_brand_is_read_and_answered_as_nvmls_constant(path, printed, brand):
    import pynvml
    from detector.backends.replay.nvml import ReplayHandle, ReplayNvml
    snapshot = load_snapshot(path)
    nvml = ReplayNvml(snapshot)
    assert snapshot.gpus[0].brand == printed
    assert nvml.nvmlDeviceGetBrand(ReplayHandle(id(nvml), 0)) == getattr(pynvml, brand)


def test_a_brand_not_printed_is_notsupported_and_one_not_known_is_nvmls_unknown():
    import pynvml
    from detector.backends.replay.nvml import ReplayHandle, ReplayNvml
    snapshot = load_snapshot(FIXTURES / "fragment-power-brake-v100-c4130.txt")
    assert snapshot.gpus[0].brand is None
    nvml = ReplayNvml(snapshot)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetBrand(ReplayHandle(id(nvml), 0))
    renamed = ReplayNvml(dataclasses.replace(snapshot, gpus=(dataclasses.replace(snapshot.gpus[0], brand="Zeta"),)))
    assert renamed.nvmlDeviceGetBrand(ReplayHandle(id(renamed), 0)) == pynvml.NVML_BRAND_UNKNOWN
