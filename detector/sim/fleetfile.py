"""The fleet file of `gpu-npd simulate`: which fake nodes exist and which faults they will suffer.

Everything is checked when the file loads, and every mistake is reported at once, each named by file,
line and field, so a typo fails in the first second rather than an hour into a simulated run. Fault
selectors (rack, labels, fraction) are resolved here too; only the timing of random faults is left to the
timeline.

    version: 1
    seed: 42
    nodes:
      - {scenario: h100-sxm-8, count: 40, name: "gpu-h100-{index:04d}", racks: 5, labels: {team: a}}
    checks:
      visibility: {interval: 120}
    faults:
      - {at: 60, node: gpu-h100-0017, kind: xid, gpu: 3, code: 79}
      - {at: 5m, rack: rack-02, kind: pcie, gpu: all, width: 8}
      - {random: {rate: 0.01}, kind: xid, gpu: random, code: 79}

A group with `nvlink_domain: NAME` puts its nodes in one multi-node NVLink domain (a GB200 NVL72 rack: one
cluster UUID, derived from NAME, and clique 1); groups naming the same domain share it. The fault kind
`nvlink_domain_fault` (`at`, `node`, `gpu`, `link`) plays a rack-wide NVLink fault as it happened on a real
rack (marin-community/marin #9086): that GPU logs XID 149 NETIR_LINK_DOWN Fatal on that link, and every
other GPU of the domain the downstream XID 145 shortly after (sim/domain_fault.py).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from detector.yamlsource import (MappingReader, Mistakes, SourceError, SourceErrors, collecting, did_you_mean, hint,
                                 load_yaml)
from detector.sim.domain_fault import DOMAIN_FAULT, DOMAIN_FAULT_FIELDS, DOWNSTREAM_DELAY_S, xid145_line, xid149_line
from fake_nvml.faults import FAULT_KINDS, Fault
from fake_nvml.models import model_by_key
from fake_nvml.scenario import NvlinkDomain, Scenario, bundled_scenarios, load_scenario

if TYPE_CHECKING:
    from detector.core.check import CheckRegistry

FLEET_VERSION = 1
GPU_ALL, GPU_RANDOM = "all", "random"

_TOP_FIELDS = {"version", "seed", "nodes", "checks", "faults"}
_GROUP_FIELDS = {"scenario", "count", "name", "racks", "labels", "nvlink_domain"}
_SELECTORS = ("node", "rack", "labels", "fraction")
_FAULT_FIELDS = {"at", "random", "kind", "gpu", *_SELECTORS}     # any other key is a fault parameter
_RANDOM_FIELDS = {"rate", "rate_per_hour", "from", "until"}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# Kubernetes' own syntax: node names are DNS subdomains; label keys have an optional DNS prefix.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class NodeGroup:
    """One entry of `nodes:`: `count` nodes of one scenario."""

    scenario: str                    # the scenario's name: a bundled name, or a scenario file's stem
    scenario_path_or_name: str       # what load_scenario takes: the bundled name, or the resolved path
    count: int
    name_pattern: str                # str.format pattern with {index}, counted from 0 within the group
    labels: dict[str, str]
    racks: int | None
    gpus: int                        # GPUs per node of this scenario
    nvlink_domain: str | None = None   # the multi-node NVLink domain its nodes share, by name
    pci_bus_ids: tuple[str, ...] = field(default=(), compare=False)   # its GPUs' bus ids (the scenario's)
    nvlinks: int = field(default=0, compare=False)                    # NVLinks per GPU of its model


@dataclass(frozen=True)
class SimNodeSpec:
    """One node of the fleet, in fleet order."""

    name: str
    scenario: str                    # what load_scenario takes (NodeGroup.scenario_path_or_name)
    labels: dict[str, str]           # the group's `labels:` only (racks are in `rack`)
    gpus: int
    rack: str | None
    group: int = 0                   # index into FleetSpec.groups
    nvlink_domain: str | None = None   # its group's `nvlink_domain:`

    def domain(self) -> NvlinkDomain | None:
        """The NVLink domain to build its fake node in (None: the scenario's own, if any)."""
        return NvlinkDomain.named(self.nvlink_domain) if self.nvlink_domain else None


@dataclass(frozen=True)
class RandomRate:
    """When a random fault strikes: a Poisson process, per node or over all its target nodes."""

    per_node_hour: float | None      # `rate`: each target node independently
    per_hour: float | None           # `rate_per_hour`: the target nodes together, the node picked uniformly
    from_s: float = 0.0
    until_s: float | None = None     # None: the planning horizon


@dataclass(frozen=True)
class FaultSpec:
    """One entry of `faults:`, its targets resolved to node names (fleet order)."""

    index: int                       # position under `faults:`
    line: int | None
    stream: str                      # seeds its random choices: its own text, so editing others leaves them be
    source: str                      # scripted (one node) | correlated (a selector) | random (a rate)
    kind: str
    gpu: int | str | None            # a GPU index, "all", "random", or None
    params: dict[str, Any]
    targets: tuple[str, ...]
    at_s: float | None = None        # scripted and correlated
    random: RandomRate | None = None


@dataclass(frozen=True)
class FleetSpec:
    file: str
    seed: int
    groups: list[NodeGroup]
    nodes: list[SimNodeSpec]
    check_settings: dict[str, Any]   # a config.yaml `checks:` mapping, already validated
    fault_specs: list[FaultSpec]


def load_fleet(path: Path, registry: "CheckRegistry | None" = None) -> FleetSpec:
    """Read and validate a fleet file; scenario paths in it are relative to the file.
    `registry` validates `checks:` (default: the installed checks). Every mistake is raised together."""
    with collecting() as mistakes:
        doc = load_yaml(path, mistakes)
        return _build(doc.data, doc.file, path.parent, registry, mistakes)


def fleet_from_dict(data: Any, file: str = "<fleet>", base_dir: Path | None = None,
                    registry: "CheckRegistry | None" = None) -> FleetSpec:
    """A fleet from data already in memory (tests, fleets built in code); errors name `file`."""
    with collecting() as mistakes:
        return _build(data, file, base_dir or Path.cwd(), registry, mistakes)


def _build(data: Any, file: str, base_dir: Path, registry: "CheckRegistry | None", mistakes: Mistakes) -> FleetSpec:
    """The fleet; each part is checked on its own and its mistakes recorded (the caller raises them, and
    then what this returns is not used)."""
    top = MappingReader(file, data, "", mistakes=mistakes)
    top.attempt(top.reject_unknown, _TOP_FIELDS)
    top.attempt(_version, top)
    seed = top.attempt(top.get, "seed", int, 0, default=0)
    groups, nodes, complete = _nodes(top, base_dir)
    settings = top.attempt(_check_settings, top, registry, default={})
    fleet = _Fleet(groups, nodes, {n.name: n for n in nodes}) if complete else None
    faults: list[FaultSpec] = []
    seen: Counter[str] = Counter()
    for index, reader in top.attempt(top.each, "faults", [], default=[]):
        text = json.dumps(reader.data, sort_keys=True, default=str)
        seen[text] += 1                      # twins draw from streams of their own, not the same one
        stream = f"{seed}:{text}:{seen[text]}"
        if reader.data.get("kind") == DOMAIN_FAULT:
            faults.extend(_domain_fault_specs(reader, index, stream, fleet))
        else:
            spec = _fault_spec(reader, index, stream, fleet)
            if spec is not None:
                faults.append(spec)
    return FleetSpec(file, seed, groups, nodes, settings, faults)


def _version(top: MappingReader) -> None:
    version = top.get("version", int)
    if version != FLEET_VERSION:
        raise top.error("version", f"unsupported version {version} (this gpu-npd reads version {FLEET_VERSION})")


@dataclass(frozen=True)
class _Fleet:
    """The fleet's nodes, for resolving fault targets; only when every node group was read whole (else a
    fault naming a node of a group with a mistake would be blamed for that group's mistake)."""

    groups: list[NodeGroup]
    nodes: list[SimNodeSpec]
    by_name: dict[str, SimNodeSpec]


# -- nodes ---------------------------------------------------------------------------------------------

def _nodes(top: MappingReader, base_dir: Path) -> tuple[list[NodeGroup], list[SimNodeSpec], bool]:
    """The node groups and their nodes, and whether every group was read whole."""
    before = top.recorded()
    entries = top.attempt(top.get, "nodes", list)
    if entries == []:
        top.report("nodes", "lists no node group: give at least one {scenario: ..., count: ...}")
    # each scenario file is read once, however many groups use it; one that failed, as its mistakes
    scenarios: dict[str, Scenario | SourceError] = {}
    groups: list[NodeGroup] = []
    nodes: list[SimNodeSpec] = []
    made_by: dict[str, str] = {}             # node name -> the group that made it
    rack_base = 0
    for _, r in top.each("nodes") if entries else []:
        group = _group(r, base_dir, scenarios)
        if group is None:
            continue
        names = r.attempt(_node_names, r, group, made_by)
        if names is None:
            continue
        for i, name in enumerate(names):
            made_by[name] = r.path
            rack = f"rack-{rack_base + i * group.racks // group.count:02d}" if group.racks else None
            nodes.append(SimNodeSpec(name, group.scenario_path_or_name, dict(group.labels), group.gpus, rack,
                                     len(groups), group.nvlink_domain))
        rack_base += group.racks or 0
        groups.append(group)
    return groups, nodes, top.recorded() == before


def _group(r: MappingReader, base_dir: Path, scenarios: dict[str, Scenario | SourceError]) -> NodeGroup | None:
    """One entry of `nodes:`, or None when it has mistakes (each recorded)."""
    before = r.recorded()
    r.attempt(r.reject_unknown, _GROUP_FIELDS)
    loaded = r.attempt(_scenario, r, base_dir, scenarios)
    count = r.attempt(_count, r)
    default_name = f"{loaded[1].name if loaded else 'node'}-{{index:04d}}"
    pattern = r.attempt(_name_pattern, r, default_name, count or 1)
    racks = r.attempt(_racks, r, count)
    labels = r.attempt(_labels, r, "labels") if _given(r, "labels") else {}
    domain = r.attempt(_domain_name, r)
    if r.recorded() > before:
        return None
    ref, scenario = loaded
    return NodeGroup(scenario.name, ref, count, pattern, labels, racks, len(scenario.pci_bus_ids), domain,
                     tuple(scenario.pci_bus_ids), model_by_key(scenario.gpu_model).nvlink_links)


def _count(r: MappingReader) -> int:
    count = r.get("count", int, 1)
    if count < 1:
        raise r.error("count", f"must be at least 1, got {count}")
    return count


def _racks(r: MappingReader, count: int | None) -> int | None:
    racks = r.get("racks", int, None)
    if racks is not None and count is not None and not 1 <= racks <= count:
        raise r.error("racks", f"must be 1 to {count} (the group's node count), got {racks}")
    return racks


def _node_names(r: MappingReader, group: NodeGroup, made_by: dict[str, str]) -> list[str]:
    """The group's node names: valid Kubernetes node names, none used by an earlier group."""
    names = [group.name_pattern.format(index=i) for i in range(group.count)]
    own: set[str] = set()
    for name in names:
        if name in made_by or name in own:
            raise r.error("name", f"node name {name!r} is already used by {made_by.get(name, r.path)}")
        own.add(name)
        if len(name) > 253 or not _NODE_NAME.match(name):
            raise r.error("name", f"{name!r} is not a valid Kubernetes node name (lowercase letters, digits, "
                                  "'-' and '.'); set `name:` to a pattern that makes one")
    return names


def _domain_name(r: MappingReader) -> str | None:
    """`nvlink_domain: NAME`: the name of the NVLink domain (NVL72 rack) the group's nodes share."""
    if not _given(r, "nvlink_domain"):
        return None
    name = r.get("nvlink_domain", str)
    if not _LABEL_NAME.match(name):
        raise r.error("nvlink_domain", f"expected a domain name (up to 63 letters, digits, '-', '_' or '.', starting "
                                       f"and ending alphanumeric), got {name!r}")
    return name


def _scenario(r: MappingReader, base_dir: Path, cache: dict[str, Scenario | SourceError]) -> tuple[str, Scenario]:
    """(what load_scenario takes, the scenario). A scenario file's own mistakes are reported with its own
    file and lines, once however many groups use it."""
    ref = r.get("scenario", str)
    is_path = ref.endswith((".yaml", ".yml")) or "/" in ref
    if is_path:
        path = Path(ref).expanduser()
        ref = str(path if path.is_absolute() else base_dir / path)
    first_use = ref not in cache
    if first_use:
        try:
            cache[ref] = load_scenario(ref)
        except SourceError as e:
            cache[ref] = e
    loaded = cache[ref]
    if isinstance(loaded, Scenario):
        return ref, loaded
    if not is_path:
        known = hint(ref, bundled_scenarios(), "bundled: {};")
        raise r.error("scenario", f"unknown scenario {ref!r} ({known} a scenario file's path ends in .yaml or "
                                  "contains '/')")
    inner = loaded.errors if isinstance(loaded, SourceErrors) else [loaded]
    if len(inner) == 1:
        raise r.error("scenario", f"cannot load scenario file: {loaded}")
    blame = r.error("scenario", f"cannot load scenario file: {len(inner)} mistakes in {ref}, listed below")
    raise SourceErrors([blame, *inner]) if first_use else blame


def _name_pattern(r: MappingReader, default: str, count: int) -> str:
    pattern = r.get("name", str, default)
    try:
        first = pattern.format(index=0)
        second = pattern.format(index=1)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise r.error("name", f"not a usable name pattern ({type(e).__name__}: {e}); its one placeholder is "
                              "{index}, e.g. \"gpu-{index:04d}\"") from None
    if count > 1 and first == second:
        raise r.error("name", f"gives all {count} nodes the same name {first!r}: put {{index}} in it")
    return pattern


def _labels(r: MappingReader, key: str) -> dict[str, str]:
    """Label values are strings to Kubernetes; YAML's `gen: 5` or `spare: true` become "5" and "true".
    Every bad label is a mistake of its own."""
    labels = r.child(key)
    out: dict[str, str] = {}
    errors: list[SourceError] = []
    for name, value in labels.data.items():
        try:
            out[name] = _label(labels, name, value)
        except SourceError as e:
            errors.append(e)
    if errors:
        raise SourceErrors.of(errors)
    return out


def _label(labels: MappingReader, name: Any, value: Any) -> str:
    prefix, _, local = str(name).rpartition("/")
    if not isinstance(name, str) or not _LABEL_NAME.match(local) or prefix and not _LABEL_PREFIX.match(prefix):
        raise labels.error(name, "not a valid label key (an optional DNS prefix and '/', then up to 63 "
                                 "letters, digits, '-', '_' or '.', starting and ending alphanumeric)")
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (str, int, float)):
        text = str(value)
    else:
        raise labels.error(name, f"a label value is a plain value, not {type(value).__name__}")
    if text and not _LABEL_NAME.match(text):
        raise labels.error(name, f"{text!r} is not a valid label value (up to 63 letters, digits, '-', '_' "
                                 "or '.', starting and ending alphanumeric)")
    return text


