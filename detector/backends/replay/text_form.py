"""`nvidia-smi -q` as text: `Label : value` lines nested by indentation under `GPU <bus id>` headers.

The layout holds from driver 3xx to 580 (spaces, or tabs on some builds); labels change between drivers
and fields.py knows their spellings. Partial outputs are read for what they hold: `-q -d MEMORY`, one GPU
of many, or a `grep -A2 Fabric` fragment without any GPU header (its sections are split into one record
per GPU where a section repeats).
"""

from __future__ import annotations

import re

from detector.backends.replay.limits import MAX_DEPTH
from detector.backends.replay.raw import RawLog, SnapshotError
from detector.backends.replay.tree import Node, norm

BANNER = "NVSMI LOG"
_FOREIGN_BANNER = re.compile(r"^=+\s*([A-Z][A-Z0-9 -]*?)\s+LOG\s*=+$")     # hl-smi: "==== HL-SMI LOG ===="
_GPU_HEADER = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_LABELLED = re.compile(r"^(?P<label>[^:]*?[^\s:])\s*:(?:\s+(?P<value>.*?))?\s*$")
# Sections a GPU record has; the top of the log has these labels only.
TOP_LABELS = frozenset({"timestamp", "driver_version", "cuda_version", "attached_gpus", "vgpu_driver_capability",
                        "hic_info"})
# Labels that only a per-GPU section carries: evidence a headerless fragment is nvidia-smi's.
GPU_LABELS = frozenset({"product_name", "gpu_uuid", "minor_number", "vbios_version", "persistence_mode",
                        "fb_memory_usage", "bar1_memory_usage", "ecc_mode", "ecc_errors", "retired_pages",
                        "remapped_rows", "temperature", "power_readings", "gpu_power_readings",
                        "clocks_throttle_reasons", "clocks_event_reasons", "fabric", "pci", "mig_mode",
                        "performance_state", "utilization", "clocks", "max_clocks", "processes"})


def parse_text(text: str, source: str) -> RawLog:
    top, gpus = Node("log"), []
    current: Node | None = None          # the GPU being read; None before the first header
    stack: list[tuple[int, Node]] = []
    saw_banner = False
    loose: list[tuple[int, Node]] = []   # top-level-less lines of a headerless fragment
    for raw in text.expandtabs(8).splitlines():
        stripped = raw.strip()
        if not stripped or stripped == "--" or stripped[0] in "+|" or stripped.startswith("nvidia-smi"):
            continue
        if stripped.startswith("="):
            foreign = _FOREIGN_BANNER.match(stripped)
            if foreign and foreign.group(1).strip() != "NVSMI":
                raise SnapshotError(f"{source}: a {foreign.group(1).strip()} log, not nvidia-smi -q output")
            saw_banner = saw_banner or BANNER in stripped
            continue
        indent = len(raw) - len(raw.lstrip())
        header = _GPU_HEADER.match(stripped)
        if header:
            current = Node("gpu", header.group(1))
            gpus.append(current)
            stack = [(indent, current)]
            continue
        if stripped.startswith(":"):
            if stack and stack[-1][1].value is None:
                stack[-1][1].value = stripped[1:].strip()     # a label whose value wrapped to its own line
            continue
        labelled = _LABELLED.match(stripped)
        node = Node(norm(labelled["label"]), labelled["value"]) if labelled else Node(norm(stripped))
        if current is None and node.name in TOP_LABELS and indent == 0:
            top.children.append(node)
            stack = [(indent, node)]
            continue
        if current is None:
            loose.append((indent, node))
        _attach(stack, indent, node, current)
        if len(stack) > MAX_DEPTH:            # the tree's walks recurse: refuse what no nvidia-smi prints
            raise SnapshotError(f"{source}: lines indented more than {MAX_DEPTH} levels deep (nvidia-smi -q nests "
                                "fewer than 10); not nvidia-smi -q output")
    if not gpus and loose:
        gpus = _split_fragment(loose)
    if not saw_banner and not any(g.value for g in gpus) and not _looks_like_gpu_sections(gpus):
        raise SnapshotError(f"{source}: not nvidia-smi -q output (no '==============NVSMI LOG==============' "
                            "banner, no 'GPU 00000000:..' header and no nvidia-smi -q section)")
    if not gpus and not top.children:
        raise SnapshotError(f"{source}: no GPU section and no driver facts in this nvidia-smi -q output")
    return RawLog("text", top, gpus)


def _attach(stack: list[tuple[int, Node]], indent: int, node: Node, gpu: Node | None) -> None:
    while stack and stack[-1][0] >= indent and stack[-1][1] is not gpu:
        stack.pop()
    parent = stack[-1][1] if stack else gpu
    if parent is not None:
        parent.children.append(node)
    stack.append((indent, node))


def _split_fragment(loose: list[tuple[int, Node]]) -> list[Node]:
    """Headerless lines: the shallowest ones are GPU sections; a section name seen again starts the next GPU."""
    outer = min(indent for indent, _ in loose)
    gpus: list[Node] = []
    seen: set[str] = set()
    for indent, node in loose:
        if indent != outer:
            continue
        if not gpus or node.name in seen:
            gpus.append(Node("gpu", None))
            seen = set()
        gpus[-1].children.append(node)
        seen.add(node.name)
    return gpus


def _looks_like_gpu_sections(gpus: list[Node]) -> bool:
    return any(c.name in GPU_LABELS for g in gpus for c in g.children)
