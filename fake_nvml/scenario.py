"""Scenarios: YAML descriptions of a fake node (its GPUs and a timeline of faults).

Bundled scenarios live in fake_nvml/scenarios/ and are named by file stem; a path works too.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from detector.backends.pciaddr import normalize_bus_id
from detector.yamlsource import MappingReader, SourceError, load_yaml, parse_yaml
from fake_nvml.faults import Fault
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
    """Load a bundled scenario by name, or a scenario file by path. Errors are SourceError."""
    return _load(name_or_path, seen=())


def _load(name_or_path: str, seen: tuple[str, ...]) -> Scenario:
    if name_or_path in seen:
        raise SourceError(name_or_path, None, "extends", f"circular: {' -> '.join(seen + (name_or_path,))}")
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        doc = load_yaml(path)
        name = path.stem
    else:
        resource = resources.files("fake_nvml") / "scenarios" / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise SourceError(name_or_path, None, None,
                              f"no bundled scenario of that name (bundled: {', '.join(bundled_scenarios())})")
        doc = parse_yaml(resource.read_text(encoding="utf-8"), f"fake_nvml/scenarios/{name_or_path}.yaml")
        name = name_or_path
    top = MappingReader(doc.file, doc.data, "")
    top.reject_unknown(_TOP_FIELDS)
    base = _load(top.get("extends", str), seen + (name_or_path,)) if top.has("extends") else None
    return _parse(name, top, base)


def _parse(name: str, top: MappingReader, base: Scenario | None) -> Scenario:
    def inherit(key: str, kind: type, default: Any) -> Any:
        return top.get(key, kind, getattr(base, key) if base else default)

    gpu_model = inherit("gpu_model", str, None)
    if gpu_model is None:
        raise top.error(None, "missing required field 'gpu_model'")
    if gpu_model not in MODELS:
        raise top.error("gpu_model", f"unknown model {gpu_model!r} (known: {', '.join(sorted(MODELS))})")
    bus_ids = _bus_ids(top, base)
    faults = list(base.faults) if base else []
    for path, line, item in top.items("faults", []):
        faults.append(_fault(MappingReader(top.file, item, path, line), len(bus_ids)))
    return Scenario(
        name=name,
        description=top.get("description", str, base.description if base else ""),
        driver_version=str(inherit("driver_version", (str, int, float), "550.90.07")),
        cuda_version=str(inherit("cuda_version", (str, int, float), "12.4")),
        gpu_model=gpu_model, pci_bus_ids=bus_ids,
        nvswitches=[_bus_id(top, "nvswitches", b) for b in top.get("nvswitches", list, [])]
        if top.has("nvswitches") else (list(base.nvswitches) if base else []),
        faults=faults,
        infiniband=parse_ib_spec(top, base.infiniband if base else None),
        nvlink_domain=_nvlink_domain(top, base),
        imex=_imex(top, base),
    )


def _imex(top: MappingReader, base: Scenario | None) -> ImexSpec | None:
    """`imex: {configured: true|false, peers: N, managed_by: host|compute_domain}` (all optional)."""
    if not top.has("imex"):
        return base.imex if base else None
    r = top.child("imex")
    r.reject_unknown({"configured", "peers", "managed_by"})
    peers = r.get("peers", int, 17)
    if not 0 <= peers <= 1023:
        raise r.error("peers", f"expected 0 to 1023 peers, got {peers}")
    managed_by = r.get("managed_by", str, "host")
    if managed_by not in ("host", "compute_domain"):
        raise r.error("managed_by", f"expected host or compute_domain, got {managed_by!r}")
    return ImexSpec(r.get("configured", bool, True), peers, managed_by)


def _nvlink_domain(top: MappingReader, base: Scenario | None) -> NvlinkDomain | None:
    """`nvlink_domain: {clique_id: 1, cluster_uuid: ...}`, or `nvlink_domain: NAME` (a UUID from the name)."""
    if not top.has("nvlink_domain"):
        return base.nvlink_domain if base else None
    value = top.get("nvlink_domain", (str, dict))
    if isinstance(value, str):
        return NvlinkDomain.named(value)
    r = top.child("nvlink_domain")
    r.reject_unknown({"clique_id", "cluster_uuid"})
    clique = r.get("clique_id", int, 1)
    if not 0 <= clique < 2**32:
        raise r.error("clique_id", f"expected 0 to 4294967295, got {clique}")
    try:
        cluster = str(uuid.UUID(r.get("cluster_uuid", str)))
    except ValueError:
        raise r.error("cluster_uuid", "expected a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)") from None
    return NvlinkDomain(clique, cluster)


def _bus_ids(top: MappingReader, base: Scenario | None) -> list[str]:
    if top.has("pci_bus_ids"):
        ids = [_bus_id(top, "pci_bus_ids", b) for b in top.get("pci_bus_ids", list)]
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


def _bus_id(top: MappingReader, key: str, value: Any) -> str:
    try:
        return normalize_bus_id(str(value))
    except ValueError as e:
        raise top.error(key, str(e)) from None


def _fault(r: MappingReader, gpu_count: int) -> TimedFault:
    at = float(r.get("at", float, 0.0))
    if at < 0:
        raise r.error("at", "must be >= 0 seconds")
    kind = r.get("kind", str)
    gpu = r.get("gpu", int, None)
    if gpu is not None and not 0 <= gpu < gpu_count:
        raise r.error("gpu", f"no GPU {gpu}: the node has GPUs 0 to {gpu_count - 1}")
    params = {k: v for k, v in r.data.items() if k not in ("at", "kind", "gpu")}
    try:
        return TimedFault(at, Fault(kind, gpu, params))
    except ValueError as e:
        raise r.error("kind", str(e)) from None
