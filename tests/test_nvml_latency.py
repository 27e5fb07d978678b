"""NVML call latency as a signal: the timing proxy (attribution by handle, bounded memory, simulated latency
charged to its own call), the judgement against same-model siblings, and the fake `nvml_slow` scenario over
sweeps on a simulated clock: GPU 7 named, nothing on healthy nodes."""

from __future__ import annotations

import ctypes
import threading
import time

import pynvml
import pytest

from conftest import builtin_rules, Clock
from detector.agent.metrics import AgentMetrics
from detector.agent.oneshot import diagnose_once
from detector.backends.nvml_timing import CallTimes, TimedNvml
from detector.checks.latency import GpuLatency, LatencyWindow, Timed, latency_fields, node_fields
from detector.checks.visibility import VisibilityCheck
from detector.config import build_checks
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.nvml import FakeNvml
from fake_nvml.scenario import load_scenario

LATENCY_RULES = {"gpu-nvml-slow", "gpu-nvml-slow-alone", "nvml-slow-on-most-gpus"}


class StepTimer:
    """A timer each call of which moves by the step the library under test sets for the call under way."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Library:
    """A tiny NVML look-alike: handles are strings, each call takes `cost[handle]` seconds of the timer."""

    NVML_SUCCESS = 0

    def __init__(self, timer: StepTimer, cost: dict[str, float]):
        self.timer, self.cost = timer, cost

    def nvmlDeviceGetCount(self) -> int:
        self.timer.now += 5.0                 # a slow call naming no GPU: never charged to one
        return len(self.cost)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        handle = sorted(self.cost)[index]
        self.timer.now += self.cost[handle]
        return handle

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        self.timer.now += self.cost[handle]
        return 40

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> None:
        self.timer.now += timeout_ms / 1000   # waits by design: not latency


# ---- the timing proxy ------------------------------------------------------------------------------


def test_calls_are_charged_to_the_gpu_whose_handle_they_name_once_it_was_opened():
    timer = StepTimer()
    nvml = TimedNvml(Library(timer, {"a": 0.001, "b": 2.0}), timer=timer)
    assert nvml.nvmlDeviceGetCount() == 2
    nvml.nvmlDeviceGetTemperature("a", 0)             # a handle no open call returned: not kept
    assert nvml.times.drain() == {}
    a, b = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    for _ in range(3):
        nvml.nvmlDeviceGetTemperature(a, 0)
        nvml.nvmlDeviceGetTemperature(b, 0)
    nvml.nvmlEventSetWait_v2(1, 10_000)
    drained = nvml.times.drain()
    assert {k: list(v) for k, v in drained.items()} == {"a": pytest.approx([0.001] * 4), "b": pytest.approx([2.0] * 4)}
    assert nvml.times.drain() == {}                   # forgotten once drained
    assert nvml.NVML_SUCCESS == 0                     # everything else is the library's own


def test_a_failing_call_is_timed_too_and_still_raises():
    timer = StepTimer()
    lib = Library(timer, {"a": 0.5})
    nvml = TimedNvml(lib, timer=timer)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    def lost(h: str) -> None:
        timer.now += 0.75
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    lib.nvmlDeviceGetPowerUsage = lost
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetPowerUsage(handle)
    assert list(nvml.times.drain()["a"]) == pytest.approx([0.5, 0.75])


def test_a_call_replaced_on_the_proxy_is_what_callers_get():
    """Tests replace single calls on host.nvml (`host.nvml.nvmlDeviceGetCount = ...`): that still works."""
    timer = StepTimer()
    nvml = TimedNvml(Library(timer, {"a": 0.0}), timer=timer)
    nvml.nvmlDeviceGetCount()
    nvml.nvmlDeviceGetCount = lambda: 42
    assert nvml.nvmlDeviceGetCount() == 42


def test_c_handles_of_one_device_share_its_key_whatever_the_pointer_object():
    """pynvml returns a new pointer object each time a GPU is opened; they point at one device."""
    devices = [pynvml.struct_c_nvmlDevice_t(), pynvml.struct_c_nvmlDevice_t()]
    nvml = TimedNvml(pynvml)
    first, again, other = (ctypes.pointer(devices[0]), ctypes.pointer(devices[0]), ctypes.pointer(devices[1]))
    assert isinstance(first, pynvml.c_nvmlDevice_t) and first is not again
    assert nvml.device_key(first) == nvml.device_key(again) != nvml.device_key(other)
    assert nvml.device_key(first) == ctypes.addressof(devices[0])


def test_memory_is_bounded_per_gpu_and_in_gpus_keeping_the_newest():
    times = CallTimes(capacity=8, max_devices=2)
    for i in range(100):
        times.record("a", float(i))
    times.record("b", 1.0)
    times.record("c", 1.0)                            # a third device: not kept
    drained = times.drain()
    assert set(drained) == {"a", "b"}
    assert len(drained["a"]) <= 8 and list(drained["a"])[-1] == 99.0
    assert list(drained["a"]) == sorted(drained["a"])  # the newest, in order


def test_a_slow_gpu_costs_its_own_calls_only_when_simulated_on_a_shared_clock():
    """GPU 7 simulates 1.5 s a call while other threads call GPU 0: GPU 0 is never charged for it, and no
    real time passes."""
    node = load_scenario("h100-sxm-8-nvml-slow").build(clock=Clock(0.0))
    host = fake_host(node, simulated_time=True)
    nvml = host.nvml
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 7)]
    nvml.times.drain()

    def hammer(handle) -> None:
        for _ in range(200):
            nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    started = time.monotonic()
    threads = [threading.Thread(target=hammer, args=(h,)) for h in handles for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 5          # 800 calls, 600 s of them simulated
    drained = nvml.times.drain()
    fast, slow = (drained[nvml.device_key(h)] for h in handles)
    assert len(fast) == len(slow) == 400
    assert max(fast) < 0.5
    assert min(slow) >= 1.5 and max(slow) < 1.9     # 1.5 s per call, charged once per call


def test_on_real_time_a_slow_gpu_really_sleeps_once_per_call():
    """The daemon's case: the call blocks as the ioctl would, and a call that looks its GPU up more than
    once inside the fake (the field-value chain) still costs one delay."""
    node = load_scenario("h100-sxm-8").build()
    node.inject(Fault("nvml_slow", 3, {"seconds": 0.05}))
    nvml = fake_host(node).nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    nvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    nvml.nvmlDeviceGetUUID(handle)
    durations = list(nvml.times.drain()[nvml.device_key(handle)])
    assert len(durations) == 3 and all(0.05 <= d < 0.095 for d in durations), durations


def test_the_fault_is_validated_and_a_reset_heals_it():
    with pytest.raises(ValueError, match="needs a 'gpu'"):
        Fault("nvml_slow", None, {"seconds": 1.0})
    with pytest.raises(ValueError, match="needs parameter 'seconds'"):
        Fault("nvml_slow", 1, {})
    node = load_scenario("h100-sxm-8-nvml-slow").build()
    assert node.read(lambda s: s.gpus[7].nvml_slow_s) == 1.5
    node.inject(Fault("recover", 7))
    assert node.read(lambda s: s.gpus[7].nvml_slow_s) == 0.0


def test_a_fake_nvml_used_without_the_proxy_is_never_faster_than_asked():
    node = load_scenario("h100-sxm-8").build()
    node.inject(Fault("nvml_slow", 0, {"seconds": 0.02}))
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    started = time.monotonic()
    for _ in range(3):
        nvml.nvmlDeviceGetUUID(handle)
    assert time.monotonic() - started >= 0.06


# ---- the judgement ---------------------------------------------------------------------------------


def lat(p95: float, calls: int = 100) -> GpuLatency:
    return GpuLatency(calls, p95, p95)


def test_a_gpu_is_set_beside_the_median_of_its_same_model_siblings():
    gpus = {f"b{i}": Timed("H100", True, lat(0.0001)) for i in range(7)}
    gpus["b7"] = Timed("H100", True, lat(1.5))
    fields = latency_fields(gpus, min_calls=20)
    assert fields["b7"]["nvml_siblings"] == 7 and fields["b7"]["nvml_siblings_p95_s"] == 0.0001
    assert fields["b7"]["nvml_slowdown"] == 15000.0
    assert fields["b0"]["nvml_siblings_p95_s"] == 0.0001 and fields["b0"]["nvml_slowdown"] == 1.0


def test_siblings_are_same_model_answered_and_ready_only():
    gpus = {"a": Timed("H100", True, lat(0.0001)),
            "b": Timed("H100", True, lat(1.0, calls=5)),        # too few calls to compare with
            "c": Timed("H100", False, lat(120.0)),              # hung: judged by the hang rule, no sibling
            "d": Timed("A100", True, lat(0.0001)),              # another model
            "e": Timed("H100", True, lat(2.0))}
    fields = latency_fields(gpus, min_calls=20)
    assert fields["e"]["nvml_siblings"] == 1 and fields["e"]["nvml_siblings_p95_s"] == 0.0001
    assert fields["b"]["nvml_latency_ready"] is False and fields["d"]["nvml_siblings"] == 0
    assert node_fields(gpus, 20) == {"nvml_gpus_timed": 3, "nvml_median_p95_s": 0.0001}


def test_uniform_slowness_names_no_gpu_but_the_node():
    gpus = {f"b{i}": Timed("H100", True, lat(1.2 + i / 100)) for i in range(8)}
    fields = latency_fields(gpus, min_calls=20)
    assert all(f["nvml_slowdown"] < 1.1 for f in fields.values())
    assert node_fields(gpus, 20)["nvml_median_p95_s"] >= 1.2


def test_the_node_median_is_high_only_when_more_than_half_are_slow():
    half = {f"b{i}": Timed("H100", True, lat(1.5 if i < 4 else 0.0001)) for i in range(8)}
    assert node_fields(half, 20)["nvml_median_p95_s"] == 0.0001
    assert all(latency_fields(half, 20)[f"b{i}"]["nvml_slowdown"] >= 10 for i in range(4))
    most = {f"b{i}": Timed("H100", True, lat(1.5 if i < 5 else 0.0001)) for i in range(8)}
    assert node_fields(most, 20)["nvml_median_p95_s"] == 1.5
    assert all(f["nvml_slowdown"] <= 1 for f in latency_fields(most, 20).values())


def test_the_window_keeps_its_clock_seconds_and_its_p95_is_nearest_rank():
    clock = Clock(0.0)
    window = LatencyWindow(300, clock)
    window.add("a", [0.001] * 95 + [2.0] * 5)
    assert window.latency("a") == GpuLatency(100, pytest.approx(0.001), 2.0)
    clock.now = 200
    window.add("a", [2.0] * 100)
    assert window.latency("a").p95_s == 2.0 and window.latency("a").calls == 200
    clock.now = 301                                   # the first batch left the window
    assert window.latency("a").calls == 100
    clock.now = 501
    assert window.latency("a") is None and window.latency("never") is None


def test_the_window_is_bounded_in_samples_per_gpu():
    window = LatencyWindow(300, Clock(0.0), max_samples=256)
    for _ in range(10):
        window.add("a", [0.001] * 100)
    assert window.latency("a").calls <= 256
    window.add("b", [0.001] * 1000)
    assert window.latency("b").calls == 256
    window.keep_only({"b"})
    assert window.latency("a") is None


# ---- the scenario, over sweeps on a simulated clock ------------------------------------------------


@pytest.fixture(scope="module")
def rules(registry):
    return builtin_rules()


def watch(scenario: str, registry, rules, sweeps: int = 3, step: float = 60.0, inject=()):
    """Every check sweeping a fake node on a simulated clock every `step` seconds, as `diagnose --duration`
    does; the visibility check reads the same clock. The last sweep and every problem's rule and GPUs."""
    clock = Clock(0.0)
    node = load_scenario(scenario).build(clock=clock)
    for fault in inject:
        node.inject(fault)
    host = fake_host(node, simulated_time=True)
    checks = [c if c.name != "visibility" else VisibilityCheck({}, clock) for c in build_checks(registry, None, {})]
    fired: dict[str, set] = {}
    for _ in range(sweeps):
        sweep, problems = diagnose_once(host, checks, rules)
        for p in problems:
            fired.setdefault(p.rule, set()).update(g.index for g in p.gpus)
        clock.now += step
    host.close()
    return sweep, problems, fired


