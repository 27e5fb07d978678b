"""Prometheus metrics of one node agent, in a registry of its own (no process-global collectors, so
several agents can live in one process). Names follow node-problem-detector where it has one.

A registry the agent makes itself also carries the process's own metrics (prometheus_client's
ProcessCollector: `process_resident_memory_bytes`, `process_cpu_seconds_total`, open fds, start time),
so the daemon's footprint can be watched where it runs, against the DaemonSet's requests and limits.
They describe the whole process: where agents share one (the tests) or run beside the API emulator
(`make demo`), those count too.

A check's own metrics come with its runs: the gauges it declares (`Check.gauges`), and what those
cannot say, in code of its own (`Check.metrics`); this module names no check."""

from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

from detector.agent.active import ConditionStatus
from detector.agent.agent import AgentSink
from detector.core.check import CheckMetrics, GaugeSpec, gpu_labels
from detector.core.inventory import Inventory
from detector.core.gpu_health import STATE_VALUE, GpuHealth, gpu_key
from detector.core.sweep import CheckRun, SweepResult
from detector.core.types import Observation, Problem


class AgentMetrics(AgentSink):
    def __init__(self, registry: CollectorRegistry | None = None):
        """`registry`: where to register; without one, a new registry that also gets the process
        collector (a registry passed in may have one already, and registering it twice fails)."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        if registry is None:
            ProcessCollector(registry=r)          # reads /proc/self at scrape time; nothing off Linux
        self.problem_counter = Counter("gpu_npd_problem_counter", "Problems found: events as they fire, "
                                       "conditions when they become true", ["type", "reason"], registry=r)
        self.problem_gauge = Gauge("gpu_npd_problem_gauge", "1 while a condition of this type is true with "
                                   "this reason", ["type", "reason"], registry=r)
        self._check_gauges: dict[str, Gauge] = {}       # made on a check's first run: its declared gauges
        self._check_metrics: dict[type[CheckMetrics], CheckMetrics] = {}    # and its own metrics
        self._by_keys: dict[tuple[str, tuple[str, ...]], set[str]] = {}    # a `by` gauge's keys per series
        self.check_duration = Gauge("gpu_npd_check_duration_seconds", "Duration of the check's last run",
                                    ["check"], registry=r)
        self.check_runs = Counter("gpu_npd_check_runs", "Check runs by how they ended (ok, error, timeout)",
                                  ["check", "status"], registry=r)
        self.api_requests = Counter("gpu_npd_api_requests", "Kubernetes API requests by verb, resource and "
                                    "response code ('error': no response)", ["verb", "resource", "code"],
                                    registry=r)
        self._active: dict[str, str | None] = {}
        self.gpu_state = Gauge("gpu_npd_gpu_health", "Each GPU's state from the problems naming it now: 0 healthy, "
                               "1 degraded (a warning), 2 failed (a critical problem); `action` is the recommended "
                               "action for that GPU (NONE when healthy)",
                               ["gpu", "uuid", "pci_bus_id", "state", "action"], registry=r)
        self._gpu_series: dict[str, tuple[str, ...]] = {}
        self.gpu_incidents = Gauge("gpu_npd_gpu_incidents", "Each GPU's incidents (critical reset-, reboot- or "
                                   "replace-class problems) within the node check's flaky_window, from the history "
                                   "kept across reboots; GpuFlaky when they span flaky_boots boots",
                                   ["gpu", "uuid", "pci_bus_id"], registry=r)
        self._incident_series: dict[str, tuple[str, ...]] = {}
        self.gpu_info = Gauge("gpu_npd_gpu_info", "1 for each GPU NVML sees, labelled with what an RMA ticket asks "
                              "for: its UUID, serial number, board part number and VBIOS version",
                              ["gpu", "uuid", "pci_bus_id", "name", "serial", "board_part_number", "vbios_version"],
                              registry=r)
        self._info_series: dict[str, tuple[str, ...]] = {}

    def reporting_from(self, judge: Callable[[], bool]) -> None:
        """`gpu_npd_reporting`: 1 while reports reach the API server (the daemon's /readyz), read at scrape."""
        Gauge("gpu_npd_reporting", "1 while conditions and events reach the Kubernetes API server; 0 while it "
              "is unreachable or refuses (problems are still in these metrics and the log)",
              registry=self.registry).set_function(lambda: 1.0 if judge() else 0.0)

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        for s in statuses:
            before = self._active.get(s.type)
            now = s.reason if s.active else None
            if before == now:
                continue
            if before is not None:
                self.problem_gauge.labels(s.type, before).set(0)
            if now is not None:
                self.problem_gauge.labels(s.type, now).set(1)
                self.problem_counter.labels(s.type, now).inc()
            self._active[s.type] = now

    def events(self, problems: list[Problem]) -> None:
        for p in problems:
            self.problem_counter.labels(p.type, p.reason).inc()

    def sweep(self, result: SweepResult, problems: list[Problem]) -> None:
        self._gpu_info(result.inventory)
        for run in result.runs:
            self.check_runs.labels(run.name, run.status).inc()
            self.check_duration.labels(run.name).set(run.duration_ms / 1000)
            self._check_metrics_of(run, result.started)
            for obs in run.observations:
                self._export(run.gauges, obs)

    def _check_metrics_of(self, run: CheckRun, when: float) -> None:
        """A check's metrics in code: made on its first finished run (absent, not 0, till then)."""
        if run.metrics is None:
            return
        metrics = self._check_metrics.get(run.metrics)
        if metrics is None:
            metrics = self._check_metrics[run.metrics] = run.metrics(self.registry)
        metrics.export(run, when)

    def _gpu_info(self, inventory: Inventory) -> None:
        """One series per GPU by bus id; a GPU whose labels change (a board swapped, a VBIOS updated) loses
        its old series, and a GPU NVML no longer reads keeps its last one (the serial is wanted most then)."""
        for g in inventory.gpus:
            if not g.pci_bus_id or not g.uuid:
                continue
            ident = g.identity
            labels = (str(g.index), g.uuid, g.pci_bus_id, g.name or "", ident.serial or "",
                      ident.board_part_number or "", ident.vbios_version or "")
            before = self._info_series.get(g.pci_bus_id)
            if before is not None and before != labels:
                self.gpu_info.remove(*before)
            self.gpu_info.labels(*labels).set(1)
            self._info_series[g.pci_bus_id] = labels

    def _export(self, gauges: Mapping[str, GaugeSpec], obs: Observation) -> None:
        """Set the gauges a check declares from one observation; a field it lacks (None) sets nothing, or
        removes the series where the gauge says `absent_when_null`."""
        gpu, bus = gpu_labels(obs)
        for metric, spec in gauges.items():
            value = obs.fields.get(spec.field)
            labels = (gpu, bus, *(str(obs.fields.get(label, "")) for label in spec.labels))
            if spec.by:
                self._export_by(metric, spec, labels, value if isinstance(value, Mapping) else {})
                continue
            if not isinstance(value, (int, float)):
                if value is None and spec.absent_when_null and metric in self._check_gauges:
                    self._remove(self._check_gauges[metric], labels)
                continue
            self._gauge(metric, spec).labels(*labels).set(float(value))

    def _gauge(self, metric: str, spec: GaugeSpec) -> Gauge:
        gauge = self._check_gauges.get(metric)
        if gauge is None:
            names = ["gpu", "pci_bus_id", *spec.labels, *([spec.by] if spec.by else [])]
            gauge = self._check_gauges[metric] = Gauge(metric, spec.help, names, registry=self.registry)
        return gauge

    def _export_by(self, metric: str, spec: GaugeSpec, labels: tuple[str, ...], values: Mapping) -> None:
        """One series per key of a mapping field; keys that were set before and are gone lose theirs."""
        gauge = self._gauge(metric, spec)
        before = self._by_keys.get((metric, labels), set())
        now = {str(k) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key in now:
            gauge.labels(*labels, key).set(float(values[key]))
        for key in before - now:
            self._remove(gauge, (*labels, key))
        self._by_keys[(metric, labels)] = now

    @staticmethod
    def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
        try:
            gauge.remove(*labels)
        except KeyError:
            pass

    def gpus(self, health: list[GpuHealth]) -> None:
        """One series per GPU; its labels change with its state, so the old series goes."""
        for h in health:
            key = gpu_key(h.gpu)
            labels = ("" if h.gpu.index is None else str(h.gpu.index), h.gpu.uuid or "", h.gpu.pci_bus_id or "",
                      h.state, h.action)
            before = self._gpu_series.get(key)
            if before is not None and before != labels:
                self.gpu_state.remove(*before)
            self.gpu_state.labels(*labels).set(STATE_VALUE[h.state])
            self._gpu_series[key] = labels
            before = self._incident_series.get(key)
            if before is not None and before != labels[:3]:
                self.gpu_incidents.remove(*before)
            self.gpu_incidents.labels(*labels[:3]).set(h.incidents)
            self._incident_series[key] = labels[:3]

    def api_request(self, verb: str, resource: str, code: str) -> None:
        self.api_requests.labels(verb, resource, code).inc()

