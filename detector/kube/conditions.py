"""Node conditions: gpu-npd's own condition types on its own node, and nothing else.

- One strategic-merge PATCH of nodes/<name>/status carries only the types gpu-npd owns (merged by
  `type`), so kubelet's Ready and pressure conditions are never touched.
- A change is sent at once; changes that arrive while a request is in flight or backing off are
  coalesced: the next request carries the latest state, nothing queues.
- lastTransitionTime moves only when the status flips; a heartbeat refreshes lastHeartbeatTime.
- On start the node's conditions are read, not reset: a type is written only once the agent has judged
  it, and types gpu-npd wrote but no rule produces any more are deleted.
- Every message gpu-npd writes starts with MARKER, which is how a later gpu-npd recognises its own
  condition types after a rule that produced one is removed.
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
from detector.core.nvlink_domain import CLIQUE_LABEL
from detector.kube.annotations import UNHEALTHY_GPUS
from detector.kube.api import ApiError, KubeApi
from detector.kube.shapes import obj, objects, text
from detector.kube.pacing import Backoff, jittered
from detector.kube.stamps import rfc3339

MARKER = "gpu-npd: "
MESSAGE_LIMIT = 1024
_UNJUDGED = object()     # no annotation value given yet: the node's annotation is left as it is


@dataclass
class _Sent:
    status: str
    reason: str
    message: str
    transition: str


class ConditionReporter:
    def __init__(self, api: KubeApi, node: str, owned_types: Iterable[str], clock: Callable[[], float],
                 heartbeat_s: float = 300.0, jitter: float = 0.1, rng: random.Random | None = None,
                 backoff: Backoff | None = None, annotation_key: str = UNHEALTHY_GPUS):
        self.api, self.node, self.owned = api, node, set(owned_types)
        self.annotation_key = annotation_key
        self.clock, self.heartbeat_s, self.jitter = clock, heartbeat_s, jitter
        self.rng = rng or random.Random()
        self.backoff = backoff or Backoff(rng=self.rng)
        self._lock = threading.Lock()
        self._desired: dict[str, ConditionStatus] = {}
        self._sent: dict[str, _Sent] = {}
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
        """Take the node's current conditions and annotation: ours keep their transition times; stale
        ones go; the annotation is written only if it has to change."""
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
                    self._sent.setdefault(t, _Sent(text(c.get("status")), text(c.get("reason")), message,
                                                   text(c.get("lastTransitionTime")) or rfc3339(self.clock())))
                elif message.startswith(MARKER):
                    self._stale.add(t)
            self._dirty = self._dirty or bool(self._stale)

    def update(self, statuses: Iterable[ConditionStatus]) -> bool:
        """The agent's judgement of some types; True when something must be sent."""
        with self._lock:
            for s in statuses:
                if s.type in self.owned:
                    self._desired[s.type] = s
            self._dirty = self._dirty or any(self._differs(t, s) for t, s in self._desired.items())
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
            self._dirty = self._dirty or any(self._differs(t, s) for t, s in self._desired.items())
            return self._dirty

    def annotation_on_node(self) -> str | None:
        """The annotation's value on the node, as read on start or last sent."""
        with self._lock:
            return self._annotation_sent

    def _annotation_due(self) -> bool:
        return self._annotation is not _UNJUDGED and self._annotation != self._annotation_sent

    def _differs(self, type_: str, s: ConditionStatus) -> bool:
        sent = self._sent.get(type_)
        return sent is None or (sent.status, sent.reason, sent.message) != _wire(s, self._gpu_note)

    # -- output ---------------------------------------------------------------------------------

    def due_at(self) -> float | None:
        with self._lock:
            if self._dirty or self._annotation_due() or self._clique_due():
                return self._retry_at
            return self._heartbeat_at if self._desired else None

    def flush(self) -> bool:
        """Send the latest state if due. False when the API server did not take it: retried after a
        backoff, or after `backoff.refused_s` when it refused (a missing permission, no such node)."""
        now = self.clock()
        with self._lock:
            annotation = self._annotation_due() or self._clique_due()
            due = self._dirty or annotation or (self._heartbeat_at is not None and now >= self._heartbeat_at)
            if not due or now < self._retry_at or not (self._desired or self._stale or annotation):
                return True
            body, sent = self._body(now)
            self._dirty = False
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
            self._stale -= {c["type"] for c in body.get("status", {}).get("conditions", [])
                            if c.get("$patch") == "delete"}
            meta = body.get("metadata", {})
            if "annotations" in meta:
                self._annotation_sent = meta["annotations"][self.annotation_key]
                self._annotation_written = True
            if "labels" in meta:
                self._clique_on_node = meta["labels"][CLIQUE_LABEL]
            self._dirty = self._dirty or any(self._differs(t, s) for t, s in self._desired.items())
            self._heartbeat_at = now + jittered(self.heartbeat_s, self.jitter, self.rng)
        return True

    def _body(self, now: float) -> tuple[dict[str, Any], dict[str, _Sent]]:
        stamp = rfc3339(now)
        conditions: list[dict[str, Any]] = []
        sent: dict[str, _Sent] = {}
        for type_, s in sorted(self._desired.items()):
            status, reason, message = _wire(s, self._gpu_note)
            before = self._sent.get(type_)
            transition = before.transition if before and before.status == status else stamp
            sent[type_] = _Sent(status, reason, message, transition)
            conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                               "lastHeartbeatTime": stamp, "lastTransitionTime": transition})
        conditions.extend({"type": t, "$patch": "delete"} for t in sorted(self._stale))
        body: dict[str, Any] = {"status": {"conditions": conditions}} if conditions else {}
        if self._annotation_due():
            body["metadata"] = {"annotations": {self.annotation_key: self._annotation}}
        if self._clique_due():
            body.setdefault("metadata", {})["labels"] = {CLIQUE_LABEL: self._clique}
        return body, sent

    def snapshot(self) -> dict[str, tuple[str, str]]:
        """What the API server was last told: type -> (status, reason)."""
        with self._lock:
            return {t: (s.status, s.reason) for t, s in self._sent.items()}


def _wire(s: ConditionStatus, gpu_note: str = "") -> tuple[str, str, str]:
    """The condition as sent; a GPU note is kept whole, the problems' text is cut to make room."""
    suffix = f" | {gpu_note[:MESSAGE_LIMIT // 2]}" if gpu_note and s.active and s.names_gpu else ""
    room = MESSAGE_LIMIT - len(suffix)
    message = MARKER + s.message
    if len(message) > room:
        message = message[: room - 1] + "…"
    return ("True" if s.active else "False"), s.reason, message + suffix
