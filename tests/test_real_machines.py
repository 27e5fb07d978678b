"""Every real machine in tests/fixtures/real_machines/ replayed through every default check: healthy ones
(data-centre and consumer, bare metal and VMs, MIG, Windows, old drivers, fragments) give no problem, sick
ones name the problem their output shows on the GPU it shows it on, and nothing else.

Each folder holds what a real machine printed (`nvidia-smi -q` or `-q -x`, side files where captured) and
`expected.yaml`: its public source, the verdict a careful SRE reads in the output, and the problems in a
vocabulary of what the output shows (mapped below to the rules' reasons). SOURCES-*.md list them all."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import diagnose_host
from detector.backends.pciaddr import normalize_bus_id
from detector.cli.replay_host import replay_host

MACHINES = Path(__file__).parent / "fixtures" / "real_machines"
FOLDERS = sorted(p.parent for p in MACHINES.glob("*/expected.yaml"))

# What an output shows -> the reasons that say it (any one of them names it right).
REASONS = {
    "remapped_rows_pending": {"RowRemapPending"},
    "remapped_rows_failure": {"RowRemapFailure"},
    "retired_pages_pending": {"PageRetirementPending"},
    "ecc_volatile_uncorrectable": {"UncorrectableEcc", "UncorrectableEccRising"},
    "hw_slowdown_active": {"HwSlowdown"},
    "hw_thermal_slowdown_active": {"HwThermalSlowdown", "HwSlowdown"},
    "hw_power_brake_active": {"HwPowerBrake", "HwSlowdown"},
    "sw_thermal_slowdown_active": {"ThermalSlowdown"},
    "pcie_downtrained_under_load": {"PcieLinkWidthDegraded", "PcieLinkGenDegraded"},
    "fabric_not_completed": {"FabricRegistrationStuck", "FabricRegistrationFailed"},
    "fabric_unhealthy": {"FabricUnhealthy", "FabricRouteUnhealthy", "FabricIncorrectConfiguration"},
    "fabric_limited_capacity": {"FabricLimitedCapacity", "FabricBandwidthDegraded"},
    "gpu_lost": {"GpuFellOffBus", "GpuNvmlError"},
}


def expected(folder: Path) -> dict:
    return yaml.safe_load((folder / "expected.yaml").read_text(encoding="utf-8"))


def found(outcome) -> set[tuple[str, str]]:
    """(reason, bus id) for each GPU a problem names; bus id '' for a problem that names none."""
    pairs = set()
    for problem in outcome.problems:
        buses = [g.pci_bus_id for g in problem.gpus if g.pci_bus_id] or [""]
        pairs |= {(problem.reason, bus) for bus in buses}
    return pairs


def test_the_corpus_is_large_and_varied():
    docs = [expected(f) for f in FOLDERS]
    assert len(docs) >= 30
    assert sum(d["verdict"] == "sick" for d in docs) >= 10
    assert {d["format"] for d in docs} == {"text", "xml"}
    lookalikes = {kind for d in docs for kind in d.get("lookalikes") or []}
    assert {"pcie_downtrained_idle", "ecc_aggregate_only", "na_fields", "ecc_off_default", "mig_enabled",
            "vm_passthrough", "wddm", "partial_output"} <= lookalikes
    for d in docs:
        assert d["source"].startswith("https://") or d["source"].startswith("captured"), d
        assert {p["kind"] for p in d.get("problems") or []} <= set(REASONS) | {"other", "inforom_corrupt"}


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_a_real_machine_replays_to_its_verdict(folder, registry):
    want = expected(folder)
    outcome = diagnose_host(replay_host(folder), registry)
    got = found(outcome)
    if want["verdict"] == "healthy":
        assert got == set(), [p.message for p in outcome.problems]
        return
    unexplained = set(got)
    for problem in want["problems"]:
        if problem["kind"] not in REASONS:
            continue                        # said in words only ("other"): a person reads it
        bus = normalize_bus_id(problem["gpu"]) if problem["gpu"] else ""
        named = {(r, b) for r, b in got if r in REASONS[problem["kind"]] and (b == bus or not bus)}
        assert named, f"{problem['kind']} on {bus or 'an unnamed GPU'} not found in {sorted(got)}"
        unexplained -= named
    assert unexplained == set(), [p.message for p in outcome.problems]