def _check_settings(top: MappingReader, registry: "CheckRegistry | None") -> dict[str, Any]:
    """`checks:` as a config file's, validated as the daemon validates it (every mistake at once)."""
    settings = top.get("checks", dict, {})
    if not settings:
        return settings
    # Imported here: loading every check plugin costs half a second a fleet without `checks:` need not pay.
    from detector.config import build_checks
    from detector.core.check import CheckRegistry
    try:
        build_checks(registry or CheckRegistry.from_entry_points(), None, settings, top.file)
    except SourceError:
        raise
    except ValueError as e:                  # a check's own validation beyond its declared fields
        raise top.error("checks", str(e)) from None
    return settings


# -- faults --------------------------------------------------------------------------------------------

def _fault_spec(r: MappingReader, index: int, stream: str, fleet: _Fleet | None) -> FaultSpec | None:
    """One fault entry, or None when it has mistakes (each recorded). Its targets are resolved only when
    the fleet's nodes are known (`fleet`)."""
    before = r.recorded()
    timing = r.attempt(_timing, r)
    kind = r.attempt(r.get, "kind", str)
    gpu = r.attempt(r.get, "gpu", (int, str), None)
    params = {k: v for k, v in r.data.items() if k not in _FAULT_FIELDS}
    if kind is not None and (gpu is not None or not _given(r, "gpu")):
        r.attempt(_validate_fault, r, kind, gpu, params)
    at_s, rate = timing or (None, None)
    targets = None
    either = _given(r, "at") and _given(r, "random")     # a mistake of its own: which targets apply is unknown
    if fleet is not None and not either:
        rng = random.Random(f"{stream}:select")
        targets = r.attempt(_targets, r, fleet.nodes, fleet.by_name, rng, _given(r, "at"))
    if targets is not None and isinstance(gpu, int):
        r.attempt(_check_gpu_index, r, gpu, targets[1])
    if r.recorded() > before or targets is None:
        return None
    source, nodes = targets
    return FaultSpec(index, r.line, stream, source, kind, gpu, params, tuple(n.name for n in nodes), at_s, rate)


