"""InfiniBand / RoCE ports: state, physical state and rate against what is expected, and the error
counters as rates over a window. Facts only; rules/infiniband.yaml says what they mean."""

from __future__ import annotations

import time
from fnmatch import fnmatch
from typing import Any, Callable, Mapping

from detector.backends.infiniband import COUNTER_BITS, IbPort, IbSnapshot, counter_max
from detector.checks.infiniband.expect import Expectations, port_name
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.rates import CounterWindow, Increase
from detector.core.sweep import SweepContext
from detector.core.types import Observation

COUNTERS = tuple(COUNTER_BITS)
COUNTER_HELP = {
    "link_downed": "times the link failed error recovery and went down (8-bit)",
    "link_error_recovery": "times the link retrained to recover from errors (8-bit)",
    "symbol_error": "minor link errors detected on the physical lanes (16-bit)",
    "port_rcv_errors": "packets received with errors (16-bit)",
    "port_xmit_discards": "outbound packets discarded: port down or congested (16-bit)",
    "local_link_integrity_errors": "times local physical errors exceeded their threshold (4-bit)",
    "excessive_buffer_overrun_errors": "times the receive buffer overran (4-bit)",
}
PHYS_MEANING = {
    1: "asleep", 2: "no link partner: the cable, transceiver or switch port is down or unplugged",
    3: "disabled by software or firmware", 4: "training the link", 5: "physical link up",
    6: "recovering from link errors", 7: "in a physical test mode",
}


def _fields() -> dict[str, str]:
    fields = {
        "scope": "port (one per InfiniBand/RoCE port) or node (the node's summary)",
        "device": "RDMA device name (mlx5_0)", "port": "port number on the device", "port_name": "device/port",
        "link_layer": "InfiniBand, Ethernet (RoCE) or Unknown", "board_id": "the HCA's part (PSID), e.g. MT_0000000838",
        "present": "false: an expected port is gone from /sys/class/infiniband",
        "expected": "true when the port should be ACTIVE (see expected_because)",
        "expected_because": "why the port should be up: named in settings, seen ACTIVE, or its peers ACTIVE",
        "state": "logical state: DOWN, INIT, ARMED, ACTIVE, ACTIVE_DEFER", "state_code": "4 = ACTIVE",
        "phys_state": "physical state: Polling, Disabled, LinkUp, LinkErrorRecovery ...",
        "phys_state_code": "5 = LinkUp", "phys_state_meaning": "what the physical state means, in words",
        "rate_gbps": "negotiated rate in Gb/s (meaningful only while ACTIVE)", "rate": "the rate as sysfs says it",
        "expected_rate_gbps": "the rate it should run at: the setting, or the fastest of its kind seen",
        "rate_window_s": "seconds the counter increases span (up to the window)",
        "saturated_counters": "counters stuck at their maximum (they clamp, not wrap): comma-separated, or empty",
        "read_error": "files of this port that could not be read or parsed, or empty",
        "applicable": "node: false when the node has no InfiniBand/RoCE port at all",
        "ports_present": "node: ports found", "ports_active": "node: ports ACTIVE",
        "ports_expected": "node: ports expected ACTIVE (named, learned or peer-inferred)",
        "expected_ports": "node: the expected_ports setting (0: not set)",
        "missing_ports": "node: expected ports not found, comma-separated",
        "down_ports": "node: expected ports present but not ACTIVE, comma-separated",
    }
    for name, meaning in COUNTER_HELP.items():
        fields[name] = f"{meaning}; raw value"
        fields[f"{name}_increase"] = f"{name} rise over the window (null until two readings, or saturated)"
        fields[f"{name}_per_min"] = f"{name} rise per minute over the window"
    return fields


