"""`nvidia-smi -q -x`: <nvidia_smi_log> with one <gpu id="bus id"> per GPU (DTD versions v10 to v13 seen).

Parsed with the standard library's expat, which refuses entity bombs and never fetches the external DTD
the DOCTYPE names. The tree is built here, from expat's start and end events, so nesting is counted as it
is read: a document deeper than limits.MAX_DEPTH is refused there, with no recursion at any depth.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from detector.backends.replay.limits import MAX_DEPTH
from detector.backends.replay.raw import RawLog, SnapshotError
from detector.backends.replay.tree import Node, norm

ROOT = "nvidia_smi_log"


class _TooDeep(Exception):
    pass


@dataclass
class _Open:
    """An element being read: its text is what comes before its first child (ElementTree's `.text`)."""

    tag: str
    gpu_id: str | None
    text: list[str] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)


class _NodeBuilder:
    """An XMLParser target that builds tree.Node directly, refusing nesting beyond `max_depth`."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.stack: list[_Open] = []
        self.root: Node | None = None
        self.root_tag = ""
        self.gpus: list[Node] = []          # the root's <gpu> children, in order (not among its children)

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        if len(self.stack) >= self.max_depth:
            raise _TooDeep
        if not self.stack:
            self.root_tag = tag
        self.stack.append(_Open(tag, attrs.get("id")))

    def data(self, text: str) -> None:
        top = self.stack[-1] if self.stack else None
        if top is not None and not top.children:
            top.text.append(text)

    def end(self, tag: str) -> None:
        element = self.stack.pop()
        text = "".join(element.text).strip()
        node = Node(norm(element.tag), text if not element.children or text else None, element.children)
        if len(self.stack) == 1 and element.tag == "gpu":
            node.name, node.value = "gpu", element.gpu_id
            self.gpus.append(node)
        elif self.stack:
            self.stack[-1].children.append(node)
        else:
            self.root = node

    def close(self) -> Node | None:
        return self.root


def parse_xml(text: str, source: str) -> RawLog:
    builder = _NodeBuilder(MAX_DEPTH)
    try:
        parser = ET.XMLParser(target=builder)
        parser.feed(text.strip())
        root = parser.close()
    except _TooDeep:
        raise SnapshotError(f"{source}: XML nested deeper than {MAX_DEPTH} elements (nvidia-smi -q -x nests "
                            "fewer than 10); not nvidia-smi -q -x output") from None
    except ET.ParseError as e:
        raise SnapshotError(f"{source}: not well-formed XML ({e}); expected nvidia-smi -q -x output") from None
    if builder.root_tag != ROOT or root is None:
        raise SnapshotError(f"{source}: XML root is <{builder.root_tag}>, expected <{ROOT}> (nvidia-smi -q -x output)")
    return RawLog("xml", Node("log", None, root.children), builder.gpus)