def _domain_fault_specs(r: MappingReader, index: int, stream: str, fleet: _Fleet | None) -> list[FaultSpec]:
    """`nvlink_domain_fault`: the 149 on one GPU's link, then the downstream 145 on every other GPU of its
    node's NVLink domain, as kernel lines (sim/domain_fault.py). Empty when it has mistakes (recorded)."""
    before = r.recorded()
    r.attempt(r.reject_unknown, set(DOMAIN_FAULT_FIELDS))
    at_s = None
    if not _given(r, "at"):
        r.report(None, f"missing `at`: a {DOMAIN_FAULT} happens once, at a time after the start")
    else:
        at_s = r.attempt(_duration, r, "at")
    origin = r.attempt(_domain_origin, r, fleet) if fleet is not None else None
    if r.recorded() > before or fleet is None or origin is None or at_s is None:
        return []
    node, gpu, link = origin
    specs = []
    for member in (n for n in fleet.nodes if n.nvlink_domain == node.nvlink_domain):
        for i, bus in enumerate(fleet.groups[member.group].pci_bus_ids):
            first = member is node and i == gpu
            message = xid149_line(bus, link) if first else xid145_line(bus, link)
            specs.append(FaultSpec(index, r.line, f"{stream}:{member.name}:{i}", "scripted" if member is node
                                   else "correlated", "kernel_line", None, {"message": message}, (member.name,),
                                   at_s if first else at_s + DOWNSTREAM_DELAY_S))
    return specs


