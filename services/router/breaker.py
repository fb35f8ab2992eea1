"""Per-worker circuit breakers: a worker that keeps failing requests is skipped for a while.

Only the worker's own faults count: a task it did not acknowledge, leaving the registry with a
request, no token within the progress bounds, an error event from it. A client's bad request
never reaches a worker, and a busy worker (it says so at once) is not failing; faults within
half a second of each other are one incident (a dying worker fails all it holds at once).
After ``threshold`` faults in a row the breaker opens: the worker gets no request for
``cooldown_s``; then one request may try it (half open): its success closes the breaker, its
fault opens it again for another cool-down. A new process under the worker's id (restarted)
starts closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Gauge

log = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]

INCIDENT_S = 0.5  # faults closer together than this are one

OPEN = Gauge(
    "kvmesh_router_breaker_open",
    "1 while a worker's circuit breaker is open (this router skips it)",
    ["worker"],
)


@dataclass
class _Breaker:
    faults: int = 0  # in a row
    opened_at: float | None = None
    trial_at: float | None = None  # half open: when a request went to try the worker
    last_fault_at: float | None = None


class Breakers:
    def __init__(
        self,
        threshold: int = 3,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._by_worker: dict[str, _Breaker] = {}

    def state(self, worker: str) -> State:
        b = self._by_worker.get(worker)
        if b is None or b.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - b.opened_at >= self.cooldown_s else "open"

    def allows(self, worker: str) -> bool:
        """Whether a request may go to the worker now (half open: one at a time; a trial
        that ended in neither a fault nor a success, say a busy refusal, lapses after a
        cool-down)."""
        state = self.state(worker)
        if state == "closed":
            return True
        b = self._by_worker[worker]
        lapsed = b.trial_at is None or self.clock() - b.trial_at >= self.cooldown_s
        return state == "half_open" and lapsed

    def trying(self, worker: str) -> None:
        """A request was sent to the worker (in half open, it is the trial)."""
        if self.state(worker) == "half_open":
            self._by_worker[worker].trial_at = self.clock()

    def fault(self, worker: str, why: str) -> None:
        """A fault of the worker. Faults within ``INCIDENT_S`` of the one before are one
        incident (a worker that dies fails every request it holds at once): they count once."""
        b = self._by_worker.setdefault(worker, _Breaker())
        now = self.clock()
        if b.last_fault_at is not None and now - b.last_fault_at < INCIDENT_S:
            return
        b.last_fault_at = now
        b.faults += 1
        b.trial_at = None
        if b.opened_at is not None or b.faults >= self.threshold:
            if b.opened_at is None:
                log.warning(
                    "breaker open for %s after %d faults in a row (last: %s); skipped for %g s",
                    worker,
                    b.faults,
                    why,
                    self.cooldown_s,
                )
            b.opened_at = now
            OPEN.labels(worker).set(1)

    def success(self, worker: str) -> None:
        b = self._by_worker.pop(worker, None)
        if b is not None and b.opened_at is not None:
            log.info("breaker closed for %s: it served a request again", worker)
            OPEN.labels(worker).set(0)
