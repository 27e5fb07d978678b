"""XID/SXid detection: kernel-log lines and NVML XID events, deduplicated, aggregated against floods."""

from detector.checks.xid.check import XidCheck

__all__ = ["XidCheck"]
