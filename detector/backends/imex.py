"""The node's IMEX (Internode Memory Exchange) daemon as `nvidia-imex-ctl` reports it, and whether the host is
set up to run one. IMEX brokers GPU memory across the trays of a multi-node NVLink domain (GB200/GB300 NVL72);
it has no business on a node outside such a domain, so what it says only matters where it is meant to run.

What this reads, and where the facts come from (sources kept in tests/fixtures/imex/SOURCE.md):
- `nvidia-imex-ctl -q`: one word, the local daemon's state. The states NVIDIA's DCGM enumerates for it
  (dcgm_fields.h, DCGM_FI_IMEX_DAEMON_STATUS): INITIALIZING, STARTING_AUTH_SERVER, WAITING_FOR_PEERS,
  WAITING_FOR_RECOVERY, INIT_GPU, READY, SHUTTING_DOWN, UNAVAILABLE. When the node has no nodes config the
  tool prints "Failed to read node configuration file" (DCGM's DcgmImexManager) and exits 255. It exits
  non-zero when the daemon is not ready (the DRA driver's compute-domain daemon uses that as its probe).
- `nvidia-imex-ctl -N -j`: the domain as JSON: top-level `status` (UP, DOWN, DEGRADED) and `nodes`, keyed by
  node index, each with `status` (READY, UNAVAILABLE ...), `host` (its address), `hostName`, `version` and
  `connections` (index -> {host, status: CONNECTED, INVALID ...}). Every configured member has an entry, also
  those whose daemon is down (then UNAVAILABLE with INVALID connections, reconstructed from the nodes config).
  This node's entry is the one whose host is one of this machine's addresses.
- The host service: the nvidia-imex systemd unit enabled (a symlink in an /etc/systemd/system/*.wants
  folder) and /etc/nvidia-imex/config.cfg, whose IMEX_NODE_CONFIG_FILE names the nodes config (default
  /etc/nvidia-imex/nodes_config.cfg): one peer address per line.

Every command runs as an argument list (no shell), in its own session, with a timeout and a cap on what is
kept of its output: a hung nvidia-imex-ctl (seen with the DRA driver, kubernetes-sigs/dra-driver-nvidia-gpu
#1417) is reported "unresponsive", never waited on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from detector.backends.children import ToolOutcome, run_tool

DAEMON_STATES = ("INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY", "INIT_GPU",
                 "READY", "SHUTTING_DOWN", "UNAVAILABLE")
DOMAIN_STATES = ("UP", "DOWN", "DEGRADED")
NOT_CONFIGURED_TEXT = "Failed to read node configuration file"
UNIT = "nvidia-imex.service"
CONFIG_FILE = "etc/nvidia-imex/config.cfg"
DEFAULT_NODES_CONFIG = "/etc/nvidia-imex/nodes_config.cfg"
OUTPUT_CAP = 1 << 20          # bytes kept of a command's stdout (and of its stderr): -N -j of 18 trays is ~10 KiB
CONFIG_CAP = 256 << 10        # bytes read of a config file


class ImexParseError(ValueError):
    """nvidia-imex-ctl's output is not what its format promises: says which command, where and what."""


CtlOutcome = ToolOutcome


class CtlRunner(Protocol):
    def run(self, args: list[str], timeout_s: float) -> CtlOutcome: ...


@dataclass(frozen=True)
class ImexPeer:
    index: str                   # the node index IMEX gives it (its line in the nodes config)
    host: str                    # its address
    node_state: str              # its daemon's state as the domain sees it: READY, UNAVAILABLE ...
    connection: str | None       # this node's connection to it: CONNECTED, INVALID ...; None: not known

    @property
    def reachable(self) -> bool:
        return self.node_state == "READY" and self.connection in (None, "CONNECTED")

    def describe(self) -> str:
        why = [s for s in (self.node_state if self.node_state != "READY" else "",
                           self.connection if self.connection not in (None, "CONNECTED") else "") if s]
        return f"{self.host or '?'} (node {self.index}: {', '.join(why) or 'unreachable'})"


@dataclass(frozen=True)
class ImexDomain:
    """`nvidia-imex-ctl -N -j`, parsed."""

    state: str                              # UP, DOWN, DEGRADED (or what the tool printed)
    local_index: str | None                 # this node's index; None: not found among the members
    local_state: str | None
    peers: tuple[ImexPeer, ...]             # every other member


@dataclass(frozen=True)
class ImexService:
    """Whether the host is set up to run IMEX as a service. None where it cannot be read from here."""

    unit_enabled: bool | None = None
    nodes_config: str | None = None         # the nodes config's path (on the host)
    nodes: int | None = None                # addresses it lists (this node's among them); None: unreadable
    errors: tuple[str, ...] = ()

    @property
    def configured(self) -> bool | None:
        """Enabled with a nodes config that lists someone: the host means to run IMEX."""
        if self.unit_enabled is False or self.nodes == 0:
            return False
        if self.unit_enabled is None or self.nodes is None:
            return None
        return True


