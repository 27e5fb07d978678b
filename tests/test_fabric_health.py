"""NVML's fabric health (issue 32, item 1), decoded in full and judged the same way live and replayed: every
field of the health mask and every summary value, through the fake NVML (the fabric_health fault), through
real driver-580 `nvidia-smi -q -x` (GB200, GB300) and `-q` text captures edited one GPU at a time, and as
raw masks. NOT_SUPPORTED / N/A stays unknown and raises nothing; a recovery in progress counts only once
held past the debounce, never from one snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest

from conftest import builtin_rules, Clock, diagnose_host, node_for
from detector.backends.fabric_health import CONFIGURATIONS, HEALTHY, FabricHealth, decode, encode
from detector.checks.fabric import FabricCheck
from detector.core.sweep import run_sweep
from detector.core.types import Severity
from detector.rules.engine import RuleEngine
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from detector.cli.replay_host import replay_host
from fake_nvml.scenario import load_scenario

FIXTURES = Path(__file__).parent / "fixtures"
REAL = FIXTURES / "real_machines"
GB300_XML = REAL / "x-k8sti-gb300-x4-580" / "nvidia-smi-q.xml"
GB300_GPU2 = "0018:06:00.0"
H100_580_TEXT = REAL / "h100-vm-580" / "nvidia-smi-q.txt"          # driver 580 prints every Health line
H100_BUS = "0000:00:06.0"

# One case per health field and summary value: the fabric_health fault's parameters, the printed lines
# that say the same (as nvidia-smi 580 prints them), and the rules that must fire on that GPU.
CASES = {
    "limited-capacity-degraded": ({"bandwidth": "degraded", "summary": "limited_capacity"},
                                  {"Summary": "Limited Capacity", "Bandwidth": "Degraded"},
                                  {"fabric-bandwidth-degraded"}),
    "limited-capacity-alone": ({"summary": "limited_capacity"}, {"Summary": "Limited Capacity"},
                               {"fabric-limited-capacity"}),
    "degraded-healthy-summary": ({"bandwidth": "degraded", "summary": "healthy"}, {"Bandwidth": "Degraded"},
                                 {"fabric-bandwidth-degraded"}),
    "route-unhealthy": ({"route_unhealthy": True}, {"Summary": "Unhealthy", "Route Unhealthy": "True"},
                        {"fabric-route-unhealthy"}),
    "unhealthy-alone": ({"summary": "unhealthy"}, {"Summary": "Unhealthy"}, {"fabric-health-unhealthy"}),
    "route-recovery": ({"route_recovery": True},
                       {"Summary": "Unhealthy", "Route Recovery in progress": "True"}, set()),
    "access-timeout-recovery": ({"access_timeout": True},
                                {"Summary": "Unhealthy", "Access Timeout Recovery": "True"}, set()),
    "healthy": ({"summary": "healthy"}, {}, set()),
    **{f"config-{name}": ({"incorrect_config": name},
                          {"Summary": "Unhealthy", "Incorrect Configuration": printed},
                          {"fabric-incorrect-configuration"})
       for name, printed in [("incorrect_sysguid", "Incorrect SysGUID"),
                             ("incorrect_chassis_sn", "Incorrect Chassis Serial Number"),
                             ("no_partition", "No Partition"), ("insufficient_nvlinks", "Insufficient Nvlinks"),
                             ("incompatible_gpu_fw", "Incompatible GPU Firmware"),
                             ("invalid_location", "Invalid Location"), ("gpu_state_invalid", "GPU State Invalid")]},
}
# nvidia-smi's text label -> its XML element
XML_TAGS = {"Summary": "summary", "Bandwidth": "bandwidth", "Route Recovery in progress": "route_recovery_in_progress",
            "Route Unhealthy": "route_unhealthy", "Access Timeout Recovery": "access_timeout_recovery",
            "Incorrect Configuration": "incorrect_configuration", "Partition Assigned": "partition_assigned"}


@pytest.fixture(scope="module")
def engine(registry):
    return RuleEngine(builtin_rules())


def named(outcome) -> set[tuple[str, str]]:
    """(rule, bus id) of each GPU each problem names."""
    return {(p.rule, g.pci_bus_id) for p in outcome.problems for g in p.gpus}


def gpu_fields(outcome, index: int) -> dict:
    run = next(r for r in outcome.sweep.runs if r.name == "fabric")
    return next(o.fields for o in run.observations if o.fields["scope"] == "gpu" and o.gpu.index == index)


# ---- the decoding: nvml.h's layout --------------------------------------------------------------------


@pytest.mark.parametrize("name,shift", [("degraded_bandwidth", 0), ("route_recovery", 2), ("route_unhealthy", 4),
                                        ("access_timeout_recovery", 6), ("partition_assigned", 12)])
def test_each_tri_state_field_reads_true_false_and_unknown_at_its_shift(name, shift):
    assert getattr(decode(1 << shift), name) is True
    assert getattr(decode(2 << shift), name) is False
    assert getattr(decode(0), name) is None                      # NOT_SUPPORTED: never healthy
    assert getattr(decode(3 << shift), name) is None              # a value the header does not define
    others = {f for f in ("degraded_bandwidth", "route_recovery", "route_unhealthy", "access_timeout_recovery",
                          "partition_assigned") if f != name}
    assert all(getattr(decode(1 << shift), f) is None for f in others)


def test_the_layout_is_the_headers():
    """The binding's constants (nvidia-ml-py 13.615) agree with the table the decoder was written from."""
    for field, const in [("degraded_bandwidth", "DEGRADED_BW"), ("route_recovery", "ROUTE_RECOVERY"),
                         ("route_unhealthy", "ROUTE_UNHEALTHY"), ("access_timeout_recovery", "ACCESS_TIMEOUT_RECOVERY"),
                         ("partition_assigned", "PARTITION_ASSIGNED")]:
        shift = getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{const}")
        true = getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{const}_TRUE")
        assert getattr(decode(true << shift), field) is True, field
    shift = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION
    for name, number in {"insufficient_nvlinks": "INSUFFICIENT_NVLINKS", "no_partition": "NO_PARTITION",
                         "none": "NONE", "gpu_state_invalid": "GPU_STATE_INVALID"}.items():
        value = getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_{number}")
        assert decode(value << shift).incorrect_configuration == name
    assert decode(pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED
                  << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE).gfm_state == "disconnected"
    for number, name in [(pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY, "healthy"),
                         (pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY, "unhealthy"),
                         (pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY, "limited_capacity"),
                         (pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED, None)]:
        assert decode(0, number).summary == name


