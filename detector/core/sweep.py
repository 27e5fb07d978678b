"""One sweep: read the GPU inventory, run the selected checks (each under its own timeout), and
collect what they observed. The daemon and `diagnose` share this; only the reporting differs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from detector.backends.pci import PciBus, PciDevice, nvidia_gpus
from detector.backends.smi import NvidiaSmi
from detector.core.check import Check, CheckMetrics, CheckOutput, CheckSkipped, GaugeSpec
from detector.core.deadline import Hung, Pending
from detector.core.inventory import Inventory, read_inventory
from detector.core.nodestatus import NodeStatus
from detector.core.types import Observation


@dataclass
class Host:
    """The backends one node agent reads. Nothing global: a simulator holds thousands."""

    node_name: str
    nvml: Any                          # the pynvml module, or a fake_nvml.FakeNvml instance
    smi: NvidiaSmi
    pci: PciBus
    nvml_init_error: str | None = None # nvmlInit failed with this (DriverNotLoaded, ...): a finding
    kernel_log: Any = None             # a reader with read_available() -> list[LogLine], or None
    boot_id: str = "current"           # this boot, as the kernel names it
    threaded: bool = True              # False: call checks inline (fake backends that cannot hang)
    close: Callable[[], None] = lambda: None
    boot_source: Callable[[], str] | None = None   # the live boot id, for a fake node that can reboot
    nccl_probe: Any = None             # an NCCL probe backend bound to this node (the fake node's); None: real
    infiniband: Any = None             # InfiniBand/RoCE ports reader (detector/backends/infiniband.py); None: none
    system: Any = None                 # driver plumbing reader: kernel modules, device files, services
                                       # (detector/backends/system.py); None: not readable here
    imex: Any = None                   # IMEX reader: nvidia-imex-ctl and the host service (detector/backends/imex.py);
                                       # None: none here (a replay)
    uptime_s: Callable[[], float | None] = lambda: None   # seconds since this boot; None: unknown (a replay)
    snapshot: bool = False             # one saved capture (a replay): what it shows counts as held
    one_sweep: bool = False            # judged in one sweep and no more (`diagnose` without a duration): no
                                       # window will fill, so counters are compared across same-model GPUs
    node_status: Callable[[], NodeStatus | None] = lambda: None   # what the cluster says of this node, as
                                       # last read (detector/core/nodestatus.py); None: unknown (no API server)
    clock: Callable[[], float] = time.monotonic   # what checks judging over time read (their windows)
    sleep: Callable[[float], None] = time.sleep   # waits between sweeps of a watch (`diagnose --duration`)
    simulated_time: bool = False       # clock and sleep are a fake node's simulated time, not the real one

    def current_boot(self) -> str:
        """This boot now: a fake node can reboot under a running agent, a real machine cannot."""
        return self.boot_source() if self.boot_source is not None else self.boot_id


@dataclass(frozen=True)
class SweepContext:
    host: Host
    inventory: Inventory
    pci_gpus: list[PciDevice] | None     # NVIDIA GPUs on the PCI bus; None when it could not be read
    pci_error: str
    started: float
    progress: Callable[[str, str], None]     # (check, what it is doing now): for checks that take minutes

    def report_progress(self, check: str) -> Callable[[str], None]:
        """A check's progress reporter; a broken display (a closed terminal) never fails the check."""
        def report(message: str) -> None:
            try:
                self.progress(check, message)
            except Exception:  # noqa: BLE001
                pass
        return report


@dataclass
class CheckRun:
    name: str
    status: str                        # ok | error | timeout | skipped
    duration_ms: float
    error: str = ""                    # for skipped: why
    result: dict[str, Any] | None = None
    observations: list[Observation] = field(default_factory=list)
    retry_after_s: float | None = None # a skipped check asks to be tried again this soon
    summary: str = ""
    gauges: Mapping[str, GaugeSpec] = field(default_factory=dict)   # the check's exported fields
    metrics: type[CheckMetrics] | None = None                       # and its metrics in code

    def status_observation(self) -> Observation:
        """Every run is itself an observation, so rules can flag checks that hang or fail."""
        return Observation(self.name, {"check": self.name, "check_status": self.status, "check_error": self.error,
                                       "duration_ms": round(self.duration_ms, 1)})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "status": self.status, "duration_ms": round(self.duration_ms, 1)}
        if self.error:
            d["error"] = self.error
        if self.result is not None:
            d["result"] = self.result
        return d


