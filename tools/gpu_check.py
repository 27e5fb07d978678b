#!/usr/bin/env python3
"""`make gpu-check`: everything gpu-npd can tell about a real GPU machine, in one folder.

1. conformance: the NVML conformance tests against the real library (`pytest -m gpu tests/conformance`),
   which check that the fake NVML answers as the real one does;
2. diagnose: `gpu-npd diagnose -o json` with every registered check (the opt-in NCCL probe included),
   plus the table a person reads (without the probe, not run a third time);
3. nccl: the NCCL all-reduce probe on its own, so its figures (bus bandwidth, wrong values) stand apart;
4. daemon: `gpu-npd run --dra-taints` against the bundled Kubernetes API emulator (plain HTTP on
   loopback) for about a minute: the verdict on the machine as it is (conditions, DeviceTaintRules: none
   expected on a healthy one), then application faults provoked by tiny CUDA programs (through cupy or
   torch), each in its own process, and the Event each one produced (pid, process, GPU, seconds from the
   fault to the event); the daemon's RSS and CPU over the run;
5. raw: what the machine itself says (nvidia-smi -q and -q -x, /proc/modules, /proc/driver/nvidia,
   /dev/nvidia*, the kernel log of the faults), laid out as a replay fixture of this machine.

Each step's output, exit code and duration go to DIR; summary.txt says what each step found and
gpu-check.json has every figure. Exit 0 when every step ran (problems that diagnose found are findings,
not failures), 1 when a step failed, 2 when there is no GPU to check.

Runs from a bare checkout with no network: the checks join through entry points, so when this Python
has no gpu-npd installed the package's metadata is made here (setuptools) and put on PYTHONPATH.

    python3 tools/gpu_check.py --out gpu-check          # on a GPU machine
    python3 tools/gpu_check.py --nvml fake:h100-sxm-8   # a dry run of the whole thing on a fake node
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEP_TIMEOUT_S = {"conformance": 240.0, "diagnose": 150.0, "nccl": 150.0}
RAW_COMMAND_TIMEOUT_S = 60.0
NODE = "gpu-check-node"
RAW_COMMANDS = {
    "nvidia-smi-q.txt": ["nvidia-smi", "-q"],
    "nvidia-smi-q.xml": ["nvidia-smi", "-q", "-x"],
    "nvidia-smi-topo.txt": ["nvidia-smi", "topo", "-m"],
    "nvidia-smi-nvlink.txt": ["nvidia-smi", "nvlink", "-s"],
    "dmesg.txt": ["dmesg"],
    "dmesg-x.txt": ["dmesg", "-x"],
}
RAW_FILES = {"proc-driver-nvidia-version.txt": Path("/proc/driver/nvidia/version"),
             "proc-modules.txt": Path("/proc/modules")}


@dataclass
class Step:
    name: str
    exit_code: int | None       # None: could not start (or timed out)
    seconds: float
    outcome: str                # one line for summary.txt
    details: dict[str, Any] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Output: DIR/summary.txt first; every step's files beside it.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for the results "
                        "(default: ./gpu-check; made if missing, files in it replaced)")
    parser.add_argument("--nvml", default="real", help="real (default), or fake:SCENARIO for a dry run")
    parser.add_argument("--nccl-size", default=None, help="bytes the NCCL probe all-reduces (gpu-npd's "
                        "default when not given)")
    parser.add_argument("--settle", type=float, default=15.0, metavar="S",
                        help="seconds the daemon runs before its verdict on the machine is read (default 15)")
    parser.add_argument("--quiet", type=float, default=30.0, metavar="S",
                        help="seconds of steady state after that, RSS and CPU measured, before the faults "
                             "(default 30)")
    parser.add_argument("--fault-timeout", type=float, default=30.0, metavar="S",
                        help="a fault program still running after S seconds is killed (default 30)")
    parser.add_argument("--event-timeout", type=float, default=15.0, metavar="S",
                        help="how long to wait for each fault's event (default 15)")
    parser.add_argument("--skip", default="", metavar="A,B", help="steps to leave out "
                        "(conformance, diagnose, nccl, daemon, raw)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    real = args.nvml == "real"
    if real and not _has_gpu():
        print("gpu-check: no NVIDIA GPU or driver here (nvmlInit failed or no devices): run it on a GPU machine, "
              "or try `--nvml fake:h100-sxm-8` for a dry run", file=sys.stderr)
        return 2
    skip = {s for s in args.skip.split(",") if s}
    env = _package_env()

    times = DaemonTimes(args.settle, args.quiet, args.fault_timeout, args.event_timeout)
    steps: list[Step] = []
    if "conformance" not in skip:
        steps += _guarded(out, "conformance", lambda: [_conformance(out, real, env)])
    if "diagnose" not in skip or "nccl" not in skip:
        steps += _guarded(out, "diagnose", lambda: _diagnose(out, args.nvml, args.nccl_size, env, skip))
    if "daemon" not in skip:
        steps += _guarded(out, "daemon", lambda: [_daemon(out, args.nvml, env, times)])
    if "raw" not in skip:
        steps += _guarded(out, "raw", lambda: [_raw(out)])
    header = f"gpu-check of {os.uname().nodename} ({args.nvml}) at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    summary = "\n".join(_summary_lines(steps))
    (out / "summary.txt").write_text(f"{header}\n{summary}\n", encoding="utf-8")
    (out / "gpu-check.json").write_text(json.dumps({
        "host": os.uname().nodename, "nvml": args.nvml, "python": sys.version.split()[0],
        "steps": [asdict(s) for s in steps]}, indent=1) + "\n", encoding="utf-8")
    print(f"{header}\n{summary}")
    print(f"gpu-check: results in {out}/")
    return 1 if any(s.outcome.startswith("FAILED") for s in steps) else 0


def _guarded(out: Path, name: str, step: Callable[[], list[Step]]) -> list[Step]:
    """A step that breaks is a failed step with its traceback kept, and the steps after it still run."""
    t0 = time.monotonic()
    try:
        return step()
    except Exception as e:  # noqa: BLE001 - reported in the summary, the traceback in a file
        (out / f"{name}.error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        return [Step(name, None, time.monotonic() - t0, f"FAILED: {type(e).__name__}: {e} (see {name}.error.txt)")]


def _summary_lines(steps: list[Step]) -> list[str]:
    lines = []
    for s in steps:
        lines.append(f"{s.name:<12} {_code(s.exit_code):>4}  {s.seconds:7.1f} s  {s.outcome}")
        lines += [f"{'':14}{line}" for line in s.details.get("summary", [])]
    return lines


def _has_gpu() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def _package_env() -> dict[str, str]:
    """What the child processes need to import gpu-npd from this checkout with its checks registered.
    Checks join through the `gpu_npd.checks` entry points, which only an installed package has: without
    one (a GPU machine with no network to install from), setuptools writes the package's metadata
    (`egg_info`: no wheel package needed) under build/, put on PYTHONPATH beside the checkout."""
    from importlib.metadata import entry_points

    if list(entry_points(group="gpu_npd.checks")):
        return {}
    meta = REPO / "build" / "gpu-check-metadata"
    shutil.rmtree(meta, ignore_errors=True)
    meta.mkdir(parents=True)
    made = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "egg_info", "--egg-base",
                           str(meta)], cwd=REPO, capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        raise SystemExit(f"gpu-check: gpu-npd is not installed for {sys.executable} and its metadata could not "
                         f"be made (setuptools needed): {made.stderr.strip().splitlines()[-1:]}")
    sys.path[1:1] = [str(meta)]
    import importlib
    importlib.invalidate_caches()
    paths = [str(REPO), str(meta), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _run(name: str, cmd: list[str], stdout: Path, stderr: Path | None = None, env: dict[str, str] | None = None,
         timeout_s: float = RAW_COMMAND_TIMEOUT_S) -> tuple[int | None, float]:
    print(f"gpu-check: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with stdout.open("w", encoding="utf-8") as out, (stderr or stdout).open("a", encoding="utf-8") as err:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=err if stderr else subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, **(env or {})}, timeout=timeout_s).returncode
        except (OSError, subprocess.TimeoutExpired) as e:
            out.write(f"\ngpu-check: {name} did not complete: {e}\n")
            code = None
    return code, time.monotonic() - t0


def _conformance(out: Path, real: bool, env: dict[str, str]) -> Step:
    """On a GPU machine only the real-NVML half runs (-m gpu); a dry run runs the fake half."""
    marker = ["-m", "gpu"] if real else ["-m", "not gpu"]
    code, seconds = _run("conformance", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                         *marker, "tests/conformance", f"--junitxml={out.resolve()}/conformance.xml"],
                         out / "conformance.txt", env=env, timeout_s=STEP_TIMEOUT_S["conformance"])
    last = _last_line(out / "conformance.txt")
    if code == 0:
        return Step("conformance", code, seconds, f"ok: {last}")
    if code == 5:
        return Step("conformance", code, seconds, "FAILED: no test ran (pytest exit 5)")
    return Step("conformance", code, seconds, f"FAILED: {last} (see conformance.txt)")


def _diagnose(out: Path, nvml: str, nccl_size: str | None, env: dict[str, str], skip: set[str]) -> list[Step]:
    from detector.core.check import CheckRegistry
    every = ",".join(CheckRegistry.from_entry_points().names())
    gpu_npd = [sys.executable, "-m", "detector.cli.main", "diagnose", "--nvml", nvml, "-q"]
    size = ["--nccl-size", nccl_size] if nccl_size else []
    steps = []
    for name, checks in (("diagnose", every), ("nccl", "nccl")):
        if name in skip:
            continue
        code, seconds = _run(name, [*gpu_npd, "--checks", checks, *size, "-o", "json"], out / f"{name}.json",
                             out / f"{name}.stderr.txt", env=env, timeout_s=STEP_TIMEOUT_S[name])
        steps.append(Step(name, code, seconds, _judge_diagnose(out / f"{name}.json", code)))
    if "diagnose" not in skip:      # the table a person reads; the NCCL probe's figures are in nccl.json
        table = ",".join(n for n in every.split(",") if n != "nccl")
        _run("diagnose table", [*gpu_npd, "--checks", table], out / "diagnose.txt", env=env,
             timeout_s=STEP_TIMEOUT_S["diagnose"])
    return steps


def _judge_diagnose(report: Path, code: int | None) -> str:
    if code not in (0, 1):
        return f"FAILED: exit {_code(code)} (see {report.stem}.stderr.txt)"
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except ValueError as e:
        return f"FAILED: output is not JSON ({e})"
    runs = ", ".join(f"{c['name']} {c['status']}" for c in data.get("checks", []))
    problems = ", ".join(sorted({p["reason"] for p in data.get("problems", [])})) or "none"
    return f"ok: exit {code}; {len(data.get('gpus', []))} GPUs; checks: {runs}; problems: {problems}"


# --- The daemon against the emulator, and application faults

@dataclass
class DaemonTimes:
    settle_s: float         # from the daemon's start to its verdict on the machine
    quiet_s: float          # steady state after that, before the faults: RSS and CPU
    fault_timeout_s: float  # a fault program running longer is killed
    event_timeout_s: float  # how long to wait for a fault's event


@dataclass
class Fault:
    """An application fault: a CUDA kernel that does one wrong thing, run by a process of its own."""
    kernel: str
    xid: int
    what: str


FAULTS = (
    Fault("illegal_address", 31, "a store to address 0x10"),
    Fault("trap", 43, "a trap instruction"),
    Fault("shared_out_of_range", 13, "a store far past a shared-memory array"),
    Fault("shared_misaligned", 13, "a misaligned shared-memory store, from another process"),
)

# Run as `python -c FAULT_PROGRAM KERNEL`. Prints one JSON line when the kernel is about to start (the
# CUDA context and the compiled kernel are ready, so the clock starts at the fault), then one with the
# error CUDA reported. cupy compiles the source with NVRTC; torch's jiterator does the same for the
# body of an element-wise function.
FAULT_PROGRAM = r'''
import json, os, sys, time
KERNEL = sys.argv[1]
BODY = {
    "illegal_address": "*(volatile int *)0x10 = v;",
    "trap": "if (v) asm volatile(\"trap;\");",
    "shared_out_of_range": "__shared__ int s[32]; volatile int *p = s; p[(1 << 22) + v] = v;",
    "shared_misaligned": "__shared__ int s[32]; *(volatile int *)((volatile char *)s + 1 + v) = v;",
}[KERNEL]

LAUNCHED = False

def say(**fields):
    global LAUNCHED
    LAUNCHED = LAUNCHED or "launch" in fields
    print(json.dumps(fields), flush=True)

def with_cupy():
    import cupy
    code = 'extern "C" __global__ void fault(int v) { ' + BODY + ' }'
    kernel = cupy.RawModule(code=code).get_function("fault")
    cupy.cuda.Device(0).synchronize()
    say(launch=time.time(), via="cupy", pid=os.getpid())
    kernel((1,), (1,), (cupy.int32(1),))
    cupy.cuda.Device(0).synchronize()

def with_torch():
    import torch
    from torch.cuda.jiterator import _create_jit_fn
    fn = _create_jit_fn("template <typename T> T fault(T x) { int v = (int)x; " + BODY + " return x; }")
    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    say(launch=time.time(), via="torch", pid=os.getpid())
    fn(x)
    torch.cuda.synchronize()

for name, run in (("cupy", with_cupy), ("torch", with_torch)):
    try:
        __import__(name)
    except ImportError:
        continue
    try:
        run()
    except Exception as e:
        say(error=f"{type(e).__name__}: {e}", via=name)
        if LAUNCHED:
            sys.exit(1)
        continue        # not even launched (no compiler, no context): try the other library
    say(error=None, via=name)
    sys.exit(0)
say(skip="neither cupy nor torch could run a CUDA kernel here: no fault provoked")
sys.exit(3)
'''


def _daemon(out: Path, nvml: str, env: dict[str, str], times: DaemonTimes) -> Step:
    """`gpu-npd run` for about a minute against the emulator; faults provoked on a real GPU."""
    from kube_emulator import Emulator

    from detector.daemon.local import DRA_TAINTS_RBAC, REPO_DEPLOY

    t0 = time.monotonic()
    real = nvml == "real"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-daemon-"))
    emulator = Emulator(rbac_paths=(REPO_DEPLOY, DRA_TAINTS_RBAC))     # plain HTTP: no trustme needed
    emulator.start()
    gpus = _gpu_devices(nvml)
    emulator.create_node(NODE, labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": str(len(gpus))})
    _publish_slice(emulator, gpus)
    kubeconfig = emulator.write_kubeconfig(work / "kubeconfig")
    command = [sys.executable, "-m", "detector.cli.main", "run", "--nvml", nvml, "--node-name", NODE,
               "--kubeconfig", str(kubeconfig), "--listen", "127.0.0.1:0", "--state-dir", str(work / "state"),
               "--dra-taints", "--start-spread", "2", "--log-format", "json"]
    print(f"gpu-check: daemon: {' '.join(command)}", file=sys.stderr, flush=True)
    log = (out / "daemon.log").open("wb")
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **env})
    sampler = Sampler(child.pid)
    sampler.start()
    details: dict[str, Any] = {"command": command, "nvml": nvml, "gpus": gpus}
    try:
        _wait(times.settle_s, child)
        details["verdict"] = _verdict(emulator)
        sampler.mark("quiet")
        _wait(times.quiet_s, child)
        sampler.mark("faults")
        details["steady"] = sampler.window("quiet", "faults")
        details["steady"]["largest_mappings"] = largest_mappings(child.pid)
        details["faults"] = (_provoke(out, emulator, env, times) if real else
                             {"skipped": "a dry run: the fake node lives inside the daemon's process, where no "
                                         "CUDA program can reach it; faults are provoked on a real GPU"})
        details["after_faults"] = _verdict(emulator)
        details["events"] = _events(emulator)
        details["api_requests"] = emulator.stats()["total"]
    finally:
        sampler.mark("stop")
        exited = child.poll()
        child.terminate()
        try:
            code = child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
        sampler.stop()
        log.close()
        emulator.stop()
        shutil.rmtree(work, ignore_errors=True)
    details["footprint"] = sampler.figures()
    details["exit_code"] = code
    details["summary"] = _daemon_summary(details)
    (out / "daemon.json").write_text(json.dumps(details, indent=1) + "\n", encoding="utf-8")
    outcome = _judge_daemon(details, exited)
    return Step("daemon", code, time.monotonic() - t0, outcome, details)


def _wait(seconds: float, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)


def _gpu_devices(nvml: str) -> list[dict[str, Any]]:
    """Index, minor number, uuid, PCI bus id and name of each GPU, as the NVIDIA DRA driver publishes them."""
    if nvml != "real":
        from fake_nvml.scenario import load_scenario
        node = load_scenario(nvml.partition(":")[2]).build(NODE)
        return [{"index": g.index, "minor": g.minor, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                 "name": g.model.name} for g in node.snapshot().gpus]
    import pynvml
    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append({"index": index, "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                         "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                         "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                         "name": _text(pynvml.nvmlDeviceGetName(h))})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _publish_slice(emulator: Any, gpus: list[dict[str, Any]]) -> None:
    """The NVIDIA DRA driver's ResourceSlice for this node's GPUs, so --dra-taints has devices to taint."""
    from detector.daemon.local import NVIDIA_DRA_DRIVER

    devices = []
    for g in gpus:
        attributes = {"resource.kubernetes.io/pciBusID": {"string": g["pci_bus_id"]},
                      "productName": {"string": g["name"]}, "index": {"int": g["index"]},
                      "uuid": {"string": g["uuid"]}}
        device = {"name": f"gpu-{g['minor']}", "attributes": attributes}
        devices.append(device if emulator.dra_version != "v1alpha3" else {"name": device["name"],
                                                                          "basic": {"attributes": attributes}})
    emulator.create_resource_slice({
        "metadata": {"name": f"{NODE}-{NVIDIA_DRA_DRIVER}-gpucheck"},
        "spec": {"driver": NVIDIA_DRA_DRIVER, "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": devices}})


def _verdict(emulator: Any) -> dict[str, Any]:
    """gpu-npd's conditions on the node (those that are True: none on a healthy machine) and the
    DeviceTaintRules it made."""
    from detector.kube.conditions import MARKER

    conditions = [c for c in emulator.node(NODE).get("status", {}).get("conditions", [])
                  if c.get("message", "").startswith(MARKER)]
    return {"conditions_true": [f"{c['type']}/{c.get('reason')}" for c in conditions if c.get("status") == "True"],
            "conditions_seen": len(conditions),
            "condition_types": sorted(c["type"] for c in conditions),   # a problem never seen writes none
            "device_taint_rules": [_taint_text(r) for r in emulator.device_taint_rules()]}


def _taint_text(rule: dict) -> str:
    spec = rule.get("spec", {})
    taint, selector = spec.get("taint", {}), spec.get("deviceSelector", {})
    return f"{taint.get('key')}={taint.get('value')}:{taint.get('effect')} on {selector.get('device')}"


def _events(emulator: Any) -> list[dict[str, Any]]:
    return [{"name": e.get("metadata", {}).get("name"), "reason": e.get("reason"), "type": e.get("type"),
             "count": int(e.get("count") or 1), "message": e.get("message")} for e in emulator.events()
            if e.get("involvedObject", {}).get("name") == NODE]


def _provoke(out: Path, emulator: Any, env: dict[str, str], times: DaemonTimes) -> list[dict[str, Any]] | dict:
    """Each fault in a process of its own, one after another; after each, the event it brought."""
    results = []
    for fault in FAULTS:
        before = _event_counts(emulator)
        run = _run_fault(out, fault, env, times.fault_timeout_s)
        if "skip" in run:
            return {"skipped": run["skip"]}
        result = {"kernel": fault.kernel, "expected_xid": fault.xid, "what": fault.what, **run}
        if run.get("launch") is not None:
            result.update(_await_event(emulator, before, run, times.event_timeout_s, fault.xid))
        results.append(result)
    return results


def _run_fault(out: Path, fault: Fault, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Start the fault program and read its two lines; a program still running at the deadline is killed."""
    print(f"gpu-check: fault: {fault.kernel} ({fault.what})", file=sys.stderr, flush=True)
    child_env = {**os.environ, **env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", FAULT_PROGRAM, fault.kernel], capture_output=True, text=True,
                              env=child_env, timeout=timeout_s)
        lines, code, stderr = proc.stdout.splitlines(), proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        lines = _text(e.stdout or b"").splitlines()
        code, stderr = None, _text(e.stderr or b"") + f"\nkilled after {timeout_s:g} s"
    with (out / "faults.log").open("a", encoding="utf-8") as f:
        f.write(f"== {fault.kernel} exit {_code(code)}\n" + "\n".join(lines) + "\n" + stderr[-4000:] + "\n")
    said: dict[str, Any] = {}
    for line in lines:
        try:
            said.update(json.loads(line))
        except ValueError:
            continue
    if "skip" in said:
        return {"skip": said["skip"]}
    pid = said.get("pid")
    return {"exit_code": code, "via": said.get("via"), "error": said.get("error"), "launch": said.get("launch"),
            "started": started, "pid": pid}