@pytest.mark.parametrize("value,name", [(0, None), *CONFIGURATIONS.items(), (9, None), (15, None)])
def test_every_incorrect_configuration_value(value, name):
    assert decode(value << 8).incorrect_configuration == name


def test_the_healthy_mask_a_real_tray_gives():
    """0x1AA: every tri-state FALSE and the configuration NONE, the mask a driver-580 GB300 tray's healthy
    lines replay to (and DCGM's own fabric health test uses as its healthy mask)."""
    health = decode(0x1AA, 1)
    assert health == HEALTHY and health.recovering is False
    assert encode(HEALTHY) == (0x1AA, 1)


def test_encoding_round_trips_every_value():
    for config in CONFIGURATIONS.values():
        for flag in (True, False, None):
            health = FabricHealth(summary="unhealthy", degraded_bandwidth=flag, route_recovery=flag,
                                  route_unhealthy=not flag if flag is not None else None,
                                  access_timeout_recovery=flag, incorrect_configuration=config,
                                  partition_assigned=flag, gfm_state="connected")
            assert decode(*encode(health)) == health


# ---- live, through the fake NVML ----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_health_field_live_names_that_gpu_only(case, registry):
    params, _, rules = CASES[case]
    node = node_for("gb200-nvl72-4")
    node.inject(Fault("fabric_health", 2, params))
    out = diagnose_host(fake_host(node), registry, checks=["fabric"])
    assert named(out) == {(rule, "0018:01:00.0") for rule in rules}, [p.message for p in out.problems]
    assert all(gpu_fields(out, i)["health_summary"] == "healthy" for i in (0, 1, 3))
    node.inject(Fault("recover", 2))
    assert diagnose_host(fake_host(node), registry, checks=["fabric"]).problems == []


