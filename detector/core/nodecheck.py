"""Checks that judge the node as a whole, from what the other checks' rules concluded.

Some questions are not about one reading but about the node's state: do enough GPUs fail that the node
needs a reboot, or does one GPU get fenced? Is automation rebooting this node again and again for the
same problem? Does one GPU keep failing across boots? A NodeCheck answers them after every sweep's rules
ran, from a NodeView. It is registered, configured, documented and ruled like any check, but the node
agent calls `judge` instead of scheduling `run`.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

from detector.core.check import Check, CheckOutput, CheckSkipped
from detector.core.gpu_health import GpuHealth, gpu_health, gpu_key
from detector.core.sweep import CheckRun, SweepResult, elapsed_ms, finished_run
from detector.core.nodestatus import NodeStatus
from detector.core.types import GpuRef, Problem

if TYPE_CHECKING:
    from detector.core.sweep import SweepContext


@dataclass(frozen=True)
class NodeView:
    """The node after one sweep's rules ran. Nothing of Kubernetes: the same view serves the daemon,
    the fleet simulator and `diagnose`."""

    node: str
    boot: str                                   # this boot, as the kernel names it
    now: float
    health: list[GpuHealth]                     # every GPU the node has had, judged by the held problems
    held: list[Problem]                         # condition problems held now and seen in this boot (other checks')
    found: list[Problem]                        # what this sweep's rules found, events included
    serials: Mapping[str, str] = field(default_factory=dict)   # gpu_key -> serial, where NVML told it
    node_scoped: frozenset[str] = frozenset()   # rules whose problems ask for the node even when they name a GPU
    state_dir: Path | None = None               # where state that must outlive reboots is kept; None: memory
    visible: tuple[GpuRef, ...] = ()            # the GPUs NVML sees now (health also has those it lost)
    node_status: NodeStatus | None = None       # what the cluster says of the node; None: unknown
    uptime_s: float | None = None               # seconds since this boot; None: unknown
    agent_age_s: float | None = None            # seconds since the agent started
    pending: tuple[str, ...] = ()               # scheduled checks that have not run in this boot yet
    maintenance: str = ""                       # why the node is under planned maintenance ("" if not)
    concluded: tuple[Problem, ...] = ()         # what the node checks judged before this one, in this pass
    reset_failed: tuple[str, ...] = ()          # GPUs whose reset failed or did not cure in this boot, named
                                                # with why (--reset-gpus; detector/agent/gpu_reset.py)


class NodeCheck(Check):
    """A check over the node's judged state (see the module docstring). Its observations go through the
    rules like any check's; `run` is never scheduled."""

    scheduled = False                           # judged after every sweep, never on a timer
    needs_fresh_inventory = False
    # True: judged only once every scheduled check has run (it judges what they concluded). False: judged
    # from the first sweep on (the readiness check, which says which checks are still to run).
    needs_all_checks: ClassVar[bool] = True
    judge_order: ClassVar[int] = 0              # node checks are judged in this order (ties: by name)

    @abstractmethod
    def judge(self, view: NodeView) -> CheckOutput:
        """What the node's state means, as observations for the rules."""

    def run(self, ctx: "SweepContext") -> CheckOutput:
        raise CheckSkipped(f"the {self.name} check judges the node after the other checks, not on its own")


def board_serials(runs: Sequence[CheckRun]) -> dict[str, str]:
    """Bus id -> serial as the kernel log printed them (a check's result `board_serials`): the only place the
    serial of a GPU NVML lost is still written (the driver prints it before the GPU's first Xid)."""
    found: dict[str, str] = {}
    for run in runs:
        serials = (run.result or {}).get("board_serials")
        if isinstance(serials, dict):
            found.update({str(k): str(v) for k, v in serials.items()})
    return found


def sweep_view(sweep: SweepResult, problems: Sequence[Problem], node_scoped: frozenset[str],
               boot: str = "current", node_status: NodeStatus | None = None,
               uptime_s: float | None = None) -> NodeView:
    """The view of one sweep on its own (`diagnose`): its condition problems count as held, every check ran,
    and there is no history beyond this process."""
    held = [p for p in problems if p.report == "condition"]
    refs = [g.ref() for g in sweep.inventory.gpus]
    serials = {**board_serials(sweep.runs),
               **{gpu_key(g.ref()): g.identity.serial for g in sweep.inventory.gpus if g.identity.serial}}
    return NodeView(sweep.node, boot, time.time(), gpu_health(refs, held), held, list(problems), serials,
                    node_scoped, visible=tuple(refs), node_status=node_status, uptime_s=uptime_s,
                    maintenance=node_status.maintenance() if node_status is not None else "")


def judge_node(checks: Sequence[NodeCheck], view: NodeView, evaluate: Callable[[CheckRun], list[Problem]],
               holding: Callable[[str], list[Problem]] | None = None) -> list[tuple[CheckRun, list[Problem]]]:
    """Each node check's judgement as a run, like a swept check's (a broken one is an error run), and what
    `evaluate` (the rules) made of it. In order: each check sees what those before it concluded — what
    `holding(check)` says it holds now (the agent's held problems, a cure being verified included), else
    what its rules found."""
    judged: list[tuple[CheckRun, list[Problem]]] = []
    for check in checks:
        t0 = time.monotonic()
        try:
            output = check.judge(view)
        except Exception as e:  # noqa: BLE001 - a broken check is reported, never fatal
            run = CheckRun(check.name, "error", elapsed_ms(t0), f"{type(e).__name__}: {e}")
        else:
            run = finished_run(check, output, elapsed_ms(t0))
        found = evaluate(run)
        judged.append((run, found))
        view = replace(view, concluded=(*view.concluded, *(holding(check.name) if holding else found)))
    return judged