@dataclass(frozen=True)
class ImexStatus:
    """What nvidia-imex-ctl says now."""

    daemon_state: str           # a DAEMON_STATES word, or: not_running, not_configured, unresponsive, not_installed,
                                # unavailable_here (the host has the tool, gpu-npd cannot run it), error
    detail: str = ""            # what the tool said (its first line), or why it could not be asked
    domain: ImexDomain | None = None
    domain_error: str = ""      # why -N -j gave no domain


@dataclass(frozen=True)
class ImexReading:
    service: ImexService
    status: ImexStatus
    errors: tuple[str, ...] = field(default_factory=tuple)


class ImexReader(Protocol):
    def read(self, timeout_s: float, command: list[str]) -> ImexReading:
        """`command`: how to run nvidia-imex-ctl here (the check's setting); each call gets `timeout_s`."""


# -- parsers (pure, tested on real and documented text) ----------------------------------------------


def parse_query(outcome: CtlOutcome) -> ImexStatus:
    """`nvidia-imex-ctl -q` -> the daemon's state."""
    if outcome.status == "timeout":
        return ImexStatus("unresponsive", outcome.detail)
    if outcome.status == "not_found":
        return ImexStatus("not_installed", outcome.detail)
    if outcome.status != "ok":
        return ImexStatus("error", outcome.detail)
    text = f"{outcome.stdout}\n{outcome.stderr}"
    first = _first_line(outcome.stdout) or _first_line(outcome.stderr)
    if NOT_CONFIGURED_TEXT in text:
        return ImexStatus("not_configured", first)
    word = outcome.stdout.strip().upper()
    if word in DAEMON_STATES:
        return ImexStatus(word, f"nvidia-imex-ctl -q exit status {outcome.returncode}")
    if outcome.returncode:
        return ImexStatus("not_running", f"exit status {outcome.returncode}: {first or 'no output'}")
    return ImexStatus("error", f"nvidia-imex-ctl -q printed no daemon state: {first or 'nothing'!r}")


def parse_domain(text: str, local_addresses: set[str]) -> ImexDomain:
    """`nvidia-imex-ctl -N -j` -> the domain. Raises ImexParseError naming the line, field and what was expected."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ImexParseError(f"nvidia-imex-ctl -N -j: line {e.lineno} column {e.colno}: not JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ImexParseError(f"nvidia-imex-ctl -N -j: expected a JSON object, got {type(data).__name__}")
    state = data.get("status")
    if not isinstance(state, str) or not state:
        raise ImexParseError("nvidia-imex-ctl -N -j: field 'status': expected the domain's state (UP, DOWN, DEGRADED)")
    nodes = data.get("nodes", {})
    if not isinstance(nodes, dict):
        raise ImexParseError(f"nvidia-imex-ctl -N -j: field 'nodes': expected an object keyed by node index, "
                             f"got {type(nodes).__name__}")
    members: dict[str, dict] = {}
    for index, node in nodes.items():
        if not isinstance(node, dict):
            raise ImexParseError(f"nvidia-imex-ctl -N -j: field 'nodes.{index}': expected an object, "
                                 f"got {type(node).__name__}")
        members[str(index)] = node
    local = next((i for i, n in members.items()
                  if n.get("host") in local_addresses or (n.get("hostName") or None) in local_addresses), None)
    connections = members[local].get("connections") if local is not None else None
    by_host = {}
    if isinstance(connections, dict):
        by_host = {c.get("host"): str(c.get("status", "")) for c in connections.values() if isinstance(c, dict)}
    peers = tuple(
        ImexPeer(index, str(node.get("host", "")), str(node.get("status", "")),
                 by_host.get(node.get("host"), "MISSING" if local is not None else None))
        for index, node in sorted(members.items(), key=lambda item: _index_key(item[0])) if index != local)
    local_state = str(members[local].get("status", "")) if local is not None else None
    return ImexDomain(state.upper(), local, local_state, peers)


def parse_nodes_config(text: str) -> list[str]:
    """A nodes config: one address (or host name) per line; blank lines and # comments skipped."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def parse_config_value(text: str, key: str) -> str | None:
    """KEY=value of /etc/nvidia-imex/config.cfg (the last one wins, as in a shell-style file)."""
    value = None
    for line in text.splitlines():
        name, sep, rest = line.strip().partition("=")
        if sep and name.strip() == key:
            value = rest.strip().strip('"')
    return value


def parse_local_addresses(fib_trie: str) -> set[str]:
    """This machine's own IPv4 addresses from /proc/net/fib_trie: the address above each `/32 host LOCAL`."""
    addresses, last = set(), None
    for line in fib_trie.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped == "/32 host LOCAL" and last:
            addresses.add(last)
    return addresses - {"127.0.0.1"}


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]