def test_the_fields_read_live(registry):
    node = node_for("gb200-nvl72-4")
    node.inject(Fault("fabric_health", 1, {"route_unhealthy": True, "incorrect_config": "insufficient_nvlinks",
                                           "bandwidth": "degraded"}))
    out = diagnose_host(fake_host(node), registry, checks=["fabric"])
    f = gpu_fields(out, 1)
    assert (f["health_summary"], f["degraded_bandwidth"], f["route_unhealthy"], f["route_recovery"],
            f["access_timeout_recovery"], f["incorrect_configuration"]) == \
        ("unhealthy", True, True, False, False, "insufficient_nvlinks")
    assert f["cluster_uuid"] == "6f1c2b4e-8d3a-4c59-9e27-0b5d7a1f3c88" and f["clique_id"] == 1
    # one problem per cause, and none for the Unhealthy summary those causes explain
    assert {p.reason: p.severity for p in out.problems} == {
        "FabricRouteUnhealthy": Severity.CRITICAL, "FabricIncorrectConfiguration": Severity.CRITICAL,
        "FabricBandwidthDegraded": Severity.WARNING}
    assert "insufficient_nvlinks" in out.by_rule()["fabric-incorrect-configuration"].message


def test_a_summary_nvml_does_not_report_is_unknown_and_raises_nothing(registry):
    node = node_for("gb200-nvl72-4")
    node.inject(Fault("fabric_health", 0, {"summary": "not_supported"}))
    out = diagnose_host(fake_host(node), registry, checks=["fabric"])
    assert gpu_fields(out, 0)["health_summary"] is None and out.problems == []


def test_a_mask_of_not_supported_fields_is_unknown_and_raises_nothing(registry):
    """A driver that fills the struct but reports no health (mask 0, summary 0): every field unknown."""
    host = fake_host(node_for("gb200-nvl72-4"))
    real = host.nvml.nvmlDeviceGetGpuFabricInfoV

    def no_health(handle, pointer):
        real(handle, pointer)
        pointer._obj.healthMask = 0
        pointer._obj.healthSummary = 0
        return pynvml.NVML_SUCCESS
    host.nvml.nvmlDeviceGetGpuFabricInfoV = no_health
    out = diagnose_host(host, registry, checks=["fabric"])
    f = gpu_fields(out, 0)
    assert out.problems == [] and f["health_mask"] == 0
    assert {f[k] for k in ("health_summary", "degraded_bandwidth", "route_recovery", "route_unhealthy",
                           "access_timeout_recovery", "incorrect_configuration", "partition_assigned")} == {None}


def test_a_driver_with_only_the_v2_struct_gives_the_mask_without_a_summary(registry):
    host = fake_host(node_for("gb200-nvl72-4-fabric-degraded"))
    real = host.nvml.nvmlDeviceGetGpuFabricInfoV

    def v2_only(handle, pointer):
        if pointer._obj.version != pynvml.nvmlGpuFabricInfo_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return real(handle, pointer)
    host.nvml.nvmlDeviceGetGpuFabricInfoV = v2_only
    out = diagnose_host(host, registry, checks=["fabric"])
    assert gpu_fields(out, 2)["health_summary"] is None and gpu_fields(out, 2)["degraded_bandwidth"] is True
    assert named(out) == {("fabric-bandwidth-degraded", "0018:01:00.0")}


def test_a_bad_fault_parameter_says_which_and_what_is_allowed():
    node = node_for("gb200-nvl72-4")
    with pytest.raises(ValueError, match="incorrect_config must be one of none, incorrect_sysguid"):
        node.inject(Fault("fabric_health", 0, {"incorrect_config": "wrong"}))
    with pytest.raises(ValueError, match="bandwidth must be one of full, degraded, got 'half'"):
        node.inject(Fault("fabric_health", 0, {"bandwidth": "half"}))


# ---- the debounce of a recovery in progress -----------------------------------------------------------


