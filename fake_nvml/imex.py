"""The fake node's IMEX: whether the host service is set up (unit enabled, a nodes config listing the tray and
its peers), what `nvidia-imex-ctl -q` and `-N -j` print in that state (the shapes documented in
detector/backends/imex.py and kept in tests/fixtures/imex/), a reader that runs that fake tool through the
real parsers, a writer that lays the service files out so the real host reader can be tested on the fake's
tree, the IMEX faults and how `recover`/`reboot` heal them.

Modelled on what is documented of the real tool: with no nodes config it prints "Failed to read node
configuration file" and exits 255; a daemon that is not READY makes `-q` exit 1; `-N -j` lists every
configured member, and a member whose daemon is down reads UNAVAILABLE with INVALID connections.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from detector.backends.imex import (CtlOutcome, ImexReading, ImexService, ImexStatus, NOT_CONFIGURED_TEXT, UNIT,
                                    query)
from fake_nvml.fault_kind import FaultArgs, FaultKind, set_field
from fake_nvml.node import FakeGpu, FakeNode, NodeState

NODES_CONFIG = "/etc/nvidia-imex/nodes_config.cfg"
TIMESTAMP = "9/4/2026 00:37:39.905"


def configure(state: NodeState, peers: int, installed: bool = True, enabled: bool = True,
              managed_by: str = "host") -> None:
    """Set the node up as an NVL72 tray's IMEX member: its own address and `peers` others (the rack's trays).
    managed_by host: the nvidia-imex unit enabled with a nodes config; compute_domain: a ComputeDomain's daemon
    pod runs IMEX with its own config, and the host's unit stays disabled (the DRA driver's default)."""
    state.imex_installed = installed
    state.imex_service_enabled = enabled and installed and managed_by == "host"
    state.imex_nodes = [f"10.114.{i // 250}.{10 + i % 250}" for i in range(peers + 1)] if enabled else []


def configured(state: NodeState) -> bool:
    """A daemon with a nodes config runs: the host's service, or a ComputeDomain's pod."""
    return bool(state.imex_nodes)


def ctl(state: NodeState, args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `nvidia-imex-ctl ARGS` on the node."""
    if not configured(state):
        return 255, "", f"{NOT_CONFIGURED_TEXT} {NODES_CONFIG}\n"
    if args == ["-q"]:
        return (0 if state.imex_daemon == "READY" else 1), f"{state.imex_daemon}\n", ""
    if args == ["-N", "-j"]:
        return 0, json.dumps(_domain(state), indent=1) + "\n", ""
    return 1, "", f"fake nvidia-imex-ctl: unsupported arguments {' '.join(args)}\n"


def _domain(state: NodeState) -> dict:
    local_up = state.imex_daemon == "READY"
    nodes = {}
    def up(i: int) -> bool:          # a local daemon that is down reaches no one: all read UNAVAILABLE
        return local_up and i not in state.imex_unreachable

    for i, host in enumerate(state.imex_nodes):
        connections = {}
        for j, other in enumerate(state.imex_nodes):
            connections[str(j)] = {"host": other, "status": "CONNECTED" if up(i) and up(j) else "INVALID",
                                   "changed": True}
        nodes[str(i)] = {"status": "READY" if up(i) else "UNAVAILABLE", "host": host, "connections": connections,
                         "changed": True, "version": state.driver_version, "hostName": ""}
    ready = sum(n["status"] == "READY" for n in nodes.values())
    domain = "UP" if ready == len(nodes) else "DOWN" if not local_up or ready <= len(nodes) // 2 else "DEGRADED"
    return {"nodes": nodes, "timestamp": TIMESTAMP, "status": domain}


def service(state: NodeState) -> ImexService:
    return ImexService(state.imex_service_enabled, NODES_CONFIG,
                       len(state.imex_nodes) if state.imex_service_enabled else 0)