def _event_counts(emulator: Any) -> dict[str, int]:
    """Each Event by its name: two faults of one XID from two processes are two Events of one reason."""
    return {e["name"] or e["reason"]: e["count"] for e in _events(emulator)}


def _await_event(emulator: Any, before: dict[str, int], run: dict[str, Any], timeout_s: float,
                 xid: int | None = None) -> dict[str, Any]:
    """The XID event that is new or counted again after the fault (the one about `xid` when several
    changed, e.g. a repeat-offender event beside it); seconds from the kernel's launch to the moment it
    was seen (polled every 50 ms). Others that changed at the same time are listed too."""
    deadline = time.monotonic() + timeout_s
    while True:
        changed = [e for e in _events(emulator)
                   if e["reason"].startswith("Xid") and e["count"] > before.get(e["name"] or e["reason"], 0)]
        if changed:
            seen = time.time()
            changed.sort(key=lambda e: (not e["reason"].startswith(f"Xid{xid}"),
                                        event_fields(e["message"])["xid"] != xid))
            first = changed[0]
            return {"event": {**event_fields(first["message"]), "reason": first["reason"], "count": first["count"],
                              "message": first["message"]},
                    "seconds_to_event": round(seen - run["launch"], 2),
                    "also": [e["reason"] for e in changed[1:]]}
        if time.monotonic() >= deadline:
            return {"event": None, "seconds_to_event": None, "also": []}
        time.sleep(0.05)


