"""A GPU judged against the same-model GPUs beside it, when no rate can be had.

One sweep (`diagnose` without a duration, a replayed capture) sees each counter once: the total since the
driver loaded, over an unknown time. Such a total alone says nothing (DCGM 4.6.1's lifetime NVLink check
flipped healthy H100 nodes unhealthy, aws/eks-node-monitoring-agent#261), but the node's other GPUs of the
same model have run as long under the same driver: a GPU whose total is far above theirs stands out.

"Far" is robust to one odd sibling and to a uniform fleet: at least `factor` times the siblings' median
and at least `floor` above it, with at least `min_siblings` siblings to take a median of. GPUs that all
hold similar counts, large or small, never stand out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count). Here rather than `statistics`,
    which imports decimal and fractions: half a MiB of the daemon's memory for three lines."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the median of no values")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def median_low(values: Sequence[float]) -> float:
    """The lower of the two middle values (a value that was measured, never a mean of two)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the median of no values")
    return ordered[(len(ordered) - 1) // 2]


def median_high(values: Sequence[float]) -> float:
    """The higher of the two middle values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the median of no values")
    return ordered[len(ordered) // 2]


@dataclass(frozen=True)
class Standout:
    value: float
    median: float          # the siblings' median
    siblings: int          # how many siblings the median is over

    def describe(self, what: str) -> str:
        """'1200 corrected ECC errors since the driver loaded, against a median of 0 on its 7 siblings'"""
        return (f"{_num(self.value)} {what} since the driver loaded, against a median of {_num(self.median)} "
                f"on its {self.siblings} same-model sibling(s)")


def standouts(values: Mapping[Hashable, float | None], groups: Mapping[Hashable, str], *, factor: float,
              floor: float, min_siblings: int = 2) -> dict[Hashable, Standout]:
    """Each key whose value is far above the median of the others in its group (same model). None: not
    read, left out of every median."""
    by_group: dict[str, list[tuple[Hashable, float]]] = {}
    for key, value in values.items():
        if value is not None:
            by_group.setdefault(groups[key], []).append((key, float(value)))
    found: dict[Hashable, Standout] = {}
    for members in by_group.values():
        if len(members) < min_siblings + 1:
            continue
        for key, value in members:
            others = [v for k, v in members if k != key]
            mid = median(others)
            if value - mid >= floor and value >= factor * mid:
                found[key] = Standout(value, mid, len(others))
    return found


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