class _InProcessCtl:
    def __init__(self, state: NodeState, sleep: Callable[[float], None]):
        self.state, self._sleep = state, sleep

    def run(self, args: list[str], timeout_s: float) -> CtlOutcome:
        if not self.state.imex_installed:
            return CtlOutcome("not_found", detail="nvidia-imex-ctl not found")
        if self.state.imex_hang_s > 0:
            self._sleep(min(self.state.imex_hang_s, timeout_s))
            if self.state.imex_hang_s >= timeout_s:
                return CtlOutcome("timeout", detail=f"nvidia-imex-ctl {' '.join(args)} did not finish within "
                                                    f"{timeout_s:g}s")
        code, out, err = ctl(self.state, args)
        return CtlOutcome("ok", code, out, err)


class FakeImex:
    """An IMEX reader over the fake node: its fake tool, through the real parsers. The command setting is
    not used (there is no process)."""

    def __init__(self, node: FakeNode, sleep: Callable[[float], None] = time.sleep):
        self.node, self._sleep = node, sleep

    def read(self, timeout_s: float, command: list[str]) -> ImexReading:
        state = self.node.snapshot()
        local = {state.imex_nodes[0]} if state.imex_nodes else set()
        status: ImexStatus = query(_InProcessCtl(state, self._sleep), timeout_s, local)
        return ImexReading(service(state), status)


def fake_imex(node: FakeNode, sleep: Callable[[float], None] = time.sleep) -> FakeImex:
    return FakeImex(node, sleep)


def write_imex(state: NodeState, root: Path) -> None:
    """Lay the host service out under `root` as the real reader expects it: the unit's wants symlink,
    /etc/nvidia-imex/config.cfg naming the nodes config, the nodes config, and /proc/net/fib_trie."""
    etc = root / "etc"
    (etc / "systemd" / "system" / "multi-user.target.wants").mkdir(parents=True, exist_ok=True)
    if state.imex_service_enabled:
        (etc / "systemd" / "system" / "multi-user.target.wants" / UNIT).symlink_to(f"/lib/systemd/system/{UNIT}")
    if state.imex_installed:
        (etc / "nvidia-imex").mkdir(parents=True, exist_ok=True)
        (etc / "nvidia-imex" / "config.cfg").write_text(
            f"# fake node {state.name}\nIMEX_CMD_ENABLED=1\nIMEX_CMD_PORT=50005\nIMEX_NODE_CONFIG_FILE={NODES_CONFIG}\n")
        if state.imex_nodes and state.imex_service_enabled:
            (root / NODES_CONFIG.lstrip("/")).write_text("".join(f"{a}\n" for a in state.imex_nodes))
    own = state.imex_nodes[0] if state.imex_nodes else "10.0.0.5"
    net = root / "proc" / "net"
    net.mkdir(parents=True, exist_ok=True)
    (net / "fib_trie").write_text(f"Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- {own}\n        /32 host LOCAL\n"
                                  f"     |-- 127.0.0.1\n        /32 host LOCAL\n")


# -- faults (declared in FAULTS below) -------------------------------------------------------------


def imex_down(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The local daemon leaves READY: every peer then reads it UNAVAILABLE, and it reaches none of them."""
    state.imex_daemon = f.params.get("state", "UNAVAILABLE")


def imex_peers_unreachable(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    peers = max(len(state.imex_nodes) - 1, 0)
    count = f.params.get("count", peers)
    if not 0 <= count <= peers:
        raise ValueError(f"fault 'imex_peers_unreachable': count must be 0 to {peers} (the node's IMEX peers), "
                         f"got {count}")
    state.imex_unreachable = sorted(set(state.imex_unreachable) | set(range(1, count + 1)))


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A node repair or reboot restarts the IMEX daemon; peers come back with it (a rack back whole)."""
    if whole_node:
        state.imex_daemon, state.imex_unreachable, state.imex_hang_s = "READY", [], 0.0


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("imex_down", False, {"state": str}, (), imex_down,
              "the node's IMEX daemon is not READY (state: what nvidia-imex-ctl -q says, default UNAVAILABLE)"),
    FaultKind("imex_peers_unreachable", False, {"count": int}, (), imex_peers_unreachable,
              "this many IMEX peers (default all) are UNAVAILABLE and not connected"),
    FaultKind("imex_hang", False, {"seconds": float}, ("seconds",), set_field("imex_hang_s", "seconds"),
              "nvidia-imex-ctl blocks for this long"),
)
