"""The allocatable check over real node objects and ResourceSlices (tests/fixtures/allocatable/SOURCE.md),
parsed as the daemon parses them (detector/kube/node_status.py), judged through rules/allocatable.yaml;
then through the node agent on a fake node, as the daemon runs it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import builtin_rules, Clock
from detector.agent.agent import AgentSettings, NodeAgent
from detector.checks.allocatable import AllocatableCheck
from detector.config import build_checks
from detector.core.gpu_health import gpu_health
from detector.core.nodecheck import NodeView
from detector.core.nodestatus import NodeStatus
from detector.core.types import GpuRef, Problem, Severity
from detector.kube.node_status import dra_devices, node_status
from detector.rules.engine import RuleEngine
from detector.yamlsource import load_yaml
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario

FIXTURES = Path(__file__).parent / "fixtures" / "allocatable"
A100_UUID = "GPU-13719f71-412c-d11e-b236-a262f530a4fc"


@pytest.fixture(scope="module")
def engine(registry) -> RuleEngine:
    return RuleEngine(builtin_rules())


def node(fixture: str, **labels: str) -> NodeStatus:
    obj = load_yaml(FIXTURES / fixture).data
    status = node_status(obj, 1_764_000_000.0)
    return replace(status, labels={**status.labels, **labels}) if labels else status


def gpus(count: int) -> list[GpuRef]:
    return [GpuRef(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", f"0000:{0x18 + i:02x}:00.0") for i in range(count)]


def lost(ref: GpuRef) -> GpuRef:
    """What NVML's inventory says of a GPU that fell off the bus: counted, but no UUID to read."""
    return GpuRef(ref.index, None, ref.pci_bus_id)


def problem(ref: GpuRef, severity: Severity = Severity.CRITICAL) -> Problem:
    return Problem("gpu-fell-off-bus", "visibility", "GpuMissing", "GpuFellOffBus", "", severity, "RESTART_BM",
                   "condition", (ref,))


def view(status: NodeStatus | None, visible: list[GpuRef], known: list[GpuRef] | None = None,
         problems: list[Problem] = (), uptime_s: float = 3600.0, agent_age_s: float = 3600.0) -> NodeView:
    health = gpu_health(known if known is not None else visible, problems)
    return NodeView("n", "boot", 1_764_000_000.0, health, list(problems), [], visible=tuple(visible),
                    node_status=status, uptime_s=uptime_s, agent_age_s=agent_age_s)


def verdicts(engine: RuleEngine, v: NodeView, **settings) -> tuple[list, dict[str, Problem]]:
    output = AllocatableCheck({"settle": 0.0, **settings}).judge(v)
    return output.observations, {p.reason: p for p in engine.evaluate(output.observations)}


# -- the device plugin's nvidia.com/gpu -------------------------------------------------------------------

def test_allocatable_stuck_at_zero_with_sixteen_healthy_gpus_is_a_warning(engine):
    """k8s-device-plugin #58: capacity 16, allocatable 0, every GPU fine on the host."""
    _, found = verdicts(engine, view(node("dp58-allocatable-zero.yaml"), gpus(16)))
    assert set(found) == {"HealthyGpusNotAdvertised"}
    p = found["HealthyGpusNotAdvertised"]
    assert (p.type, p.severity, p.action) == ("GpuAllocatableMismatch", Severity.WARNING, "RESTART_DEVICE_PLUGIN")
    assert p.message.startswith("nvidia.com/gpu: 0 allocatable (capacity 16) but 16 healthy GPUs call for 16")


def test_zero_and_zero_while_gpus_run_is_a_warning(engine):
    """k8s-device-plugin #1228: capacity and allocatable both 0 while the plugin pod runs."""
    _, found = verdicts(engine, view(node("dp1228-zero.yaml"), gpus(8)))
    assert set(found) == {"HealthyGpusNotAdvertised"}
    assert "0 allocatable (capacity 0) but 8 healthy GPUs" in found["HealthyGpusNotAdvertised"].message


def test_a_one_gpu_node_that_matches_is_quiet(engine):
    observations, found = verdicts(engine, view(node("dp213-one-gpu.yaml"), gpus(1)))
    assert found == {}
    assert observations[0].fields["advertised"] == 1 and observations[0].fields["nvml_gpus"] == 1


