"""How a fake module declares the faults it applies: each lists its kinds as `FAULTS` (a tuple of FaultKind)
and says how a `recover`/`reboot` heals its state (`heal`); fake_nvml/faults.py gathers them into the one
catalogue. This sits below both the modules and the catalogue, so neither needs the other's side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from fake_nvml.node import FakeGpu, FakeNode, NodeState


class FaultArgs(Protocol):
    """What applying a fault reads of it: a Fault (fake_nvml/faults.py), which is built over every module's
    kinds and so cannot be imported by them."""

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...


# fn(fault, the node's live state, the fault's GPU or None, the node): changes the state, may log to the node.
Apply = Callable[[FaultArgs, NodeState, FakeGpu | None, FakeNode], None]


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault: which parameters it takes and what it does to the node."""

    name: str
    needs_gpu: bool
    params: dict[str, type]            # optional parameters and their types
    required: tuple[str, ...]
    apply: Apply
    help: str


def set_field(attr: str, value_param: str | None, value: Any = None) -> Apply:
    """An apply that sets one field of the GPU (or, without a GPU, of the node state): to the fault's
    `value_param` parameter, or to `value`."""
    def apply(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
        target: Any = gpu if gpu is not None else state
        setattr(target, attr, f.params[value_param] if value_param else value)
    return apply