def _domain_origin(r: MappingReader, fleet: _Fleet) -> tuple[SimNodeSpec, int, int] | None:
    """(node, gpu, link) where a domain fault starts: a node in an NVLink domain, and a GPU and link it has;
    None when the GPU or link is wrong (each recorded)."""
    name = r.get("node", str)
    node = fleet.by_name.get(name)
    if node is None:
        raise r.error("node", _no_node(name, fleet.nodes))
    if node.nvlink_domain is None:
        raise r.error("node", f"node {name!r} is in no NVLink domain: give its group `nvlink_domain: NAME`")
    gpu = r.attempt(_domain_gpu, r, node)
    link = r.attempt(_domain_link, r, node, fleet.groups[node.group].nvlinks)
    return (node, gpu, link) if gpu is not None and link is not None else None


def _domain_gpu(r: MappingReader, node: SimNodeSpec) -> int:
    gpu = r.get("gpu", int)
    if not 0 <= gpu < node.gpus:
        raise r.error("gpu", f"no GPU {gpu} on node {node.name!r}: it has GPUs 0 to {node.gpus - 1}")
    return gpu


def _domain_link(r: MappingReader, node: SimNodeSpec, links: int) -> int:
    link = r.get("link", int)
    if not 0 <= link < links:
        raise r.error("link", f"no NVLink {link} on a GPU of node {node.name!r}: its GPUs have links 0 to "
                              f"{links - 1}" if links else f"node {node.name!r}'s GPUs have no NVLink")
    return link


