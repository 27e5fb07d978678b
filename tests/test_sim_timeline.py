"""The fault timeline: scripted, correlated and random faults expanded to (time, node, GPU), the same
for the same seed, with random rates that come out near what was asked."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import pytest

from detector.sim.fleetfile import FleetSpec, fleet_from_dict
from detector.sim.timeline import PlannedFault, plan_faults
from fake_nvml.faults import Fault

HOUR = 3600.0


def fleet(*faults: dict[str, Any], seed: int = 42, h100: int = 6, a100: int = 2) -> FleetSpec:
    """h100 nodes h-00.. in racks of 3 (team a), then a100 nodes a-00.. (team b, one rack)."""
    return fleet_from_dict({
        "version": 1, "seed": seed,
        "nodes": [
            {"scenario": "h100-sxm-8", "count": h100, "name": "h-{index:02d}", "racks": max(h100 // 3, 1),
             "labels": {"team": "a"}},
            {"scenario": "a100-pcie-4", "count": a100, "name": "a-{index:02d}", "racks": 1, "labels": {"team": "b"}},
        ],
        "faults": list(faults),
    })


def big_fleet(*faults: dict[str, Any], nodes: int = 7500, seed: int = 1) -> FleetSpec:
    return fleet_from_dict({"version": 1, "seed": seed, "nodes": [{"scenario": "h100-sxm-8", "count": nodes}],
                            "faults": list(faults)})


def where(planned: list[PlannedFault]) -> list[tuple[float, str, int | None]]:
    return [(p.at_s, p.node, p.fault.gpu) for p in planned]


def test_a_scripted_fault() -> None:
    planned = plan_faults(fleet({"at": "1m", "node": "h-04", "kind": "xid", "gpu": 3, "code": 79}), HOUR)
    assert planned == [PlannedFault(60.0, "h-04", Fault("xid", 3, {"code": 79}), "scripted")]


def test_a_node_fault_has_no_gpu() -> None:
    planned = plan_faults(fleet({"at": 5, "node": "a-01", "kind": "smi_hang", "seconds": 30}), HOUR)
    assert planned == [PlannedFault(5.0, "a-01", Fault("smi_hang", None, {"seconds": 30}), "scripted")]


def test_a_rack_with_every_gpu() -> None:
    planned = plan_faults(fleet({"at": 300, "rack": "rack-01", "kind": "pcie", "gpu": "all", "width": 8}), HOUR)
    assert where(planned) == [(300.0, node, gpu) for node in ("h-03", "h-04", "h-05") for gpu in range(8)]
    assert {p.source for p in planned} == {"correlated"}
    assert all(p.fault == Fault("pcie", p.fault.gpu, {"width": 8}) for p in planned)


def test_gpu_all_follows_each_nodes_gpu_count() -> None:
    planned = plan_faults(fleet({"at": 1, "fraction": 1, "kind": "lost", "gpu": "all"}), HOUR)
    per_node = Counter(p.node for p in planned)
    assert per_node == {**{f"h-{i:02d}": 8 for i in range(6)}, "a-00": 4, "a-01": 4}


def test_labels_select_nodes() -> None:
    planned = plan_faults(fleet({"at": 10, "labels": {"team": "b"}, "kind": "driver_unloaded"}), HOUR)
    assert where(planned) == [(10.0, "a-00", None), (10.0, "a-01", None)]


def test_a_fraction_is_that_share_chosen_by_the_seed() -> None:
    def chosen(seed: int) -> frozenset[str]:
        spec = big_fleet({"at": 60, "fraction": 0.1, "kind": "lost", "gpu": 0}, nodes=1000, seed=seed)
        nodes = [p.node for p in plan_faults(spec, HOUR)]
        assert len(nodes) == len(set(nodes)) == 100
        return frozenset(nodes)

    assert chosen(1) == chosen(1)
    assert chosen(1) != chosen(2)


def test_a_small_fraction_still_hits_one_node() -> None:
    planned = plan_faults(fleet({"at": 60, "fraction": 0.01, "kind": "lost", "gpu": 0}), HOUR)
    assert len(planned) == 1


def test_gpu_random_picks_among_each_nodes_gpus() -> None:
    spec = fleet({"at": 1, "fraction": 1, "kind": "lost", "gpu": "random"}, h100=300, a100=300)
    planned = plan_faults(spec, HOUR)
    assert len(planned) == 600 and len({p.node for p in planned}) == 600
    h100 = Counter(p.fault.gpu for p in planned if p.node.startswith("h-"))
    a100 = Counter(p.fault.gpu for p in planned if p.node.startswith("a-"))
    assert set(h100) == set(range(8)) and set(a100) == set(range(4))


def test_per_node_rate_comes_out_near_the_expected_count() -> None:
    """7,500 nodes x 1%/node/hour x 10 h: about 750 faults (Poisson: sd ~ 27)."""
    spec = big_fleet({"random": {"rate": 0.01}, "kind": "xid", "gpu": "random", "code": 79})
    planned = plan_faults(spec, 10 * HOUR)
    assert 750 * 0.75 <= len(planned) <= 750 * 1.25, len(planned)
    assert all(0 <= p.at_s < 10 * HOUR and p.source == "random" for p in planned)
    assert all(p.fault.kind == "xid" and p.fault.params == {"code": 79} for p in planned)
    assert len({p.node for p in planned}) > 600                     # spread over the fleet, not a few nodes
    assert set(Counter(p.fault.gpu for p in planned)) == set(range(8))
    first_half = sum(p.at_s < 5 * HOUR for p in planned)
    assert 0.4 < first_half / len(planned) < 0.6                     # uniform in time


def test_fleet_wide_rate_picks_nodes_uniformly() -> None:
    spec = big_fleet({"random": {"rate_per_hour": 100}, "kind": "lost", "gpu": 0}, nodes=50)
    planned = plan_faults(spec, 10 * HOUR)
    assert 1000 * 0.8 <= len(planned) <= 1000 * 1.2, len(planned)
    per_node = Counter(p.node for p in planned)
    assert len(per_node) == 50 and max(per_node.values()) < 60       # about 20 each


def test_random_faults_stay_in_their_window_and_the_horizon() -> None:
    spec = big_fleet({"random": {"rate": 1, "from": "1h", "until": "3h"}, "kind": "lost", "gpu": 0},
                     {"random": {"rate_per_hour": 10, "from": "1h"}, "kind": "lost", "gpu": 1}, nodes=100)
    planned = plan_faults(spec, 2 * HOUR)
    windowed = [p.at_s for p in planned if p.fault.gpu == 0]
    assert 100 * 0.7 <= len(windowed) <= 100 * 1.3                   # 100 nodes x 1/h x the 1 h left
    assert all(HOUR <= t < 2 * HOUR for t in windowed)
    assert all(HOUR <= p.at_s < 2 * HOUR for p in planned if p.fault.gpu == 1)


def test_timed_faults_past_the_horizon_are_left_out() -> None:
    spec = fleet({"at": "2h", "node": "h-00", "kind": "lost", "gpu": 0},
                 {"at": "1h", "node": "h-01", "kind": "lost", "gpu": 0})
    assert [p.node for p in plan_faults(spec, HOUR)] == ["h-01"]
    assert [p.node for p in plan_faults(spec, 3 * HOUR)] == ["h-01", "h-00"]


def test_an_unbounded_horizon_needs_an_until() -> None:
    bounded = fleet({"random": {"rate": 1, "until": "1h"}, "kind": "lost", "gpu": 0})
    assert plan_faults(bounded, math.inf) == plan_faults(bounded, HOUR)
    with pytest.raises(ValueError, match="needs `until`"):
        plan_faults(fleet({"random": {"rate": 1}, "kind": "lost", "gpu": 0}), math.inf)
    with pytest.raises(ValueError, match="horizon"):
        plan_faults(bounded, -1)


def test_the_same_seed_gives_the_same_timeline_and_another_seed_another() -> None:
    faults = ({"random": {"rate": 0.5}, "kind": "xid", "gpu": "random", "code": 79},
              {"random": {"rate_per_hour": 5}, "kind": "lost", "gpu": "random"},
              {"at": 60, "fraction": 0.5, "kind": "lost", "gpu": "random"})
    first, again = plan_faults(fleet(*faults, seed=7), 5 * HOUR), plan_faults(fleet(*faults, seed=7), 5 * HOUR)
    assert first == again and len(first) > 20
    assert where(plan_faults(fleet(*faults, seed=8), 5 * HOUR)) != where(first)


def test_adding_or_moving_a_fault_leaves_the_others_as_they_were() -> None:
    """A fault's random choices are seeded by the seed and its own text, not by its place in the file."""
    rate = {"random": {"rate": 0.5}, "kind": "xid", "gpu": "random", "code": 79}
    other = {"random": {"rate": 2}, "kind": "lost", "gpu": "random"}
    alone = plan_faults(fleet(rate), 5 * HOUR)
    for faults in ((other, rate), (rate, other)):
        assert [p for p in plan_faults(fleet(*faults), 5 * HOUR) if p.fault.kind == "xid"] == alone


