"""One state per GPU, from the problems that name it: so dashboards and alerts count bad GPUs, not nodes.

A GPU is `failed` while a critical problem names it, `degraded` while a warning does, else `healthy`;
its `action` is the most demanding recommended action among those problems (NONE when healthy).
Informational problems leave a GPU healthy, and so do problems whose recommended action is the
application's (RESTART_APP: an XID 13, 31 or 43 from a user's kernel): a GPU is never degraded, tainted or
counted towards remediation because one program faulted on it. Problems that name no GPU (the driver is
not loaded, NVML hangs) are the node's, shown by its conditions, and are not spread over its GPUs.

`since` is when a GPU entered its state: the first match of the problems that put it there, kept while the
state holds (`carry_since`), so it names the start of an outage and moves only when the state changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Mapping

from detector.core.types import GpuRef, Problem, Severity, action_strength

if TYPE_CHECKING:
    from detector.core.nvlink_domain import LinkXid

HEALTHY, DEGRADED, FAILED = "healthy", "degraded", "failed"
STATE_VALUE = {HEALTHY: 0, DEGRADED: 1, FAILED: 2}
_BY_SEVERITY = {Severity.CRITICAL: FAILED, Severity.WARNING: DEGRADED}
APPLICATION_ACTIONS = frozenset({"RESTART_APP"})     # about the program that ran, not the GPU it ran on


@dataclass(frozen=True)
class GpuHealth:
    gpu: GpuRef
    state: str                       # healthy, degraded or failed
    action: str                      # the recommended action for this GPU now; NONE when healthy
    reasons: tuple[str, ...] = ()    # the reasons of the problems naming it, most urgent first
    incidents: int = 0               # its incidents in the node check's flaky window (where it keeps history)
    boots: int = 0                   # distinct boots those incidents fell in: 2 or more, its failures recur
    verifying: bool = False          # unhealthy only by problems whose cure is being verified: still fenced,
                                     # but no reason to remediate the node again (the cure already happened)
    serial: str = ""                 # the board's serial where known: what an RMA ticket names
    since: float | None = None       # when it entered this state (unhealthy GPUs whose problems' start is known)
    clique: str = ""                 # its multi-node NVLink domain, `<cluster UUID>.<clique ID>` ("" none)
    link_xid: "LinkXid | None" = None   # its weightiest link-level XID of this boot (nvlink_domain.py)


def gpu_key(ref: GpuRef) -> str:
    """The same GPU across runs: its bus id, else its UUID, else its index."""
    return ref.pci_bus_id or ref.uuid or ("" if ref.index is None else f"index:{ref.index}")


def gpu_health(gpus: Iterable[GpuRef], problems: Iterable[Problem],
               first_seen: Mapping[Problem, float] | None = None) -> list[GpuHealth]:
    """Every GPU in `gpus` (those known to be there), plus any GPU a problem names that is not among
    them (a GPU lost from NVML), each judged by the problems naming it. Sorted by index, then bus id.
    `first_seen`: when each held problem first matched, which dates an unhealthy GPU's state."""
    refs: dict[str, GpuRef] = {}
    for ref in gpus:
        if key := gpu_key(ref):
            refs.setdefault(key, ref)
    naming: dict[str, list[Problem]] = {}
    for problem in problems:
        for ref in problem.gpus:
            key = _match(ref, refs)
            if key:
                refs[key] = fuller(refs[key], ref) if key in refs else ref
                naming.setdefault(key, []).append(problem)
    return sorted((_judge(refs[key], naming.get(key, []), first_seen or {}) for key in refs),
                  key=lambda h: (h.gpu.index is None, h.gpu.index or 0, h.gpu.pci_bus_id or ""))


def _match(ref: GpuRef, known: dict[str, GpuRef]) -> str:
    """The key of the known GPU this reference means (by bus id, UUID or index), else its own key."""
    for key, other in known.items():
        if (ref.pci_bus_id and ref.pci_bus_id == other.pci_bus_id) or (ref.uuid and ref.uuid == other.uuid) or \
                (not ref.pci_bus_id and not ref.uuid and ref.index is not None and ref.index == other.index):
            return key
    return gpu_key(ref)


def fuller(known: GpuRef, other: GpuRef) -> GpuRef:
    """What either knows of one GPU, `known`'s first: NVML forgets a lost GPU's UUID, an earlier inventory
    or a held XID problem still has it."""
    if (known.uuid or not other.uuid) and (known.pci_bus_id or not other.pci_bus_id):
        return known
    return GpuRef(known.index if known.index is not None else other.index, known.uuid or other.uuid,
                  known.pci_bus_id or other.pci_bus_id)


def _judge(ref: GpuRef, problems: list[Problem], first_seen: Mapping[Problem, float]) -> GpuHealth:
    serious = sorted((p for p in problems if p.severity in _BY_SEVERITY and p.action not in APPLICATION_ACTIONS),
                     key=lambda p: (-action_strength(p.action), -p.severity.rank, p.reason))
    if not serious:
        return GpuHealth(ref, HEALTHY, "NONE")
    reasons = tuple(dict.fromkeys(p.reason for p in serious))
    worst = max(serious, key=lambda p: p.severity.rank)
    state = _BY_SEVERITY[worst.severity]
    since = min((first_seen[p] for p in serious if p in first_seen and _BY_SEVERITY[p.severity] == state),
                default=None)
    return GpuHealth(ref, state, serious[0].action, reasons, since=since)


def carry_since(health: Iterable[GpuHealth], before: Mapping[str, GpuHealth]) -> list[GpuHealth]:
    """A GPU still in the state it was in keeps the `since` it had (by gpu_key): one problem ending while
    another holds the GPU failed does not move the start of its outage."""
    kept = []
    for h in health:
        old = before.get(gpu_key(h.gpu))
        same = old is not None and old.state == h.state and h.state != HEALTHY and old.since is not None
        kept.append(replace(h, since=old.since) if same else h)
    return kept