EVENT_GPU = re.compile(r"^GPU (\d+)")
EVENT_XID = re.compile(r"\bXID (\d+)\b")
EVENT_PROCESS = re.compile(r"\(process ([^,()]+), pid ([^)]+)\)")


def event_fields(message: str) -> dict[str, Any]:
    """GPU index, XID, process name and pid as an XID event's message states them (None: not stated)."""
    gpu, xid, process = EVENT_GPU.search(message), EVENT_XID.search(message), EVENT_PROCESS.search(message)
    pid = process[2].strip() if process else None
    name = process[1].strip() if process else None
    return {"gpu": int(gpu[1]) if gpu else None, "xid": int(xid[1]) if xid else None,
            "process": None if name in (None, "none") else name,
            "pid": int(pid) if pid and pid.isdigit() else None}


def _judge_daemon(details: dict[str, Any], exited: int | None) -> str:
    if exited is not None:
        return f"FAILED: the daemon exited with {exited} before the end (see daemon.log)"
    fp = details["footprint"]
    healthy = not details["verdict"]["conditions_true"] and not details["verdict"]["device_taint_rules"]
    return (f"ok: verdict {'healthy' if healthy else 'NOT healthy'}; steady RSS {details['steady']['rss_mib']} MiB, "
            f"CPU {details['steady']['cpu_millicores']} millicores; peak RSS {fp['peak_rss_mib']} MiB")