def _index_key(index: str) -> tuple[int, str]:
    return (int(index), "") if index.isdigit() else (1 << 30, index)


# -- running the tool -----------------------------------------------------------------------------


class SubprocessCtl:
    """nvidia-imex-ctl (or a stand-in) run with an argument list, in its own session, output capped."""

    def __init__(self, command: list[str]):
        self.command = list(command)

    def run(self, args: list[str], timeout_s: float) -> CtlOutcome:
        outcome = run_tool([*self.command, *args], timeout_s, OUTPUT_CAP)
        if outcome.status == "timeout":      # say which query hung: -q or -N -j
            return CtlOutcome("timeout", detail=f"{self.command[0]} {' '.join(args)} did not finish within "
                                                f"{timeout_s:g}s")
        return outcome


def query(runner: CtlRunner, timeout_s: float, local_addresses: set[str]) -> ImexStatus:
    """Ask the daemon its state, then (where it answered at all) the domain. Each call has its own timeout."""
    status = parse_query(runner.run(["-q"], timeout_s))
    if status.daemon_state in ("unresponsive", "not_installed", "not_configured", "error"):
        return status
    outcome = runner.run(["-N", "-j"], timeout_s)
    if outcome.status != "ok":
        return ImexStatus(status.daemon_state, status.detail, None, f"nvidia-imex-ctl -N -j: {outcome.detail}")
    if NOT_CONFIGURED_TEXT in outcome.stdout + outcome.stderr:
        return ImexStatus(status.daemon_state, status.detail, None, f"nvidia-imex-ctl -N -j: {NOT_CONFIGURED_TEXT}")
    try:
        domain = parse_domain(outcome.stdout, local_addresses)
    except ImexParseError as e:
        return ImexStatus(status.daemon_state, status.detail, None, str(e))
    return ImexStatus(status.daemon_state, status.detail, domain)


# -- the host's IMEX service ------------------------------------------------------------------------


def read_service(host_root: Path) -> ImexService:
    """The host service's intent under `host_root` (/ on the host, /host in the DaemonSet)."""
    errors: list[str] = []
    systemd = host_root / "etc" / "systemd" / "system"
    enabled: bool | None
    try:
        wants = [d for d in systemd.iterdir() if d.name.endswith(".wants")]
        enabled = any(os.path.lexists(d / UNIT) for d in wants)
    except FileNotFoundError:
        enabled = False if (host_root / "etc").is_dir() else None
    except OSError as e:
        errors.append(f"{systemd}: {e.strerror or e}")
        enabled = None
    config_text = _read(host_root / CONFIG_FILE, errors)
    path = (parse_config_value(config_text, "IMEX_NODE_CONFIG_FILE") if config_text else None) or DEFAULT_NODES_CONFIG
    nodes: int | None
    nodes_path = host_root / path.lstrip("/")
    if not nodes_path.exists():
        nodes = 0 if (host_root / "etc").is_dir() else None
    else:
        text = _read(nodes_path, errors)
        nodes = len(parse_nodes_config(text)) if text is not None else None
    return ImexService(enabled, path, nodes, tuple(errors))


def _read(path: Path, errors: list[str]) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(CONFIG_CAP).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        errors.append(f"{path}: {e.strerror or e}")
        return None


class HostImex:
    """The real reader: the host's service files under `host_root`, the tool run by `runner(command)`, this
    machine's addresses from the host's /proc/net/fib_trie."""

    def __init__(self, host_root: Path, runner: Callable[[list[str]], CtlRunner] = SubprocessCtl,
                 tool_paths: tuple[str, ...] = ("usr/bin/nvidia-imex-ctl", "usr/sbin/nvidia-imex-ctl")):
        self.host_root, self._runner, self._tool_paths = host_root, runner, tool_paths

    def read(self, timeout_s: float, command: list[str]) -> ImexReading:
        service = read_service(self.host_root)
        errors: list[str] = []
        fib = _read(self.host_root / "proc" / "net" / "fib_trie", errors)
        status = query(self._runner(command), timeout_s, parse_local_addresses(fib or ""))
        if status.daemon_state == "not_installed" and self.host_root != Path("/") \
                and any((self.host_root / p).exists() for p in self._tool_paths):
            status = ImexStatus("unavailable_here", "the host has nvidia-imex-ctl, gpu-npd's container does not: "
                                                    "set checks.imex.command to reach it")
        return ImexReading(service, status, tuple(errors) + service.errors)


def host_imex(sysfs_root: Path | None) -> HostImex:
    """The IMEX reader for this machine: its host root beside the sysfs root, as for the plumbing reader
    (detector/backends/system.py): --sysfs-root /host/sys reads /host/etc and /host/proc."""
    host = sysfs_root.parent if sysfs_root is not None and sysfs_root.name == "sys" else Path("/")
    return HostImex(host)