def visibility_fields(sweep) -> dict:
    run = next(r for r in sweep.runs if r.name == "visibility")
    return {o.gpu.index if o.gpu else "node": o.fields for o in run.observations}


def test_the_slow_gpu_is_named_with_its_figures_and_its_siblings(registry, rules):
    started = time.monotonic()
    sweep, problems, fired = watch("h100-sxm-8-nvml-slow", registry, rules)
    assert time.monotonic() - started < 30            # 3 sweeps of ~300 calls at 1.5 s: simulated
    assert fired == {"gpu-nvml-slow": {7}}
    (problem,) = problems
    assert problem.type == "GpuDriverUnhealthy" and problem.reason == "GpuNvmlSlow"
    assert problem.severity.value == "warning" and problem.action == "INSPECT"
    assert "p95 1.5 s" in problem.message and "7 same-model siblings" in problem.message
    fields = visibility_fields(sweep)
    assert fields[7]["nvml_p95_s"] == 1.5 and fields[7]["nvml_calls"] > 200
    assert all(fields[i]["nvml_p95_s"] < 0.05 for i in range(7))
    assert fields["node"]["nvml_timed"] is True and fields["node"]["nvml_median_p95_s"] < 0.05


@pytest.mark.parametrize("scenario", ["h100-sxm-8", "h100-sxm-8-power-capped", "h100-sxm-8-ecc-corrected",
                                      "h100-sxm-8-throttle-blip"])
