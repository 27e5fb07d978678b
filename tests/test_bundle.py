"""`gpu-npd bundle`: a bundle is a replay. For every bundled fault scenario whose problems one snapshot can show,
`bundle --nvml fake:S --out DIR` then `diagnose --nvml replay:DIR` finds the same rules as the fake node
itself, within the bundle's size cap; the cap, the redaction and the errors are tested on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detector.agent.bundle_writer import redact
from detector.cli.main import main
from fake_nvml.scenario import bundled_scenarios

# What one snapshot cannot show, and why. Each is a real limit of a capture, not of the bundle's writing.
NOT_IN_A_SNAPSHOT = {
    # A GPU NVML counts but cannot open (off the bus) is not in nvidia-smi -q: the replay sees it on the bus
    # (lspci.txt) and NVML without it, so it names it gpu-not-visible-to-nvml, not gpu-fell-off-bus (which
    # needs NVML's own GPU_IS_LOST answer); the XID in kernel.log still fires (see below). A GPU NVML never
    # listed (gpu-missing, init-failed) replays the same.
    "h100-sxm-8-xid79": "GPU off the bus: NVML's GPU_IS_LOST is not in nvidia-smi -q (seen as not visible)",
    "h100-sxm-8-device-plugin-stale": "GPU off the bus: NVML's GPU_IS_LOST is not in nvidia-smi -q (seen as "
                                      "not visible)",
    # No NVML, no nvidia-smi -q: the bundle holds the verdict and the kernel log, but no capture to replay.
    "h100-sxm-8-no-driver": "no driver: nvidia-smi -q prints nothing to replay",
    "h100-sxm-8-driver-mismatch": "nvidia-smi cannot initialise NVML (version mismatch): nothing to replay",
    "h100-sxm-8-nvml-hang": "NVML hangs: nvidia-smi -q -x times out, nothing to replay",
    "h100-sxm-8-smi-hang": "nvidia-smi hangs: -q -x times out, nothing to replay",
    # Rates and latencies over a window: one snapshot has no window.
    "h100-sxm-8-nvml-slow": "NVML latency is measured over calls, a capture holds answers",
    # Time-held states: a live sweep waits for a reason to be held over its window, a snapshot counts what it
    # shows as held (detector/cli/replay_host.py HELD), so the replay finds more, not the same.
    "h100-sxm-8-hw-slowdown": "a clock reason held over a window",
    "h100-sxm-8-power-brake": "a clock reason held over a window",
    "h100-sxm-8-throttle-blip": "a clock reason held over a window",
    "h100-sxm-8-hot-gpu": "a clock reason held over a window",
    "h100-sxm-8-hbm-hot": "a clock reason held over a window",
    "h100-sxm-8-fabric-not-started": "fabric registration held over a window; the fabric manager's service",
    # Host services and InfiniBand ports are read live from the host, and no capture file holds them.
    "h100-sxm-8-fabric-manager-down": "the fabric manager service: not in a capture",
    "gb200-nvl72-4-imex-down": "the IMEX daemon: not in a capture",
    "h100-sxm-8-ib-port-down": "InfiniBand ports: not in a capture",
    "h100-sxm-8-ib-rate-degraded": "InfiniBand ports: not in a capture",
}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _rules(argv: list[str], capsys) -> set[tuple[str, tuple[str, ...]]]:
    code, out, err = _run([*argv, "-o", "json", "-q"], capsys)
    assert code in (0, 1), err
    return {(p["rule"], tuple(g.get("pci_bus_id") or "" for g in p["gpu_details"])) for p in json.loads(out)["problems"]}


def _bundle(scenario: str, out: Path, capsys, *extra: str) -> dict:
    code, stdout, err = _run(["bundle", "-q", "--nvml", f"fake:{scenario}", "--out", str(out), *extra], capsys)
    assert code == 0, err
    assert stdout.strip() == str(out)
    return json.loads((out / "manifest.json").read_text())


def test_the_list_of_what_a_snapshot_cannot_show_names_only_bundled_scenarios():
    assert set(NOT_IN_A_SNAPSHOT) <= set(bundled_scenarios())


SHOWN = [s for s in bundled_scenarios() if s not in NOT_IN_A_SNAPSHOT]


@pytest.mark.parametrize("scenario", SHOWN)
def test_a_bundle_replays_to_the_same_rules(scenario, tmp_path, capsys):
    manifest = _bundle(scenario, tmp_path / "b", capsys)
    on_node = _rules(["diagnose", "--nvml", f"fake:{scenario}"], capsys)
    replayed = _rules(["diagnose", "--nvml", f"replay:{tmp_path / 'b'}"], capsys)
    assert replayed == on_node
    on_disk = sum(p.stat().st_size for p in (tmp_path / "b").iterdir() if p.name != "manifest.json")
    assert manifest["bytes"] == on_disk <= 64 << 20
    assert manifest["truncated"] == []


def test_remap_pending_bundle_names_the_gpu_and_replays_its_remap(tmp_path, capsys):
    """The issue's own acceptance: the pending remap and the uncorrectable error on GPU 2 come back."""
    manifest = _bundle("h100-sxm-8-remap-pending", tmp_path / "b", capsys)
    replayed = _rules(["diagnose", "--nvml", f"replay:{tmp_path / 'b'}"], capsys)
    assert ("memory-remap-pending", ("0000:3a:00.0",)) in replayed
    assert [g["pci_bus_id"] for g in manifest["gpus"]] == ["0000:3a:00.0"]
    assert manifest["gpus"][0]["serial"] and manifest["gpus"][0]["uuid"].startswith("GPU-")
    names = {f["name"] for f in manifest["files"]}
    assert {"nvidia-smi-q.xml", "nvml.json", "kernel.log", "verdict.json", "proc-modules.txt",
            "proc-driver-nvidia-version.txt", "dev-nvidia.txt"} <= names
    verdict = json.loads((tmp_path / "b" / "verdict.json").read_text())
    assert {p["rule"] for p in verdict["problems"]} == {r for r, _ in replayed}


