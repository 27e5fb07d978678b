"""Scenarios: YAML descriptions of a fake node (its GPUs and a timeline of faults).

Bundled scenarios live in fake_nvml/scenarios/ and are named by file stem; a path works too. Every
mistake of a scenario file is reported at once, each with file, line and field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from detector.backends.pciaddr import normalize_bus_id
from detector.yamlsource import (MappingReader, Mistakes, SourceError, SourceErrors, collecting, hint, load_yaml,
                                 parse_yaml)
from fake_nvml.faults import FAULT_KINDS, Fault
from fake_nvml.imex import configure as fake_imex_setup
from fake_nvml.infiniband import IbSpec, parse_ib_spec
from fake_nvml.models import MODELS, model_by_key
from fake_nvml.node import Clock, FakeGpu, FakeNode, NodeState, NvSwitch, TimedFault

# An HGX 8-GPU board's GPU bus ids, in PCI order.
HGX8_BUS_IDS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
                "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
_UUID_NAMESPACE = uuid.UUID("5b0c6a52-3f7e-4d7e-9a61-0d6c4b1e8a10")
_TOP_FIELDS = {"description", "extends", "node_name", "driver_version", "cuda_version", "gpu_model", "gpus",
               "pci_bus_ids", "nvswitches", "faults", "infiniband", "nvlink_domain", "imex"}


@dataclass(frozen=True)
class NvlinkDomain:
    """The multi-node NVLink domain a node's GPUs register in (an NVL72 rack): NVML's clique ID and cluster
    UUID, the same on every tray of the rack."""

    clique_id: int
    cluster_uuid: str

    @classmethod
    def named(cls, name: str, clique_id: int = 1) -> "NvlinkDomain":
        """A domain whose cluster UUID derives from its name, so every node of a fleet's group shares it."""
        return cls(clique_id, str(uuid.uuid5(_UUID_NAMESPACE, f"nvlink-domain/{name}")))


@dataclass(frozen=True)
class ImexSpec:
    """`imex: {configured: true, peers: 17}`: the IMEX packages installed; with `configured` the host service
    enabled with a nodes config listing this tray and `peers` others (an NVL72 rack: 17)."""

    configured: bool = True
    peers: int = 17
    managed_by: str = "host"             # host (the nvidia-imex unit) or compute_domain (a ComputeDomain's pod)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    driver_version: str
    cuda_version: str
    gpu_model: str
    pci_bus_ids: list[str]
    nvswitches: list[str]
    faults: list[TimedFault] = field(default_factory=list)
    infiniband: IbSpec = IbSpec()        # HCA ports (fake_nvml/infiniband.py); none by default
    nvlink_domain: NvlinkDomain | None = None   # a multi-node NVLink domain (GB200 NVL72); None: none
    imex: ImexSpec | None = None         # the IMEX packages and host service (fake_nvml/imex.py); None: none

    def build(self, node_name: str | None = None, clock: Clock = time.monotonic,
              nvlink_domain: NvlinkDomain | None = None, **kwargs: Any) -> FakeNode:
        """A fresh fake node for this scenario. GPU UUIDs derive from the node name, so fleets differ;
        `nvlink_domain` puts the node in a fleet's shared domain instead of the scenario's own."""
        name = node_name or self.name
        domain = nvlink_domain or self.nvlink_domain
        model = model_by_key(self.gpu_model)
        gpus = []
        for index, bus_id in enumerate(self.pci_bus_ids):
            ident = uuid.uuid5(_UUID_NAMESPACE, f"{name}/{index}")
            gpus.append(FakeGpu(
                index=index, model=model, uuid=f"GPU-{ident}", serial=str(1650000000000 + ident.int % 10**9),
                pci_bus_id=bus_id, minor=index, pcie_gen=model.pcie_max_gen, pcie_width=model.pcie_max_width,
                pcie_max_gen=model.pcie_max_gen, pcie_max_width=model.pcie_max_width,
            ))
        major, _, minor = self.cuda_version.partition(".")
        state = NodeState(
            name=name, driver_version=self.driver_version, cuda_version=int(major) * 1000 + int(minor or 0) * 10,
            gpus=gpus, nvswitches=[NvSwitch(b) for b in self.nvswitches],
            boot_id=str(uuid.uuid5(_UUID_NAMESPACE, f"{name}/boot")), ib_ports=self.infiniband.build(),
            fabric_clique_id=domain.clique_id if domain else 0,
            fabric_cluster_uuid=domain.cluster_uuid if domain else "",
        )
        if self.imex is not None:
            fake_imex_setup(state, self.imex.peers, installed=True, enabled=self.imex.configured,
                            managed_by=self.imex.managed_by)
        return FakeNode(state, list(self.faults), clock=clock, **kwargs)