def _daemon_summary(details: dict[str, Any]) -> list[str]:
    v, after = details["verdict"], details["after_faults"]
    lines = [f"verdict: conditions True: {', '.join(v['conditions_true']) or 'none'}; DeviceTaintRules: "
             f"{', '.join(v['device_taint_rules']) or 'none'} ({v['conditions_seen']} gpu-npd conditions)"]
    faults = details["faults"]
    if isinstance(faults, dict):
        lines.append(f"faults: skipped: {faults['skipped']}")
    else:
        for f in faults:
            e = f.get("event")
            if f.get("launch") is None:
                lines.append(f"fault {f['kernel']}: the program did not reach its kernel (exit {_code(f['exit_code'])}: "
                             f"{f.get('error')}; see faults.log)")
            elif e is None:
                lines.append(f"fault {f['kernel']} (pid {f['pid']}, via {f['via']}): NO event within the wait")
            else:
                lines.append(f"fault {f['kernel']} (pid {f['pid']}, via {f['via']}): {e['reason']} count {e['count']}, "
                             f"GPU {e['gpu']}, process {e['process']}, pid {e['pid']}, "
                             f"{f['seconds_to_event']} s after the launch"
                             + (f"; also {', '.join(f['also'])}" if f.get("also") else ""))
    lines.append(f"after the faults: conditions True: {', '.join(after['conditions_true']) or 'none'}; "
                 f"DeviceTaintRules: {', '.join(after['device_taint_rules']) or 'none'}")
    s = details["steady"]
    lines.append(f"footprint: steady RSS {s['rss_mib']} MiB (anon {s['rss_anon_mib']}, file {s['rss_file_mib']}), "
                 f"{s['cpu_millicores']} millicores over {s['seconds']} s, {s['threads']} threads; peak RSS "
                 f"{details['footprint']['peak_rss_mib']} MiB, with children {details['footprint']['peak_tree_rss_mib']} MiB")
    lines.append("largest mappings (MiB): " + ", ".join(f"{Path(n).name or n} {m}" for n, m in s.get("largest_mappings", [])[:6]))
    return lines