def test_more_advertised_than_nvml_answers_for_is_critical_and_names_the_lost_gpu(engine):
    """The pytorch/ci-infra #1058 case: a GPU fell off the bus, allocatable stays 1 on a one-GPU node."""
    gpu = gpus(1)[0]
    _, found = verdicts(engine, view(node("dp213-one-gpu.yaml"), [lost(gpu)], [gpu], [problem(gpu)]))
    p = found["AdvertisedGpusMissing"]
    assert p.severity is Severity.CRITICAL and p.gpus == ()          # the node's resource, not one GPU's
    assert p.message.startswith("nvidia.com/gpu: 1 allocatable (capacity 1) but NVML sees 0 GPUs")
    assert f"GPUs NVML no longer sees: GPU 0 ({gpu.uuid}, {gpu.pci_bus_id})" in p.message
    assert "HealthyGpusNotAdvertised" not in found


def test_a_failed_gpu_the_plugin_stopped_advertising_is_no_mismatch(engine):
    """Capacity 8 (it counts unhealthy GPUs by design), allocatable 7, GPU 3 lost: the plugin did its job."""
    refs = gpus(8)
    status = replace(node("dp213-one-gpu.yaml"), capacity={"nvidia.com/gpu": "8"}, allocatable={"nvidia.com/gpu": "7"})
    visible = [lost(r) if r.index == 3 else r for r in refs]
    _, found = verdicts(engine, view(status, visible, refs, [problem(refs[3])]))
    assert found == {}
    degraded = [problem(refs[5], Severity.WARNING)]          # nor is a degraded GPU dropped, or kept
    assert verdicts(engine, view(status, refs, refs, degraded))[1] == {}


# -- quantities, as the API server may write them (issue 30, finding 13) ------------------------------------

def counted(allocatable: str | None, capacity: str | None = "8") -> NodeStatus:
    def only(value: str | None) -> dict[str, str]:
        return {"cpu": "96", **({"nvidia.com/gpu": value} if value is not None else {})}
    return NodeStatus("n", 0.0, capacity=only(capacity), allocatable=only(allocatable))


def eight_with_gpu_3_lost() -> tuple[list[GpuRef], list[GpuRef], list[Problem]]:
    refs = gpus(8)
    return [lost(r) if r.index == 3 else r for r in refs], refs, [problem(refs[3])]


@pytest.mark.parametrize("quantity, advertised", [("8k", 8000), ("1e3", 1000), ("8000m", 8), ("8.0", 8),
                                                   ("+8", 8), ("0.008k", 8)])
def test_allocatable_as_a_quantity_with_a_gpu_lost_is_a_mismatch(engine, quantity, advertised):
    """int("8k") fails: read so, the lost GPU went unreported. As a quantity it is counted."""
    visible, known, problems = eight_with_gpu_3_lost()
    observations, found = verdicts(engine, view(counted(quantity), visible, known, problems))
    assert observations[0].fields["advertised"] == advertised
    assert set(found) == {"AdvertisedGpusMissing"}
    assert found["AdvertisedGpusMissing"].type == "GpuAllocatableMismatch"
    assert "GPU 3 (" in found["AdvertisedGpusMissing"].message


@pytest.mark.parametrize("allocatable, capacity", [("8", "8"), ("8.0", "8"), ("8000m", "8k"), ("8", "8000m"),
                                                    ("0.008k", "8e0"), ("8", "1e1")])
def test_the_same_count_in_another_form_is_no_mismatch(engine, allocatable, capacity):
    observations, found = verdicts(engine, view(counted(allocatable, capacity), gpus(8)))
    assert found == {}
    assert observations[0].fields["advertised"] == 8 and observations[0].fields["why"] == ""


