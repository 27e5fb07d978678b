"""The fake NVML's nvlink calls: NVLink state and error counters, fabric state. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu."""

from __future__ import annotations


class NvlinkCalls:
    pass