class Sampler:
    """The daemon's RSS (and its children's: nvidia-smi runs count in the pod's memory too) every half
    second, and its CPU time at marks, so a window's millicores can be told."""

    def __init__(self, pid: int, every_s: float = 0.5):
        import psutil

        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[dict[str, float]] = []
        self.marks: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self) -> None:
        self.mark("start")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            sample = self._sample()
            if sample is None:
                return
            self.samples.append(sample)

    def _sample(self) -> dict[str, float] | None:
        import psutil

        try:
            rss = self.proc.memory_info().rss
            tree = rss + sum(_rss(c) for c in self.proc.children(recursive=True))
            status = _status(self.proc.pid)
        except psutil.Error:
            return None
        return {"t": time.monotonic(), "rss": rss, "tree_rss": tree, "anon": status.get("RssAnon", 0) * 1024,
                "file": status.get("RssFile", 0) * 1024, "threads": status.get("Threads", 0)}

    def mark(self, name: str) -> None:
        import psutil

        try:
            cpu = self.proc.cpu_times()
            self.marks[name] = {"t": time.monotonic(), "cpu": cpu.user + cpu.system}
        except psutil.Error:
            pass

    def window(self, start: str, end: str) -> dict[str, Any]:
        a, b = self.marks.get(start), self.marks.get(end)
        if not a or not b:
            return {"rss_mib": None, "rss_anon_mib": None, "rss_file_mib": None, "cpu_millicores": None,
                    "seconds": None, "threads": None}
        inside = [s for s in self.samples if a["t"] <= s["t"] <= b["t"]] or self.samples[-1:] or [{}]
        last = inside[-1]
        seconds = b["t"] - a["t"]
        return {"rss_mib": _mib(max(s.get("rss", 0) for s in inside)), "rss_anon_mib": _mib(last.get("anon", 0)),
                "rss_file_mib": _mib(last.get("file", 0)), "threads": last.get("threads"),
                "cpu_millicores": round((b["cpu"] - a["cpu"]) / seconds * 1000, 2) if seconds > 0 else None,
                "seconds": round(seconds, 1)}

    def figures(self) -> dict[str, Any]:
        return {"peak_rss_mib": _mib(max((s["rss"] for s in self.samples), default=0)),
                "peak_tree_rss_mib": _mib(max((s["tree_rss"] for s in self.samples), default=0)),
                "samples": len(self.samples),
                "rss_mib_series": [[round(s["t"] - self.marks["start"]["t"], 1), _mib(s["rss"])]
                                   for s in self.samples[::4]]}


