"""The health of the workers' KV event feeds, as a holder of the index sees it (a router, or
cachemeta): their heartbeats heard, stale feeds flagged with a log line once, a resync asked
of those whose events were lost (at most every ``RESYNC_EVERY_S``), and the figures on
/metrics."""

from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.bus import Bus, subjects
from shared.kvindex.view import KvIndex
from shared.messages.heartbeat import Heartbeat
from shared.messages.kvevents import ResyncRequest

log = logging.getLogger(__name__)

RESYNC_EVERY_S = 10.0
WORKERS = ("prefill", "decode")


class FeedWatch:
    def __init__(self, index: KvIndex, bus: Bus, holder_id: str) -> None:
        self.index = index
        self.bus = bus
        self.holder_id = holder_id
        self.asked: dict[str, float] = {}  # worker → when a resync was last asked of it

    def heard(self, hb: Heartbeat, now: float) -> None:
        if hb.role not in WORKERS:
            return
        feeds = self.index.feeds
        if hb.status == "stopped":
            feeds.forget(hb.service_id)
        else:
            load = hb.load
            feeds.heard(hb.service_id, hb.started_at, load.kv_events, load.kv_unannounced_s, now)

    async def check(self, now: float) -> None:
        """Feeds' staleness brought up to date: each change logged once, a resync asked."""
        feeds = self.index.feeds
        for source, why in feeds.check(now):
            if why:
                log.warning(
                    "%s's KV events are stale (%s): its memory tier is not routed by", source, why
                )
            else:
                log.info("%s's KV events are whole again", source)
                self.asked.pop(source, None)
        for source, feed in feeds.stale().items():
            if not feed.lagging:  # a quiet feed: republishing what it said before mends nothing
                continue
            if now - self.asked.get(source, -RESYNC_EVERY_S) < RESYNC_EVERY_S:
                continue
            self.asked[source] = now
            ask = ResyncRequest(by=self.holder_id, why=feed.stale)
            try:
                await self.bus.publish(subjects.kv_resync(source), ask)
            except Exception as err:
                log.debug("resync of %s not asked: %s", source, err)

    def stale(self) -> dict[str, str]:
        """Stale workers and why."""
        return {s: f.stale for s, f in self.index.feeds.stale().items()}


def approx_bytes(index: KvIndex) -> int:
    """What the index's blocks hold in memory: its rows' arrays, every slot."""
    return index.blocks.nbytes


class IndexCollector(Collector):
    """The index's size and its feeds' health, read at scrape time."""

    def __init__(self, watch: FeedWatch) -> None:
        self.watch = watch

    def collect(self):  # noqa: ANN201 (prometheus_client's protocol)
        index = self.watch.index
        blocks = GaugeMetricFamily("kvmesh_kv_index_blocks", "blocks in this process's index")
        blocks.add_metric([], len(index))
        size = GaugeMetricFamily(
            "kvmesh_kv_index_bytes", "memory the index's blocks take (its arrays, every slot)"
        )
        size.add_metric([], approx_bytes(index))
        seq = GaugeMetricFamily("kvmesh_kv_index_seq", "the KV event stream position applied")
        seq.add_metric([], index.seq)
        lag = GaugeMetricFamily(
            "kvmesh_kv_events_lag", "KV events a worker made that have not come", labels=["worker"]
        )
        stale = GaugeMetricFamily(
            "kvmesh_kv_events_stale",
            "1 while a worker's KV events are stale (its memory tier not routed by)",
            labels=["worker"],
        )
        for source, feed in index.feeds.by_source.items():
            if feed.heard_epoch:
                lag.add_metric([source], feed.lag())
                stale.add_metric([source], 1 if feed.stale else 0)
        yield from (blocks, size, seq, lag, stale)
