"""The node annotation that lists the node's unhealthy GPUs, for people and tools that read node objects.

    gpu-npd.io/unhealthy-gpus: '[{"index":3,"pciBusId":"0000:5d:00.0","uuid":"GPU-8fb2…","serial":"1650…",
                                  "state":"failed","action":"RESTART_BM","since":"2026-03-02T10:41:07Z"}]'
                                                                  (one line, no spaces)

One compact JSON object per GPU that is not healthy, sorted by index then bus id; no annotation at all
when every GPU is healthy. It rides in the same status PATCH as the node's conditions (conditions.py).
`since` is when the GPU entered its state, to the second, and moves only when the state does, so the
value changes only when a GPU's state, action or identity does: no PATCH per sweep. `serial` and `since`
came later than the other keys: readers (`gpu-npd fleet`, `read_unhealthy_gpus`) take values without them.

A GPU in a multi-node NVLink domain (GB200/GB300 NVL72) also carries what `gpu-npd fleet` needs to find
where a domain-wide fault started (core/domain_origin.py), and no more (the Node object is read by
everything that lists nodes):

    "clique":"6f1c2b4e-8d3a-4c59-9e27-0b5d7a1f3c88.1",
    "linkXid":{"xid":"149.37","code":149,"fatal":true,"link":14,"at":"2026-09-10T08:08:46Z"}

`clique` is the DRA driver's `nvidia.com/gpu.clique` text; `linkXid` the GPU's weightiest link-level XID
of this boot (an origin-class one over the downstream 145), about 90 characters.

A GPU whose incidents (the node check's: critical reset-, reboot- or replace-class problems) fell on two or
more distinct boots within the node check's flaky window carries `"boots":N` (about 10 characters), so
`gpu-npd fleet --flaky` finds the GPUs whose failures recur across reboots without reading every node's
history; a GPU whose incidents are all in one boot has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from detector.core.domain import key
from detector.core.gpu_health import HEALTHY, GpuHealth
from detector.core.nvlink_domain import LINK_DOWN, LINK_DOWN_TEXT, LinkXid, parse_clique
from detector.kube.stamps import parse_rfc3339, rfc3339

UNHEALTHY_GPUS = key("unhealthy-gpus")
# gpu-npd writes about 180 characters a GPU: 64 GPUs fit in 12 KiB. A longer value was planted (any pod
# that may patch a node may write it) and is not parsed.
MAX_VALUE = 16 << 10
RECURS = 2                       # distinct boots with an incident from which the annotation says `boots`
MAX_BOOTS = 10_000               # a count read back above this was not written by gpu-npd (it keeps 200 boots)


def unhealthy_gpus_annotation(health: Iterable[GpuHealth], before: str | None = None) -> str | None:
    """The annotation's value for these GPUs; None when none is unhealthy (the annotation goes).
    `before`, the value on the node, lends its serials to GPUs whose serial is not known now: a daemon
    restarted after a GPU fell off the bus cannot read that GPU's serial from NVML any more."""
    bad = sorted((h for h in health if h.state != HEALTHY),
                 key=lambda h: (h.gpu.index is None, h.gpu.index or 0, h.gpu.pci_bus_id or ""))
    if not bad:
        return None
    try:
        known = read_unhealthy_gpus(before)
    except ValueError:
        known = []
    return json.dumps([_entry(h, _serial(h, known), h.link_xid) for h in bad], separators=(",", ":"))


def _serial(h: GpuHealth, known: list["UnhealthyGpu"]) -> str:
    """Its serial, else the one written for the same board (same bus id, and the same UUID where both
    have one)."""
    if h.serial or not h.gpu.pci_bus_id:
        return h.serial
    return next((g.serial for g in known if g.serial and g.pci_bus_id == h.gpu.pci_bus_id
                 and (not g.uuid or not h.gpu.uuid or g.uuid == h.gpu.uuid)), "")


