"""The fault timeline: every fault of a fleet file, expanded to (time, node, GPU) before the run starts.

Planning ahead makes a run reproducible (one seed, one timeline) and lets it be printed or compared
with what the detector reported. Every fault spec draws from streams seeded by the fleet's seed and
its own text, so adding, removing or moving one fault leaves the others' times and GPUs as they were.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator

from detector.sim.fleetfile import GPU_ALL, GPU_RANDOM, FaultSpec, FleetSpec
from fake_nvml.faults import Fault

# command: POST /faults at run time; annotation: a node's gpu-npd.io/inject-fault (and its healing)
FAULT_SOURCES = ("scripted", "correlated", "random", "command", "annotation")


@dataclass(frozen=True)
class PlannedFault:
    at_s: float                      # seconds after the fleet's start
    node: str
    fault: Fault
    source: str                      # one of FAULT_SOURCES


def plan_faults(spec: FleetSpec, horizon_s: float) -> list[PlannedFault]:
    """Every fault due within [0, horizon_s], sorted by (at_s, node, gpu); the same for the same seed.
    An infinite horizon works only when every random fault has an `until`."""
    if math.isnan(horizon_s) or horizon_s < 0:
        raise ValueError(f"the planning horizon must be 0 or more seconds, got {horizon_s}")
    gpus = {n.name: n.gpus for n in spec.nodes}
    planned: list[PlannedFault] = []
    for fs in spec.fault_specs:
        timing, choice = random.Random(f"{fs.stream}:time"), random.Random(f"{fs.stream}:gpu")
        for at_s, node in _occurrences(fs, horizon_s, timing):
            planned.extend(PlannedFault(at_s, node, Fault(fs.kind, gpu, dict(fs.params)), fs.source)
                           for gpu in _gpus(fs.gpu, gpus[node], choice))
    planned.sort(key=lambda p: (p.at_s, p.node, -1 if p.fault.gpu is None else p.fault.gpu))
    return planned


def _occurrences(fs: FaultSpec, horizon_s: float, rng: random.Random) -> Iterator[tuple[float, str]]:
    if fs.random is None:
        if fs.at_s is not None and fs.at_s <= horizon_s:
            yield from ((fs.at_s, node) for node in fs.targets)
        return
    rate = fs.random
    end = horizon_s if rate.until_s is None else min(rate.until_s, horizon_s)
    if math.isinf(end):
        raise ValueError(f"faults[{fs.index}] (line {fs.line}): a random fault needs `until` "
                         "when the planning horizon is unbounded")
    if rate.per_node_hour is not None:
        per_s = rate.per_node_hour / 3600
        for node in fs.targets:                  # independent Poisson processes, one per node
            t = rate.from_s + rng.expovariate(per_s)
            while t < end:
                yield t, node
                t += rng.expovariate(per_s)
    else:
        assert rate.per_hour is not None
        per_s = rate.per_hour / 3600             # one process for them all, each fault on a node picked uniformly
        t = rate.from_s + rng.expovariate(per_s)
        while t < end:
            yield t, fs.targets[rng.randrange(len(fs.targets))]
            t += rng.expovariate(per_s)


def _gpus(gpu: int | str | None, count: int, rng: random.Random) -> list[int | None]:
    if gpu == GPU_ALL:
        return list(range(count))
    if gpu == GPU_RANDOM:
        return [rng.randrange(count)]
    assert gpu is None or isinstance(gpu, int)
    return [gpu]