def test_healthy_nodes_raise_nothing(scenario, registry, rules):
    sweep, _, fired = watch(scenario, registry, rules)
    assert fired == {}
    fields = visibility_fields(sweep)
    assert all(fields[i]["nvml_latency_ready"] and fields[i]["nvml_p95_s"] < 0.05 for i in range(8))


def test_every_gpu_slow_is_the_node_not_a_gpu(registry, rules):
    slow = [Fault("nvml_slow", i, {"seconds": 1.0}) for i in range(8)]
    _, problems, fired = watch("h100-sxm-8", registry, rules, inject=slow)
    assert fired == {"nvml-slow-on-most-gpus": set()}
    assert problems[0].reason == "NvmlSlow" and "median p95 1 s over 8 GPUs" in problems[0].message


def test_a_lone_gpu_is_judged_on_the_floor(registry, rules):
    _, _, fired = watch("rtx-4090-1", registry, rules, inject=[Fault("nvml_slow", 0, {"seconds": 0.8})])
    assert fired == {"gpu-nvml-slow-alone": {0}}
    _, _, fired = watch("rtx-4090-1", registry, rules, inject=[Fault("nvml_slow", 0, {"seconds": 0.2})])
    assert fired == {}


def test_one_sweep_of_the_inventory_alone_is_not_judged(registry, rules):
    """13 inventory calls per GPU are under the 20 a window needs: no verdict yet, whatever they took."""
    clock = Clock(0.0)
    host = fake_host(load_scenario("h100-sxm-8-nvml-slow").build(clock=clock), simulated_time=True)
    sweep, problems = diagnose_once(host, [VisibilityCheck({}, clock)], rules)
    fields = visibility_fields(sweep)
    assert problems == [] and fields[7]["nvml_calls"] == 13 and fields[7]["nvml_latency_ready"] is False