def _entry(h: GpuHealth, serial: str, link: LinkXid | None) -> dict[str, Any]:
    fields = {"index": h.gpu.index, "pciBusId": h.gpu.pci_bus_id, "uuid": h.gpu.uuid, "serial": serial,
              "state": h.state, "action": h.action, "since": rfc3339(h.since) if h.since is not None else None,
              "clique": h.clique, "linkXid": link_xid_dict(link) if link is not None else None,
              "boots": h.boots if h.boots >= RECURS else None}
    return {k: v for k, v in fields.items() if v not in (None, "")}      # an unknown id is left out


def link_xid_dict(x: LinkXid) -> dict[str, Any]:
    fields = {"xid": x.decoded, "code": x.code, "fatal": x.fatal, "link": x.link,
              "at": rfc3339(x.time) if x.time is not None else None}
    return {k: v for k, v in fields.items() if v is not None}


def link_xid_of_dict(value: Any) -> LinkXid | None:
    """A `linkXid` as read back; None when it is missing or not what gpu-npd writes."""
    if not isinstance(value, dict):
        return None
    code, decoded, fatal, link, at = (value.get(k) for k in ("code", "xid", "fatal", "link", "at"))
    if type(code) is not int or not (0 < code < 1000 or code == LINK_DOWN and decoded == LINK_DOWN_TEXT):
        return None
    return LinkXid(code, decoded[:16] if isinstance(decoded, str) and decoded else str(code),
                   fatal if isinstance(fatal, bool) else None, link if type(link) is int and 0 <= link < 1024 else None,
                   parse_rfc3339(at) if isinstance(at, str) and len(at) <= 40 else None)


@dataclass(frozen=True)
class UnhealthyGpu:
    """One entry of the annotation as read back; what the writer did not know (or an older gpu-npd did not
    write) is None."""

    index: int | None
    pci_bus_id: str | None
    uuid: str | None
    serial: str | None
    state: str
    action: str | None
    since: str | None           # RFC 3339, as written
    clique: str | None = None   # `<cluster UUID>.<clique ID>`, canonical; None when absent or not one
    link_xid: LinkXid | None = None
    boots: int | None = None    # distinct boots with an incident, where they are 2 or more (None: not said)

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "pciBusId": self.pci_bus_id, "uuid": self.uuid, "serial": self.serial,
               "state": self.state, "action": self.action, "since": self.since}
        if self.clique:                  # only GPUs in a multi-node NVLink domain have these
            out["clique"] = self.clique
        if self.link_xid is not None:
            out["linkXid"] = link_xid_dict(self.link_xid)
        if self.boots is not None:       # only GPUs whose incidents recur across boots have this
            out["boots"] = self.boots
        return out


def read_unhealthy_gpus(value: str | None) -> list[UnhealthyGpu]:
    """The annotation's GPUs; ValueError when the value is not what gpu-npd writes (over MAX_VALUE
    characters, not JSON, nested past what the parser allows, or not a list of objects)."""
    if not value:
        return []
    if len(value) > MAX_VALUE:
        raise ValueError(f"{UNHEALTHY_GPUS} is {len(value):,} characters, over the {MAX_VALUE:,} gpu-npd writes "
                         "at most")
    try:
        entries = json.loads(value)
    except ValueError as e:
        raise ValueError(f"{UNHEALTHY_GPUS} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{UNHEALTHY_GPUS} is JSON nested too deeply: not parsed") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{UNHEALTHY_GPUS} is not a JSON list of objects")
    return [UnhealthyGpu(_int(e.get("index")), _str(e.get("pciBusId")), _str(e.get("uuid")), _str(e.get("serial")),
                         _str(e.get("state")) or "unknown", _str(e.get("action")), _str(e.get("since")),
                         _clique(e.get("clique")), link_xid_of_dict(e.get("linkXid")), _boots(e.get("boots")))
            for e in entries]


def _boots(value: Any) -> int | None:
    """`boots` as gpu-npd writes it (a whole number from RECURS up); None otherwise."""
    n = _int(value)
    return n if n is not None and RECURS <= n <= MAX_BOOTS else None


def _clique(value: Any) -> str | None:
    """The clique text in canonical form; None when missing or not `<UUID>.<clique ID>`."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        cluster, clique = parse_clique(value)
    except ValueError:
        return None
    return f"{cluster}.{clique}"


def _str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
