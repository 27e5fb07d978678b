#!/usr/bin/env python3
"""What a real GPU says about its own speed, idle and under load: the facts issue 31's slow-GPU and NVML-latency
judgements rest on, captured once on a GPU machine so the fakes and fixtures can follow a real one.

Per GPU, every `--interval` seconds: SM/memory/graphics clocks (now, max, application, default application),
power draw and every power limit NVML has, utilisation, temperature, performance state, the clock event
reasons now, NVML's violation time per policy, the PCIe replay counter, and every field value whose name in
this nvidia-ml-py says clocks-event/throttle, violation, PCIe replay, ECC or NVLink error (each with its field
id and return code: the ids differ between NVML headers, so the capture says which were read). Then how long
NVML calls take (per function: p50, p95, max over `--calls` calls). First idle, then while a matrix-multiply
load (torch, else cupy) keeps every GPU busy; `nvidia-smi -q -d PERFORMANCE,CLOCK,POWER` in each phase.

    python3 tools/perf_capture.py --out perf-capture --load-s 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pynvml

FIELD_WORDS = ("CLOCKS_EVENT", "THROTTLE", "VIOLATION", "PCIE_REPLAY", "ECC_SBE", "ECC_DBE", "NVLINK_ERROR",
               "NVLINK_CRC", "NVLINK_RECOVERY", "NVLINK_REPLAY", "PCIE_COUNT", "POWER_", "ENERGY")
POLICIES = [n for n in dir(pynvml) if n.startswith("NVML_PERF_POLICY_") and n != "NVML_PERF_POLICY_COUNT"]
LOAD = """
import sys, time
end = time.time() + float(sys.argv[1])
try:
    import torch
    devs = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    mats = [torch.randn(8192, 8192, device=d, dtype=torch.bfloat16) for d in devs]
    while time.time() < end:
        for m in mats:
            for _ in range(20):
                m @ m
        for d in devs:
            torch.cuda.synchronize(d)
except ImportError:
    import cupy
    a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
    while time.time() < end:
        for _ in range(10):
            a @ a
        cupy.cuda.Device().synchronize()
"""


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """A value, or the NVML error's name: a GPU that does not offer a reading says so."""
    try:
        value = fn(*args)
    except pynvml.NVMLError as e:
        return f"error: {type(e).__name__}"
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if hasattr(value, "_fields_"):
        return {name: getattr(value, name) for name, _ in value._fields_}
    return value


def field_ids() -> dict[str, int]:
    return {n: getattr(pynvml, n) for n in sorted(dir(pynvml))
            if n.startswith("NVML_FI_DEV_") and any(w in n for w in FIELD_WORDS) and isinstance(getattr(pynvml, n), int)}


def scan_ids(handle: Any, first: int, last: int) -> dict[int, Any]:
    """Each field id in [first, last] read alone: what this driver answers there (its return code, value type
    and value), whatever this nvidia-ml-py calls it. Headers moved the throttle counters between ids."""
    out: dict[int, Any] = {}
    for fid in range(first, last + 1):
        try:
            v = pynvml.nvmlDeviceGetFieldValues(handle, [fid])[0]
        except pynvml.NVMLError as e:
            out[fid] = f"error: {type(e).__name__}"
            continue
        if v.nvmlReturn != 0:
            out[fid] = {"return": v.nvmlReturn}
            continue
        kind = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(v.valueType, "ullVal")
        out[fid] = {"type": v.valueType, "value": getattr(v.value, kind)}
    return out


def read_fields(handle: Any, ids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = list(ids)
    for start in range(0, len(names), 64):
        chunk = names[start:start + 64]
        try:
            values = pynvml.nvmlDeviceGetFieldValues(handle, [ids[n] for n in chunk])
        except pynvml.NVMLError as e:
            out.update({n: f"error: {type(e).__name__}" for n in chunk})
            continue
        for name, v in zip(chunk, values):
            if v.nvmlReturn != 0:
                out[name] = {"id": ids[name], "return": v.nvmlReturn}
                continue
            kind = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(v.valueType, "ullVal")
            out[name] = {"id": ids[name], "value": getattr(v.value, kind), "type": v.valueType}
    return out


def sample(handle: Any, ids: dict[str, int]) -> dict[str, Any]:
    n = pynvml
    s: dict[str, Any] = {"t": time.time()}
    for label, clock in (("sm", n.NVML_CLOCK_SM), ("mem", n.NVML_CLOCK_MEM), ("graphics", n.NVML_CLOCK_GRAPHICS)):
        s[f"clock_{label}_mhz"] = call(n.nvmlDeviceGetClockInfo, handle, clock)
        s[f"max_clock_{label}_mhz"] = call(n.nvmlDeviceGetMaxClockInfo, handle, clock)
        s[f"app_clock_{label}_mhz"] = call(n.nvmlDeviceGetApplicationsClock, handle, clock)
        s[f"default_app_clock_{label}_mhz"] = call(n.nvmlDeviceGetDefaultApplicationsClock, handle, clock)
    s["power_mw"] = call(n.nvmlDeviceGetPowerUsage, handle)
    s["enforced_power_limit_mw"] = call(n.nvmlDeviceGetEnforcedPowerLimit, handle)
    s["power_management_limit_mw"] = call(n.nvmlDeviceGetPowerManagementLimit, handle)
    s["default_power_limit_mw"] = call(n.nvmlDeviceGetPowerManagementDefaultLimit, handle)
    s["power_limit_constraints_mw"] = call(n.nvmlDeviceGetPowerManagementLimitConstraints, handle)
    s["utilization"] = call(n.nvmlDeviceGetUtilizationRates, handle)
    s["temperature_c"] = call(n.nvmlDeviceGetTemperature, handle, n.NVML_TEMPERATURE_GPU)
    s["pstate"] = call(n.nvmlDeviceGetPerformanceState, handle)
    s["clocks_event_reasons"] = call(n.nvmlDeviceGetCurrentClocksEventReasons, handle)
    s["supported_clocks_event_reasons"] = call(n.nvmlDeviceGetSupportedClocksEventReasons, handle)
    s["violation_ns"] = {p: call(n.nvmlDeviceGetViolationStatus, handle, getattr(n, p)) for p in POLICIES}
    s["pcie_replay_counter"] = call(n.nvmlDeviceGetPcieReplayCounter, handle)
    s["fields"] = read_fields(handle, ids)
    return s


LATENCY_CALLS: dict[str, Callable[[Any], Any]] = {
    "GetUUID": pynvml.nvmlDeviceGetUUID,
    "GetPciInfo": pynvml.nvmlDeviceGetPciInfo,
    "GetTemperature": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    "GetPowerUsage": pynvml.nvmlDeviceGetPowerUsage,
    "GetClockInfo(SM)": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
    "GetUtilizationRates": pynvml.nvmlDeviceGetUtilizationRates,
    "GetCurrentClocksEventReasons": pynvml.nvmlDeviceGetCurrentClocksEventReasons,
    "GetMemoryInfo": pynvml.nvmlDeviceGetMemoryInfo,
    "GetTotalEccErrors": lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    "GetViolationStatus(POWER)": lambda h: pynvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER),
    "GetPcieReplayCounter": pynvml.nvmlDeviceGetPcieReplayCounter,
    "GetCurrPcieLinkWidth": pynvml.nvmlDeviceGetCurrPcieLinkWidth,
    "GetComputeRunningProcesses": pynvml.nvmlDeviceGetComputeRunningProcesses,
    "GetNvLinkState(0)": lambda h: pynvml.nvmlDeviceGetNvLinkState(h, 0),
}


