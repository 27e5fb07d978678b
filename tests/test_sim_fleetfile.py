"""Fleet files: a realistic one loads into nodes, racks, labels and resolved fault targets, and every
mistake is reported with file, line and field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from detector.sim.fleetfile import (FleetSpec, NodeGroup, RandomRate, SimNodeSpec, fleet_from_dict,
                                    load_fleet)
from detector.yamlsource import SourceError
from fake_nvml.scenario import load_scenario

FLEET = """\
# a small fleet: three groups, one of them from a scenario file next to this one
version: 1
seed: 42
nodes:
  - scenario: h100-sxm-8
    count: 10
    name: "gpu-h100-{index:04d}"
    racks: 3
    labels: {team: a, gen: 5}
  - scenario: a100-pcie-4
    count: 4
    racks: 2
  - scenario: scenarios/custom.yaml
    count: 2
    name: "custom-{index}"
checks:
  visibility: {interval: 120}
  xid: {interval: 300}
faults:
  - at: 60
    node: gpu-h100-0007
    kind: xid
    gpu: 3
    code: 79
  - at: 5m
    rack: rack-01
    kind: pcie
    gpu: all
    width: 8
  - at: 1h
    labels: {team: a}
    fraction: 0.5
    kind: nccl_degraded
    factor: 0.5
  - random: {rate: 0.01, from: 10m, until: 2h}
    kind: xid
    gpu: random
    code: 79
  - random: {rate_per_hour: 2}
    rack: rack-03
    kind: smi_hang
    seconds: 30