@dataclass
class SweepResult:
    node: str
    inventory: Inventory
    runs: list[CheckRun]
    started: float
    boot: str = "current"        # the boot it began in: what it saw is that boot's, even if a fake node
                                 # reboots before it ends (a real one takes the daemon with it)

    @property
    def observations(self) -> list[Observation]:
        out: list[Observation] = []
        for run in self.runs:
            out.append(run.status_observation())
            out.extend(run.observations)
        return out


def run_sweep(host: Host, checks: Sequence[Check], inventory_timeout_s: float = 10.0,
              inventory: Inventory | None = None,
              progress: Callable[[str, str], None] | None = None) -> SweepResult:
    """`inventory`: reuse one read recently (the daemon's fast path for kernel-log wake-ups).
    `progress(check, message)`: what a long check is doing while it runs (diagnose shows it)."""
    started, boot = time.time(), host.current_boot()
    try:
        pci_gpus, pci_error = nvidia_gpus(host.pci), ""
    except OSError as e:
        pci_gpus, pci_error = None, str(e)
    if inventory is not None:
        pass
    elif host.nvml_init_error:
        inventory = Inventory(None, host.nvml_init_error, []).named_from_pci(pci_gpus)
    else:
        inventory = read_inventory(host.nvml, inventory_timeout_s, threaded=host.threaded).named_from_pci(pci_gpus)
    ctx = SweepContext(host, inventory, pci_gpus, pci_error, started, progress or _no_progress)
    if host.threaded:
        runs = _run_threaded(ctx, checks)
    else:
        runs = [_run_inline(ctx, check) for check in checks]
    return SweepResult(host.node_name, inventory, runs, started, boot)


def _run_inline(ctx: SweepContext, check: Check) -> CheckRun:
    t0 = time.monotonic()
    try:
        output = check.run(ctx)
    except CheckSkipped as e:
        return CheckRun(check.name, "skipped", elapsed_ms(t0), str(e), retry_after_s=e.retry_after_s)
    except Exception as e:  # noqa: BLE001 - a broken check is reported, never fatal
        return CheckRun(check.name, "error", elapsed_ms(t0), f"{type(e).__name__}: {e}")
    return finished_run(check, output, elapsed_ms(t0))


def _run_threaded(ctx: SweepContext, checks: Sequence[Check]) -> list[CheckRun]:
    pending = [(check, Pending(lambda c=check: c.run(ctx), f"check-{check.name}")) for check in checks]
    runs = []
    for check, p in pending:
        try:
            output = p.result(p.started + check.timeout_s - time.monotonic())
        except Hung:
            runs.append(CheckRun(check.name, "timeout", p.elapsed_ms,
                                 f"did not finish within its {check.timeout_s:g}s timeout"))
        except CheckSkipped as e:
            runs.append(CheckRun(check.name, "skipped", p.elapsed_ms, str(e), retry_after_s=e.retry_after_s))
        except Exception as e:  # noqa: BLE001 - a broken check is reported, never fatal
            runs.append(CheckRun(check.name, "error", p.elapsed_ms, f"{type(e).__name__}: {e}"))
        else:
            runs.append(finished_run(check, output, p.elapsed_ms))
    return runs


def finished_run(check: Check, output: CheckOutput, duration_ms: float) -> CheckRun:
    """The run a check's output makes: status error when the output says it partly failed."""
    return CheckRun(check.name, "error" if output.error else "ok", duration_ms, output.error,
                    result=output.result, observations=list(output.observations), summary=output.summary,
                    gauges=check.gauges, metrics=check.metrics)


def _no_progress(check: str, message: str) -> None:
    pass


def elapsed_ms(t0: float) -> float:
    return (time.monotonic() - t0) * 1000
