"""The fake node's InfiniBand/RoCE ports, for the infiniband check: a reader over their state (each port's
is a FakeIbPort, fake_nvml/ib_port.py; what `detector.backends.infiniband` reads from sysfs, computed), a
writer that lays the same ports out as a sysfs tree, so the real reader can be tested on the fake's files,
the port faults and how `recover`/`reboot` heal them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector.backends.infiniband import (COUNTER_BITS, NO_PMA, PHYS_STATE_NAMES, STATE_NAMES, IbPort,
                                          IbSnapshot, counter_max)
from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.ib_port import CONNECTX7_BOARD, FakeIbPort, fake_ports
from fake_nvml.node import FakeGpu, FakeNode, NodeState

# Per-lane signalling rate (Gb/s) by the kernel's speed names (drivers/infiniband/core/sysfs.c rate_show).
LANE_GBPS = {"SDR": 2.5, "DDR": 5.0, "QDR": 10.0, "FDR": 14.0, "EDR": 25.0, "HDR": 50.0, "NDR": 100.0,
             "XDR": 200.0}
PHYS_BY_NAME = {name: code for code, name in PHYS_STATE_NAMES.items()}
STATE_BY_NAME = {name: code for code, name in STATE_NAMES.items()}


def rate_text(gbps: float, width: int) -> str:
    """The kernel's rate string: keep the lane speed that makes `gbps` at some standard width, preferring
    the port's own width (a port that lost lanes shows `2X NDR`, one that fell back a speed `4X HDR`)."""
    for w in (width, 1, 2, 4, 8, 12):
        for speed, lane in LANE_GBPS.items():
            if abs(lane * w - gbps) < 1e-6:
                return f"{gbps:g} Gb/sec ({w}X {speed})"
    return f"{gbps:g} Gb/sec ({width}X SDR)"


def ib_port(p: FakeIbPort, elapsed_s: float) -> IbPort:
    """What sysfs shows for the port now. A port that is not ACTIVE reads the kernel's SDR default rate."""
    up = p.state == 4
    gbps = (p.trained_gbps or p.rate_gbps) if up else 2.5 * p.width
    text = rate_text(gbps, p.width)
    return IbPort(
        device=p.device, port=p.port, link_layer=p.link_layer, state_code=p.state,
        state=STATE_NAMES.get(p.state, "UNKNOWN"), phys_state_code=p.phys_state,
        phys_state=PHYS_STATE_NAMES.get(p.phys_state, "<unknown>"), rate_gbps=gbps, rate=text,
        board_id=p.board_id or None, counters={name: p.counter(name, elapsed_s) for name in COUNTER_BITS},
    )


def ib_snapshot(state: NodeState, elapsed_s: float) -> IbSnapshot:
    ports = [ib_port(p, elapsed_s) for p in state.ib_ports if p.present]
    return IbSnapshot(bool(ports) or any(not p.present for p in state.ib_ports), ports, elapsed_s)


class FakeInfiniband:
    """A ports reader over the fake node's live state; its clock is the node's."""

    def __init__(self, node: FakeNode):
        self.node = node

    def read(self) -> IbSnapshot:
        return self.node.read(lambda state: ib_snapshot(state, self.node.elapsed_s()))


def fake_infiniband(node: FakeNode) -> FakeInfiniband:
    """A ports reader over the fake node."""
    return FakeInfiniband(node)


def write_sysfs(state: NodeState, root: Path, elapsed_s: float = 0.0) -> None:
    """Lay the ports out as Linux does: `<root>/devices/pci0000:00/<bdf>/infiniband/<dev>` with
    `<root>/class/infiniband/<dev>` a symlink to it. Counters are their values at `elapsed_s`."""
    snapshot = ib_snapshot(state, elapsed_s)
    if not snapshot.present:
        return
    class_dir = root / "class" / "infiniband"
    class_dir.mkdir(parents=True, exist_ok=True)
    devices = sorted({p.device for p in snapshot.ports})
    for n, device in enumerate(devices):
        real = root / "devices" / "pci0000:00" / f"0000:{0xc0 + n:02x}:00.0" / "infiniband" / device
        for p in (p for p in snapshot.ports if p.device == device):
            port_dir = real / "ports" / str(p.port)
            (port_dir / "counters").mkdir(parents=True, exist_ok=True)
            files = {"state": f"{p.state_code}: {p.state}", "phys_state": f"{p.phys_state_code}: {p.phys_state}",
                     "rate": p.rate, "link_layer": p.link_layer}
            for name, text in files.items():
                (port_dir / name).write_text(f"{text}\n")
            for name, value in p.counters.items():
                (port_dir / "counters" / name).write_text(f"{NO_PMA if value is None else value}\n")
            if p.board_id:
                (real / "board_id").write_text(f"{p.board_id}\n")
        link = class_dir / device
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(real, class_dir))


# -- faults (declared in FAULTS below) -----------------------------------------------------------------

def _ports(f: FaultArgs, state: NodeState) -> list[FakeIbPort]:
    device, port = f.params["device"], f.params.get("port")
    found = [p for p in state.ib_ports if p.device == device and (port is None or p.port == port)]
    if not found:
        have = ", ".join(p.name for p in state.ib_ports) or "none"
        raise ValueError(f"fault {f.kind!r}: node {state.name} has no port {device}/{port or '*'} (it has: {have})")
    return found