def test_twin_faults_draw_their_own_times() -> None:
    rate = {"random": {"rate": 0.5}, "kind": "lost", "gpu": "random"}
    planned = plan_faults(fleet(rate, dict(rate)), 5 * HOUR)
    times = [p.at_s for p in planned]
    assert len(set(times)) == len(times) > 20


def test_the_plan_is_sorted_by_time_node_and_gpu() -> None:
    spec = fleet({"random": {"rate": 2}, "kind": "xid", "gpu": "random", "code": 43},
                 {"at": 600, "fraction": 1, "kind": "pcie", "gpu": "all", "gen": 4},
                 {"at": 600, "node": "h-02", "kind": "smi_hang", "seconds": 5})
    planned = plan_faults(spec, 2 * HOUR)
    keys = [(p.at_s, p.node, -1 if p.fault.gpu is None else p.fault.gpu) for p in planned]
    assert keys == sorted(keys)
    at_600_on_h02 = [p.fault.gpu for p in planned if p.at_s == 600 and p.node == "h-02"]
    assert at_600_on_h02 == [None, *range(8)]


def test_planning_a_big_fleet_for_a_day_is_fast() -> None:
    spec = big_fleet({"random": {"rate": 0.01}, "kind": "xid", "gpu": "random", "code": 79},
                     {"at": "6h", "fraction": 0.05, "kind": "pcie", "gpu": "all", "width": 8})
    started = time.perf_counter()
    planned = plan_faults(spec, 24 * HOUR)
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, elapsed
    assert 1800 * 0.8 <= len(planned) - 375 * 8 <= 1800 * 1.2
