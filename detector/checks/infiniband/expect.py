"""Which ports should be up, and how fast: configured, or learned from the node itself and then held for
the life of the process, so a port that goes down or vanishes later is noticed.

Learning follows NVIDIA NVSentinel's NIC health monitor (docs/nic-health-monitor.md): a port that is down
the first time it is seen is reported only with peer evidence, and a card with fewer active ports than its
peers is an anomaly (its "card homogeneity" check). Here a port is expected up when

  - it is named in the `ports` setting, or
  - it has been seen ACTIVE since the check started, or
  - a peer port is ACTIVE: the same port number on another HCA of the same part (board_id) and link
    layer. Eight single-port ConnectX-7 rails with one down: the down one is expected. A dual-port card
    with only port 1 cabled on every card: port 2 never is.

The expected rate of an ACTIVE port is the `expected_rate_gbps` setting, or else the fastest rate seen on an
ACTIVE port of the same part and link layer since the check started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from detector.backends.infiniband import IbPort

Group = tuple[str, str]       # (board_id, link_layer)


def group_of(port: IbPort) -> Group:
    return (port.board_id or "", port.link_layer or "")


@dataclass
class Expectations:
    configured: tuple[str, ...] = ()            # "mlx5_0/1" names that must be up
    configured_rate_gbps: float = 0.0           # 0: learn it
    why: dict[str, str] = field(default_factory=dict)         # port name -> why it is expected
    known: dict[str, IbPort] = field(default_factory=dict)    # the last reading of every expected port
    fastest: dict[Group, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.configured:
            self.why[name] = "named in the ports setting"

    def learn(self, ports: Iterable[IbPort]) -> None:
        ports = list(ports)
        active_numbers: dict[Group, set[tuple[int, str]]] = {}
        for p in ports:
            if p.active:
                active_numbers.setdefault(group_of(p), set()).add((p.port, p.device))
                if p.rate_gbps is not None:
                    g = group_of(p)
                    self.fastest[g] = max(self.fastest.get(g, 0.0), p.rate_gbps)
        for p in ports:
            if p.name not in self.why:
                if p.active:
                    self.why[p.name] = "seen ACTIVE since the check started"
                elif any(n == p.port and d != p.device for n, d in active_numbers.get(group_of(p), ())):
                    self.why[p.name] = f"port {p.port} of its peer HCAs (same part, same link layer) is ACTIVE"
            if p.name in self.why:
                self.known[p.name] = p

    def expected(self, port_name: str) -> str | None:
        """Why the port should be up, or None when nothing says so."""
        return self.why.get(port_name)

    def rate_gbps(self, port: IbPort) -> float | None:
        if self.configured_rate_gbps > 0:
            return self.configured_rate_gbps
        return self.fastest.get(group_of(port))

    def missing(self, seen: set[str]) -> list[IbPort | str]:
        """Expected ports not in this reading: their last reading, or the name alone if never seen."""
        return [self.known.get(name, name) for name in sorted(self.why) if name not in seen]


def port_name(name: str) -> str:
    """A `ports` setting entry: "mlx5_0/1", or "mlx5_0" for its port 1."""
    name = name.strip()
    return name if "/" in name else f"{name}/1"
