"""The fake NVML's driver calls: persistence mode, versions, reset-required. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu."""

from __future__ import annotations


class DriverCalls:
    pass
