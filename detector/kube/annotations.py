"""The node annotation that lists the node's unhealthy GPUs, for people and tools that read node objects.

    gpu-npd.io/unhealthy-gpus: '[{"index":3,"pciBusId":"0000:5d:00.0","uuid":"GPU-8fb2…","state":"failed",
                                  "action":"RESTART_BM"}]'        (one line, no spaces)

One compact JSON object per GPU that is not healthy, sorted by index then bus id; no annotation at all
when every GPU is healthy. It rides in the same status PATCH as the node's conditions (conditions.py).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from detector.core.domain import key
from detector.core.gpu_health import HEALTHY, GpuHealth

UNHEALTHY_GPUS = key("unhealthy-gpus")


def unhealthy_gpus_annotation(health: Iterable[GpuHealth]) -> str | None:
    """The annotation's value for these GPUs; None when none is unhealthy (the annotation goes)."""
    bad = sorted((h for h in health if h.state != HEALTHY),
                 key=lambda h: (h.gpu.index is None, h.gpu.index or 0, h.gpu.pci_bus_id or ""))
    if not bad:
        return None
    return json.dumps([_entry(h) for h in bad], separators=(",", ":"))


def _entry(h: GpuHealth) -> dict[str, Any]:
    fields = {"index": h.gpu.index, "pciBusId": h.gpu.pci_bus_id, "uuid": h.gpu.uuid, "state": h.state,
              "action": h.action}
    return {k: v for k, v in fields.items() if v not in (None, "")}      # an unknown id is left out
