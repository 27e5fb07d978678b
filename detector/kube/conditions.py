"""Node conditions: gpu-npd's own condition types on its own node, and nothing else.

- One strategic-merge PATCH of nodes/<name>/status carries only the types gpu-npd owns (merged by
  `type`), so kubelet's Ready and pressure conditions are never touched.
- Light on the Node: every Node update goes to every watcher of Nodes, so a type is written only once its
  problem was seen on the node (judged True here, or True or cleared on the node when read). A problem never
  seen leaves no condition; one that was seen and is over stays False (its lastTransitionTime says when it
  cleared) for `keep_cleared_s` after it cleared, then goes. The `always` types (what a remediator and the
  readiness gate key on) are written from their first judgement, False included.
- A change is sent at once; changes that arrive while a request is in flight or backing off are
  coalesced: the next request carries the latest state, nothing queues.
- lastTransitionTime moves only when the status flips; a heartbeat refreshes lastHeartbeatTime of the
  types written, and is no request at all when none is.
- On start the node's conditions are read, not reset: a type is written only once the agent has judged
  it; types gpu-npd wrote but no rule produces any more are deleted, and so are an older gpu-npd's False
  conditions of its own types that say only that nothing was found (`legacy_false`: written for every
  type, seen or not), the `always` types excepted.
- Every message gpu-npd writes starts with MARKER, which is how a later gpu-npd recognises its own
  condition types after a rule that produced one is removed. Ownership of a type is its rules' (`owned`):
  nothing else is written or deleted, whatever its message says, but a MARKER type no rule produces; and
  never kubelet's or the maintenance conditions (NEVER_OURS), whatever a rule or a message says.
- One node annotation of gpu-npd's own (annotations.py) rides in the same PATCH (the status subresource
  takes metadata.annotations for Nodes): sent only when its value differs from what the node has (read
  on start) or was last sent, so a heartbeat never carries it; removed with null only if it is there.
- The node label `nvidia.com/gpu.clique` (the node's multi-node NVLink domain, as NVIDIA's DRA driver and
  GPU feature discovery write it) rides in the same PATCH, only when the node had none when read on start:
  a label they set is theirs, reused and never overwritten, changed or removed.
- A GPU note (`note_gpus`: why an unhealthy GPU is not fenced, say no ResourceSlice for DRA device
  taints) ends the message of every true condition whose problems name a GPU, while it holds.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from detector.agent.active import ConditionStatus
from detector.core.nodestatus import MAINTENANCE_CONDITIONS
from detector.core.nvlink_domain import CLIQUE_LABEL
from detector.kube.annotations import UNHEALTHY_GPUS
from detector.kube.api import ApiError, KubeApi
from detector.kube.shapes import obj, objects, text
from detector.kube.pacing import Backoff, jittered
from detector.kube.stamps import parse_rfc3339, rfc3339
from detector.rules.loader import KUBELET_CONDITIONS

MARKER = "gpu-npd: "
MESSAGE_LIMIT = 1024
KEEP_CLEARED_S = 24 * 3600.0    # a cleared condition stays this long after it cleared (its lastTransitionTime)
_UNJUDGED = object()     # no annotation value given yet: the node's annotation is left as it is
# Others' types, never written or deleted whatever a rule or a message says (the rule loader refuses them too):
# kubelet's, and KEP-5683's lifecycle conditions that an administrator's tooling writes and gpu-npd only reads.
NEVER_OURS = frozenset(KUBELET_CONDITIONS) | frozenset(MAINTENANCE_CONDITIONS)

Wire = tuple[str, str, str]     # status, reason, message


def legacy_false(type_: str) -> str:
    """What gpu-npd before issue 34 wrote for every type it judged healthy, seen or not: such a condition
    cannot say whether its problem was ever seen, so it is not kept."""
    return f"{MARKER}no {type_} problem found"


@dataclass
class _Sent:
    status: str
    reason: str
    message: str
    transition: str

    def wire(self) -> Wire:
        return self.status, self.reason, self.message


class ConditionReporter:
    def __init__(self, api: KubeApi, node: str, owned_types: Iterable[str], clock: Callable[[], float],
                 heartbeat_s: float = 300.0, jitter: float = 0.1, rng: random.Random | None = None,
                 backoff: Backoff | None = None, annotation_key: str = UNHEALTHY_GPUS,
                 always: Iterable[str] = (), keep_cleared_s: float = KEEP_CLEARED_S):
        self.api, self.node, self.owned = api, node, set(owned_types) - NEVER_OURS
        self.always = frozenset(always)
        self.keep_cleared_s = keep_cleared_s
        self.annotation_key = annotation_key
        self.clock, self.heartbeat_s, self.jitter = clock, heartbeat_s, jitter
        self.rng = rng or random.Random()
        self.backoff = backoff or Backoff(rng=self.rng)
        self._lock = threading.Lock()
        self._desired: dict[str, ConditionStatus] = {}
        self._sent: dict[str, _Sent] = {}       # our types on the node: as read on start or last sent
        self._seen: set[str] = set()            # types whose problem was seen on this node: written from then on
        self._legacy: set[str] = set()          # an older gpu-npd's never-seen False on the node (read on start)
        self._stale: set[str] = set()           # ours on the node, produced by no rule now: delete
        self._dirty = False
        self._gpu_note = ""
        self._annotation: object = _UNJUDGED    # the value wanted: a string, None (absent) or _UNJUDGED
        self._annotation_sent: str | None = None   # on the node, as read on start or last sent
        self._annotation_written = False
        self._adopted = False                   # the node was read: its labels are known
        self._clique_on_node: str | None = None    # the clique label as read on start or last sent
        self._clique: str = ""                  # the value wanted ("": none to write)
        self._retry_at = 0.0
        self._heartbeat_at: float | None = None
        self.last_error: ApiError | None = None
        self.patches = 0

    # -- input ----------------------------------------------------------------------------------

    def adopt(self, node_object: dict[str, Any]) -> None:
        """Take the node's current conditions and annotation: ours keep their transition times; a True or
        cleared one says its problem was seen; stale ones and an older gpu-npd's never-seen False ones go;
        the annotation is written only if it has to change."""
        with self._lock:
            if not self._annotation_written:
                value = obj(obj(node_object.get("metadata")).get("annotations")).get(self.annotation_key)
                self._annotation_sent = value if isinstance(value, str) else None
            label = obj(obj(node_object.get("metadata")).get("labels")).get(CLIQUE_LABEL)
            if not self._adopted:
                self._clique_on_node = label if isinstance(label, str) else None
            self._adopted = True
            for c in objects(obj(node_object.get("status")).get("conditions")):
                t, message = text(c.get("type")), text(c.get("message"))
                if t in self.owned:
                    if t in self._sent:
                        continue
                    status = text(c.get("status"))
                    self._sent[t] = _Sent(status, text(c.get("reason")), message,
                                          text(c.get("lastTransitionTime")) or rfc3339(self.clock()))
                    if message == legacy_false(t) and status != "True" and t not in self.always:
                        self._legacy.add(t)
                    elif status == "True" or message.startswith(MARKER):
                        self._seen.add(t)
                elif message.startswith(MARKER) and t not in NEVER_OURS:
                    self._stale.add(t)
            self._dirty = self._dirty or self._out_of_date(self.clock())

    def update(self, statuses: Iterable[ConditionStatus]) -> bool:
        """The agent's judgement of some types; True when something must be sent."""
        with self._lock:
            for s in statuses:
                if s.type in self.owned:
                    self._desired[s.type] = s
                    if s.active:
                        self._seen.add(s.type)
            self._dirty = self._dirty or self._out_of_date(self.clock())
            return self._dirty

    def annotate(self, value: str | None) -> bool:
        """The annotation's wanted value (None: absent); True when it changed from the last one given."""
        with self._lock:
            changed, self._annotation = value != self._annotation, value
            return changed

    def clique(self, value: str) -> bool:
        """The node's clique label value ("" none); True when it is to be written (the node has none)."""
        with self._lock:
            self._clique = value
            return self._clique_due()

    def _clique_due(self) -> bool:
        return self._adopted and bool(self._clique) and self._clique_on_node is None

    def note_gpus(self, note: str) -> bool:
        """A note for the conditions that name a GPU ("" for none); True when something must be sent."""
        with self._lock:
            self._gpu_note = note
            self._dirty = self._dirty or self._out_of_date(self.clock())
            return self._dirty

    def annotation_on_node(self) -> str | None:
        """The annotation's value on the node, as read on start or last sent."""
        with self._lock:
            return self._annotation_sent

    def _annotation_due(self) -> bool:
        return self._annotation is not _UNJUDGED and self._annotation != self._annotation_sent

    # -- what the node should show --------------------------------------------------------------

    def _wanted(self, type_: str, now: float) -> Wire | None:
        """The condition the node should show for this type; None: none at all. A type not judged yet keeps
        what the node shows (a restart never resets conditions to healthy), but an older gpu-npd's
        never-seen False and a cleared one past `keep_cleared_s` go whether judged or not."""
        on, s = self._sent.get(type_), self._desired.get(type_)
        if s is not None and (s.active or type_ in self.always):
            return _wire(s, self._gpu_note)
        if type_ in self._legacy or (on is not None and on.status != "True" and type_ not in self.always
                                     and self._expired(on, now)):
            return None
        if s is None:
            return on.wire() if on is not None else None
        seen = type_ in self._seen or (on is not None and on.status == "True")
        return _wire(s, self._gpu_note) if seen else None

    def _expired(self, on: _Sent, now: float) -> bool:
        cleared = parse_rfc3339(on.transition)
        return cleared is not None and now - cleared >= self.keep_cleared_s

    def _out_of_date(self, now: float) -> bool:
        """Called with the lock held: does the node (as last read or sent) differ from what it should show?"""
        if self._stale:
            return True
        for t in self._desired.keys() | self._sent.keys():
            on = self._sent.get(t)
            if self._wanted(t, now) != (on.wire() if on is not None else None):
                return True
        return False

    def _next_expiry(self) -> float | None:
        """When the first cleared condition on the node is due to go (None: none will)."""
        times = [parse_rfc3339(on.transition) for t, on in self._sent.items()
                 if on.status != "True" and t not in self.always]
        return min((t + self.keep_cleared_s for t in times if t is not None), default=None)

    # -- output ---------------------------------------------------------------------------------

    def due_at(self) -> float | None:
        with self._lock:
            if self._dirty or self._annotation_due() or self._clique_due():
                return self._retry_at
            times = [t for t in (self._heartbeat_at if self._desired else None, self._next_expiry()) if t is not None]
            return max(min(times), self._retry_at) if times else None

    def flush(self) -> bool:
        """Send the latest state if due. False when the API server did not take it: retried after a
        backoff, or after `backoff.refused_s` when it refused (a missing permission, no such node)."""
        now = self.clock()
        with self._lock:
            annotation = self._annotation_due() or self._clique_due()
            expiry = self._next_expiry()
            due = (self._dirty or annotation or (expiry is not None and now >= expiry)
                   or (self._heartbeat_at is not None and now >= self._heartbeat_at))
            if not due or now < self._retry_at:
                return True
            body, sent, deleted = self._body(now)
            self._dirty = False
            if not body:                        # nothing of ours to write or refresh: no request at all
                self._heartbeat_at = now + jittered(self.heartbeat_s, self.jitter, self.rng)
                return True
        try:
            self.api.patch_node_status(self.node, body)
        except ApiError as e:
            with self._lock:
                self.last_error, self._dirty = e, True
                self._retry_at = now + self.backoff.after(e.status, e.retry_after_s)
            return False
        with self._lock:
            self.patches += 1
            self.last_error = None
            self.backoff.reset()
            self._retry_at = 0.0
            self._sent.update(sent)
            self._legacy -= sent.keys() | deleted
            for t in deleted:
                self._sent.pop(t, None)
                if not (t in self._desired and self._desired[t].active):    # seen again meanwhile: kept
                    self._seen.discard(t)
            self._stale -= deleted
            meta = body.get("metadata", {})
            if "annotations" in meta:
                self._annotation_sent = meta["annotations"][self.annotation_key]
                self._annotation_written = True
            if "labels" in meta:
                self._clique_on_node = meta["labels"][CLIQUE_LABEL]
            self._dirty = self._dirty or self._out_of_date(now)
            self._heartbeat_at = now + jittered(self.heartbeat_s, self.jitter, self.rng)
        return True

    def _body(self, now: float) -> tuple[dict[str, Any], dict[str, _Sent], set[str]]:
        """The PATCH: every judged type the node should show (all of them, so it is also the heartbeat),
        and a delete for each of ours that should not be there."""
        stamp = rfc3339(now)
        conditions: list[dict[str, Any]] = []
        sent: dict[str, _Sent] = {}
        deleted: set[str] = set()
        for type_ in sorted(self._desired.keys() | self._sent.keys()):
            wanted = self._wanted(type_, now)
            before = self._sent.get(type_)
            if wanted is None:
                if before is not None:
                    deleted.add(type_)
                continue
            if type_ not in self._desired:
                continue                        # not judged yet: the node keeps what it shows
            status, reason, message = wanted
            transition = before.transition if before and before.status == status else stamp
            sent[type_] = _Sent(status, reason, message, transition)
            conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                               "lastHeartbeatTime": stamp, "lastTransitionTime": transition})
        deleted |= self._stale
        conditions.extend({"type": t, "$patch": "delete"} for t in sorted(deleted))
        body: dict[str, Any] = {"status": {"conditions": conditions}} if conditions else {}
        if self._annotation_due():
            body["metadata"] = {"annotations": {self.annotation_key: self._annotation}}
        if self._clique_due():
            body.setdefault("metadata", {})["labels"] = {CLIQUE_LABEL: self._clique}
        return body, sent, deleted

    def snapshot(self) -> dict[str, tuple[str, str]]:
        """What the API server was last told: type -> (status, reason)."""
        with self._lock:
            return {t: (s.status, s.reason) for t, s in self._sent.items()}

    def settled(self, types: Iterable[str]) -> bool:
        """These types are judged and the node shows what was decided for each (True, False, or nothing
        for a problem never seen): what a test or a benchmark waits for before looking at the node."""
        with self._lock:
            return all(t in self._desired for t in types) and not self._dirty and not self._out_of_date(self.clock())


def _wire(s: ConditionStatus, gpu_note: str = "") -> Wire:
    """The condition as sent; a GPU note is kept whole, the problems' text is cut to make room."""
    suffix = f" | {gpu_note[:MESSAGE_LIMIT // 2]}" if gpu_note and s.active and s.names_gpu else ""
    room = MESSAGE_LIMIT - len(suffix)
    message = MARKER + s.message
    if len(message) > room:
        message = message[: room - 1] + "…"
    return ("True" if s.active else "False"), s.reason, message + suffix
