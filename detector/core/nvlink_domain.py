"""What one node knows of its multi-node NVLink domain (a GB200/GB300 NVL72 rack): each GPU's clique and
cluster UUID (the fabric check) and each GPU's weightiest link-level evidence of this boot: an XID (the xid
check) or an NVLink held down (the nvlink check's `nvlink-link-down`), which counts as a fatal link fault.

In an NVL72 rack one failing link can fault every tray: the GPU whose link went down reports XID 149
(NETIR_LINK_DOWN, Fatal), and the rack's other GPUs the downstream XID 145 (RLW) (marin-community/marin
#9086: one XID 149 on one GPU, XID 145 on the other 63). Judged node by node, that is 16 sick nodes; judged
as a domain (domain_origin.py), one tray. This module only gathers the facts a node can see; nothing of
Kubernetes here.

The clique text is the one NVIDIA's DRA driver and GPU feature discovery put in the node label
`nvidia.com/gpu.clique`: `<cluster UUID>.<clique ID>`, the UUID in its canonical lowercase form and the
clique ID in decimal (k8s-dra-driver-gpu, cmd/compute-domain-kubelet-plugin/nvlib.go, getCliqueID), given
only when every GPU with a fabric agrees on one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from detector.core.gpu_health import gpu_key
from detector.core.types import Observation

NVLINK5_XIDS = frozenset(range(144, 151))   # the catalogue's NVLink5 unit errors (SAW ... MSE)
DOWNSTREAM_XIDS = frozenset({145})          # RLW: what every other GPU of a faulted domain reports
CLEANUP_XID = 45                            # preemptive cleanup: "caused by previous Xid 149/145"
LINK_DOWN = 0                               # no XID: an NVLink the nvlink check saw held down (a falling link)
LINK_DOWN_TEXT = "link-down"
CLIQUE_LABEL = "nvidia.com/gpu.clique"


def canonical_uuid(text: str) -> str:
    """A cluster UUID as the DRA driver writes it (8-4-4-4-12, lowercase), from that form or NVML's bare
    32 hex digits; "" for none (empty, or all zeros: NVML's "no cluster"). ValueError when it is neither."""
    text = (text or "").strip()
    if not text:
        return ""
    value = uuid.UUID(hex=text)           # takes both forms, and braces or a urn: prefix
    return "" if value.int == 0 else str(value)


def clique_text(cluster_uuid: str, clique_id: int) -> str:
    """`<cluster UUID>.<clique ID>`, the label's value."""
    return f"{canonical_uuid(cluster_uuid)}.{clique_id}"


def parse_clique(text: str) -> tuple[str, int]:
    """(cluster UUID, clique ID) from a label value; ValueError when it is not one."""
    head, dot, tail = (text or "").rpartition(".")
    if not dot or not tail.isascii() or not tail.isdigit() or len(tail) > 10 or int(tail) >= 2**32:
        raise ValueError(f"{text!r} is not <cluster UUID>.<clique ID>")
    cluster = canonical_uuid(head)
    if not cluster:
        raise ValueError(f"{text!r} has no cluster UUID")
    return cluster, int(tail)


@dataclass(frozen=True)
class LinkXid:
    """One link-level XID on one GPU, as far as judging a domain needs it; or, with code LINK_DOWN, one of its
    NVLinks held down."""

    code: int                      # the XID; LINK_DOWN (0) for a link held down
    decoded: str                   # the catalogue's sub-code form ("149.37") where known, else str(code);
                                   # LINK_DOWN_TEXT for a link held down
    fatal: bool | None             # the line's Fatal/Nonfatal; None when it says neither
    link: int | None
    time: float | None             # when the driver logged it (epoch seconds); None: unknown

    @property
    def origin_class(self) -> bool:
        """A fatal NVLink5 error that is not the downstream 145, or a link that fell: where a domain's fault
        may start."""
        return self.fatal is True and (self.code == LINK_DOWN
                                       or self.code in NVLINK5_XIDS and self.code not in DOWNSTREAM_XIDS)

    @property
    def downstream(self) -> bool:
        """What a GPU shows when the fault started elsewhere: 145, or the cleanup 45 that follows."""
        return self.code in DOWNSTREAM_XIDS or self.code == CLEANUP_XID

    def weight(self) -> tuple[int, float]:
        """Which of a GPU's link XIDs speaks for it: an origin-class XID over a link held down (the XID says
        more) over a downstream XID over the rest, then the latest."""
        rank = (2 if self.code == LINK_DOWN else 3) if self.origin_class else 1 if self.code in DOWNSTREAM_XIDS else 0
        return rank, self.time if self.time is not None else float("-inf")

    def describe(self) -> str:
        """`XID 149.37 link 14` (or `NVLink 14 down`), as the remediation ask and the fleet view say it."""
        if self.code == LINK_DOWN:
            return f"NVLink {self.link if self.link is not None else '?'} down"
        return f"XID {self.decoded}" + (f" link {self.link}" if self.link is not None else "")


def link_xid_of(fields: Mapping[str, Any], when: float | None) -> LinkXid | None:
    """The xid check's observation of one kernel or NVML XID, as a LinkXid when it is link-level (144-150,
    or the cleanup 45); None otherwise."""
    code = fields.get("code")
    if fields.get("kind") != "xid" or type(code) is not int or not (code in NVLINK5_XIDS or code == CLEANUP_XID):
        return None
    decoded = fields.get("xid_decoded")
    fatal, link = fields.get("fatal"), fields.get("link")
    return LinkXid(code, decoded if isinstance(decoded, str) and decoded else str(code),
                   fatal if isinstance(fatal, bool) else None,
                   link if type(link) is int and link >= 0 else None, when)


def link_down_of(fields: Mapping[str, Any], when: float | None) -> LinkXid | None:
    """The nvlink check's observation of one link, as a LinkXid when the link is expected up and has been
    held down (what its nvlink-link-down rule fires on); None otherwise."""
    link = fields.get("link")
    if fields.get("scope") != "link" or not fields.get("expected") or fields.get("held_down") is not True \
            or type(link) is not int or link < 0:
        return None
    return LinkXid(LINK_DOWN, LINK_DOWN_TEXT, True, link, when)


@dataclass
class DomainFacts:
    """Per GPU (by gpu_key): its fabric's clique text and its weightiest link XID of this boot. Fed each
    run's observations by the agent; bounded by the node's GPUs. A new boot forgets the XIDs (a reboot
    clears what the driver logged), not the cliques (the next fabric reading replaces them)."""

    cliques: dict[str, str] = field(default_factory=dict)
    link_xids: dict[str, LinkXid] = field(default_factory=dict)
    boot: str = ""

    def observe(self, observations: Iterable[Observation], boot: str) -> bool:
        """Take one run's observations; True when something changed."""
        if boot != self.boot:
            changed = bool(self.link_xids)
            self.boot, self.link_xids = boot, {}
        else:
            changed = False
        for o in observations:
            if o.gpu is None or not (key := gpu_key(o.gpu)):
                continue
            if o.check == "fabric" and "cluster_uuid" in o.fields:
                changed |= self._fabric(key, o.fields)
            elif o.check in ("xid", "nvlink") and o.fields.get("boot") in (None, boot):
                x = link_xid_of(o.fields, o.time) if o.check == "xid" else link_down_of(o.fields, o.time)
                before = self.link_xids.get(key)
                if x is not None and (before is None or x.weight() > before.weight()):
                    self.link_xids[key] = x
                    changed = True
        return changed

    def _fabric(self, key: str, fields: Mapping[str, Any]) -> bool:
        try:
            cluster = canonical_uuid(str(fields.get("cluster_uuid") or ""))
        except ValueError:
            cluster = ""
        clique = fields.get("clique_id")
        text = clique_text(cluster, clique) if cluster and type(clique) is int and clique >= 0 else ""
        if self.cliques.get(key, "") == text:
            return False
        if text:
            self.cliques[key] = text
        else:
            self.cliques.pop(key, None)
        return True

    def node_clique(self) -> str:
        """The node's clique text when every GPU with a fabric agrees on one (as the DRA driver requires);
        "" when none has a fabric or they disagree."""
        values = set(self.cliques.values())
        return next(iter(values)) if len(values) == 1 else ""
