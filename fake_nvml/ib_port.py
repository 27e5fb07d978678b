"""One InfiniBand/RoCE HCA port's state, part of the node's state (NodeState.ib_ports). Kept apart from
fake_nvml/infiniband.py, which reads, writes and breaks ports over the whole node: the node's state sits
below that module, so the port it holds must too.

Error counters move with the node's time: a fault sets a rate per minute from now on, and a counter
clamps at its width's maximum as the real PMA counters do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from detector.backends.infiniband import COUNTER_BITS, counter_max

CONNECTX7_BOARD = "MT_0000000838"    # the PSID an HGX H100 node's ConnectX-7 rails report (SOURCE.md)


@dataclass
class FakeIbPort:
    """One HCA port. `rate_gbps`/`width`: what it trains at when healthy; `trained_gbps`: a degraded rate."""

    device: str
    port: int = 1
    link_layer: str = "InfiniBand"
    rate_gbps: float = 400.0
    width: int = 4
    board_id: str = CONNECTX7_BOARD
    state: int = 4                   # ACTIVE
    phys_state: int = 5              # LinkUp
    trained_gbps: float | None = None
    present: bool = True             # False: gone from sysfs (the HCA fell off the bus, its driver unloaded)
    counters: dict[str, int] = field(default_factory=dict)       # values at `rising_since_s`
    rising: dict[str, float] = field(default_factory=dict)       # counter -> increase per minute
    rising_since_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    def counter(self, name: str, elapsed_s: float) -> int:
        """The counter now: its base plus what its rate added since, clamped at the maximum."""
        grown = self.rising.get(name, 0.0) * max(elapsed_s - self.rising_since_s, 0.0) / 60
        return min(int(self.counters.get(name, 0) + grown), counter_max(name))

    def settle(self, elapsed_s: float) -> None:
        """Fold what the counters grew to into their base, before their rates change."""
        self.counters = {name: self.counter(name, elapsed_s) for name in COUNTER_BITS}
        self.rising_since_s = elapsed_s


def fake_ports(count: int, rate_gbps: float = 400.0, link_layer: str = "InfiniBand", width: int = 4,
               board_id: str = CONNECTX7_BOARD) -> list[FakeIbPort]:
    """`count` single-port HCAs mlx5_0 ... as an HGX node has one per GPU."""
    return [FakeIbPort(f"mlx5_{i}", 1, link_layer, float(rate_gbps), width, board_id) for i in range(count)]


def ports_from_dicts(items: list[dict[str, Any]]) -> list[FakeIbPort]:
    """NodeState.from_dict's loader for `ib_ports`."""
    return [FakeIbPort(**item) for item in items]
