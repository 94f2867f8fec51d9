"""Fair admission of SQL tasks to a probe's workers, between the clients that asked for them.

At most ``limit`` tasks run at once, and at most ``share`` of them for one client, so one
client's burst of heavy queries always leaves room for another's ``SELECT 1``. What a client
asks past its share waits in its own queue (``per_client`` at most); the queues are served
round robin, one task per client in turn; past a client's queue (or ``total`` waiting in
all), that client hears "busy" and no one else does. Pure bookkeeping: the caller
(``executors.WorkerThreads``) holds the lock and runs what it is told to.
"""

from __future__ import annotations

import collections
from typing import Any, Literal

RUN, WAIT, BUSY = "run", "wait", "busy"


class FairAdmission:
    def __init__(self, *, limit: int, share: int, per_client: int, total: int) -> None:
        self.limit, self.share, self.per_client, self.total = limit, min(share, limit), per_client, total
        self.running: collections.Counter[str] = collections.Counter()
        self.running_total = 0
        self._waiting: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self.waiting_total = 0

    def _may_run(self, key: str) -> bool:
        return self.running_total < self.limit and self.running[key] < self.share

    def _start(self, key: str) -> None:
        self.running[key] += 1
        self.running_total += 1

    def offer(self, key: str, item: Any) -> Literal["run", "wait", "busy"]:
        """``item`` of client ``key``: "run" it now (counted as running), it "wait"s its turn
        (``finished`` hands it out), or "busy": refused."""
        queue = self._waiting.get(key)
        if not queue and self._may_run(key):
            self._start(key)
            return RUN
        if (queue is not None and len(queue) >= self.per_client) or self.waiting_total >= self.total:
            return BUSY
        if queue is None:
            queue = self._waiting[key] = collections.deque()
        queue.append(item)
        self.waiting_total += 1
        return WAIT

    def finished(self, key: str) -> tuple[str, Any] | None:
        """A task of ``key`` ended: the next ``(key, item)`` to run now (counted as running),
        the client after the last one served first; None if nothing may run."""
        self.running[key] -= 1
        if not self.running[key]:
            del self.running[key]
        self.running_total -= 1
        for client in list(self._waiting):
            if self._may_run(client):
                queue = self._waiting.pop(client)
                item = queue.popleft()
                if queue:
                    self._waiting[client] = queue  # to the back of the round
                self.waiting_total -= 1
                self._start(client)
                return client, item
        return None
