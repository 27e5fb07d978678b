"""nvidia-smi's own words, read right: every output in tests/fixtures/real_smi/ (each with its source)
gives the status, reason, GPUs and per-GPU errors its `expect` says, whatever exit code came with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from detector.checks.smi_listing import parse_smi_list

ROOT = Path(__file__).parent / "fixtures" / "real_smi"
CASES = sorted(ROOT.glob("*.yaml"))


def _codes(doc: dict) -> list[int]:
    if doc["exit_code"] is not None:
        return [doc["exit_code"]]
    return sorted({doc["documented_exit_code"], 0})


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_real_nvidia_smi_output(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["source"] and doc["what"] and doc["output"]
    expect = doc["expect"]
    for code in _codes(doc):
        listing = parse_smi_list(code, doc["output"])
        assert (listing.status, listing.reason) == (expect["status"], expect["reason"]), code
        assert listing.uuids == set(expect["uuids"]), code
        assert listing.errors == expect["errors"], code


def test_corpus_covers_the_cases_that_matter():
    docs = [yaml.safe_load(p.read_text()) for p in CASES]
    reasons = {d["expect"]["reason"] for d in docs}
    assert {"", "unknown_error", "gpu_lost", "driver_not_loaded", "version_mismatch", "no_devices",
            "inforom_corrupted"} <= reasons
    assert any("MIG" in d["output"] for d in docs) and len(docs) >= 15


def test_a_named_gpu_is_blamed_and_the_others_are_not_judged():
    """The bug this guards: one GPU's error line made all eight healthy GPUs 'not listed'."""
    listing = parse_smi_list(255, "Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error\n")
    assert listing.in_smi("GPU-11111111-2222-3333-4444-555555555555", "0000:5d:00.0") is False
    assert listing.in_smi("GPU-66666666-2222-3333-4444-555555555555", "0000:18:00.0") is None
    complete = parse_smi_list(0, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-66666666-2222-3333-4444-555555555555)\n")
    assert complete.in_smi("GPU-66666666-2222-3333-4444-555555555555", "0000:18:00.0") is True
    assert complete.in_smi("GPU-77777777-2222-3333-4444-555555555555", "0000:2a:00.0") is False