def test_capacity_without_allocatable_is_healthy_gpus_not_advertised(engine):
    """kubelet lists capacity 8 and no allocatable nvidia.com/gpu: the scheduler is offered none of them."""
    observations, found = verdicts(engine, view(counted(None, "8"), gpus(8)))
    assert set(found) == {"HealthyGpusNotAdvertised"}
    message = found["HealthyGpusNotAdvertised"].message
    assert message.startswith("nvidia.com/gpu: 0 allocatable (capacity 8) but 8 healthy GPUs call for 8")
    assert "no nvidia.com/gpu allocatable at all" in message
    assert observations[0].fields["capacity"] == 8
    shared = NodeStatus("n", 0.0, capacity={"nvidia.com/gpu.shared": "32"}, allocatable={"cpu": "96"},
                        labels={"nvidia.com/gpu.replicas": "4"})
    _, found = verdicts(engine, view(shared, gpus(8)))
    assert "0 allocatable (capacity 32) but 8 healthy GPUs call for 32" in found["HealthyGpusNotAdvertised"].message


def test_neither_capacity_nor_allocatable_is_still_not_applicable(engine):
    """A node whose device plugin has not registered yet lists no nvidia.com/gpu at all: no verdict."""
    observations, found = verdicts(engine, view(counted(None, None), gpus(8)))
    assert found == {} and observations[0].fields["not_applicable"] is True


@pytest.mark.parametrize("quantity, words", [("500m", "'500m' is 0.5, not a whole number"),
                                              ("7.5", "is 7.5, not a whole number"), ("-1", "negative"),
                                              ("eight", "not a quantity"), ("1e30", "out of range")])
def test_allocatable_that_is_no_whole_count_is_said_and_not_judged(engine, quantity, words):
    """No GPU is called lost (or unadvertised) on a count that is not one; `why` says what it is."""
    visible, known, problems = eight_with_gpu_3_lost()
    output = AllocatableCheck({"settle": 0.0}).judge(view(counted(quantity), visible, known, problems))
    [observation] = output.observations
    assert engine.evaluate(output.observations) == []
    assert words in observation.fields["why"] and "not a valid GPU count" in observation.fields["why"]
    assert observation.fields["over"] is False and observation.fields["under"] is False
    assert "not judged" in output.summary and "matches" not in output.summary
    output = AllocatableCheck({"settle": 0.0}).judge(view(counted(None, quantity), gpus(8)))   # capacity alone
    assert engine.evaluate(output.observations) == [] and words in output.observations[0].fields["why"]


def test_a_capacity_that_is_no_count_does_not_stop_allocatable_being_judged(engine):
    visible, known, problems = eight_with_gpu_3_lost()
    observations, found = verdicts(engine, view(counted("8", "lots"), visible, known, problems))
    assert set(found) == {"AdvertisedGpusMissing"}
    assert observations[0].fields["capacity"] == -1 and "'lots' is not a quantity" in observations[0].fields["why"]


# -- time-slicing and MIG ---------------------------------------------------------------------------------

def test_time_slicing_without_a_replicas_label_is_not_judged(engine):
    """gpu-operator #684: one GPU, replicas 12, nvidia.com/gpu 12 and no GFD replicas label shown."""
    observations, found = verdicts(engine, view(node("op684-time-slicing.yaml"), gpus(1)))
    assert found == {}
    assert "12 per GPU" in observations[0].fields["why"]


def test_time_slicing_with_the_replicas_label_is_judged_in_replicas(engine):
    status = node("op684-time-slicing.yaml", **{"nvidia.com/gpu.replicas": "12"})
    assert verdicts(engine, view(status, gpus(1)))[1] == {}
    _, found = verdicts(engine, view(node("op684-time-slicing.yaml", **{"nvidia.com/gpu.replicas": "6"}), gpus(1)))
    assert "AdvertisedGpusMissing" in found and "room for at most 6" in found["AdvertisedGpusMissing"].message
    _, found = verdicts(engine, view(node("op684-time-slicing.yaml"), gpus(2)), replicas=12)   # the setting
    assert "HealthyGpusNotAdvertised" in found and "call for 24" in found["HealthyGpusNotAdvertised"].message


def test_renamed_shared_resource_with_mig_and_time_slicing_is_not_a_false_alarm(engine):
    """bottlerocket #4418: 8 GPUs, 4 MIG partitions each, replicas 4: nvidia.com/gpu 0, .shared 128."""
    observations, found = verdicts(engine, view(node("br4418-mig-shared.yaml"), gpus(8)))
    assert found == {}
    assert observations[0].fields["resource"] == "nvidia.com/gpu.shared"
    labelled = node("br4418-mig-shared.yaml", **{"nvidia.com/mig.strategy": "single", "nvidia.com/gpu.replicas": "4"})
    observations, found = verdicts(engine, view(labelled, gpus(8)))
    assert found == {} and "MIG single" in observations[0].fields["why"]


