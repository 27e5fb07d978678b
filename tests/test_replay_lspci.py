"""A capture's PCI bus (lspci.txt, `lspci -Dnk`): a GPU on the bus that NVML lost or never listed is there, which
nvidia-smi -q cannot show. A bundle writes it; a replay reads it, a real `lspci -nn` line included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from detector.backends.replay.side_files import LSPCI, PciListed, parse_lspci
from detector.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures"
CAPTURE = FIXTURES / "real_machines" / "h100-vm-580"        # one H100 at 0000:00:06.0, healthy


def test_a_real_lspci_nn_line_is_read_and_its_subsystem_line_is_not_a_device():
    text = (FIXTURES / "lspci" / "gh-openshift-psap-blog-microshift-gpus.txt").read_text()
    assert parse_lspci(text) == (PciListed("0000:17:00.0", 0x030200, 0x10DE, 0x20B7, None),)


def test_lspci_dnk_as_a_bundle_writes_it_with_its_drivers():
    text = ("0000:05:00.0 0680: 10de:22a3 (rev a1)\n\tKernel driver in use: nvidia-nvswitch\n"
            "0000:5d:00.0 0302: 10de:2330 (rev a1)\n\tSubsystem: 10de:16c1\n\tKernel driver in use: nvidia\n"
            "\tKernel modules: nvidiafb, nouveau, nvidia\n0000:9a:00.0 0302: 10de:2330\n")
    assert parse_lspci(text) == (PciListed("0000:05:00.0", 0x068000, 0x10DE, 0x22A3, "nvidia-nvswitch"),
                                 PciListed("0000:5d:00.0", 0x030200, 0x10DE, 0x2330, "nvidia"),
                                 PciListed("0000:9a:00.0", 0x030200, 0x10DE, 0x2330, None))


def _replayed(folder: Path, capsys) -> set[tuple[str, tuple[str, ...]]]:
    capsys.readouterr()
    code = main(["diagnose", "--nvml", f"replay:{folder}", "-o", "json", "-q"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return {(p["rule"], tuple(g.get("pci_bus_id") or "" for g in p["gpu_details"])) for p in json.loads(out)["problems"]}


def test_a_gpu_on_the_bus_that_the_capture_does_not_show_is_missing_from_nvml(tmp_path, capsys):
    folder = tmp_path / "capture"
    shutil.copytree(CAPTURE, folder)
    (folder / LSPCI).write_text("0000:00:06.0 0302: 10de:2330 (rev a1)\n\tKernel driver in use: nvidia\n")
    assert not any(rule.startswith("gpu-") for rule, _ in _replayed(folder, capsys))    # the bus agrees
    (folder / LSPCI).write_text("0000:00:06.0 0302: 10de:2330 (rev a1)\n\tKernel driver in use: nvidia\n"
                                "0000:00:07.0 0302: 10de:2330 (rev a1)\n\tKernel driver in use: nvidia\n")
    assert ("gpu-not-visible-to-nvml", ("0000:00:07.0",)) in _replayed(folder, capsys)


def test_a_bundle_of_a_node_whose_gpu_never_came_up_shows_it_on_replay(tmp_path, capsys):
    assert main(["bundle", "--nvml", "fake:h100-sxm-8-gpu-missing", "--out", str(tmp_path / "b"), "-q"]) == 0
    listing = parse_lspci((tmp_path / "b" / LSPCI).read_text())
    assert "0000:ba:00.0" in {d.bus_id for d in listing if d.class_code >> 8 == 0x0302}
    assert ("gpu-not-visible-to-nvml", ("0000:ba:00.0",)) in _replayed(tmp_path / "b", capsys)
