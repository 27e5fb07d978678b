"""`nvidia-smi -q -x`: <nvidia_smi_log> with one <gpu id="bus id"> per GPU (DTD versions v10 to v13 seen).

Parsed with the standard library; the DOCTYPE names an external DTD that is never fetched.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from fake_nvml.replay.raw import RawLog, SnapshotError
from fake_nvml.replay.tree import Node, norm

ROOT = "nvidia_smi_log"


def parse_xml(text: str, source: str) -> RawLog:
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as e:
        raise SnapshotError(f"{source}: not well-formed XML ({e}); expected nvidia-smi -q -x output") from None
    if root.tag != ROOT:
        raise SnapshotError(f"{source}: XML root is <{root.tag}>, expected <{ROOT}> (nvidia-smi -q -x output)")
    top, gpus = Node("log"), []
    for element in root:
        if element.tag == "gpu":
            gpu = _node(element)
            gpu.name, gpu.value = "gpu", element.get("id")
            gpus.append(gpu)
        else:
            top.children.append(_node(element))
    return RawLog("xml", top, gpus)


def _node(element: ET.Element) -> Node:
    text = (element.text or "").strip()
    children = [_node(c) for c in element]
    return Node(norm(element.tag), text if not children or text else None, children)