def test_mig_mixed_judges_only_what_mig_cannot_explain(engine):
    """gpu-operator #637: nvidia.com/gpu 2 beside mig-* resources. Fewer than the healthy GPUs is what MIG
    mode does; more than NVML sees at all is still a lie."""
    observations, found = verdicts(engine, view(node("op637-mig-mixed.yaml"), gpus(4)))
    assert found == {} and observations[0].fields["mig_strategy"] == "mixed"
    unshared = node("op637-mig-mixed.yaml", **{"nvidia.com/gpu.replicas": "1"})      # GFD: not shared
    _, found = verdicts(engine, view(unshared, gpus(1)))
    assert set(found) == {"AdvertisedGpusMissing"}
    observations, found = verdicts(engine, view(node("op637-mig-mixed.yaml"), gpus(1)))
    assert found == {} and "2 per GPU" in observations[0].fields["why"]     # sharing unknown: 2 = 2 x 1


def test_mig_resources_alone_are_not_judged(engine):
    """gpu-feature-discovery #7: only nvidia.com/mig-3g.20gb 16, strategy mixed."""
    assert verdicts(engine, view(node("gfd7-mig-mixed.yaml"), gpus(8)))[1] == {}


# -- DRA ----------------------------------------------------------------------------------------------------

def slice_devices(node_name: str = "aks-gpupool-15127565-vmss000002"):
    return dra_devices([load_yaml(FIXTURES / "dra719-resourceslice.yaml").data], node_name)


def dra_node(devices) -> NodeStatus:
    return NodeStatus("aks-gpupool-15127565-vmss000002", 0.0, dra_devices=devices)


def test_a_dra_only_node_whose_gpu_nvml_sees_is_quiet(engine):
    a100 = GpuRef(0, A100_UUID, "0000:00:1e.0")
    observations, found = verdicts(engine, view(dra_node(slice_devices()), [a100]))
    assert found == {} and [o.fields["source"] for o in observations] == ["dra"]
    with_zero = replace(dra_node(slice_devices()), allocatable={"nvidia.com/gpu": "0"}, capacity={"nvidia.com/gpu": "0"})
    observations, found = verdicts(engine, view(with_zero, [a100]))       # allocatable 0 by design
    assert found == {} and [o.fields["source"] for o in observations] == ["dra"]


def test_a_published_gpu_nvml_does_not_see_is_critical_and_a_healthy_unpublished_one_a_warning(engine):
    other = GpuRef(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "0000:00:1e.0")
    _, found = verdicts(engine, view(dra_node(slice_devices()), [other]))
    assert set(found) == {"DraDevicesMissing"}                # the warning waits while the worse holds
    assert found["DraDevicesMissing"].message == (
        f"gpu.nvidia.com: 1 GPU devices published, NVML sees 1: published but not seen by NVML: gpu-1 ({A100_UUID}); "
        f"healthy but not published: GPU 0 ({other.uuid}, 0000:00:1e.0)."
        " Recommended action: RESTART_DEVICE_PLUGIN (restart the NVIDIA device plugin (or DRA driver) pod on the "
        "node, so that what the scheduler is told matches the GPUs again).")
    a100, spare = GpuRef(0, A100_UUID, "0000:00:1e.0"), GpuRef(1, other.uuid, "0000:00:1f.0")
    _, found = verdicts(engine, view(dra_node(slice_devices()), [a100, spare]))
    assert set(found) == {"HealthyGpusNotPublished"} and f"GPU 1 ({other.uuid}" in found["HealthyGpusNotPublished"].message


def test_another_nodes_slice_is_not_this_nodes(engine):
    assert slice_devices("some-other-node") == ()


# -- when nothing is judged ---------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [None, NodeStatus("n", 0.0, capacity={"cpu": "8"}, allocatable={"cpu": "8"}),
                                    NodeStatus("n", 0.0, dra_devices=())])
