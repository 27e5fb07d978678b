"""nvidia-smi's own words, read right: every output in tests/fixtures/real_smi/ (each with its source)
gives the status, reason, GPUs and per-GPU errors its `expect` says, whatever exit code came with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from detector.backends.smi_listing import parse_smi_list

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
            "inforom_corrupted", "not_found", "nvml_init_failed"} <= reasons
    assert any("MIG" in d["output"] for d in docs) and len(docs) >= 15
    assert all(d["source"].startswith("https://") for d in docs)


def test_a_named_gpu_is_blamed_and_the_others_are_not_judged():
    """The bug this guards: one GPU's error line made all eight healthy GPUs 'not listed'."""
    listing = parse_smi_list(255, "Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error\n")
    assert listing.in_smi("GPU-11111111-2222-3333-4444-555555555555", "0000:5d:00.0") is False
    assert listing.in_smi("GPU-66666666-2222-3333-4444-555555555555", "0000:18:00.0") is None
    complete = parse_smi_list(0, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-66666666-2222-3333-4444-555555555555)\n")
    assert complete.in_smi("GPU-66666666-2222-3333-4444-555555555555", "0000:18:00.0") is True
    assert complete.in_smi("GPU-77777777-2222-3333-4444-555555555555", "0000:2a:00.0") is False


def test_every_spelling_of_the_bus_id_names_the_same_gpu():
    """Real drivers print the failing GPU's bus id in several ways; newer ones (seen in public notes of
    2025-26 drivers) put NVML's index first, `GPU1: 0000:34:00.0`. Each names 0000:3b:00.0 alone."""
    for spelling in ("GPU0000:3B:00.0", "GPU 0000:3B:00.0", "GPU 00000000:3B:00.0", "GPU00000000:3b:00.0",
                     "gpu 0000:3B:00.0", "GPU1: 0000:3B:00.0", "GPU 1: 0000:3B:00.0", "GPU 000:3B:00.0"):
        listing = parse_smi_list(255, f"Unable to determine the device handle for {spelling}: Unknown Error\n")
        assert listing.errors == {"0000:3b:00.0": "Unknown Error"}, spelling
        assert (listing.status, listing.reason) == ("partial", "unknown_error"), spelling


def test_a_failing_gpu_then_no_devices_blames_that_gpu():
    """A node whose only GPU fails: newer drivers name it, then say no devices were found."""
    listing = parse_smi_list(6, "Unable to determine the device handle for GPU0: 0000:01:00.0: Unknown Error\n"
                                "No devices were found\n")
    assert (listing.status, listing.reason) == ("partial", "unknown_error")
    assert listing.errors == {"0000:01:00.0": "Unknown Error"}


def test_an_error_line_without_a_bus_id_is_never_a_clean_listing():
    """Even with exit code 0 (nvidia-smi -q -x exits 0 after such a line), a listing with a device-handle
    error is not complete, so the GPU it could not name is not called 'not listed' and no other is either."""
    text = ("GPU 0: NVIDIA A10 (UUID: GPU-f15ae561-21b1-6003-c768-861fc285203b)\n"
            "Unable to determine the device handle for GPU1: Unknown Error\n")
    listing = parse_smi_list(0, text)
    assert (listing.status, listing.reason) == ("partial", "unknown_error")
    assert listing.unnamed_errors == ("Unable to determine the device handle for GPU1: Unknown Error",)
    assert listing.in_smi("GPU-466be1f8-6148-1a27-a450-592604f3df54", "0000:3b:00.0") is None


@pytest.mark.parametrize("code, reason", [(9, "driver_not_loaded"), (12, "library_not_found"), (14, "inforom_corrupted"),
                                          (15, "gpu_lost"), (255, "unknown_error"), (6, "not_found")])
def test_a_silent_failure_is_named_by_its_exit_code(code, reason):
    """No message to go by: nvidia-smi(1)'s RETURN VALUE section says what the code means."""
    listing = parse_smi_list(code, "")
    assert (listing.status, listing.reason) == ("failed", reason)
    assert f"exit code {code}" in listing.detail
