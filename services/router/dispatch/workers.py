"""The workers as this router sees them: who is alive (the registry, from heartbeats), how far
behind this router runs (its loop lag), and who keeps failing (circuit breakers). Pure and
synchronous.

Ages use the router's own clock (when a beat arrived), never the sender's, so clock skew
between machines cannot keep a dead worker alive.

A worker that keeps failing requests is skipped for a while (its circuit breaker is open).
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Gauge

from shared.messages.heartbeat import ROLES, Heartbeat, WorkerEntry

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    heartbeat: Heartbeat
    seen_at: float  # the router's monotonic clock when the last beat arrived
    first_seen_at: float

    @property
    def service_id(self) -> str:
        return self.heartbeat.service_id

    @property
    def ready(self) -> bool:
        return self.heartbeat.status == "ready"

    def age(self, now: float) -> float:
        return now - self.seen_at


class WorkerRegistry:
    """Services by id and by role. One that missed ``missed_beats`` of its beats is dropped."""

    def __init__(self, missed_beats: int = 3) -> None:
        self.missed_beats = missed_beats
        self._by_id: dict[str, WorkerRecord] = {}
        # Every model a worker has said it serves since this router started: a request for
        # one whose workers are all gone now is a 503 (retry), for any other a 404.
        self.models_served: set[str] = set()
        self._by_role: dict[str, set[str]] = {role: set() for role in ROLES}

    def __len__(self) -> int:
        return len(self._by_id)

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; returns True when it registers a new service, or a new
        process under a known id (restarted before its old one was dropped)."""
        if hb.status == "stopped":
            self.remove(hb.service_id)
            return False
        old = self._by_id.get(hb.service_id)
        if old is not None and (
            old.heartbeat.role != hb.role or old.heartbeat.started_at != hb.started_at
        ):
            self.remove(hb.service_id)  # another process under this id: start over
            old = None
        first_seen = now if old is None else old.first_seen_at
        self._by_id[hb.service_id] = WorkerRecord(hb, seen_at=now, first_seen_at=first_seen)
        if hb.role in ("prefill", "decode") and (old is None or old.heartbeat.models != hb.models):
            self.models_served.update(hb.models)  # (an encoder lists what it could encode)
        self._by_role[hb.role].add(hb.service_id)
        return old is None

    def remove(self, service_id: str) -> WorkerRecord | None:
        record = self._by_id.pop(service_id, None)
        if record is not None:
            self._by_role[record.heartbeat.role].discard(service_id)
        return record

    def expire(self, now: float, grace_s: float = 0.0) -> list[WorkerRecord]:
        """Drop every service whose last beat is older than ``missed_beats`` of its intervals
        (plus ``grace_s``: how far behind this router runs, its beats waiting in its queue)."""
        dead = [
            r
            for r in self._by_id.values()
            if r.age(now) > self.missed_beats * r.heartbeat.interval_s + grace_s
        ]
        for record in dead:
            self.remove(record.service_id)
        return dead

    def get(self, service_id: str) -> WorkerRecord | None:
        return self._by_id.get(service_id)

    def alive(self, service_id: str) -> bool:
        """Whether the service may still answer: registered, its last beat not "stopped"
        (dropped, expired or stopped: gone)."""
        record = self._by_id.get(service_id)
        return record is not None and record.heartbeat.status != "stopped"

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Known services (ready or draining), of one role or all, ordered by id."""
        ids = self._by_id.keys() if role is None else self._by_role[role]
        return [self._by_id[i] for i in sorted(ids)]

    def ready(self, role: str) -> list[WorkerRecord]:
        return [r for r in self.workers(role) if r.ready]

    def missing_roles(self) -> list[str]:
        """Roles with no ready service."""
        return [role for role in ROLES if not self.ready(role)]

    def entries(self, now: float, role: str | None = None) -> list[WorkerEntry]:
        return [
            WorkerEntry(
                service_id=r.service_id,
                role=r.heartbeat.role,
                status=r.heartbeat.status,
                addresses=r.heartbeat.addresses,
                models=r.heartbeat.models,
                load=r.heartbeat.load,
                age_s=round(r.age(now), 3),
                uptime_s=round(r.heartbeat.sent_at - r.heartbeat.started_at, 3),
            )
            for r in self.workers(role)
        ]

    def check_integrity(self) -> None:
        indexed = set().union(*self._by_role.values())
        assert indexed == set(self._by_id), "role index and id map disagree"
        for role, ids in self._by_role.items():
            for service_id in ids:
                record = self._by_id[service_id]
                assert record.heartbeat.role == role, f"{service_id} filed under {role}"
                assert record.service_id == service_id
                assert record.first_seen_at <= record.seen_at


class LoopLag:
    """How far behind the router's event loop runs: a timer's wake-ups against when it was
    due, the worst of the last few. A router that far behind can neither judge heartbeats
    (they wait in its queue too) nor take more requests (they would wait as long)."""

    def __init__(self, kept: int = 4) -> None:
        self._recent: deque[float] = deque([0.0], maxlen=kept)

    def observe(self, late_s: float) -> None:
        self._recent.append(max(0.0, late_s))

    @property
    def seconds(self) -> float:
        return max(self._recent)


# -- circuit breakers -------------------------------------------------------------------------

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

    def faults(self, worker: str) -> int:
        """The worker's faults in a row (incidents, each counted once)."""
        b = self._by_worker.get(worker)
        return b.faults if b is not None else 0

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
        """The worker served (or registered): its breaker closed, its gauge 0 (there from
        its first beat on, so a dashboard sees every worker's)."""
        b = self._by_worker.pop(worker, None)
        if b is not None and b.opened_at is not None:
            log.info("breaker closed for %s: it served a request again", worker)
        OPEN.labels(worker).set(0)
