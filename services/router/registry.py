"""The router's registry of live services, built from heartbeats. Pure and synchronous."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.messages.heartbeat import ROLES, Heartbeat, WorkerEntry


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
    """Services by id and by role. One that missed ``missed_beats`` of its beats is dropped.

    Ages use the router's own clock (when a beat arrived), never the sender's, so clock skew
    between machines cannot keep a dead worker alive.
    """

    def __init__(self, missed_beats: int = 3) -> None:
        self.missed_beats = missed_beats
        self._by_id: dict[str, WorkerRecord] = {}
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
