"""The routing policy's TTFT estimates on /metrics, read at scrape time: how far they were from
what came (per worker and for the pool, over every request and recently) and the terms the
pool's estimate learned (``routing/estimate.py``)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.routing.route import RoutingPolicy

POOL = "pool"  # the scope of the figures over every worker


class EstimateCollector(Collector):
    """One a process (the registry is the process's): the router sets its policy."""

    def __init__(self) -> None:
        self.policy: RoutingPolicy | None = None

    def collect(self):  # noqa: ANN201
        policy = self.policy
        if policy is None:
            return
        scopes = [(POOL, policy.pool.estimate)] + [
            (sid, w.estimate) for sid, w in sorted(policy.workers.items())
        ]
        error = GaugeMetricFamily(
            "kvmesh_router_ttft_estimate_error",
            "the routing estimate's relative TTFT error, |estimated - measured| / measured: "
            "its mean over every request (window=all) and an exponential average (recent)",
            labels=["scope", "window"],
        )
        counted = CounterMetricFamily(
            "kvmesh_router_ttft_estimates",
            "requests whose estimated TTFT was checked against the measured",
            labels=["scope"],
        )
        for scope, estimate in scopes:
            e = estimate.error
            if e.n:
                error.add_metric([scope, "all"], e.mape)
                error.add_metric([scope, "recent"], e.recent)
            counted.add_metric([scope], e.n)
        yield error
        yield counted
        terms = GaugeMetricFamily(
            "kvmesh_router_ttft_estimate_term",
            "what the pool's estimate learned: each fitted term's weight (1 = as configured) "
            "and the queue's factor, or the plain estimate's rates (tokens/s)",
            labels=["term"],
        )
        for term, value in policy.pool.estimate.terms().items():
            terms.add_metric([term], value)
        yield terms


ESTIMATES = EstimateCollector()
REGISTRY.register(ESTIMATES)