"""

CUSTOM_SCENARIO = "description: two GPUs\ngpu_model: h100-sxm5-80gb\ngpus: 2\n"


@pytest.fixture
def fleet_path(tmp_path: Path) -> Path:
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "custom.yaml").write_text(CUSTOM_SCENARIO)
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def test_a_realistic_fleet_file_loads(fleet_path: Path) -> None:
    spec = load_fleet(fleet_path)
    assert isinstance(spec, FleetSpec)
    assert spec.file == str(fleet_path) and spec.seed == 42
    custom = str(fleet_path.parent / "scenarios" / "custom.yaml")
    assert spec.groups == [
        NodeGroup("h100-sxm-8", "h100-sxm-8", 10, "gpu-h100-{index:04d}", {"team": "a", "gen": "5"}, 3, 8),
        NodeGroup("a100-pcie-4", "a100-pcie-4", 4, "a100-pcie-4-{index:04d}", {}, 2, 4),
        NodeGroup("custom", custom, 2, "custom-{index}", {}, None, 2),
    ]
    names = [n.name for n in spec.nodes]
    assert names == ([f"gpu-h100-{i:04d}" for i in range(10)] + [f"a100-pcie-4-{i:04d}" for i in range(4)]
                     + ["custom-0", "custom-1"])
    assert [n.gpus for n in spec.nodes] == [8] * 10 + [4] * 4 + [2] * 2
    assert [n.group for n in spec.nodes] == [0] * 10 + [1] * 4 + [2] * 2
    # Racks are consecutive blocks within a group, numbered across the whole fleet.
    assert [n.rack for n in spec.nodes] == (["rack-00"] * 4 + ["rack-01"] * 3 + ["rack-02"] * 3
                                            + ["rack-03"] * 2 + ["rack-04"] * 2 + [None] * 2)
    assert spec.nodes[0] == SimNodeSpec("gpu-h100-0000", "h100-sxm-8", {"team": "a", "gen": "5"}, 8, "rack-00", 0)
    assert all(n.labels == {} for n in spec.nodes[10:])
    assert spec.nodes[0].labels is not spec.nodes[1].labels          # no node can change another's labels
    assert load_scenario(spec.nodes[-1].scenario).name == "custom"   # SimNodeSpec.scenario is loadable
    assert spec.check_settings == {"visibility": {"interval": 120}, "xid": {"interval": 300}}


def test_fault_specs_resolve_their_targets(fleet_path: Path) -> None:
    scripted, rack, labels, per_node, fleetwide = load_fleet(fleet_path).fault_specs
    assert (scripted.source, scripted.targets, scripted.at_s) == ("scripted", ("gpu-h100-0007",), 60.0)
    assert (scripted.kind, scripted.gpu, scripted.params) == ("xid", 3, {"code": 79})
    assert scripted.index == 0 and scripted.line == 20
    assert (rack.source, rack.at_s, rack.gpu, rack.params) == ("correlated", 300.0, "all", {"width": 8})
    assert rack.targets == ("gpu-h100-0004", "gpu-h100-0005", "gpu-h100-0006")
    assert labels.source == "correlated" and labels.at_s == 3600.0
    assert len(labels.targets) == 5 and set(labels.targets) <= {f"gpu-h100-{i:04d}" for i in range(10)}
    assert list(labels.targets) == sorted(labels.targets)             # fleet order
    assert per_node.source == "random" and per_node.at_s is None and len(per_node.targets) == 16
    assert per_node.random == RandomRate(per_node_hour=0.01, per_hour=None, from_s=600.0, until_s=7200.0)
    assert fleetwide.random == RandomRate(per_node_hour=None, per_hour=2.0, from_s=0.0, until_s=None)
    assert fleetwide.targets == ("a100-pcie-4-0000", "a100-pcie-4-0001")


def test_fraction_is_chosen_by_the_seed(fleet_path: Path) -> None:
    def chosen(seed: int) -> tuple[str, ...]:
        text = FLEET.replace("seed: 42", f"seed: {seed}")
        fleet_path.write_text(text)
        return load_fleet(fleet_path).fault_specs[2].targets

    assert chosen(1) == chosen(1)
    assert len({chosen(seed) for seed in range(8)}) > 1


def test_defaults_and_fleet_from_dict_of_7500_nodes() -> None:
    started = time.perf_counter()
    spec = fleet_from_dict({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 7500}]})
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, elapsed
    assert spec.file == "<fleet>" and spec.seed == 0 and spec.fault_specs == [] and spec.check_settings == {}
    assert len(spec.nodes) == 7500 and len({n.name for n in spec.nodes}) == 7500
    assert spec.nodes[0].name == "h100-sxm-8-0000" and spec.nodes[-1].name == "h100-sxm-8-7499"
    assert all(n.gpus == 8 and n.rack is None for n in spec.nodes)


def test_a_group_count_defaults_to_one_and_racks_split_evenly() -> None:
    spec = fleet_from_dict({"version": 1, "nodes": [{"scenario": "rtx-4090-1"},
                                                    {"scenario": "a100-pcie-4", "count": 10, "racks": 4}]})
    assert [n.name for n in spec.nodes][:2] == ["rtx-4090-1-0000", "a100-pcie-4-0000"]
    racks = [n.rack for n in spec.nodes[1:]]
    assert racks == ["rack-00"] * 3 + ["rack-01"] * 2 + ["rack-02"] * 3 + ["rack-03"] * 2


def test_durations_accept_units() -> None:
    faults = [{"at": at, "node": "rtx-4090-1-0000", "kind": "smi_hang", "seconds": 1}
              for at in (0, 90, 2.5, "90s", "5m", "1h", "1.5h", "2d", "45")]
    spec = fleet_from_dict({"version": 1, "nodes": [{"scenario": "rtx-4090-1"}], "faults": faults})
    assert [f.at_s for f in spec.fault_specs] == [0, 90, 2.5, 90, 300, 3600, 5400, 172800, 45]


def test_errors_from_code_name_the_given_file() -> None:
    with pytest.raises(SourceError) as e:
        fleet_from_dict({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 0}]}, file="<built>")
    assert (e.value.file, e.value.line, e.value.field) == ("<built>", None, "nodes[0].count")


# --- every mistake names file, line and field ----------------------------------------------------------

BASE = """\
version: 1
seed: 7
nodes:
  - scenario: h100-sxm-8
    count: 4
    name: "gpu-h100-{index:02d}"
    racks: 2
    labels: {team: a}
  - scenario: a100-pcie-4
    count: 2
    name: "gpu-a100-{index:02d}"
