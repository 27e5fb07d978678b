"""The fake NVML's slow GPU: every call touching the GPU takes `nvml_slow_s` seconds more (the `nvml_slow`
fault), the way a GPU degrading towards a detach makes the driver answer slowly for it alone (NVIDIA/DCGM
#313: calls on one GPU blocking for tens of seconds under load, returning at once when it idled). Mixed
into FakeNvml, which calls `_wait_if_slow(gpu)` wherever it waits for a hung GPU.

On real time (the daemon, the emulator) the call truly sleeps, as the ioctl would. On a simulated clock
(`diagnose --duration` on a fake node: FakeNvml(simulated_time=True)) it does not: it declares the latency
for this call on this thread, and the timing proxy (detector/backends/nvml_timing.py) adds it to what it
measured. Advancing the shared simulated clock instead would charge the delay to every call running at the
same time on other threads, and move the sweep schedule under the checks.
"""

from __future__ import annotations

import threading
import time

from fake_nvml.fault_kind import FaultKind, set_field
from fake_nvml.node import FakeGpu, NodeState


class LatencyCalls:
    """Mixed into FakeNvml, which sets `simulated_time`, `_latency` (a threading.local) and `_calls_bounded`
    (False) in __init__.

    One call pays once: some fake calls look their GPU up more than once (a call built on another, the
    field-value mixins' chain), a real call crosses into the driver once. The timing proxy says where each call
    ends (`call_returned`); a FakeNvml used without it, which never hears that, pays on every look-up instead
    (slower than asked, never faster)."""

    simulated_time: bool
    _latency: threading.local
    _calls_bounded: bool

    def _wait_if_slow(self, gpu: FakeGpu) -> None:
        seconds = gpu.nvml_slow_s
        if seconds <= 0:
            return
        local = self._latency
        if self._calls_bounded and getattr(local, "paid", False):
            return
        local.paid = True
        if self.simulated_time:
            local.seconds = getattr(local, "seconds", 0.0) + seconds
        else:
            time.sleep(seconds)

    def call_returned(self) -> float:
        """The call under way on this thread has returned: the seconds it simulated instead of sleeping (0 on
        real time, where it slept). detector/backends/nvml_timing.py SimulatesLatency."""
        self._calls_bounded = True
        local = self._latency
        local.paid = False
        seconds = getattr(local, "seconds", 0.0)
        if seconds:
            local.seconds = 0.0
        return seconds


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset or node repair brings the driver's answers back to their usual speed."""
    for g in gpus:
        g.nvml_slow_s = 0.0


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("nvml_slow", True, {"seconds": float}, ("seconds",), set_field("nvml_slow_s", "seconds"),
              "every NVML call touching this GPU takes this many seconds more (it still answers); simulated, "
              "not slept, when the node runs on a simulated clock"),
)
