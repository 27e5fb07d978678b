"""What every NCCL probe backend takes and gives back, so the check and the rules never care which
backend measured (nccl-tests, torch.distributed or the fake node)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

OK, FAILED, TIMEOUT = "ok", "failed", "timeout"


def all_reduce_busbw(size_bytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes), as nccl-tests defines it for all-reduce:
    algbw = size / time, busbw = algbw x 2(n-1)/n, comparable across rank counts."""
    if seconds <= 0 or ranks < 1:
        raise ValueError(f"cannot compute bandwidth from {seconds}s over {ranks} ranks")
    return size_bytes / seconds / 1e9 * 2 * (ranks - 1) / ranks


def _quiet(message: str) -> None:
    pass


@dataclass(frozen=True)
class ProbeRequest:
    ranks: int                     # one rank per GPU
    size_bytes: int                # one large message: bandwidth at small sizes says nothing of the links
    timeout_s: float               # the backend kills the probe (its whole process group) at this age
    warmup: int = 5
    iterations: int = 20
    progress: Callable[[str], None] = field(default=_quiet, compare=False)


@dataclass(frozen=True)
class ProbeResult:
    """One probe run. `status` says whether it measured anything: `failed` (crashed, exited non-zero
    without figures, printed FAILED) and `timeout` (killed) carry `error`; `ok` carries the figures.
    Wrong results are not a status: they are counted in `wrong`, next to the bandwidth measured."""

    backend: str                   # nccl-tests | torch | torch-gloo | fake
    transport: str                 # nccl, or gloo (CPU tensors: no bandwidth threshold applies)
    ranks: int
    size_bytes: int
    status: str
    avg_busbw_gbps: float | None = None
    min_busbw_gbps: float | None = None
    busbw_gbps: float | None = None    # the figure thresholds judge: nccl-tests' average, torch's slowest rank
    wrong: int | None = None           # elements that came back wrong; None when not validated
    error: str = ""
    duration_s: float = 0.0
    per_rank_busbw_gbps: tuple[float, ...] = ()   # rank i is GPU i: the slow one is named (torch only)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "backend": self.backend, "ranks": self.ranks, "size_bytes": self.size_bytes,
            "avg_busbw_gbps": self.avg_busbw_gbps, "min_busbw_gbps": self.min_busbw_gbps,
            "wrong": self.wrong, "status": self.status, "transport": self.transport,
            "busbw_gbps": self.busbw_gbps, "error": self.error, "duration_s": round(self.duration_s, 2),
        }
        if self.per_rank_busbw_gbps:
            d["per_rank_busbw_gbps"] = list(self.per_rank_busbw_gbps)
        return d


class ProbeBackend(Protocol):
    name: str

    def run(self, request: ProbeRequest) -> ProbeResult:
        """Measure; never raise for a probe that fails (that is a result), only for a backend that
        cannot be used at all (ProbeUnavailable)."""


class ProbeUnavailable(RuntimeError):
    """The backend cannot run here (binary missing, torch not installed): a setup problem, not a GPU one."""