@pytest.mark.parametrize("params", [{"route_recovery": True}, {"access_timeout": True}])
def test_a_recovery_counts_only_once_held_past_the_debounce(params, engine):
    clock = Clock(0.0)
    node = load_scenario("gb200-nvl72-4").build(clock=clock)
    host = fake_host(node, threaded=False)
    check = FabricCheck({"recovery_debounce": 300.0}, clock=clock)

    def at(t: float) -> set[str]:
        clock.now = t
        return {p.rule for p in engine.evaluate(run_sweep(host, [check]).observations)}
    assert at(0.0) == set()
    node.inject(Fault("fabric_health", 3, params))            # its summary reads Unhealthy too
    assert at(10.0) == set()                                  # first seen recovering: a transient
    assert at(309.0) == set()
    assert at(310.0) == {"fabric-recovery-held"}
    node.inject(Fault("recover", 3))
    assert at(320.0) == set()
    node.inject(Fault("fabric_health", 3, params))            # a new recovery starts its own wait
    assert at(330.0) == set()


def test_the_debounce_is_a_setting(engine):
    clock = Clock(0.0)
    node = load_scenario("gb200-nvl72-4").build(clock=clock)
    host = fake_host(node, threaded=False)
    node.inject(Fault("fabric_health", 0, {"route_recovery": True}))
    check = FabricCheck({"recovery_debounce": 60.0}, clock=clock)
    run_sweep(host, [check])
    clock.now = 60.0
    observations = run_sweep(host, [check]).observations
    gpu0 = next(o for o in observations if o.fields.get("scope") == "gpu" and o.gpu.index == 0)
    assert (gpu0.fields["recovery_s"], gpu0.fields["recovery_held"]) == (60.0, True)
    assert {p.rule for p in engine.evaluate(observations)} == {"fabric-recovery-held"}


# ---- replayed: real captures edited one GPU at a time -------------------------------------------------


def xml_with(lines: dict[str, str], bus: str = "00000018:06:00.0", src: Path = GB300_XML) -> str:
    text = src.read_text()
    start = text.index(f'<gpu id="{bus}">')
    end = text.index("</gpu>", start)
    block = text[start:end]
    for label, value in lines.items():
        tag = XML_TAGS[label]
        block, n = re.subn(f"<{tag}>[^<]*</{tag}>", f"<{tag}>{value}</{tag}>", block)
        assert n == 1, tag
    return text[:start] + block + text[end:]


def text_with(lines: dict[str, str]) -> str:
    """The real driver-580 text capture, its GPU registered (Completed / Success, as on a tray) and its
    Health lines healthy as the GB300 prints them, then `lines` over them."""
    healthy = {"Summary": "Healthy", "Bandwidth": "Full", "Route Recovery in progress": "False",
               "Route Unhealthy": "False", "Access Timeout Recovery": "False", "Incorrect Configuration": "None"}
    text = H100_580_TEXT.read_text()
    for label, value in {"State": "Completed", "Status": "Success"}.items():
        text, n = re.subn(rf"(\n        {label} +: )N/A", rf"\g<1>{value}", text, count=1)
        assert n == 1, label
    for label, value in {**healthy, **lines}.items():
        text, n = re.subn(rf"(\n            {re.escape(label)} +: )N/A", rf"\g<1>{value}", text)
        assert n == 1, label
    return text


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_health_field_replayed_from_xml(case, registry, tmp_path):
    _, lines, rules = CASES[case]
    path = tmp_path / "nvidia-smi-q.xml"
    path.write_text(xml_with(lines))
    out = diagnose_host(replay_host(path), registry, checks=["fabric"])
    # a recovery in progress: one snapshot cannot tell a transient from a held state, so nothing
    assert named(out) == {(rule, GB300_GPU2) for rule in rules}, [p.message for p in out.problems]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_health_field_replayed_from_text(case, registry, tmp_path):
    _, lines, rules = CASES[case]
    path = tmp_path / "nvidia-smi-q.txt"
    path.write_text(text_with(lines))
    out = diagnose_host(replay_host(path), registry, checks=["fabric"])
    assert named(out) == {(rule, H100_BUS) for rule in rules}, [p.message for p in out.problems]