def test_the_latency_is_exported_per_gpu(registry, rules):
    sweep, problems, _ = watch("h100-sxm-8-nvml-slow", registry, rules, sweeps=2)
    metrics = AgentMetrics()
    metrics.sweep(sweep, problems)
    value = metrics.registry.get_sample_value
    assert value("gpu_npd_gpu_nvml_call_p95_seconds", {"gpu": "7", "pci_bus_id": "0000:db:00.0"}) == 1.5
    assert value("gpu_npd_gpu_nvml_call_max_seconds", {"gpu": "7", "pci_bus_id": "0000:db:00.0"}) == 1.5
    assert value("gpu_npd_gpu_nvml_call_p95_seconds", {"gpu": "0", "pci_bus_id": "0000:18:00.0"}) < 0.05


def test_on_real_time_a_gpu_too_slow_for_the_inventory_deadline_is_hung_and_its_latency_still_shown(rules):
    """The daemon's case on real time: 13 inventory calls at 0.1 s miss a 0.5 s deadline, so the GPU is
    GpuNvmlCallHung (one problem, not two); the calls it did answer, slowly, are still its latency."""
    from detector.core.sweep import run_sweep
    from detector.rules.engine import RuleEngine
    node = load_scenario("h100-sxm-8").build()
    node.inject(Fault("nvml_slow", 7, {"seconds": 0.1}))
    host = fake_host(node)
    check = VisibilityCheck({})
    run_sweep(host, [check], inventory_timeout_s=0.5)
    time.sleep(1.6)                                   # the abandoned read of GPU 7 finishes its 13 calls
    out = run_sweep(host, [check], inventory_timeout_s=0.5)
    problems = RuleEngine(rules).evaluate(out.observations)
    assert {(p.rule, tuple(g.index for g in p.gpus)) for p in problems} == {("gpu-nvml-hung", (7,))}
    fields = visibility_fields(out)
    assert fields[7]["nvml_error"] == "Hung" and fields[7]["nvml_calls"] >= 13
    assert 0.1 <= fields[7]["nvml_p95_s"] < 0.2
