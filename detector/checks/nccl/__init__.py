"""The NCCL all-reduce probe check: backends (nccl-tests, torch.distributed, the fake node) behind one
result type, thresholds in rules/nccl.yaml."""

from detector.checks.nccl.check import NcclCheck

__all__ = ["NcclCheck"]