def port_state(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`ib_port_state`: the port goes to this state and physical state (names as sysfs shows them)."""
    for p in _ports(f, state):
        p.state = _code(f, "state", STATE_BY_NAME, p.state)
        p.phys_state = _code(f, "phys_state", PHYS_BY_NAME, p.phys_state)


def port_down(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`ib_port_down`: DOWN; Polling (the link partner is gone: a cable, transceiver or switch port, which
    counts a link_downed) or Disabled (turned off by software, which does not)."""
    phys = _code(f, "phys_state", PHYS_BY_NAME, 2)
    for p in _ports(f, state):
        if phys != 3 and p.state == 4:
            p.settle(node.elapsed_s())
            p.counters["link_downed"] = min(p.counters.get("link_downed", 0) + 1, counter_max("link_downed"))
        p.state, p.phys_state = 1, phys


def port_rate(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`ib_rate`: the port retrains at this rate (Gb/s)."""
    for p in _ports(f, state):
        p.trained_gbps = float(f.params["rate_gbps"])


def port_errors(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`ib_errors`: an error counter jumps by `add` and/or rises by `per_min` from now on."""
    name = f.params["counter"]
    if name not in COUNTER_BITS:
        raise ValueError(f"fault 'ib_errors': counter must be one of {', '.join(COUNTER_BITS)}, got {name!r}")
    for p in _ports(f, state):
        p.settle(node.elapsed_s())
        p.counters[name] = min(p.counters.get(name, 0) + f.params.get("add", 0), counter_max(name))
        if "per_min" in f.params:
            p.rising[name] = float(f.params["per_min"])


def port_missing(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """`ib_missing`: the HCA's ports vanish from sysfs."""
    for p in _ports(f, state):
        p.present = False


def _code(f: FaultArgs, key: str, names: dict[str, int], default: int) -> int:
    value = f.params.get(key)
    if value is None:
        return default
    if value not in names:
        raise ValueError(f"fault {f.kind!r}: {key} must be one of {', '.join(names)}, got {value!r}")
    return names[value]


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A node repair or reboot: every port back, trained at full rate, its counters cleared (an HCA reset
    clears them; after a repair, perfquery -R does) and no longer rising. A GPU reset leaves ports alone."""
    if not whole_node:
        return
    for p in state.ib_ports:
        p.state, p.phys_state, p.trained_gbps, p.present = 4, 5, None, True
        p.counters, p.rising = {}, {}


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("ib_port_down", False, {"device": str, "port": int, "phys_state": str}, ("device",),
              port_down, "an InfiniBand/RoCE port goes DOWN (phys_state Polling: link lost, the default; "
              "Disabled: turned off by software)"),
    FaultKind("ib_port_state", False, {"device": str, "port": int, "state": str, "phys_state": str},
              ("device", "state"), port_state,
              "a port's state (DOWN, INIT, ARMED, ACTIVE) and physical state (Polling, Disabled, LinkUp ...)"),
    FaultKind("ib_rate", False, {"device": str, "port": int, "rate_gbps": float}, ("device", "rate_gbps"),
              port_rate, "a port retrains at this rate in Gb/s (lanes or speed lost)"),
    FaultKind("ib_errors", False, {"device": str, "port": int, "counter": str, "per_min": float, "add": int},
              ("device", "counter"), port_errors,
              "a port error counter (symbol_error, link_downed ...) jumps by add and/or rises per_min from now"),
    FaultKind("ib_missing", False, {"device": str}, ("device",), port_missing,
              "an HCA's ports vanish from /sys/class/infiniband (fell off the bus, driver gone)"),
)


# -- scenario files: the top-level `infiniband:` field --------------------------------------------------

@dataclass(frozen=True)
class IbSpec:
    """A scenario's HCA ports: `ports` single-port HCAs (0: none), all alike."""

    ports: int = 0
    rate_gbps: float = 400.0
    link_layer: str = "InfiniBand"
    width: int = 4
    board_id: str = CONNECTX7_BOARD

    def build(self) -> list[FakeIbPort]:
        return fake_ports(self.ports, self.rate_gbps, self.link_layer, self.width, self.board_id)


LINK_LAYERS = ("InfiniBand", "Ethernet")


def parse_ib_spec(top: Any, base: IbSpec | None) -> IbSpec:
    """`infiniband: {ports: 8, rate_gbps: 400, link_layer: InfiniBand, width: 4, board_id: ...}` from a
    scenario's MappingReader `top`; keys not given come from the scenario it extends. `infiniband: null`
    (or `ports: 0`): no HCA at all."""
    inherited = base or IbSpec()
    if not top.has("infiniband"):
        return inherited
    if top.data["infiniband"] is None:
        return IbSpec()
    r = top.child("infiniband")
    r.reject_unknown({"ports", "rate_gbps", "link_layer", "width", "board_id"})
    ports = r.get("ports", int, inherited.ports)
    if not 0 <= ports <= 64:
        raise r.error("ports", f"expected 0 to 64 ports, got {ports}")
    rate = float(r.get("rate_gbps", float, inherited.rate_gbps))
    if not 0 < rate <= 3200:
        raise r.error("rate_gbps", f"expected a rate in Gb/s (400 for NDR 4X), got {rate:g}")
    layer = r.get("link_layer", str, inherited.link_layer)
    if layer not in LINK_LAYERS:
        raise r.error("link_layer", f"expected one of {', '.join(LINK_LAYERS)}, got {layer!r}")
    width = r.get("width", int, inherited.width)
    if width not in (1, 2, 4, 8, 12):
        raise r.error("width", f"expected a link width of 1, 2, 4, 8 or 12 lanes, got {width}")
    return IbSpec(ports, rate, layer, width, r.get("board_id", str, inherited.board_id))
