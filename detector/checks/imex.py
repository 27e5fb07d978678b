"""IMEX where it is used, and only there: the node's IMEX daemon and its connections to its peers, judged only
when the node is meant to run IMEX.

Why "only there": IMEX brokers GPU memory across the trays of a multi-node NVLink domain. An idle GB200/GB300
tray with no ComputeDomain, or a single-node system, runs no IMEX daemon on purpose, and `nvidia-imex-ctl`
then says it is not READY. DCGM's IMEX health watch and NVSentinel on top of it judged that answer alone and
held healthy nodes unhealthy (NVIDIA/NVSentinel #1471, NVIDIA/DCGM #308: see rules/imex.yaml). This check
first decides whether IMEX is meant to run here, from signals that say so on purpose:
- Kubernetes: the NVIDIA DRA driver's compute-domain kubelet plugin labels the node
  `resource.nvidia.com/computeDomain=<ComputeDomain UID>` while a ComputeDomain's channel is prepared on it
  (its ComputeDomainManager.AddNodeLabel), and the ComputeDomain's IMEX daemon pods run on the nodes that
  carry it. Read from the node's labels (NodeStatus), so no pod or ResourceClaim list is needed.
- The host: the nvidia-imex systemd unit enabled and a nodes config that lists addresses
  (detector/backends/imex.py, read_service).
- The site's word: the `expected` setting (true/false) where neither can be read (no host /etc mounted,
  IMEX run by a scheduler such as Slurm).
Not expected: nothing is raised, whatever the tool says (the observation still shows it). Unknown: nothing is
raised either (a null never matches).

Expected: a daemon that does not run (the tool cannot reach it, or says UNAVAILABLE) is down at once; one in
a start-up state (INITIALIZING ... WAITING_FOR_PEERS, or a tool that hangs) is down once seen so for
`startup_grace` seconds; a domain DOWN, or peers this node cannot reach, count once they last `debounce`
seconds (a rack's trays boot and restart their daemons at different times). Verdicts: rules/imex.yaml.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from detector.backends.imex import UNIT, ImexReading, ImexService, ImexStatus
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.nodestatus import NodeStatus
from detector.core.sweep import SweepContext
from detector.core.types import Observation

COMPUTE_DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
DOWN_AT_ONCE = frozenset({"not_running", "UNAVAILABLE"})
STARTING = frozenset({"INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY", "INIT_GPU",
                      "SHUTTING_DOWN", "unresponsive", "error"})
CANNOT_ASK = frozenset({"not_installed", "unavailable_here", "not_configured"})   # the tool cannot tell from here


class ImexCheck(Check):
    """One node observation: whether IMEX is meant to run here and why, and the daemon, domain and peers."""

    name = "imex"
    description = ("IMEX daemon and peer connections (multi-node NVLink, GB200/GB300 NVL72), judged only where IMEX "
                   "is meant to run: a ComputeDomain on the node or the host's IMEX service set up")
    fields = {
        "imex_expected": "true when IMEX is meant to run here (a ComputeDomain label or the host service enabled "
                         "with a nodes config, or the expected setting), false when it is not, null: unknown",
        "expected_why": "what imex_expected rests on",
        "daemon_state": "nvidia-imex-ctl -q: READY, INITIALIZING ... UNAVAILABLE; or not_running (the tool could "
                        "not reach a daemon), not_configured (no nodes config), unresponsive (timed out), "
                        "not_installed, unavailable_here (the host has the tool, gpu-npd cannot run it), error",
        "daemon_detail": "what the tool said, or why it could not be asked",
        "daemon_not_ready_s": "seconds this check has seen the daemon not READY (0 when READY)",
        "daemon_down": "true when IMEX is expected and the daemon does not run, or has not been READY for "
                       "startup_grace seconds; null when it cannot be told from here",
        "ctl_missing": "true when the host service is set up but the host has no nvidia-imex-ctl",
        "domain_state": "nvidia-imex-ctl -N -j: UP, DEGRADED or DOWN (null: not read)",
        "domain_error": "why the domain could not be read ('' when it was)",
        "node_index": "this node's index in the IMEX domain (null: not found among its members)",
        "peers": "the other members of the IMEX domain",
        "peers_unreachable": "peers that are not READY or that this node is not CONNECTED to",
        "unreachable_peers": "those peers: address (node index: state)",
        "peers_unreachable_s": "seconds this check has seen peers unreachable (0 when none)",
        "peers_unreachable_held": "true when peers stayed unreachable for the debounce setting's seconds",
        "domain_down_held": "true when the domain has read DOWN for the debounce setting's seconds",
        "debounce_s": "the debounce setting",
    }
    config_fields = {
        "command": ConfigField(list, ["nvidia-imex-ctl"], "how to run nvidia-imex-ctl (an argument list, no shell; "
                               "e.g. [chroot, /host, nvidia-imex-ctl] where the host's tool is not in the image)"),
        "call_timeout": ConfigField(float, 5.0, "seconds each nvidia-imex-ctl call may take before it counts as "
                                    "unresponsive"),
        "expected": ConfigField(str, "auto", "auto (from the node's ComputeDomain label and the host service), "
                                "true or false: whether IMEX is meant to run on the node"),
        "debounce": ConfigField(float, 120.0, "seconds a DOWN domain or unreachable peers must last before they "
                                "count"),
        "startup_grace": ConfigField(float, 300.0, "seconds a daemon may stay in a start-up state (or the tool "
                                     "hang) before it counts as down"),
    }
    gauges = {
        "gpu_npd_imex_peers_unreachable": GaugeSpec("peers_unreachable", "IMEX peers this node cannot reach",
                                                    absent_when_null=True),
    }
    default_interval_s = 60.0
    default_timeout_s = 15.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        if self.config["expected"] not in ("auto", "true", "false"):
            raise ValueError(f"check 'imex': expected must be auto, true or false, got {self.config['expected']!r}")
        command = self.config["command"]
        if not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"check 'imex': command must be a non-empty list of strings, got {command!r}")
        self._not_ready_since: float | None = None
        self._unreachable_since: float | None = None
        self._domain_down_since: float | None = None

    def run(self, ctx: SweepContext) -> CheckOutput:
        reader = ctx.host.imex
        if reader is None:
            fields = _blank("no IMEX reader here (a saved capture has no IMEX)")
            return CheckOutput([Observation(self.name, fields)], {"node": fields}, summary="not applicable: no IMEX "
                               "reader (a replay)")
        reading: ImexReading = reader.read(float(self.config["call_timeout"]), list(self.config["command"]))
        expected, why, source = self._intent(ctx.host.node_status(), reading.service)
        fields = self._judge(reading.status, expected, why, source, reading.service)
        errors = "; ".join(reading.errors)
        return CheckOutput([Observation(self.name, fields)], {"node": fields}, summary=_summary(fields), error=errors)

    def _intent(self, status: NodeStatus | None, service: ImexService) -> tuple[bool | None, str, str]:
        setting = self.config["expected"]
        if setting != "auto":
            return setting == "true", f"the imex check's expected setting is {setting}", "setting"
        domain = (status.labels.get(COMPUTE_DOMAIN_LABEL) if status is not None else None) or ""
        if domain:
            return True, f"ComputeDomain {domain} on the node (node label {COMPUTE_DOMAIN_LABEL})", "kubernetes"
        if service.configured:
            return True, f"host service {UNIT} enabled with {service.nodes} node(s) in {service.nodes_config}", "host"
        cluster = "no ComputeDomain label" if status is not None else "no cluster view (no ComputeDomain known)"
        if service.configured is False:
            host = (f"{UNIT} not enabled" if service.unit_enabled is False
                    else f"no nodes listed in {service.nodes_config}")
            return False, f"{cluster} and no host IMEX service ({host})", ""
        return None, f"{cluster}; the host's IMEX service files cannot be read here", ""

    def _judge(self, status: ImexStatus, expected: bool | None, why: str, source: str,
               service: ImexService) -> dict[str, Any]:
        now, state = self._clock(), status.daemon_state
        debounce, grace = float(self.config["debounce"]), float(self.config["startup_grace"])
        ready = state == "READY"
        self._not_ready_since = None if ready else (self._not_ready_since if self._not_ready_since is not None
                                                    else now)
        not_ready_s = 0.0 if ready else round(now - (self._not_ready_since or now), 1)
        daemon_down: bool | None
        if not expected:
            daemon_down = None if expected is None else False
        elif ready:
            daemon_down = False
        elif state in CANNOT_ASK and not (source == "host" and state == "not_configured"):
            daemon_down = None
        elif state in DOWN_AT_ONCE or state == "not_configured":
            daemon_down = True
        else:
            daemon_down = not_ready_s >= grace
        domain = status.domain
        unreachable = [p for p in domain.peers if not p.reachable] if domain is not None and ready else []
        self._unreachable_since = (self._unreachable_since if self._unreachable_since is not None else now) \
            if unreachable else None
        unreachable_s = round(now - self._unreachable_since, 1) if self._unreachable_since is not None else 0.0
        domain_down = domain is not None and ready and domain.state == "DOWN"
        self._domain_down_since = (self._domain_down_since if self._domain_down_since is not None else now) \
            if domain_down else None
        domain_down_s = now - self._domain_down_since if self._domain_down_since is not None else 0.0
        return {
            "imex_expected": expected,
            "expected_why": why,
            "daemon_state": state,
            "daemon_detail": status.detail,
            "daemon_not_ready_s": not_ready_s,
            "daemon_down": daemon_down,
            "ctl_missing": bool(expected) and source == "host" and state == "not_installed",
            "domain_state": domain.state if domain is not None else None,
            "domain_error": status.domain_error,
            "node_index": int(domain.local_index) if domain is not None and (domain.local_index or "").isdigit()
            else None,
            "peers": len(domain.peers) if domain is not None else None,
            "peers_unreachable": len(unreachable) if domain is not None and ready else None,
            "unreachable_peers": ", ".join(p.describe() for p in unreachable),
            "peers_unreachable_s": unreachable_s,
            "peers_unreachable_held": bool(unreachable) and unreachable_s >= debounce,
            "domain_down_held": domain_down and domain_down_s >= debounce,
            "debounce_s": debounce,
        }


def _blank(why: str) -> dict[str, Any]:
    return {"imex_expected": None, "expected_why": why, "daemon_state": None, "daemon_detail": "",
            "daemon_not_ready_s": None, "daemon_down": None, "ctl_missing": False, "domain_state": None,
            "domain_error": "", "node_index": None, "peers": None, "peers_unreachable": None, "unreachable_peers": "",
            "peers_unreachable_s": None, "peers_unreachable_held": False, "domain_down_held": False,
            "debounce_s": None}


def _summary(f: dict[str, Any]) -> str:
    if f["imex_expected"] is False:
        return f"not expected here ({f['expected_why']}); daemon: {f['daemon_state']}"
    head = "expected" if f["imex_expected"] else "expected: unknown"
    domain = f", domain {f['domain_state']}" if f["domain_state"] else ""
    peers = (f", {f['peers_unreachable']} of {f['peers']} peer(s) unreachable" if f["peers_unreachable"]
             else f", {f['peers']} peer(s) connected" if f["peers"] is not None and f["daemon_state"] == "READY" else "")
    return f"{head} ({f['expected_why']}); daemon {f['daemon_state']}{domain}{peers}"
