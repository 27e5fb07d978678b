"""What `nvidia-smi -L` said, in its own words: the GPUs it listed, the GPUs it could not open and why,
and what its exit code means.

A clean listing (exit 0, no error line) is complete: a GPU it does not list is missing. Anything else
is partial at best and judges only the GPUs it names: older drivers stop at the first GPU they cannot
open, newer ones go on past it, and the text does not say which happened, so a GPU neither listed nor
named is not blamed.

Exit codes are nvidia-smi(1)'s RETURN VALUE section (https://docs.nvidia.com/deploy/nvidia-smi/index.html,
quoted in NVIDIA's GPU Operator troubleshooting guide, "infoROM is corrupted (nvidia-smi return code 14)":
https://github.com/NVIDIA/cloud-native-docs/blob/main/gpu-operator/troubleshooting.rst): 0 success,
2 invalid argument, 3 not available on the device, 4 no permission, 6 query unsuccessful, 8 external power
cables not attached, 9 NVIDIA driver not loaded, 10 interrupt issue with a GPU, 12 NVML shared library
not found, 13 function not implemented, 14 infoROM corrupted, 15 GPU fallen off the bus or otherwise
inaccessible, 255 other error. (nvidia-smi's 10 is NVML's 11, NVML_ERROR_IRQ_ISSUE; NVML's 10 is a timeout.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from detector.backends.pciaddr import normalize_bus_id

EXIT_REASONS = {
    2: "invalid_argument", 3: "not_supported", 4: "no_permission", 6: "not_found", 8: "insufficient_power",
    9: "driver_not_loaded", 10: "irq_issue", 12: "library_not_found", 13: "function_not_found",
    14: "inforom_corrupted", 15: "gpu_lost", 255: "unknown_error",
}
_GPU = re.compile(r"^GPU (\d+): (.*) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
# `GPU0000:3B:00.0`, `GPU 0000:0B:00.0`, `GPU 000:BA:80.0`, `gpu 0000:01:00.0`, and newer drivers' `GPU1:
# 0000:34:00.0` (NVML index, then bus id); nvidia-smi.exe says "detect".
_HANDLE = r"Unable to (?:determine|detect) the device handle for GPU"
_NO_HANDLE = re.compile(_HANDLE + r"\s*(?:\d+:\s*)?"
                        r"(?P<bus>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\s*: (?P<why>.*)",
                        re.IGNORECASE)
# The same failure with no bus id to name the GPU by: still a failure, blamed on no GPU.
_NO_HANDLE_UNNAMED = re.compile(_HANDLE + r"\s*(?P<which>[^:]*)(?::\s*(?P<why>.*))?", re.IGNORECASE)
_INFOROM = re.compile(r"infoROM is corrupted at gpu\s+(?P<bus>[0-9A-Fa-f:.]+)", re.IGNORECASE)
# The node-wide messages, in the words real nvidia-smi prints (both apostrophes occur).
_NODE_MESSAGES = [
    (re.compile(r"couldn.t communicate with the NVIDIA driver"), "driver_not_loaded"),
    (re.compile(r"No devices were found"), "no_devices"),
    (re.compile(r"Driver/library version mismatch", re.IGNORECASE), "version_mismatch"),
    (re.compile(r"NVML Shared Library Not Found|libnvidia-ml\.so", re.IGNORECASE), "library_not_found"),
    (re.compile(r"Unable to query number of GPUs"), "unknown_error"),
    (re.compile(r"GPU is lost"), "gpu_lost"),
    (re.compile(r"Failed to initialize NVML"), "nvml_init_failed"),
]
_GPU_REASONS = [("GPU is lost", "gpu_lost"), ("Unknown Error", "unknown_error"), ("Not Found", "not_found"),
                ("Insufficient Permissions", "no_permission"), ("infoROM is corrupted", "inforom_corrupted")]


@dataclass(frozen=True)
class SmiListing:
    status: str                          # ok | partial | failed | timeout | not_found | error | disabled
    uuids: frozenset[str] = frozenset()
    errors: dict[str, str] = field(default_factory=dict)   # bus id -> what nvidia-smi said of that GPU
    detail: str = ""
    reason: str = ""                     # why, in one word: driver_not_loaded, no_devices, gpu_lost, ...
    unnamed_errors: tuple[str, ...] = ()  # "Unable to determine the device handle" lines without a bus id

    def in_smi(self, uuid: str | None, bus_id: str) -> bool | None:
        """Listed (True), named as failing or missing from a complete listing (False), or unknown."""
        if bus_id in self.errors:
            return False
        if uuid and uuid in self.uuids:
            return True
        return False if self.status == "ok" else None


def parse_smi_list(returncode: int, text: str) -> SmiListing:
    """`nvidia-smi -L`: one `GPU n: NAME (UUID: ...)` line per GPU (MIG devices indented under their
    GPU, not GPUs themselves); a GPU it cannot open gets `Unable to determine the device handle for
    GPU<bus id>: <error>` instead."""
    uuids: set[str] = set()
    errors: dict[str, str] = {}
    unnamed: list[str] = []
    node_reason = ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in lines:
        if m := _GPU.match(line):
            uuids.add(m.group(3))
        elif named := _named_error(line):
            errors[named[0]] = named[1]
        elif m := _NO_HANDLE_UNNAMED.search(line):
            unnamed.append(line)
            node_reason = node_reason or _gpu_reason(m["why"] or "")
        elif not node_reason:
            node_reason = next((r for rx, r in _NODE_MESSAGES if rx.search(line)), "")
    gpu_reasons = [_gpu_reason(why) for why in errors.values()]
    if node_reason == "no_devices" and gpu_reasons:
        node_reason = ""          # newer drivers add it after the GPU they could not open: that GPU says why
    reason = node_reason or (gpu_reasons[0] if gpu_reasons else "") or EXIT_REASONS.get(returncode, "")
    if returncode == 0 and not errors and not node_reason:
        return SmiListing("ok", frozenset(uuids))
    detail = _detail(returncode, lines)
    if uuids or errors:
        return SmiListing("partial", frozenset(uuids), errors, detail, reason, tuple(unnamed))
    return SmiListing("failed", detail=detail, reason=reason or ("unknown_error" if returncode else "no_output"),
                      unnamed_errors=tuple(unnamed))


def _named_error(line: str) -> tuple[str, str] | None:
    """(canonical bus id, what nvidia-smi said) for a line naming a failing GPU by its bus id."""
    if m := _NO_HANDLE.search(line):
        bus, why = m["bus"], m["why"].strip()
    elif m := _INFOROM.search(line):
        bus, why = m["bus"], "infoROM is corrupted"
    else:
        return None
    try:
        return normalize_bus_id(bus), why
    except ValueError:
        return None                    # not a bus id after all: an error line that names no GPU


def _gpu_reason(why: str) -> str:
    return next((r for text, r in _GPU_REASONS if text.lower() in why.lower()), "unknown_error")


def _detail(returncode: int, lines: list[str]) -> str:
    meaning = EXIT_REASONS.get(returncode, "")
    first = next((ln for ln in lines if not _GPU.match(ln)), "")
    text = f"exit code {returncode}" + (f" ({meaning.replace('_', ' ')})" if meaning else "")
    return (f"{text}: {first}" if first else text)[:300]
