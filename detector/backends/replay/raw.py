"""What a parser hands on: the log's own fields and one tree per GPU, in the order printed."""

from __future__ import annotations

from dataclasses import dataclass

from detector.backends.replay.tree import Node


class SnapshotError(ValueError):
    """The file is not nvidia-smi -q output (or cannot be read): says which file and what was expected."""


@dataclass(frozen=True)
class RawLog:
    form: str                 # "xml" or "text"
    top: Node                 # timestamp, driver_version, cuda_version, attached_gpus
    gpus: list[Node]          # one per GPU section; its value is the bus id from the header (None in a
                              # headerless fragment)