def test_no_node_object_no_plugin_no_driver_is_not_applicable(engine, status):
    observations, found = verdicts(engine, view(status, gpus(8)))
    assert found == {} and observations[0].fields["not_applicable"] is True


def test_settle_holds_judgement_after_boot_or_agent_start(engine):
    status = node("dp1228-zero.yaml")
    check = AllocatableCheck({"settle": 600.0})
    for uptime, age in ((30.0, 7200.0), (7200.0, 30.0)):          # a fresh boot, or a fresh agent
        output = check.judge(view(status, gpus(8), uptime_s=uptime, agent_age_s=age))
        assert output.observations[0].fields["settling"] is True and engine.evaluate(output.observations) == []
    output = check.judge(view(status, gpus(8), uptime_s=601.0, agent_age_s=700.0))
    assert {p.reason for p in engine.evaluate(output.observations)} == {"HealthyGpusNotAdvertised"}


# -- through the node agent, as the daemon runs it ------------------------------------------------------------

def test_through_the_agent_allocatable_seven_of_eight_and_back(registry):
    """The acceptance case on the fake node: allocatable 7 of 8 healthy turns the condition True, 8 False."""
    rules = builtin_rules()
    clock = Clock(1_764_000_000.0)
    fake = load_scenario("h100-sxm-8").build(clock=clock)
    host = fake_host(fake, threaded=False)
    status = {"now": node_status({"metadata": {"name": "h100-sxm-8"},
                                  "status": {"allocatable": {"nvidia.com/gpu": "7"}, "capacity": {"nvidia.com/gpu": "8"}}},
                                 clock.now)}
    host.node_status = lambda: status["now"]
    checks = build_checks(registry, ["visibility", "allocatable"], {"allocatable": {"settle": 0}})
    agent = NodeAgent(host, checks, rules, settings=AgentSettings(start_spread_s=0.0), clock=clock)
    agent.run(agent.checks)
    condition = {c.type: c for c in agent.conditions()}["GpuAllocatableMismatch"]
    assert condition.active and condition.reason == "HealthyGpusNotAdvertised"
    assert "nvidia.com/gpu: 7 allocatable (capacity 8) but 8 healthy GPUs call for 8" in condition.message
    status["now"] = replace(status["now"], allocatable={"nvidia.com/gpu": "8"})
    agent.kick_node_checks()
    agent.run_due()
    assert not {c.type: c for c in agent.conditions()}["GpuAllocatableMismatch"].active
    fake.inject(Fault("xid", 3, {"code": 79}))                 # the plugin keeps 8: pods would land on GPU 3
    agent.run(agent.checks)
    condition = {c.type: c for c in agent.conditions()}["GpuAllocatableMismatch"]
    assert condition.active and condition.reason == "AdvertisedGpusMissing"
    assert "GPU 3 (" in condition.message and "NVML sees 7 GPUs" in condition.message


def test_through_the_agent_allocatable_8k_and_a_gpu_lost(registry):
    """The acceptance case of issue 30: allocatable written `8k`, XID 79 on GPU 3: GpuAllocatableMismatch."""
    rules = builtin_rules()
    clock = Clock(1_764_000_000.0)
    fake = load_scenario("h100-sxm-8").build(clock=clock)
    host = fake_host(fake, threaded=False)
    status = node_status({"metadata": {"name": "h100-sxm-8"},
                          "status": {"allocatable": {"nvidia.com/gpu": "8k"}, "capacity": {"nvidia.com/gpu": "8k"}}},
                         clock.now)
    host.node_status = lambda: status
    checks = build_checks(registry, ["visibility", "allocatable"], {"allocatable": {"settle": 0}})
    agent = NodeAgent(host, checks, rules, settings=AgentSettings(start_spread_s=0.0), clock=clock)
    fake.inject(Fault("xid", 3, {"code": 79}))
    agent.run(agent.checks)
    condition = {c.type: c for c in agent.conditions()}["GpuAllocatableMismatch"]
    assert condition.active and condition.reason == "AdvertisedGpusMissing"
    assert "8000 allocatable (capacity 8000)" in condition.message and "GPU 3 (" in condition.message
