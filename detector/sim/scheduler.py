"""One scheduler for a whole fleet: a heap of timed tasks and a few worker threads, never a thread
per node. A task says when it wants to run next; anything may wake it sooner; a task never runs on
two workers at once (a wake-up while it runs makes it run again right after)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("gpu_npd.sim")

ERROR_RETRY_S = 5.0


class Task:
    """Subclasses implement `run`, returning the time to run next, or None to wait for a wake-up."""

    name = "task"

    def __init__(self) -> None:
        self._due: float | None = None       # the heap entry that counts; others are stale
        self._running = False
        self._again: float | None = None     # woken while running: run again at this time

    def run(self) -> float | None:
        raise NotImplementedError


class Scheduler:
    def __init__(self, workers: int = 4, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._heap: list[tuple[float, int, Task]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, name=f"sim-worker-{i}", daemon=True)
                         for i in range(workers)]
        self.runs = 0

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():                 # never started when the fleet failed to register its nodes
                t.join(timeout_s)

    def wake(self, task: Task, when: float | None = None) -> None:
        """Run `task` at `when` (default: now), unless it is already due sooner."""
        when = self.clock() if when is None else when
        with self._cond:
            if task._running:
                task._again = when if task._again is None else min(task._again, when)
                return
            self._push(task, when)

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _push(self, task: Task, when: float) -> None:
        if task._due is not None and task._due <= when:
            return
        task._due = when
        heapq.heappush(self._heap, (when, next(self._seq), task))
        if self._heap[0][2] is task:
            self._cond.notify()

    def _next_task(self) -> Task | None:
        with self._cond:
            while not self._stop.is_set():
                if not self._heap:
                    self._cond.wait(0.5)
                    continue
                when, _, task = self._heap[0]
                if task._due != when:                  # superseded by an earlier wake-up
                    heapq.heappop(self._heap)
                    continue
                wait = when - self.clock()
                if wait > 0:
                    self._cond.wait(min(wait, 0.5))
                    continue
                heapq.heappop(self._heap)
                task._due, task._running = None, True
                return task
        return None

    def _work(self) -> None:
        while (task := self._next_task()) is not None:
            try:
                when = task.run()
            except Exception:  # noqa: BLE001 - one node's bug must not stop the fleet
                log.exception("%s failed", task.name)
                when = self.clock() + ERROR_RETRY_S
            with self._cond:
                self.runs += 1
                task._running = False
                again, task._again = task._again, None
                times = [t for t in (when, again) if t is not None]
                if times:
                    self._push(task, min(times))
