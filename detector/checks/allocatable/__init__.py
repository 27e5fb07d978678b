"""The allocatable check (check.py): what the scheduler is told of the GPUs against what NVML sees; how the
counts are compared (judge.py) and how resource names and labels are read (resources.py)."""

from detector.checks.allocatable.check import SETTLE_S, AllocatableCheck

__all__ = ["AllocatableCheck", "SETTLE_S"]
