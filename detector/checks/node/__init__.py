"""The node check (check.py) and the history it keeps across reboots (history.py)."""

from detector.checks.node.check import NodeStateCheck, span

__all__ = ["NodeStateCheck", "span"]
