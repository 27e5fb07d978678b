"""The fake NVML's memory calls: ECC, retired pages, row remapping. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu."""

from __future__ import annotations


class MemoryCalls:
    pass