def test_the_replay_reads_the_bundles_kernel_log(tmp_path, capsys):
    """xid-79 comes from kernel.log alone: without it the replay does not find it."""
    _bundle("h100-sxm-8-xid79", tmp_path / "b", capsys)
    assert ("xid-79", ("0000:5d:00.0",)) in _rules(["diagnose", "--nvml", f"replay:{tmp_path / 'b'}"], capsys)
    (tmp_path / "b" / "kernel.log").unlink()
    assert not any(r == "xid-79" for r, _ in _rules(["diagnose", "--nvml", f"replay:{tmp_path / 'b'}"], capsys))


def test_a_kernel_log_link_in_a_replay_folder_is_refused(tmp_path, capsys):
    _bundle("h100-sxm-8", tmp_path / "b", capsys)
    (tmp_path / "b" / "kernel.log").unlink()
    (tmp_path / "b" / "kernel.log").symlink_to("/etc/hostname")
    code, _, err = _run(["diagnose", "--nvml", f"replay:{tmp_path / 'b'}"], capsys)
    assert code == 2 and "kernel.log: not a regular file" in err


def test_the_size_cap_cuts_the_kernel_log_and_leaves_out_what_does_not_fit(tmp_path, capsys):
    manifest = _bundle("h100-sxm-8-xid79", tmp_path / "b", capsys, "--max-size", "0.3")
    assert manifest["bytes"] <= 0.3 * (1 << 20)
    assert manifest["truncated"], manifest
    written = {f["name"] for f in manifest["files"]}
    assert {p.name for p in (tmp_path / "b").iterdir()} == written | {"manifest.json"}
    assert not set(manifest["truncated"]) & written - {"kernel.log"}


def test_a_non_empty_folder_is_refused(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("keep me")
    code, _, err = _run(["bundle", "--nvml", "fake:h100-sxm-8", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and "not empty" in err
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["mine.txt"]


def test_an_unwritable_folder_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, _, err = _run(["bundle", "--nvml", "fake:h100-sxm-8", "--out", str(tmp_path / "file" / "b")], capsys)
    assert code == 2 and "gpu-npd: error:" in err and "file" in err


# Real lines: tests/fixtures/real_logs/gh-nvidia-open-gpu-kernel-modules-446.yaml (Talos kernel log with the
# node's IP) and gh-siderolabs-extensions-893.yaml (a service log line with an IP and a GUID).
TALOS = ("192.168.11.119: kern: warning: [2026-04-22T21:27:51.291660856Z]: NVRM: kflcnCoreDumpNondestructive_IMPL: "
         "TRACE: 08 = 0x0000000004d4b1a0")
FM = ("10.10.10.10: 2025/11/25 13:58:49 nvidia-fabricmanager-wrapper: found NVSwitch LPF: device=mlx5_10 "
      "guid=0xcc40f3030027f630")
# Real look-alikes that must stay: a bus id, a UUID, a driver version, a kmsg record, an XID line.
KEEP = ("NVRM: GPU at PCI:0000:18:00: GPU-1f140f8d-9831-5f17-a432-a2a962145d9e",
        "6,0,10,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07",
        "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "<pci_bus_id>00000000:00:06.0</pci_bus_id>", "Thu Nov 26 14:07:21 2026")


def test_redaction_takes_addresses_and_keeps_gpu_identities():
    assert redact(TALOS).startswith("[ip]: kern: warning: [2026-04-22T21:27:51.291660856Z]: NVRM:")
    assert "10.10.10.10" not in redact(FM) and "guid=0xcc40f3030027f630" in redact(FM)
    for line in KEEP:
        assert redact(line) == line
    assert redact("fe80::1c2b:3dff:fe4e:5f60 login-2.dc1.example.com /home/alice/train.py", keep=["gpu-node-7"]) \
        == "[ip] [host] /home/[user]/train.py"
    assert redact("node gpu-node-7.dc1.example.com", keep=["gpu-node-7.dc1.example.com"]) == \
        "node gpu-node-7.dc1.example.com"


def test_no_redact_keeps_addresses(tmp_path, capsys):
    log = tmp_path / "kern.log"
    log.write_text(TALOS + "\n")
    _bundle("h100-sxm-8", tmp_path / "r", capsys, "--kernel-log", str(log))
    _bundle("h100-sxm-8", tmp_path / "n", capsys, "--kernel-log", str(log), "--no-redact")
    assert "192.168.11.119" not in (tmp_path / "r" / "kernel.log").read_text()
    assert (tmp_path / "n" / "kernel.log").read_text() == TALOS + "\n"
