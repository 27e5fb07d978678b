"""The daemon keeps an evidence bundle when it matters: when a GPU turns failed, and when the node first asks for
remediation, before a reboot, a reset or an RMA destroys what the node knows (issue 33).

The keeper is an AgentSink: it only notices and queues (`capture`), so a condition or an Event is never
delayed. One worker thread writes one bundle at a time; the queue holds `queue` requests and drops more with a
log line. Bundles go to `<state dir>/bundles/<UTC time>-<reason>/`, the last `keep` of them within
`max_total_bytes` (oldest removed first), so a remediator that reboots the node finds them after the reboot.

At most one bundle per incident: an incident starts when a GPU turns failed or the node asks for remediation
while nothing was failing, and ends when no GPU is failed and no ask is active. A GPU that fails during an
incident already kept is a new incident of its own (its own bundle); the ask that follows a failure is not.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from detector.agent.active import ConditionStatus
from detector.agent.bundle_index import BUNDLES_DIR, read_bundles
from detector.agent.agent import AgentSink
from detector.agent.bundle_writer import BundleOptions, Manifest, bundle_name, prepare_folder
from detector.core.gpu_health import GpuHealth, gpu_key
from detector.core.types import GpuRef

log = logging.getLogger("gpu_npd.bundles")

BUNDLES = BUNDLES_DIR        # the bundles folder under the state directory
FAILED = "failed"


@dataclass(frozen=True)
class KeeperSettings:
    keep: int = 5                          # bundles kept; the oldest go first
    max_total_bytes: int = 256 << 20       # all bundles together
    max_bundle_bytes: int = 64 << 20       # one bundle
    queue: int = 4                         # requests waiting for the worker; more are dropped (and said)
    redact: bool = True
    remediation_types: tuple[str, ...] = ("GpuNodeNeedsRemediation",)


# (out folder, options) -> the manifest written; gathers the host's evidence (the daemon binds it)
Write = Callable[[Path, BundleOptions], Manifest]
Kept = Callable[[Path, Manifest], None]


@dataclass(frozen=True)
class _Request:
    reason: str
    incident: str
    gpus: tuple[GpuRef, ...]
    asked: float
    done: threading.Event = field(default_factory=threading.Event, compare=False)   # written, failed or dropped
    kept: list[Path] = field(default_factory=list, compare=False)                   # where, once written


class BundleKeeper(AgentSink):
    def __init__(self, folder: Path, write: Write, settings: KeeperSettings | None = None,
                 on_kept: Kept | None = None, history: Path | None = None, boot_id: str | None = None):
        """`boot_id`: this boot; the bundles already kept in it (a restarted daemon) count as this incident's,
        so a restart never takes a second bundle of a GPU that is still failed."""
        self.folder, self.write = folder, write
        self.settings = settings or KeeperSettings()
        self.on_kept = on_kept
        self.history = history
        self._queue: queue.Queue[_Request | None] = queue.Queue(maxsize=max(1, self.settings.queue))
        self._lock = threading.Lock()
        self._failed: set[str] = set()       # GPUs failed now
        self._incident_gpus: set[str] = set()  # GPUs whose failure this incident has kept
        self._asking = False
        self._incident: str | None = None
        self._count = 0
        self.dropped = 0
        self.written: list[Path] = []
        if boot_id is not None:
            self._resume(boot_id)

    def _resume(self, boot_id: str) -> None:
        """The incident a previous run of the daemon kept in this boot (the newest bundle's) and the GPUs its
        bundles named, from the manifests it wrote."""
        for bundle in (b for b in read_bundles(self.folder.parent)[0] if b.boot_id == boot_id):   # newest first
            self._incident = self._incident or bundle.incident or bundle.path.name
            self._incident_gpus.update(gpu_key(GpuRef(g.index, g.uuid, g.pci_bus_id)) for g in bundle.gpus)

    # -- noticing (the agent's thread: returns at once) ------------------------------------------------

    def capture(self, reason: str, gpus: list[GpuRef], wait_s: float = 0.0) -> bool:
        """Queue a bundle about `gpus`; it appears under the bundles folder. Another part of the daemon (a GPU
        reset, on its own thread) asks for one this way before it acts, and may wait up to `wait_s` for it to
        be written, so the evidence is taken before the act destroys it. True when it was written in time."""
        with self._lock:
            incident = self._incident or self._new_incident(reason)
        request = _Request(reason, incident, tuple(gpus), time.time())
        self._enqueue(request)
        return request.done.wait(wait_s) and bool(request.kept)

    def gpus(self, health: list[GpuHealth]) -> None:
        failed = {gpu_key(h.gpu): h.gpu for h in health if h.state == FAILED}
        with self._lock:
            new = [ref for key, ref in failed.items() if key not in self._failed and key not in self._incident_gpus]
            self._failed = set(failed)
            if not new:
                self._maybe_end()
                return
            incident = self._new_incident("gpu failed")
            self._incident_gpus.update(gpu_key(r) for r in new)
        names = ", ".join(r.label() for r in new)
        self._enqueue(_Request(f"gpu failed: {names}", incident, tuple(new), time.time()))

    def conditions(self, statuses: list[ConditionStatus]) -> None:
        asking = any(s.active for s in statuses if s.type in self.settings.remediation_types)
        with self._lock:
            first = asking and not self._asking
            self._asking = asking
            if not first or self._incident is not None:
                self._maybe_end()
                return                   # the ask that follows a kept failure is the same incident
            incident = self._new_incident("remediation")
        self._enqueue(_Request("remediation asked", incident, (), time.time()))

    def _new_incident(self, what: str) -> str:
        self._count += 1
        self._incident = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{self._count}"
        return self._incident

    def _maybe_end(self) -> None:
        if not self._failed and not self._asking:
            self._incident = None
            self._incident_gpus.clear()

    def _enqueue(self, request: _Request) -> None:
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            request.done.set()
            self.dropped += 1
            log.warning("evidence bundle for %r dropped: %d requests already wait for the writer",
                        request.reason, self.settings.queue)

    # -- writing (the worker thread) -------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """The worker: one bundle at a time until `stop`."""
        while not stop.is_set():
            try:
                request = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if request is None:
                return
            try:
                out = self._take(request)
                if out is not None:
                    request.kept.append(out)
            finally:
                request.done.set()

    def _take(self, request: _Request) -> Path | None:
        out = self.folder / bundle_name(request.reason, request.asked)
        n = 1
        while out.exists():
            n += 1
            out = self.folder / f"{bundle_name(request.reason, request.asked)}-{n}"
        started = time.monotonic()
        try:
            prepare_folder(out)
            options = BundleOptions(reason=request.reason, incident=request.incident, gpus=request.gpus,
                                    max_bytes=self.settings.max_bundle_bytes, redact=self.settings.redact,
                                    history=self.history)
            manifest = self.write(out, options)
        except Exception as e:  # noqa: BLE001 - a bundle that fails never takes the daemon with it
            log.warning("evidence bundle %s failed: %s: %s", out, type(e).__name__, e)
            shutil.rmtree(out, ignore_errors=True)
            return None
        self.written.append(out)
        total = sum(f["bytes"] for f in manifest.files)
        log.info("evidence bundle kept: %s (%d files, %d bytes, %.1f s) for %s", out, len(manifest.files), total,
                 time.monotonic() - started, request.reason)
        self.prune()
        if self.on_kept is not None:
            try:
                self.on_kept(out, manifest)
            except Exception:  # noqa: BLE001
                log.exception("reporting the evidence bundle failed")
        return out

    def prune(self) -> None:
        """Keep the newest `keep` bundles within `max_total_bytes`; the oldest go first (by name: UTC time)."""
        bundles = sorted(p for p in self.folder.iterdir() if p.is_dir() and not p.is_symlink()) \
            if self.folder.is_dir() else []
        sizes = {p: sum(f.stat().st_size for f in p.iterdir() if f.is_file()) for p in bundles}
        while bundles and (len(bundles) > self.settings.keep
                           or sum(sizes[p] for p in bundles) > self.settings.max_total_bytes):
            oldest = bundles.pop(0)
            shutil.rmtree(oldest, ignore_errors=True)
            log.info("evidence bundle removed (keeping the last %d within %d bytes): %s", self.settings.keep,
                     self.settings.max_total_bytes, oldest)


def kept_message(out: Path, manifest: Manifest) -> str:
    """The Event's message: where the bundle is on the node and what it holds."""
    total = sum(f["bytes"] for f in manifest.files)
    gpus = ", ".join(f"GPU {g['index']} (serial {g['serial'] or '?'}, {g['pci_bus_id']})" for g in manifest.gpus)
    files = ", ".join(f["name"] for f in manifest.files)
    cut = f"; cut or left out under the cap: {', '.join(manifest.truncated)}" if manifest.truncated else ""
    return (f"evidence kept on the node at {out} ({manifest.reason}{'; ' + gpus if gpus else ''}): "
            f"{len(manifest.files)} files, {total} bytes: {files}{cut}. "
            f"Judge it anywhere: gpu-npd diagnose --nvml replay:DIR")


def describe(settings: KeeperSettings) -> dict[str, Any]:
    return {"keep": settings.keep, "max_total_bytes": settings.max_total_bytes,
            "max_bundle_bytes": settings.max_bundle_bytes}
