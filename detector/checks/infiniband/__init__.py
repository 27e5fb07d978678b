"""InfiniBand/RoCE ports from sysfs: state, rate and error counter rates, per port."""

from detector.checks.infiniband.check import InfinibandCheck

__all__ = ["InfinibandCheck"]
