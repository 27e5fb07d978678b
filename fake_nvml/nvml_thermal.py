"""The fake NVML's thermal calls: temperatures, clock event reasons, violation counters, power. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu."""

from __future__ import annotations


class ThermalCalls:
    pass