def _no_node(name: str, nodes: list[SimNodeSpec]) -> str:
    guess = did_you_mean(name, [n.name for n in nodes])
    known = f"did you mean `{guess}`?" if guess else f"its nodes run from {nodes[0].name!r} to {nodes[-1].name!r}"
    return f"no node named {name!r} in the fleet ({known})"


def _timing(r: MappingReader) -> tuple[float | None, RandomRate | None]:
    if _given(r, "at") and _given(r, "random"):
        raise r.error("random", "give either `at` (a time after the start) or `random` (a rate), not both")
    if not _given(r, "at") and not _given(r, "random"):
        raise r.error(None, "missing `at` (a time after the start) or `random` (a rate)")
    if _given(r, "at"):
        return _duration(r, "at"), None
    rr = r.child("random")
    rr.attempt(rr.reject_unknown, _RANDOM_FIELDS)
    if _given(rr, "rate") and _given(rr, "rate_per_hour"):
        raise rr.error("rate_per_hour", "give either `rate` (per node per hour) or `rate_per_hour` "
                                        "(all its nodes together), not both")
    if not _given(rr, "rate") and not _given(rr, "rate_per_hour"):
        raise r.error("random", "missing `rate` (per node per hour) or `rate_per_hour` (all its nodes together)")
    key = "rate" if _given(rr, "rate") else "rate_per_hour"
    value = rr.attempt(_rate, rr, key)
    from_s = rr.attempt(_duration, rr, "from") if _given(rr, "from") else 0.0
    until_s = rr.attempt(_duration, rr, "until") if _given(rr, "until") else None
    if until_s is not None and from_s is not None and until_s <= from_s:
        raise rr.error("until", f"must be later than `from` ({from_s:g}s), got {until_s:g}s")
    if value is None or from_s is None:
        return None, None                    # its mistakes are recorded
    per_node = value if key == "rate" else None
    return None, RandomRate(per_node, None if per_node is not None else value, from_s, until_s)


