"""Resetting one GPU: what the node says of it first (NVML), and the reset itself (`nvidia-smi -r -i BUS`).

NVML has no reset call (nvmlDeviceResetGpuLockedClocks only resets clocks); nvidia-smi's `-r`/`--gpu-reset`
is the reset NVIDIA ships and what NVSentinel's reset job runs. Every run goes through the Host's smi runner
with a timeout and bounded output, with an argument list (no shell). Its answers, as real nodes print them
(tests/fixtures/gpu_reset/, each with its source):
- done: `GPU 00000000:1A:00.0 was successfully reset.` then `All done.`, exit 0;
- held: `The following GPUs could not be reset:` / `GPU 00000000:1A:00.0: In use by another client`, exit
  255 (NVSentinel #1690: nvidia-persistenced's handle alone does it), or on older drivers `GPU
  00000000:C1:00.0 is currently in use by another process.` (gpu-operator #118);
- the platform refuses: `Resetting GPU 00000000:00:04.0 is not supported.` (a cloud VM, gpu-operator
  #1606; GCP's says `Not Supported`, dra-driver-nvidia-gpu #883), or `Unknown Error` where the hypervisor
  blocks the function-level reset (AWS, NVIDIA ai-cloud-validation #603).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from detector.backends.children import ToolOutcome
from detector.backends.smi import NvidiaSmi

DONE, IN_USE, NOT_SUPPORTED, FAILED = "done", "in-use", "not-supported", "failed"
DETAIL_LIMIT = 300                    # the tool's words kept for an Event: a line or two
_IN_USE = re.compile(r"in use by another (client|process)", re.IGNORECASE)
_NOT_SUPPORTED = re.compile(r"is not supported|: not supported", re.IGNORECASE)
_DONE = re.compile(r"was successfully reset", re.IGNORECASE)


@dataclass(frozen=True)
class ResetAnswer:
    """What one nvidia-smi run answered: `kind` is DONE, IN_USE, NOT_SUPPORTED or FAILED (a timeout, a
    missing tool, an unknown error); `detail` its words, cut to DETAIL_LIMIT."""

    kind: str
    detail: str

    @property
    def done(self) -> bool:
        return self.kind == DONE


def classify(outcome: ToolOutcome) -> ResetAnswer:
    """A reset run's answer. Success needs both exit 0 and the tool's own words: an exit 0 that says
    nothing of this GPU is not taken as a reset."""
    if outcome.status != "ok":
        return ResetAnswer(FAILED, (outcome.detail or f"nvidia-smi {outcome.status}")[:DETAIL_LIMIT])
    text = " ".join((outcome.stdout + " " + outcome.stderr).split())
    if outcome.returncode == 0 and _DONE.search(text):
        return ResetAnswer(DONE, text[:DETAIL_LIMIT])
    if _IN_USE.search(text):
        return ResetAnswer(IN_USE, text[:DETAIL_LIMIT])
    if _NOT_SUPPORTED.search(text):
        return ResetAnswer(NOT_SUPPORTED, text[:DETAIL_LIMIT])
    return ResetAnswer(FAILED, (text or f"exit {outcome.returncode}")[:DETAIL_LIMIT])


class SmiGpuControl:
    """nvidia-smi's reset and persistence switches for one GPU, named by its PCI bus id."""

    def __init__(self, smi: NvidiaSmi, timeout_s: float = 60.0):
        self.smi, self.timeout_s = smi, timeout_s

    def reset(self, bus_id: str) -> ResetAnswer:
        return classify(self.smi.run(["-r", "-i", bus_id], self.timeout_s))

    def set_persistence(self, bus_id: str, on: bool) -> ResetAnswer:
        """`nvidia-smi -pm 0|1 -i BUS`; it answers `All done.` (NVSentinel #1690)."""
        outcome = self.smi.run(["-pm", "1" if on else "0", "-i", bus_id], self.timeout_s)
        if outcome.status == "ok" and outcome.returncode == 0:
            return ResetAnswer(DONE, " ".join(outcome.stdout.split())[:DETAIL_LIMIT])
        return classify(outcome) if outcome.status == "ok" else ResetAnswer(FAILED, outcome.detail[:DETAIL_LIMIT])


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says of a GPU before a reset. None where NVML could not say (an error, not supported)."""

    processes: tuple[int, ...] | None          # pids of compute processes on it
    persistence: bool | None
    mig: bool | None                          # MIG mode current
    nvlinks_active: int | None                # NVLinks up (0 on a PCIe GPU)
    errors: tuple[str, ...] = field(default_factory=tuple)   # what could not be read, for the message


def read_facts(nvml: Any, bus_id: str, max_links: int = 18) -> GpuFacts:
    """The GPU's processes, persistence and MIG mode and active NVLinks. Each read on its own: one that
    fails is None and named in `errors` (the policy refuses a reset it cannot check)."""
    errors: list[str] = []

    def read(what: str, call: Any) -> Any:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - NVMLError and the fake's alike; named, never raised
            errors.append(f"{what}: {type(e).__name__} {e}".strip())
            return None

    handle = read("handle", lambda: nvml.nvmlDeviceGetHandleByPciBusId(bus_id))
    if handle is None:
        return GpuFacts(None, None, None, None, tuple(errors))
    procs = read("processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    persistence = read("persistence mode", lambda: nvml.nvmlDeviceGetPersistenceMode(handle))
    mig = _optional(lambda: nvml.nvmlDeviceGetMigMode(handle))
    links = 0
    for link in range(max_links):
        state = _optional(lambda: nvml.nvmlDeviceGetNvLinkState(handle, link))
        if state is None:
            break
        links += int(state == 1)
    return GpuFacts(
        tuple(int(getattr(p, "pid", 0)) for p in procs) if procs is not None else None,
        bool(persistence == 1) if persistence is not None else None,
        bool(mig[0] == 1) if mig else False,
        links, tuple(errors))


def _optional(call: Any) -> Any:
    """A reading a GPU may not have (MIG on a PCIe card, NVLink past its last link): None, no error."""
    try:
        return call()
    except Exception:  # noqa: BLE001
        return None
