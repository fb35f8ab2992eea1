"""Prometheus metrics: every service serves them at GET /metrics.

The metric objects live in prometheus_client's process-wide registry (its design: one process,
one registry); each service updates the ones that concern it. What a service already keeps as
its load (requests in flight and queued, KV pool, queued tokens) is read at scrape time, not
copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.messages.heartbeat import Load

if TYPE_CHECKING:
    from shared.eplb.balancer import BalancerStats

# The router's view of requests.
REQUESTS = Counter(
    "kvmesh_requests", "requests answered, by endpoint and HTTP status", ["endpoint", "status"]
)
TTFT = Histogram(
    "kvmesh_ttft_seconds",
    "time to first token, as the router saw it",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TPOT = Histogram(
    "kvmesh_tpot_seconds",
    "time per output token after the first, per request",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
TOKEN_TRANSIT = Histogram(
    "kvmesh_token_transit_seconds",
    "a message of token events from a worker's send to this router's receipt (NATS both ways: "
    "the worker's publish, the server, the router's read; by the two hosts' clocks)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
TOKEN_MESSAGES = Counter(
    "kvmesh_token_messages",
    "messages of token events this router received, by path: link (a worker's token link, "
    "shared/bus/tokens.py) or nats",
    ["path"],
)
INPUT_TOKENS = Counter(
    "kvmesh_input_tokens", "prompt tokens by where their KV came from", ["source"]
)  # computed, memory, storage
OUTPUT_TOKENS = Counter("kvmesh_output_tokens", "tokens generated")
# Classes (shared/messages/generate.py) and tenants: a tenant is a key's (with auth off, all
# requests are one tenant's here: a header's name would make a label of anything sent).
REFUSED = Counter(
    "kvmesh_refused",
    "requests refused for load (429), by class and by what was full",
    ["priority", "where"],
)
CLASS_TTFT = Histogram(
    "kvmesh_class_ttft_seconds",
    "time to first token, as the router saw it, by class and tenant",
    ["priority", "tenant"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)
QUEUED = Gauge("kvmesh_queued", "tasks waiting in a prefill worker's queue, by class", ["priority"])
QUEUE_WAIT = Histogram(
    "kvmesh_queue_wait_seconds",
    "time a task waited in a prefill worker's queue, by class",
    ["priority"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)
SPEC_TOKENS = Counter(
    "kvmesh_spec_tokens",
    "speculative decoding: drafted tokens verified (kind=drafted) and accepted (kind=accepted)",
    ["kind"],
)
LORA = Gauge(
    "kvmesh_lora",
    "LoRA adapters on a worker: resident (what=resident), loaded since start (what=loads) and "
    "the seconds those loads took (what=load_seconds)",
    ["what"],
)
ENGINE_FAILURES = Counter(
    "kvmesh_engine_failures",
    "engine calls that raised, by what (decode_step, prefill): each failed the requests it held",
    ["what"],
)
MOVES = Counter(
    "kvmesh_request_moves",
    "requests moved off failed workers: retried before their first token, or resumed mid-answer",
    ["kind"],
)
RESUMES_WAITING = Gauge(
    "kvmesh_resumes_waiting",
    "answers half sent whose workers are gone, waiting (resume_wait_s at most) for one to carry on",
)

# Bytes over each link: handoff (prefill → decode KV), store_write / store_read (storage
# tier), image (router → encoder), embeds (encoder → stream → prefill).
BYTES = Counter("kvmesh_bytes", "bytes moved, by link and direction", ["link", "direction"])

# Workers and the encoder.
PREFILL_TOKENS = Counter(
    "kvmesh_prefill_tokens", "prompt tokens a worker prefilled, computed or reused", ["kind"]
)
STORE_FAILURES = Counter(
    "kvmesh_kv_store_failures",
    "KV blocks the storage tier failed to take or give, by op (write, read) and why (full, "
    "read_only, io): a write not stored, a read a miss",
    ["op", "why"],
)
KV_EVENTS_MALFORMED = Counter(
    "kvmesh_kv_events_malformed",
    "KV events dropped by a holder of the block index (cachemeta, a router) because they did "
    "not parse or did not hold together (a hash of the wrong width, sizes not one per hash)",
)
STREAM_BYTES = Gauge(
    "kvmesh_stream_bytes",
    "a JetStream stream's size on the NATS servers, as the service that configures it last "
    "read it, and its bound (of: held, limit)",
    ["stream", "of"],
)
CACHEMETA_FAILURES = Counter(
    "kvmesh_cachemeta_failures",
    "cachemeta's housekeeping that failed, by what (snapshot, gc): it goes on, and retries",
    ["what"],
)
IMAGES = Counter(
    "kvmesh_images", "images answered by the encoder, by where embeddings came from", ["source"]
)


class LoadCollector(Collector):
    """The service's Load (and, on the router, each known service's heartbeat age) at scrape
    time."""

    def __init__(
        self,
        role: str,
        load: Callable[[], Load],
        heartbeat_ages: Callable[[], list[tuple[str, str, float]] | None],
        nats_pending: Callable[[], tuple[int, int, int] | None] = lambda: None,
    ) -> None:
        self.role = role
        self.load = load
        self.heartbeat_ages = heartbeat_ages
        self.nats_pending = nats_pending

    def collect(self):  # noqa: ANN201
        load = self.load()
        for name, help_, value in (
            ("kvmesh_inflight_requests", "requests being worked on", load.inflight),
            ("kvmesh_queued_requests", "requests waiting to start", load.queued),
            ("kvmesh_queued_tokens", "prefill: uncached prompt tokens waiting", load.queued_tokens),
            ("kvmesh_kv_blocks_used", "KV pool blocks in use", load.kv_blocks_used),
            ("kvmesh_kv_blocks_total", "KV pool blocks", load.kv_blocks_total),
            (
                "kvmesh_kv_write_skips",
                "blocks not stored (write-behind queue full)",
                load.kv_write_skips,
            ),
        ):
            g = GaugeMetricFamily(name, help_, labels=["role"])
            g.add_metric([self.role], value)
            yield g
        pending = self.nats_pending()
        if pending is not None:
            out_bytes, in_msgs, in_bytes = pending
            g = GaugeMetricFamily(
                "kvmesh_nats_pending_bytes",
                "bytes waiting on this process's NATS connection: published, not yet written "
                "(out); received, not yet handled (in)",
                labels=["role", "direction"],
            )
            g.add_metric([self.role, "out"], out_bytes)
            g.add_metric([self.role, "in"], in_bytes)
            yield g
            g = GaugeMetricFamily(
                "kvmesh_nats_pending_messages",
                "messages received on this process's NATS connection, not yet handled",
                labels=["role"],
            )
            g.add_metric([self.role], in_msgs)
            yield g
        ages = self.heartbeat_ages()
        if ages is not None:
            g = GaugeMetricFamily(
                "kvmesh_heartbeat_age_seconds",
                "seconds since each known service's last heartbeat",
                labels=["role", "service_id"],
            )
            for role, sid, age in ages:
                g.add_metric([role, sid], age)
            yield g


class EplbCollector(Collector):
    """A decode worker's expert placement (``shared/eplb/``) at scrape time: the balance its
    plan predicted and the last window's measured, per card and overall, replans and moves."""

    def __init__(self, stats: Callable[[], BalancerStats | None]) -> None:
        self.stats = stats

    def collect(self):  # noqa: ANN201
        stats = self.stats()
        if stats is None:
            return
        balance = GaugeMetricFamily(
            "kvmesh_eplb_balance",
            "busiest ÷ mean card: the placement's prediction at its plan, and the last window's",
            labels=["kind"],
        )
        balance.add_metric(["predicted"], stats.predicted)
        balance.add_metric(["measured"], stats.measured)
        yield balance
        share = GaugeMetricFamily(
            "kvmesh_eplb_card_share",
            "each card's share of the routed tokens: predicted by the plan, measured last window",
            labels=["card", "kind"],
        )
        for kind, cards in (
            ("predicted", stats.predicted_cards),
            ("measured", stats.measured_cards),
        ):
            for card, value in enumerate(cards):
                share.add_metric([str(card), kind], value)
        yield share
        for name, help_, value in (
            ("kvmesh_eplb_steps", "decode steps counted", stats.steps),
            ("kvmesh_eplb_replans", "placement plans made", stats.replans),
            ("kvmesh_eplb_expert_moves", "experts moved by the plans taken", stats.moves),
        ):
            yield CounterMetricFamily(name, help_, value=value)
        if stats.last_plan_s is not None:
            yield GaugeMetricFamily(
                "kvmesh_eplb_plan_seconds", "the last plan's time", value=stats.last_plan_s
            )


def register_load(collector: Collector) -> None:
    REGISTRY.register(collector)


async def metrics_handler(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
