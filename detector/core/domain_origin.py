"""Where a fault in one multi-node NVLink domain most likely started, from what each GPU of the domain
showed: a pure judgement, nothing of Kubernetes (the fleet view gathers the GPUs, kube/fleet_view.py).

On an NVL72 rack one link going down faults every tray: the GPU whose link failed reports a fatal
link-level XID (149 NETIR_LINK_DOWN; any fatal 144-150 but the downstream 145), the others only the
downstream XID 145 (RLW) and the cleanup XID 45 after it (marin-community/marin #9086: one GPU with XID 149
on link 14, the other 63 GPUs of the rack XID 145). So:

- exactly one GPU with an origin-class XID (or an NVLink held down, a falling link): that GPU is the
  origin, the rest downstream;
- several (two 149s on different trays): no single origin, each is named and none is picked;
- none (only 145s, or one fatal 145 alone on one node): no origin found. A 145 says the fault came from
  elsewhere, not where: naming any GPU then would be a guess.

An origin-class XID far apart in time from the domain's downstream XIDs (`window_s`) is an unrelated
fault of its own, not the origin of these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from detector.core.nvlink_domain import LinkXid

WINDOW_S = 600.0        # an origin's XID and the downstream ones it caused: seconds apart at most


@dataclass(frozen=True)
class DomainGpu:
    """One GPU of a domain that has a problem or a link-level XID."""

    node: str
    gpu: int | None
    pci_bus_id: str | None
    link_xid: LinkXid | None       # its weightiest link-level XID of this boot, if any

    def label(self) -> str:
        return f"{self.node} GPU {self.gpu if self.gpu is not None else self.pci_bus_id or '?'}"


@dataclass(frozen=True)
class DomainVerdict:
    cluster_uuid: str
    clique_id: int
    nodes: tuple[str, ...]             # every node seen in the domain, sorted
    affected: tuple[DomainGpu, ...]    # GPUs with a problem or a link XID
    candidates: tuple[DomainGpu, ...]  # GPUs with an origin-class XID near the downstream ones
    unrelated: tuple[DomainGpu, ...]   # origin-class XIDs too far in time from the downstream ones
    downstream_only: int               # affected GPUs whose link XID is downstream (145, 45) alone

    @property
    def origin(self) -> DomainGpu | None:
        return self.candidates[0] if len(self.candidates) == 1 else None

    @property
    def verdict(self) -> str:
        """healthy (nothing affected), origin (one), several (no single origin), none (no origin found)."""
        if not self.affected:
            return "healthy"
        return {0: "none", 1: "origin"}.get(len(self.candidates), "several")

    def explain(self) -> str:
        """One sentence: where it started and the evidence, or why no GPU is named."""
        tail = f"{self.downstream_only} GPU{'s' if self.downstream_only != 1 else ''} show only downstream XIDs"
        if self.verdict == "healthy":
            return "no problem in the domain"
        if self.origin is not None:
            o = self.origin
            assert o.link_xid is not None
            return f"fault started on {o.label()} ({o.link_xid.describe()}{_at(o.link_xid)}); {tail}"
        if self.verdict == "several":
            named = ", ".join(f"{c.label()} ({c.link_xid.describe() if c.link_xid else '?'})" for c in self.candidates)
            return f"no single origin: {len(self.candidates)} GPUs have a fatal link-level XID: {named}; {tail}"
        return f"no origin found: no GPU has a fatal link-level XID other than the downstream 145; {tail}"


def judge_domain(cluster_uuid: str, clique_id: int, nodes: list[str], gpus: list[DomainGpu],
                 window_s: float = WINDOW_S) -> DomainVerdict:
    """The domain's verdict from its affected GPUs (see the module docstring)."""
    affected = sorted(gpus, key=lambda g: (g.node, g.gpu if g.gpu is not None else -1, g.pci_bus_id or ""))
    origin_class = [g for g in affected if g.link_xid is not None and g.link_xid.origin_class]
    downstream = [g for g in affected if g.link_xid is not None and g.link_xid.downstream]
    times = [g.link_xid.time for g in downstream if g.link_xid is not None and g.link_xid.time is not None]
    first = min(times) if times else None

    def near(g: DomainGpu) -> bool:
        t = g.link_xid.time if g.link_xid is not None else None
        return first is None or t is None or abs(t - first) <= window_s

    return DomainVerdict(cluster_uuid, clique_id, tuple(sorted(set(nodes))), tuple(affected),
                         tuple(g for g in origin_class if near(g)), tuple(g for g in origin_class if not near(g)),
                         len(downstream))


def _at(x: LinkXid) -> str:
    if x.time is None:
        return ""
    return " at " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(x.time))
