"""Token buckets and backoff: how gpu-npd stays gentle on the API server."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TokenBucket:
    """`burst` tokens, refilled at `rate` per second (client-go's flowcontrol and spam filter)."""

    rate: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.tokens, self.stamp = float(self.burst), self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def try_take(self) -> bool:
        self._refill()
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def wait_s(self) -> float:
        """Seconds until a token is available (0 if one is)."""
        self._refill()
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


# Retry-After asks for a pause; a real API server asks for a second or a few (priority and fairness answer
# 429 with `Retry-After: 1`). Obeyed up to 30 s, the longest the reporter's own backoff ever waits: a
# report takes two requests (read the node, patch its status), so even when a hostile or broken header
# delays both, the conditions reach the API server within a minute and a half, not never.
RETRY_AFTER_CAP_S = 30.0


def honoured(retry_after_s: float | None) -> float:
    """How much of a Retry-After is obeyed: a finite number of seconds, at most RETRY_AFTER_CAP_S (an
    infinite or absurd one would otherwise silence the daemon for good)."""
    if retry_after_s is None or not math.isfinite(retry_after_s):
        return 0.0
    return min(max(0.0, retry_after_s), RETRY_AFTER_CAP_S)


@dataclass
class Backoff:
    """Exponential backoff with equal jitter (each wait between half and all of the doubling ceiling, so
    the first failures already space out), floored by the server's Retry-After up to RETRY_AFTER_CAP_S."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    refused_s: float = 300.0     # after a refusal (401, 403, 404): only a person's fix cures it, so ask rarely

    def after(self, status: int, retry_after_s: float | None = None) -> float:
        """The wait after a failed request with this HTTP status (0: no answer)."""
        if status in (401, 403, 404):
            return max(self.refused_s, honoured(retry_after_s))
        return self.next_delay(retry_after_s)

    def next_delay(self, retry_after_s: float | None = None) -> float:
        self.failures += 1
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 60))
        delay = self.rng.uniform(ceiling / 2, ceiling)
        return max(delay, honoured(retry_after_s))

    def reset(self) -> None:
        self.failures = 0


def jittered(period_s: float, fraction: float, rng: random.Random) -> float:
    """`period_s` plus up to `fraction` of it, so thousands of nodes do not act in the same second and none
    acts more often than every `period_s` (a heartbeat stays within node-problem-detector's one per 5 min)."""
    return period_s * (1 + rng.uniform(0.0, fraction))
