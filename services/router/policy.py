"""Which prefill and decode worker serve a request. Pure: registry records in, a pick out.

A policy is picked by name (setting KVMESH_ROUTER_ROUTING_POLICY). The routing issue adds a
cache-aware policy; ``RouteRequest`` already carries what it needs (the prompt's block hashes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.router.registry import WorkerRecord


@dataclass(frozen=True)
class RouteRequest:
    model: str
    n_prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[str, ...] = ()


@dataclass
class Outstanding:
    """What this router has sent to each worker and not yet seen finish: fresher than the
    worker's last heartbeat (which is up to an interval old)."""

    requests: dict[str, int] = field(default_factory=dict)

    def add(self, service_id: str) -> None:
        self.requests[service_id] = self.requests.get(service_id, 0) + 1

    def done(self, service_id: str) -> None:
        left = self.requests.get(service_id, 0) - 1
        if left > 0:
            self.requests[service_id] = left
        else:
            self.requests.pop(service_id, None)

    def __getitem__(self, service_id: str) -> int:
        return self.requests.get(service_id, 0)


class RoutingPolicy(ABC):
    @abstractmethod
    def rank_prefill(
        self, workers: list[WorkerRecord], request: RouteRequest, outstanding: Outstanding
    ) -> list[WorkerRecord]:
        """Prefill candidates, best first."""

    @abstractmethod
    def rank_decode(
        self, workers: list[WorkerRecord], request: RouteRequest, outstanding: Outstanding
    ) -> list[WorkerRecord]:
        """Decode candidates, best first (ones without room for the request left out)."""


class LeastLoaded(RoutingPolicy):
    """Fewest requests in flight (this router's count, else the worker's own report); decode
    also needs KV headroom for the prompt and the whole answer."""

    def rank_prefill(self, workers, request, outstanding):  # noqa: ANN001, ANN201
        def load(w: WorkerRecord) -> tuple[int, int]:
            reported = w.heartbeat.load.inflight + w.heartbeat.load.queued
            return max(outstanding[w.service_id], reported), reported

        return sorted(workers, key=load)

    def rank_decode(self, workers, request, outstanding):  # noqa: ANN001, ANN201
        def headroom(w: WorkerRecord) -> int:
            load = w.heartbeat.load
            return load.kv_blocks_total - load.kv_blocks_used

        def load(w: WorkerRecord) -> tuple[int, int]:
            return max(outstanding[w.service_id], w.heartbeat.load.inflight), -headroom(w)

        return sorted((w for w in workers if headroom(w) > 0), key=load)


POLICIES: dict[str, type[RoutingPolicy]] = {"least-loaded": LeastLoaded}
