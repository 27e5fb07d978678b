"""What a check is, and the registry through which checks join without editing the core."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from detector.core.types import Observation

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from detector.core.sweep import CheckRun, SweepContext

ENTRY_POINT_GROUP = "gpu_npd.checks"

# Fields every check's status observation carries; rules may use them with any check.
COMMON_FIELDS: dict[str, str] = {
    "check": "the check's name",
    "check_status": "how the check's last run ended: ok, error, timeout or skipped",
    "check_error": "the error (or why it skipped) when check_status is not ok, else empty",
    "duration_ms": "how long the run took, in milliseconds",
}


# Settings every check takes besides its own.
SCHEDULE_FIELDS: dict[str, str] = {
    "interval": "seconds between runs",
    "timeout": "seconds before a run is abandoned (and reported)",
    "enabled": "run it when no --checks list is given (default: true, except for opt-in checks)",
}


@dataclass(frozen=True)
class ConfigField:
    kind: type
    default: Any
    help: str


class CheckSkipped(Exception):
    """The check chose not to run now (the GPUs are busy, another probe is running). Not a failure:
    what it found before still holds. `retry_after_s`: try again this soon instead of a whole interval."""

    def __init__(self, reason: str, retry_after_s: float | None = None):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GaugeSpec:
    """A Prometheus gauge the daemon exports from one numeric field of a check's observations. Its
    series are labelled by the observation's GPU (`gpu`, `pci_bus_id`) and by `labels`, other fields
    of the observation (a link number, a port, a GPU model). Declared, not coded, so a check needs no
    metrics code.

    `by`: the field is a mapping of label value -> number (throttle share by reason), one series each,
    labelled `by`; a key gone from the mapping loses its series. `absent_when_null`: a field that becomes
    null removes the series instead of leaving its last value (a busy clock while the GPU is idle)."""

    field: str
    help: str
    labels: tuple[str, ...] = ()
    by: str = ""
    absent_when_null: bool = False


class CheckMetrics(ABC):
    """Metrics of one check that a declared gauge cannot say: a counter, a summary from the run's result.
    The agent's metrics make one per class, in their own registry, on the first finished run of a check
    that names it (`Check.metrics`), and hand it every finished run of that check from then on."""

    @abstractmethod
    def __init__(self, registry: "CollectorRegistry") -> None:
        """Register the metrics in `registry` (the agent's own: several agents may share a process)."""

    @abstractmethod
    def export(self, run: "CheckRun", when: float) -> None:
        """One finished run; `when`: the wall-clock time its sweep started."""


def gpu_labels(obs: Observation) -> tuple[str, str]:
    """The `gpu` and `pci_bus_id` labels of an observation's series ('' where it names none)."""
    gpu = "" if obs.gpu is None or obs.gpu.index is None else str(obs.gpu.index)
    bus = obs.fields.get("pci_bus_id") or (obs.gpu.pci_bus_id if obs.gpu else "") or ""
    return gpu, bus


@dataclass
class CheckOutput:
    observations: list[Observation] = field(default_factory=list)
    result: dict[str, Any] | None = None      # a check-specific summary for reports
    summary: str = ""                         # the result for people (diagnose's table)
    error: str = ""                           # the run partly failed (an unreadable input): status error,
                                              # the observations it did make still count


class Check(ABC):
    """A plugin that looks at one aspect of the node and reports neutral facts (Observations).

    Subclasses declare the fields their observations carry, so rule files can be validated
    against them when they load, not when a GPU breaks at 3 a.m.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    fields: ClassVar[Mapping[str, str]]
    config_fields: ClassVar[Mapping[str, ConfigField]] = {}
    gauges: ClassVar[Mapping[str, GaugeSpec]] = {}        # metric name -> the field it exports
    metrics: ClassVar[type[CheckMetrics] | None] = None   # what it exports that gauges cannot say
    default_interval_s: ClassVar[float] = 60.0
    default_timeout_s: ClassVar[float] = 15.0
    # False: a GPU inventory up to a minute old will do (the xid check only maps bus ids to GPUs),
    # so a kernel-log wake-up does not cost a full NVML read.
    needs_fresh_inventory: ClassVar[bool] = True
    # False: runs only when asked for (--checks, or `enabled: true` in its settings); for probes that
    # need the GPUs to themselves or software most nodes lack.
    enabled_by_default: ClassVar[bool] = True
    # True: runs for minutes; the daemon gives it a thread of its own so it never delays the others.
    long_running: ClassVar[bool] = False
    # False: not run on a timer but after every sweep (node checks): no interval or timeout to set.
    scheduled: ClassVar[bool] = True

    def __init__(self, config: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        """`clock`: what checks that judge over time (rates, windows, grace periods) read; tests move it."""
        self._clock = clock
        config = dict(config or {})
        unknown = set(config) - set(self.config_fields) - set(self.schedule_fields())
        if unknown:
            known = ", ".join(sorted(self.config_fields)) or "none besides interval and timeout"
            raise ValueError(f"check {self.name!r}: unknown setting(s) {', '.join(sorted(unknown))} "
                             f"(known: {known})")
        self.config = {key: config.get(key, spec.default) for key, spec in self.config_fields.items()}
        self.interval_s = float(config.get("interval", self.default_interval_s))
        self.timeout_s = float(config.get("timeout", self.default_timeout_s))
        self.enabled = bool(config.get("enabled", self.enabled_by_default))

    @abstractmethod
    def run(self, ctx: "SweepContext") -> CheckOutput:
        """Look, and return what was seen. May raise; may block (the sweep abandons it at its timeout)."""

    @classmethod
    def schedule_fields(cls) -> dict[str, str]:
        """The schedule settings it takes: interval, timeout and enabled, or only enabled when unscheduled."""
        return dict(SCHEDULE_FIELDS) if cls.scheduled else {"enabled": SCHEDULE_FIELDS["enabled"]}

    @classmethod
    def all_fields(cls) -> set[str]:
        return set(cls.fields) | set(COMMON_FIELDS)


class RegistryError(Exception):
    """The checks cannot be found or loaded: gpu-npd is not installed, or a plugin is broken."""


class CheckRegistry:
    """Check classes by name. Built-in and third-party checks arrive the same way: entry points."""

    def __init__(self) -> None:
        self._checks: dict[str, type[Check]] = {}

    def register(self, cls: type[Check]) -> type[Check]:
        existing = self._checks.get(cls.name)
        if existing is not None and existing is not cls:
            raise ValueError(f"two checks are named {cls.name!r}: {existing.__module__} and {cls.__module__}")
        self._checks[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Check]:
        try:
            return self._checks[name]
        except KeyError:
            raise KeyError(f"no check named {name!r} (available: {', '.join(self.names())})") from None

    def names(self) -> list[str]:
        return sorted(self._checks)

    def fields_by_check(self) -> dict[str, set[str]]:
        return {name: cls.all_fields() for name, cls in self._checks.items()}

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP) -> "CheckRegistry":
        registry = cls()
        for ep in entry_points(group=group):
            try:
                check = ep.load()
            except Exception as e:  # noqa: BLE001 - a plugin that fails to import is named, not a traceback
                raise RegistryError(f"the check entry point {ep.name} = {ep.value} cannot be loaded: "
                                    f"{type(e).__name__}: {e}") from None
            if not (isinstance(check, type) and issubclass(check, Check)):
                raise RegistryError(f"entry point {ep.name} = {ep.value} is not a Check subclass")
            registry.register(check)
        if not registry._checks:
            raise RegistryError(f"no checks registered under entry-point group {group!r}: gpu-npd's package "
                                "metadata is missing (install it: pip install -e ., or `make install`)")
        return registry