def _rate(rr: MappingReader, key: str) -> float:
    value = float(rr.get(key, float))
    if not (value > 0 and math.isfinite(value)):
        raise rr.error(key, f"must be a positive number of faults per hour, got {value:g}")
    return value


def _duration(r: MappingReader, key: str) -> float:
    value = r.get(key, (int, float, str))
    if isinstance(value, str):
        m = _DURATION.match(value.strip())
        if not m:
            raise r.error(key, f"expected a non-negative duration: seconds (90) or with a unit (90s, 5m, 1h, 2d), "
                               f"got {value!r}")
        seconds = float(m[1]) * _UNITS[m[2]]
    else:
        seconds = float(value)
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise r.error(key, f"expected a non-negative duration, got {value!r}")
    return seconds


def _validate_fault(r: MappingReader, kind: str, gpu: int | str | None, params: dict[str, Any]) -> None:
    """Fault validates itself; this only finds the field to blame for its complaint, and names every
    unknown parameter, each with its near miss."""
    if isinstance(gpu, str) and gpu not in (GPU_ALL, GPU_RANDOM):
        raise r.error("gpu", f"expected a GPU index, {GPU_ALL!r} or {GPU_RANDOM!r}, got {gpu!r}")
    if isinstance(gpu, int) and gpu < 0:
        raise r.error("gpu", f"expected a GPU index (0 or more), got {gpu}")
    spec = FAULT_KINDS.get(kind)
    if spec is None:
        raise r.error("kind", f"unknown fault kind {kind!r} ({hint(kind, FAULT_KINDS, 'known: {}')})")
    unknown = [k for k in params if k not in spec.params]
    if unknown:
        raise SourceErrors.of([r.error(k, f"fault {kind!r} takes no parameter {k!r} "
                                          f"({_parameter_hint(k, spec.params)})") for k in unknown])
    try:
        Fault(kind, 0 if isinstance(gpu, str) else gpu, params)
    except ValueError as e:
        blamed = next((k for k in params if str(e).startswith(f"fault {kind!r}: {k} ")), None)
        raise r.error(blamed or ("gpu" if "'gpu'" in str(e) else None), str(e)) from None
    if isinstance(gpu, str) and not spec.needs_gpu:
        raise r.error("gpu", f"{kind!r} faults need no GPU, so `gpu: {gpu}` has none to pick: leave gpu out")