def bundled_scenarios() -> list[str]:
    root = resources.files("fake_nvml") / "scenarios"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """Load a bundled scenario by name, or a scenario file by path. Errors are SourceError: every
    mistake of the file together."""
    return _load(name_or_path, seen=())


def _load(name_or_path: str, seen: tuple[str, ...]) -> Scenario:
    if name_or_path in seen:
        raise SourceError(name_or_path, None, "extends", f"circular: {' -> '.join(seen + (name_or_path,))}")
    with collecting() as mistakes:
        name, doc_file, data = _read(name_or_path, mistakes)
        top = MappingReader(doc_file, data, "", mistakes=mistakes)
        top.attempt(top.reject_unknown, _TOP_FIELDS)
        # the file it extends is read first: its mistakes, if any, are raised with this file's so far
        base = _load(top.get("extends", str), seen + (name_or_path,)) if top.has("extends") else None
        return _parse(name, top, base)


def _read(name_or_path: str, mistakes: Mistakes) -> tuple[str, str, Any]:
    """(scenario name, file name for messages, parsed YAML) of a scenario path or bundled name."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        doc = load_yaml(path, mistakes)
        return path.stem, doc.file, doc.data
    resource = resources.files("fake_nvml") / "scenarios" / f"{name_or_path}.yaml"
    if not resource.is_file():
        raise SourceError(name_or_path, None, None, "no bundled scenario of that name "
                          f"({hint(name_or_path, bundled_scenarios(), 'bundled: {}')})")
    doc = parse_yaml(resource.read_text(encoding="utf-8"), f"fake_nvml/scenarios/{name_or_path}.yaml", mistakes)
    return name_or_path, doc.file, doc.data


def _parse(name: str, top: MappingReader, base: Scenario | None) -> Scenario:
    """The scenario; each field is checked on its own, its mistakes recorded in top.mistakes (the caller
    raises them, and then what this returns is not used)."""
    def inherit(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        return top.attempt(top.get, key, kind, getattr(base, key) if base else default)

    gpu_model = top.attempt(_gpu_model, top, base)
    bus_ids = top.attempt(_bus_ids, top, base)
    faults = list(base.faults) if base else []
    for _, r in top.attempt(top.each, "faults", [], default=[]):
        fault = top.attempt(_fault, r, len(bus_ids) if bus_ids is not None else None)
        if fault is not None:
            faults.append(fault)
    nvswitches = top.attempt(_bus_id_list, top, "nvswitches") if top.has("nvswitches") else None
    return Scenario(
        name=name,
        description=inherit("description", str, ""),
        driver_version=str(inherit("driver_version", (str, int, float), "550.90.07")),
        cuda_version=str(inherit("cuda_version", (str, int, float), "12.4")),
        gpu_model=gpu_model, pci_bus_ids=bus_ids or [],
        nvswitches=nvswitches if nvswitches is not None else (list(base.nvswitches) if base else []),
        faults=faults,
        infiniband=top.attempt(parse_ib_spec, top, base.infiniband if base else None, default=IbSpec()),
        nvlink_domain=top.attempt(_nvlink_domain, top, base),
        imex=top.attempt(_imex, top, base),
    )


def _gpu_model(top: MappingReader, base: Scenario | None) -> str:
    gpu_model = top.get("gpu_model", str, base.gpu_model if base else None)
    if gpu_model is None:
        raise top.error("gpu_model", "missing required field 'gpu_model'")
    if gpu_model not in MODELS:
        raise top.error("gpu_model", f"unknown model {gpu_model!r} ({hint(gpu_model, MODELS, 'known: {}')})")
    return gpu_model


def _imex(top: MappingReader, base: Scenario | None) -> ImexSpec | None:
    """`imex: {configured: true|false, peers: N, managed_by: host|compute_domain}` (all optional)."""
    if not top.has("imex"):
        return base.imex if base else None
    r = top.child("imex")
    before = r.recorded()
    r.attempt(r.reject_unknown, {"configured", "peers", "managed_by"})
    peers = r.attempt(_in_range, r, "peers", 17, 0, 1023, "peers")
    managed_by = r.attempt(r.choice, "managed_by", ("host", "compute_domain"), "host")
    configured = r.attempt(r.get, "configured", bool, True)
    return ImexSpec(configured, peers, managed_by) if r.recorded() == before else None


def _in_range(r: MappingReader, key: str, default: int, low: int, high: int, unit: str = "") -> int:
    value = r.get(key, int, default)
    if not low <= value <= high:
        raise r.error(key, f"expected {low} to {high}{' ' + unit if unit else ''}, got {value}")
    return value


def _nvlink_domain(top: MappingReader, base: Scenario | None) -> NvlinkDomain | None:
    """`nvlink_domain: {clique_id: 1, cluster_uuid: ...}`, or `nvlink_domain: NAME` (a UUID from the name)."""
    if not top.has("nvlink_domain"):
        return base.nvlink_domain if base else None
    value = top.get("nvlink_domain", (str, dict))
    if isinstance(value, str):
        return NvlinkDomain.named(value)
    r = top.child("nvlink_domain")
    before = r.recorded()
    r.attempt(r.reject_unknown, {"clique_id", "cluster_uuid"})
    clique = r.attempt(_in_range, r, "clique_id", 1, 0, 2**32 - 1)
    cluster = r.attempt(_uuid, r, "cluster_uuid")
    return NvlinkDomain(clique, cluster) if r.recorded() == before else None


def _uuid(r: MappingReader, key: str) -> str:
    try:
        return str(uuid.UUID(r.get(key, str)))
    except ValueError:
        raise r.error(key, "expected a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)") from None


def _bus_ids(top: MappingReader, base: Scenario | None) -> list[str]:
    if top.has("pci_bus_ids"):
        ids = _bus_id_list(top, "pci_bus_ids")
        if top.has("gpus") and top.get("gpus", int) != len(ids):
            raise top.error("gpus", f"says {top.get('gpus', int)} GPUs but pci_bus_ids lists {len(ids)}")
    elif top.has("gpus"):
        count = top.get("gpus", int)
        if not 1 <= count <= 64:
            raise top.error("gpus", f"expected 1 to 64 GPUs, got {count}")
        ids = HGX8_BUS_IDS[:count] if count <= 8 else [f"0000:{0x10 + 8 * i:02x}:00.0" for i in range(count)]
    elif base:
        ids = list(base.pci_bus_ids)
    else:
        raise top.error(None, "missing required field 'gpus' (a count) or 'pci_bus_ids' (a list)")
    if len(set(ids)) != len(ids):
        raise top.error("pci_bus_ids", "bus ids repeat")
    return sorted(ids)


def _bus_id_list(top: MappingReader, key: str) -> list[str]:
    """A list of PCI bus ids, normalized; every malformed one is a mistake of its own."""
    ids: list[str] = []
    errors: list[SourceError] = []
    for value in top.get(key, list):
        try:
            ids.append(normalize_bus_id(str(value)))
        except ValueError as e:
            errors.append(top.error(key, str(e)))
    if errors:
        raise SourceErrors.of(errors)
    return ids


def _fault(r: MappingReader, gpu_count: int | None) -> TimedFault | None:
    """A timed fault, or None when it has mistakes (each recorded). `gpu_count` None: the node's GPUs
    are not known (a mistake of their own), so the GPU index goes unchecked."""
    before = r.recorded()
    at = r.attempt(_at, r)
    kind = r.attempt(r.get, "kind", str)
    gpu = r.attempt(r.get, "gpu", int, None)
    if gpu is not None and gpu_count is not None and not 0 <= gpu < gpu_count:
        r.report("gpu", f"no GPU {gpu}: the node has GPUs 0 to {gpu_count - 1}")
    if r.recorded() > before or kind is None:
        return None
    params = {k: v for k, v in r.data.items() if k not in ("at", "kind", "gpu")}
    try:
        return TimedFault(at, Fault(kind, gpu, params))
    except ValueError as e:
        problem = str(e)
        if kind not in FAULT_KINDS:
            problem = f"unknown fault kind {kind!r} ({hint(kind, FAULT_KINDS, 'known: {}')})"
        raise r.error("kind", problem) from None


def _at(r: MappingReader) -> float:
    at = float(r.get("at", float, 0.0))
    if at < 0:
        raise r.error("at", "must be >= 0 seconds")
    return at