"""


def with_fault(*lines: str) -> str:
    return BASE + "faults:\n  - " + "\n    ".join(lines) + "\n"


XID = ("at: 60", "node: gpu-h100-01", "kind: xid", "gpu: 3")

# (id, file text, text on the blamed line, blamed field, words in the problem)
ERRORS = [
    ("unknown-top-field", BASE + "colour: blue\n", "colour:", "colour", "unknown field"),
    ("bad-version", BASE.replace("version: 1", "version: 2"), "version:", "version", "unsupported version 2"),
    ("missing-nodes", "version: 1\nseed: 1\n", "version:", "nodes", "missing required field 'nodes'"),
    ("empty-nodes", "version: 1\nnodes: []\n", "nodes:", "nodes", "no node group"),
    ("unknown-group-field", BASE.replace("count: 2", "cuont: 2"), "cuont:", "nodes[1].cuont", "unknown field"),
    ("unknown-scenario", BASE.replace("a100-pcie-4", "tpu-v5"), "tpu-v5", "nodes[1].scenario",
     "bundled: a100-pcie-4, gb200-nvl72-4"),
    ("near-miss-scenario", BASE.replace("a100-pcie-4", "h200-sxm-8"), "h200-sxm-8", "nodes[1].scenario",
     "unknown scenario 'h200-sxm-8' (did you mean `h100-sxm-8`? a scenario file's path ends in .yaml"),
    ("missing-scenario-file", BASE.replace("a100-pcie-4", "nowhere/x.yaml"), "nowhere", "nodes[1].scenario",
     "cannot load scenario file"),
    ("zero-count", BASE.replace("count: 2", "count: 0"), "count: 0", "nodes[1].count", "at least 1"),
    ("count-not-int", BASE.replace("count: 2", "count: many"), "count: many", "nodes[1].count",
     "expected an integer"),
    ("duplicate-names", BASE.replace("gpu-a100-{index:02d}", "gpu-h100-{index:02}"), 'gpu-h100-{index:02}"',
     "nodes[1].name",
     "'gpu-h100-00' is already used by nodes[0]"),
    ("same-name-for-all", BASE.replace('gpu-a100-{index:02d}', 'gpu-a100'), 'name: "gpu-a100"', "nodes[1].name",
     "put {index} in it"),
    ("bad-name-placeholder", BASE.replace('gpu-a100-{index:02d}', 'gpu-{idx}'), 'gpu-{idx}', "nodes[1].name",
     "not a usable name pattern"),
    ("invalid-node-name", BASE.replace('gpu-a100-{index:02d}', 'GPU_{index}'), 'GPU_', "nodes[1].name",
     "not a valid Kubernetes node name"),
    ("too-many-racks", BASE.replace("racks: 2", "racks: 5"), "racks: 5", "nodes[0].racks", "must be 1 to 4"),
    ("invalid-label", BASE.replace("team: a", "team: a b"), "team:", "nodes[0].labels.team",
     "not a valid label value"),
    ("unknown-check", BASE + "checks:\n  visibilty: {interval: 60}\n", "visibilty", "checks.visibilty",
     "no check named"),
    ("unknown-check-setting", BASE + "checks:\n  visibility: {colour: 1}\n", "colour", "checks.visibility.colour",
     "unknown field"),
    ("check-settings-not-a-mapping", BASE + "checks:\n  visibility: 60\n", "visibility: 60", "checks.visibility",
     "expected a mapping"),
    ("bad-check-interval", BASE + "checks:\n  pcie:\n    interval: -5\n", "interval: -5", "checks.pcie.interval",
     "positive"),
    ("unknown-fault-kind", with_fault("at: 60", "node: gpu-h100-01", "kind: melt"), "kind: melt",
     "faults[0].kind", "unknown fault kind 'melt'"),
    ("unknown-fault-parameter", with_fault(*XID, "code: 79", "colour: red"), "colour: red", "faults[0].colour",
     "takes no parameter 'colour'"),
    ("bad-parameter-type", with_fault(*XID, "code: seventy-nine"), "code: seventy", "faults[0].code",
     "code must be int"),
    ("missing-parameter", with_fault(*XID), "- at: 60", "faults[0]", "needs parameter 'code'"),
    ("fault-needs-a-gpu", with_fault("at: 60", "node: gpu-h100-01", "kind: xid", "code: 79"), "- at: 60",
     "faults[0].gpu", "needs a 'gpu'"),
    ("unknown-node", with_fault("at: 60", "node: gpu-h100-99", "kind: xid", "gpu: 0", "code: 79"),
     "node: gpu-h100-99", "faults[0].node", "no node named 'gpu-h100-99'"),
    ("gpu-not-on-node", with_fault("at: 60", "node: gpu-a100-01", "kind: xid", "gpu: 5", "code: 79"), "gpu: 5",
     "faults[0].gpu", "GPUs 0 to 3"),
    ("gpu-not-on-every-target", with_fault("at: 60", "fraction: 1", "kind: xid", "gpu: 6", "code: 79"), "gpu: 6",
     "faults[0].gpu", "no GPU 6 on node 'gpu-a100-00' (and 1 more"),
    ("bad-gpu-word", with_fault("at: 60", "fraction: 1", "kind: xid", "gpu: any", "code: 79"), "gpu: any",
     "faults[0].gpu", "'all' or 'random'"),
    ("gpu-all-on-a-node-fault", with_fault("at: 60", "rack: rack-00", "kind: smi_hang", "gpu: all", "seconds: 5"),
     "gpu: all", "faults[0].gpu", "need no GPU"),
    ("gpu-random-on-a-node-fault", with_fault("random: {rate: 1}", "kind: driver_unloaded", "gpu: random"),
     "gpu: random", "faults[0].gpu", "need no GPU"),
    ("unknown-rack", with_fault("at: 60", "rack: rack-07", "kind: pcie", "gpu: all", "width: 8"), "rack: rack-07",
     "faults[0].rack", "racks: rack-00, rack-01"),
    ("labels-match-nothing", with_fault("at: 60", "labels: {team: b}", "kind: pcie", "gpu: 0"), "team: b",
     "faults[0].labels", "no node has the labels"),
    ("rack-and-labels-match-nothing", BASE.replace("racks: 2", "racks: 2\n    name: x{index}").replace(
        '    name: "gpu-h100-{index:02d}"\n', "") + "faults:\n  - at: 1\n    rack: rack-00\n"
     "    labels: {team: z}\n    kind: lost\n    gpu: 0\n", "team: z", "faults[0].labels", "in rack 'rack-00'"),
    ("node-with-rack", with_fault("at: 60", "node: gpu-h100-01", "rack: rack-00", "kind: lost", "gpu: 0"),
     "rack: rack-00", "faults[0].rack", "combines with no rack"),
    ("at-without-target", with_fault("at: 60", "kind: lost", "gpu: 0"), "- at: 60", "faults[0]", "needs a target"),
    ("negative-at", with_fault("at: -5", "node: gpu-h100-01", "kind: lost", "gpu: 0"), "at: -5", "faults[0].at",
     "non-negative duration"),
    ("at-in-words", with_fault("at: 5 minutes", "node: gpu-h100-01", "kind: lost", "gpu: 0"), "at: 5 minutes",
     "faults[0].at", "90s, 5m, 1h"),
    ("at-and-random", with_fault("at: 5", "random: {rate: 1}", "kind: lost", "gpu: 0"), "random:",
     "faults[0].random", "not both"),
    ("no-timing", with_fault("node: gpu-h100-01", "kind: lost", "gpu: 0"), "- node:", "faults[0]",
     "missing `at`"),
    ("zero-rate", with_fault("random:", "  rate: 0", "kind: lost", "gpu: 0"), "rate: 0", "faults[0].random.rate",
     "positive"),
    ("negative-fleet-rate", with_fault("random: {rate_per_hour: -2}", "kind: lost", "gpu: 0"), "random:",
     "faults[0].random.rate_per_hour", "positive"),
    ("two-rates", with_fault("random: {rate: 1, rate_per_hour: 2}", "kind: lost", "gpu: 0"), "random:",
     "faults[0].random.rate_per_hour", "not both"),
    ("no-rate", with_fault("random:", "  from: 10", "kind: lost", "gpu: 0"), "random:", "faults[0].random",
     "missing `rate`"),
    ("unknown-random-field", with_fault("random:", "  rate: 1", "  every: 5", "kind: lost", "gpu: 0"),
     "every: 5", "faults[0].random.every", "unknown field"),
    ("until-before-from", with_fault("random:", "  rate: 1", "  from: 1h", "  until: 30m", "kind: lost",
                                     "gpu: 0"), "until: 30m", "faults[0].random.until", "later than `from`"),
    ("bad-fraction", with_fault("at: 60", "fraction: 1.5", "kind: lost", "gpu: 0"), "fraction: 1.5",
     "faults[0].fraction", "at most 1"),
    ("duplicate-key", with_fault(*XID, "code: 79", "code: 43"), "code: 43", "code", "duplicate key"),
]


@pytest.mark.parametrize("text, needle, field, words", [case[1:] for case in ERRORS], ids=[c[0] for c in ERRORS])
def test_every_error_names_file_line_and_field(tmp_path: Path, text: str, needle: str, field: str | None,
                                               words: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(SourceError) as e:
        load_fleet(path)
    err = e.value
    lines = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(lines) == 1, f"needle {needle!r} is on lines {lines}"
    assert (err.file, err.line, err.field) == (str(path), lines[0], field), str(err)
    assert words in err.problem, str(err)
    assert str(err).startswith(f"{path}:{lines[0]}: ")