def _parameter_hint(key: str, params: Iterable[str]) -> str:
    """The near miss among a fault kind's parameters and a fault entry's fields, else both listed."""
    guess = did_you_mean(key, [*params, *_FAULT_FIELDS])
    if guess:
        return f"did you mean `{guess}`?"
    return (f"it takes: {', '.join(sorted(params)) or 'none'}; "
            f"a fault entry also takes: {', '.join(sorted(_FAULT_FIELDS))}")


def _targets(r: MappingReader, nodes: list[SimNodeSpec], by_name: dict[str, SimNodeSpec],
             rng: random.Random, timed: bool) -> tuple[str, list[SimNodeSpec]]:
    """(source, target nodes): `node` alone; else `rack` and/or `labels` narrow the fleet, and
    `fraction` takes a seeded share (at least one) of what is left."""
    given = [k for k in _SELECTORS if _given(r, k)]
    if "node" in given:
        if len(given) > 1:
            raise r.error(given[1] if given[0] == "node" else given[0],
                          "`node` names one node: it combines with no rack, labels or fraction")
        name = r.get("node", str)
        node = by_name.get(name)
        if node is None:
            raise r.error("node", _no_node(name, nodes))
        return ("scripted" if timed else "random"), [node]
    if timed and not given:
        raise r.error(None, "a fault with `at` needs a target: node, rack, labels or fraction")
    chosen = nodes
    if _given(r, "rack"):
        rack = r.get("rack", str)
        chosen = [n for n in chosen if n.rack == rack]
        if not chosen:
            racks = sorted({n.rack for n in nodes if n.rack})
            known = f"racks: {', '.join(racks)}" if racks else "no node group has `racks:`"
            raise r.error("rack", f"no node is in rack {rack!r} ({known})")
    if _given(r, "labels"):
        want = _labels(r, "labels")
        chosen = [n for n in chosen if all(n.labels.get(k) == v for k, v in want.items())]
        if not chosen:
            where = f" in rack {r.get('rack', str)!r}" if _given(r, "rack") else ""
            raise r.error("labels", f"no node{where} has the labels {want}")
    if _given(r, "fraction"):
        fraction = float(r.get("fraction", float))
        if not 0 < fraction <= 1:
            raise r.error("fraction", f"must be more than 0 and at most 1, got {fraction:g}")
        keep = sorted(rng.sample(range(len(chosen)), max(1, round(fraction * len(chosen)))))
        chosen = [chosen[i] for i in keep]
    return ("correlated" if timed else "random"), list(chosen)


def _check_gpu_index(r: MappingReader, gpu: int, targets: list[SimNodeSpec]) -> None:
    short = [n for n in targets if gpu >= n.gpus]
    if short:
        others = f" (and {len(short) - 1} more of its targets)" if len(short) > 1 else ""
        raise r.error("gpu", f"no GPU {gpu} on node {short[0].name!r}{others}: it has GPUs 0 to {short[0].gpus - 1}")


def _given(r: MappingReader, key: str) -> bool:
    """A key left empty (`rack:`) counts as left out, as MappingReader.get treats it."""
    return r.data.get(key) is not None