def _rss(proc: Any) -> int:
    try:
        return proc.memory_info().rss
    except Exception:  # noqa: BLE001 - a child gone between listing and reading
        return 0


def _status(pid: int) -> dict[str, int]:
    """/proc/PID/status's RssAnon, RssFile (kB) and Threads: which part of the RSS is the program's own."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "Threads"):
                fields[key] = int(value.split()[0])
    except OSError:
        pass
    return fields


def largest_mappings(pid: int, smaps: str | None = None, top: int = 12) -> list[list[Any]]:
    """Where the RSS is: /proc/PID/smaps summed by mapped file ([heap], [stack] and anonymous memory as
    named there), largest first, in MiB; what a footprint cut has to aim at."""
    try:
        text = smaps if smaps is not None else Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return []
    totals: dict[str, int] = {}
    name = "[anonymous]"
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else "[anonymous]"
        elif head[:1] == ["Rss:"]:
            totals[name] = totals.get(name, 0) + int(head[1])
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:top]
    return [[name, round(kib / 1024, 1)] for name, kib in ranked if kib]


def _mib(value: float) -> float:
    return round(value / 2**20, 1)


# --- What the machine says in its own words

def _raw(out: Path) -> Step:
    """The files of a replay fixture (as tests/fixtures' real machines): a missing tool or file is noted,
    never a failure."""
    t0 = time.monotonic()
    raw = out / "raw"
    raw.mkdir(exist_ok=True)
    kept = []
    for name, cmd in RAW_COMMANDS.items():
        if shutil.which(cmd[0]):
            code, _ = _run(name, cmd, raw / name)
            kept.append(name if code == 0 else f"{name} (exit {_code(code)})")
    for name, path in RAW_FILES.items():
        if path.is_file():
            shutil.copyfile(path, raw / name)
            kept.append(name)
    information = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    if information:
        (raw / "proc-driver-nvidia-gpu-information.txt").write_text(
            "".join(f"== {p}\n{p.read_text(errors='replace')}" for p in information), encoding="utf-8")
        kept.append("proc-driver-nvidia-gpu-information.txt")
    devices = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    if devices:
        _run("dev-nvidia.txt", ["ls", "-la", *devices], raw / "dev-nvidia.txt")
        kept.append("dev-nvidia.txt")
    ib = Path("/sys/class/infiniband")
    if ib.is_dir():
        lines = []
        for port in sorted(ib.glob("*/ports/*")):
            for attr in ("state", "phys_state", "rate", "link_layer"):
                try:
                    lines.append(f"{port}/{attr}: {(port / attr).read_text().strip()}")
                except OSError as e:
                    lines.append(f"{port}/{attr}: unreadable ({e.strerror})")
        (raw / "infiniband-ports.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        kept.append("infiniband-ports.txt")
    return Step("raw", 0, time.monotonic() - t0, "kept: " + (", ".join(kept) or "nothing (no nvidia-smi, no driver)"))


def _last_line(path: Path) -> str:
    lines = [l for l in path.read_text(encoding="utf-8", errors="replace").splitlines() if l.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def _code(code: int | None) -> str:
    return "-" if code is None else str(code)


if __name__ == "__main__":
    sys.exit(main())