class InfinibandCheck(Check):
    """One observation per port (no GPU: named by device and port) plus one for the node. Rates come from
    a CounterWindow the check keeps, timed by the reader's own clock."""

    name = "infiniband"
    description = "InfiniBand/RoCE ports: state, physical state and rate vs expected; error counter rates"
    fields = _fields()
    config_fields = {
        "window": ConfigField(float, 600.0, "seconds over which error counters are judged as rates"),
        "devices": ConfigField(str, "*", "glob of RDMA device names to watch (mlx5_*); others are ignored"),
        "expected_ports": ConfigField(int, 0, "ports that must be ACTIVE; 0 = learn them (named, seen ACTIVE, "
                                              "or ACTIVE on peer HCAs)"),
        "ports": ConfigField(list, [], "ports that must be present and ACTIVE, as device/port (mlx5_0/1)"),
        "expected_rate_gbps": ConfigField(float, 0.0, "rate every ACTIVE port must run at; 0 = the fastest "
                                                      "seen on ports of the same part and link layer"),
    }
    gauges = {
        "gpu_npd_ib_port_state": GaugeSpec("state_code", "InfiniBand/RoCE port state (4 = ACTIVE)",
                                           ("device", "port")),
        "gpu_npd_ib_port_phys_state": GaugeSpec("phys_state_code", "Port physical state (5 = LinkUp)",
                                                ("device", "port")),
        "gpu_npd_ib_port_rate_gbps": GaugeSpec("rate_gbps", "Negotiated port rate in Gb/s", ("device", "port")),
        **{f"gpu_npd_ib_{name}": GaugeSpec(name, f"Port counter {name}: {COUNTER_HELP[name]}", ("device", "port"))
           for name in ("link_downed", "symbol_error", "port_rcv_errors", "link_error_recovery")},
    }
    default_interval_s = 60.0
    default_timeout_s = 10.0
    needs_fresh_inventory = False          # reads no GPU at all

    def __init__(self, config: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        if self.config["window"] <= 0:
            raise ValueError("check 'infiniband': window must be a positive number of seconds")
        self.expect = Expectations(tuple(port_name(str(p)) for p in self.config["ports"]),
                                   float(self.config["expected_rate_gbps"]))
        self.window = CounterWindow(float(self.config["window"]))

    def run(self, ctx: SweepContext) -> CheckOutput:
        reader = ctx.host.infiniband
        if reader is None:
            node = {"scope": "node", "applicable": False, "ports_present": 0}
            return CheckOutput([Observation(self.name, node)], {"state": "unavailable", "ports": []},
                               "no InfiniBand reader on this host")
        snapshot: IbSnapshot = reader.read()
        ports = [p for p in snapshot.ports if fnmatch(p.device, self.config["devices"])]
        self.expect.learn(ports)
        observations = [self._observe(p, snapshot.taken_at) for p in ports]
        seen = {p.name for p in ports}
        missing = self.expect.missing(seen)
        observations += [self._missing(p) for p in missing]
        self.window.keep_only({(p.name, c) for p in ports for c in COUNTERS})
        node = self._node(observations)
        result = {"state": "ok" if node["applicable"] else "not_applicable",
                  "ports": [_port_result(o.fields) for o in observations]}
        errors = [f"{o.fields['port_name']}: {o.fields['read_error']}" for o in observations if o.fields["read_error"]]
        summary = _summary(node, observations)
        if snapshot.ports and not observations:
            summary = (f"{len(snapshot.ports)} port(s), none on a device matching devices "
                       f"{self.config['devices']!r} (not applicable)")
        return CheckOutput([*observations, Observation(self.name, node)], result, summary,
                           error="; ".join([*snapshot.errors, *errors]))

    def _observe(self, p: IbPort, now: float) -> Observation:
        why = self.expect.expected(p.name)
        fields: dict[str, Any] = {
            **_identity(p), "present": True, "expected": why is not None, "expected_because": why or "",
            "state": p.state, "state_code": p.state_code, "phys_state": p.phys_state,
            "phys_state_code": p.phys_state_code, "phys_state_meaning": PHYS_MEANING.get(p.phys_state_code or 0, ""),
            "rate_gbps": p.rate_gbps, "rate": p.rate, "expected_rate_gbps": self.expect.rate_gbps(p),
            "read_error": "; ".join(p.errors),
        }
        saturated, span = [], 0.0
        for name in COUNTERS:
            value = p.counters.get(name)
            fields[name] = value
            increase: Increase | None = None
            if value is not None:
                increase = self.window.add((p.name, name), value, now)
                if value >= counter_max(name):
                    saturated.append(name)
                    if increase is not None and increase.amount == 0:
                        increase = None        # stuck at the top the whole window: no rate can be told
            span = max(span, increase.seconds if increase else 0.0)
            fields[f"{name}_increase"] = int(increase.amount) if increase else None
            fields[f"{name}_per_min"] = round(increase.per_min(), 3) if increase else None
        fields["rate_window_s"] = round(span, 1)
        fields["saturated_counters"] = ",".join(saturated)
        return Observation(self.name, fields)

    def _missing(self, last: IbPort | str) -> Observation:
        name = last if isinstance(last, str) else last.name
        device, _, number = name.partition("/")
        known = last if isinstance(last, IbPort) else IbPort(device, int(number) if number.isdigit() else 0)
        fields: dict[str, Any] = {
            **_identity(known), "present": False, "expected": True, "expected_because": self.expect.expected(name),
            "state": None, "state_code": None, "phys_state": None, "phys_state_code": None, "phys_state_meaning": "",
            "rate_gbps": None, "rate": None, "expected_rate_gbps": self.expect.rate_gbps(known), "read_error": "",
            "rate_window_s": 0.0, "saturated_counters": "",
            **{k: None for c in COUNTERS for k in (c, f"{c}_increase", f"{c}_per_min")},
        }
        return Observation(self.name, fields)

    def _node(self, observations: list[Observation]) -> dict[str, Any]:
        present = [o.fields for o in observations if o.fields["present"]]
        return {
            "scope": "node", "applicable": bool(observations),
            "ports_present": len(present),
            "ports_active": sum(1 for f in present if f["state_code"] == 4),
            "ports_expected": sum(1 for o in observations if o.fields["expected"]),
            "expected_ports": int(self.config["expected_ports"]),
            "missing_ports": ",".join(o.fields["port_name"] for o in observations if not o.fields["present"]),
            "down_ports": ",".join(f["port_name"] for f in present if f["expected"] and f["state_code"] != 4),
        }


def _identity(p: IbPort) -> dict[str, Any]:
    return {"scope": "port", "device": p.device, "port": p.port, "port_name": p.name,
            "link_layer": p.link_layer, "board_id": p.board_id}


def _port_result(f: dict[str, Any]) -> dict[str, Any]:
    keys = ("port_name", "link_layer", "present", "expected", "state", "phys_state", "rate_gbps",
            "expected_rate_gbps", "rate_window_s", "saturated_counters", "read_error")
    return {**{k: f[k] for k in keys}, "counters": {c: f[c] for c in COUNTERS},
            "per_min": {c: f[f"{c}_per_min"] for c in COUNTERS}}


def _summary(node: dict[str, Any], observations: list[Observation]) -> str:
    if not node["applicable"]:
        return "no InfiniBand/RoCE ports on this node (not applicable)"
    parts = [f"{node['ports_present']} port(s), {node['ports_active']} ACTIVE"]
    ports = [o.fields for o in observations]
    down = [f"{f['port_name']} {f['state']}/{f['phys_state']}" for f in ports if f["present"] and f["state_code"] != 4]
    if down:
        parts.append("not ACTIVE: " + ", ".join(down))
    if node["missing_ports"]:
        parts.append("missing: " + node["missing_ports"].replace(",", ", "))
    slow = [f"{f['port_name']} {f['rate_gbps']:g} of {f['expected_rate_gbps']:g} Gb/s" for f in ports
            if f["state_code"] == 4 and f["expected_rate_gbps"] and (f["rate_gbps"] or 0) < f["expected_rate_gbps"]]
    if slow:
        parts.append("slow: " + ", ".join(slow))
    saturated = [f"{f['port_name']} {f['saturated_counters']}" for f in ports if f["saturated_counters"]]
    if saturated:
        parts.append("saturated counters: " + "; ".join(saturated))
    return "; ".join(parts)
