"""Structured logs: one JSON object per line for log pipelines, or plain text for people."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str):
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "node": self.node,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: str, level: str, node: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpu_npd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # urllib3 logs a malformed answer (headers cut short, a bad header line) as a warning with a traceback,
    # which Python's last-resort handler would print raw to stderr. gpu-npd says every failed request
    # itself (kube/health.py, one line an outage), so urllib3's own lines are not wanted.
    quiet = logging.getLogger("urllib3")
    quiet.handlers[:] = [logging.NullHandler()]
    quiet.propagate = False