def test_the_replayed_fields_and_cluster_uuid(registry, tmp_path):
    path = tmp_path / "nvidia-smi-q.xml"
    path.write_text(xml_with({"Summary": "Unhealthy", "Route Unhealthy": "True"}))
    f = gpu_fields(diagnose_host(replay_host(path), registry, checks=["fabric"]), 2)
    assert (f["cluster_uuid"], f["clique_id"], f["health_summary"], f["route_unhealthy"],
            f["incorrect_configuration"], f["partition_assigned"]) == \
        ("00000001-0000-0000-0000-000000000001", 32766, "unhealthy", True, "none", None)


def test_na_health_lines_stay_unknown(registry):
    """The B200's Bandwidth, Route and Incorrect Configuration read N/A (and an H100 on 565 prints only
    Bandwidth N/A): unknown, no problem, whatever the summary says."""
    out = diagnose_host(replay_host(REAL / "x-k8sti-b200-x8-580"), registry, checks=["fabric"])
    f = gpu_fields(out, 0)
    assert out.problems == [] and (f["health_summary"], f["access_timeout_recovery"]) == ("healthy", False)
    assert (f["degraded_bandwidth"], f["route_unhealthy"], f["incorrect_configuration"]) == (None, None, None)
    out = diagnose_host(replay_host(REAL / "t-gls-h100-sxm-x8-565"), registry, checks=["fabric"])
    assert gpu_fields(out, 0)["health_summary"] is None and not {p.rule for p in out.problems} & {
        "fabric-health-unhealthy", "fabric-limited-capacity", "fabric-bandwidth-degraded"}


def test_an_unrecognised_misconfiguration_is_unknown_never_none(registry, tmp_path):
    path = tmp_path / "nvidia-smi-q.xml"
    path.write_text(xml_with({"Incorrect Configuration": "Something New"}))
    out = diagnose_host(replay_host(path), registry, checks=["fabric"])
    assert gpu_fields(out, 2)["incorrect_configuration"] is None and out.problems == []


@pytest.mark.parametrize("name,bus,rule,severity", [
    ("x-gb300-gpu2-limited-capacity.xml", GB300_GPU2, "fabric-bandwidth-degraded", Severity.WARNING),
    ("x-gb300-gpu2-route-unhealthy.xml", GB300_GPU2, "fabric-route-unhealthy", Severity.CRITICAL),
    ("x-gb200-gpu2-insufficient-nvlinks.xml", "0000:9c:00.0", "fabric-incorrect-configuration",
     Severity.CRITICAL),
])
def test_the_edited_tray_captures_name_that_gpu(name, bus, rule, severity, registry):
    out = diagnose_host(replay_host(FIXTURES / "fabric_health" / name), registry)
    assert named(out) == {(rule, bus)}, [p.message for p in out.problems]
    assert out.problems[0].severity == severity


@pytest.mark.parametrize("folder", ["x-k8sti-gb200-x4-580", "x-k8sti-gb300-x4-580", "x-k8sti-b200-x8-580"])
def test_the_real_trays_replay_healthy_with_their_health_read(folder, registry):
    out = diagnose_host(replay_host(REAL / folder), registry)
    assert out.problems == []
    assert {gpu_fields(out, i)["health_summary"] for i in range(4)} == {"healthy"}


# ---- the bundled scenarios ----------------------------------------------------------------------------


def test_the_healthy_tray_is_clean_and_its_health_is_read(registry):
    out = diagnose_host(fake_host(node_for("gb200-nvl72-4")), registry)
    assert out.problems == []
    for i in range(4):
        f = gpu_fields(out, i)
        assert (f["health_summary"], f["degraded_bandwidth"], f["route_unhealthy"], f["incorrect_configuration"],
                f["recovering"]) == ("healthy", False, False, "none", False)


def test_the_degraded_tray_names_gpu_2_only_with_a_warning(registry):
    out = diagnose_host(fake_host(node_for("gb200-nvl72-4-fabric-degraded")), registry)
    assert named(out) == {("fabric-bandwidth-degraded", "0018:01:00.0")}
    assert [p.severity for p in out.problems] == [Severity.WARNING]