def latencies(handle: Any, calls: int) -> dict[str, dict[str, float | str]]:
    out: dict[str, dict[str, float | str]] = {}
    for name, fn in LATENCY_CALLS.items():
        times, error = [], ""
        for _ in range(calls):
            t0 = time.perf_counter()
            try:
                fn(handle)
            except pynvml.NVMLError as e:
                error = type(e).__name__
            times.append(time.perf_counter() - t0)
        times.sort()
        out[name] = {"p50_ms": round(statistics.median(times) * 1e3, 4),
                     "p95_ms": round(times[int(0.95 * (len(times) - 1))] * 1e3, 4),
                     "max_ms": round(times[-1] * 1e3, 4), **({"error": error} if error else {})}
    return out


def smi(out: Path, name: str) -> None:
    try:
        text = subprocess.run(["nvidia-smi", "-q", "-d", "PERFORMANCE,CLOCK,POWER"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"nvidia-smi failed: {e}"
    (out / name).write_text(text, encoding="utf-8")


def phase(handles: list[Any], ids: dict[str, int], seconds: float, interval: float, calls: int) -> dict[str, Any]:
    samples: list[list[dict[str, Any]]] = [[] for _ in handles]
    end = time.monotonic() + seconds
    while True:
        for i, h in enumerate(handles):
            samples[i].append(sample(h, ids))
        if time.monotonic() + interval > end:
            break
        time.sleep(interval)
    return {"samples": samples, "latency": [latencies(h, calls) for h in handles]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("perf-capture"))
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds sampled idle (default 10)")
    parser.add_argument("--load-s", type=float, default=40.0, help="seconds sampled under load (default 40)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--calls", type=int, default=200, help="calls per function timed (default 200)")
    parser.add_argument("--scan-ids", default="", metavar="A-B", help="also read every field id from A to B alone, "
                        "idle and under load (what the driver answers at each id)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        ids = field_ids()
        capture: dict[str, Any] = {
            "driver": call(pynvml.nvmlSystemGetDriverVersion), "nvml": call(pynvml.nvmlSystemGetNVMLVersion),
            "nvidia_ml_py": getattr(pynvml, "__version__", None) or _dist_version(),
            "gpus": [{"name": call(pynvml.nvmlDeviceGetName, h), "pci_bus_id": call(pynvml.nvmlDeviceGetPciInfo, h)["busId"]
                      if isinstance(call(pynvml.nvmlDeviceGetPciInfo, h), dict) else None} for h in handles],
            "field_ids": ids, "policies": POLICIES,
        }
        first, _, last = args.scan_ids.partition("-")
        scan = (lambda: [scan_ids(h, int(first), int(last)) for h in handles]) if args.scan_ids else (lambda: None)
        smi(args.out, "nvidia-smi-perf-idle.txt")
        capture["idle_id_scan"] = scan()
        capture["idle"] = phase(handles, ids, args.idle_s, args.interval, args.calls)
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.load_s + 15)], stdout=subprocess.DEVNULL,
                                stderr=open(args.out / "load.stderr.txt", "w"))
        try:
            time.sleep(8)            # the load starts (CUDA context, first kernels) before it is sampled
            smi(args.out, "nvidia-smi-perf-load.txt")
            capture["load"] = phase(handles, ids, args.load_s, args.interval, args.calls)
            capture["load_id_scan"] = scan()
        finally:
            load.terminate()
            load.wait(30)
        capture["load_exit"] = load.returncode
    finally:
        pynvml.nvmlShutdown()
    (args.out / "perf-capture.json").write_text(json.dumps(capture, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"perf-capture: {len(handles)} GPU(s); results in {args.out}/")
    return 0


def _dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nvidia-ml-py")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
