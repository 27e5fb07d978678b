"""An overall deadline for each API request, not only urllib3's per-read timeout.

urllib3's read timeout bounds each read of the socket: a server (or proxy) that trickles one byte a
second satisfies every read and holds a request open for hours, and with it the sender thread, while
nothing records a failure. Here one watchdog thread per client ends any request still running at its
deadline by shutting its socket down: the blocked read returns at once, urllib3 raises, and the caller
sees a timeout like any other failure.

The connection a request runs on is found through `_current` (a ContextVar: each thread, and so each
request in flight, has its own): the guarded connection classes below record themselves there when urllib3
sends a request or reads its answer, so the watchdog reaches the socket in the header phase too.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool


@dataclass(eq=False)
class Guard:
    """One request under a deadline: the connection it runs on, and whether the deadline has passed."""

    deadline_s: float
    conn: HTTPConnection | None = None
    fired: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, conn: HTTPConnection) -> None:
        with self._lock:
            self.conn = conn
            fired = self.fired
        if fired:
            _cut(conn)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            conn = self.conn
        if conn is not None:
            _cut(conn)


_current: ContextVar[Guard | None] = ContextVar("gpu_npd_request_guard", default=None)


def _cut(conn: HTTPConnection) -> None:
    sock = getattr(conn, "sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                      # already closed: the request ended on its own


class _Guarded:
    """Mixed into urllib3's connections: tell the running request's guard which connection it is on."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        self._attach()
        return super().request(*args, **kwargs)  # type: ignore[misc]

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        self._attach()
        return super().getresponse(*args, **kwargs)  # type: ignore[misc]

    def _attach(self) -> None:
        guard = _current.get()
        if guard is not None:
            guard.attach(self)  # type: ignore[arg-type]


class GuardedHTTPConnection(_Guarded, HTTPConnection):
    pass


class GuardedHTTPSConnection(_Guarded, HTTPSConnection):
    pass


class GuardedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = GuardedHTTPConnection


class GuardedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = GuardedHTTPSConnection


def guard_pool(pool: urllib3.PoolManager) -> urllib3.PoolManager:
    """`pool`, making its connections guarded (a request without a guard runs as before)."""
    pool.pool_classes_by_scheme = {"http": GuardedHTTPConnectionPool, "https": GuardedHTTPSConnectionPool}
    return pool


class Watchdog:
    """One thread (started on first use) that fires guards at their deadlines; cheap to arm and disarm."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Guard]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline_s: float) -> Guard:
        """A guard that fires `deadline_s` from now unless disarmed; made current for this thread."""
        guard = Guard(deadline_s)
        with self._cv:
            heapq.heappush(self._heap, (self._clock() + deadline_s, next(self._order), guard))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="api-deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()
        return guard

    def disarm(self, guard: Guard) -> None:
        """The request ended: its guard will not fire (it is dropped from the heap when it comes due)."""
        with guard._lock:
            guard.conn = None
            guard.deadline_s = -1.0       # marks it done; its heap entry is skipped

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._heap and self._heap[0][2].deadline_s < 0:
                    heapq.heappop(self._heap)
                if not self._heap:
                    if not self._cv.wait(60.0) and not self._heap:
                        self._thread = None
                        return                    # idle for a minute: the next arm starts a new thread
                    continue
                due, _, guard = self._heap[0]
                wait = due - self._clock()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
            if guard.deadline_s >= 0:
                guard.fire()


class guarded:
    """`with guarded(watchdog, seconds) as guard:` — the requests this thread makes inside are cut at the
    deadline; `guard.fired` says whether that is why one failed."""

    def __init__(self, watchdog: Watchdog, deadline_s: float):
        self.watchdog, self.deadline_s = watchdog, deadline_s
        self.guard: Guard | None = None
        self._token: Any = None

    def __enter__(self) -> Guard:
        self.guard = self.watchdog.arm(self.deadline_s)
        self._token = _current.set(self.guard)
        return self.guard

    def __exit__(self, *exc: object) -> None:
        try:
            _current.reset(self._token)
        except ValueError:
            _current.set(None)        # a watch generator closed from another context: nothing to restore
        assert self.guard is not None
        self.watchdog.disarm(self.guard)


__all__ = ["Guard", "Watchdog", "guard_pool", "guarded"]
