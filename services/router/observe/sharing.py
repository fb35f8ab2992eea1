"""The mesh's statistics over NATS: every router's minutes on one JetStream stream (the last of
each router's minute kept, for a day), so any router reports the whole mesh, and a router that
restarts finds its own earlier minutes there. A minute that could not be shared is offered
again at the next round; the last minutes go out as the router stops."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from services.router.observe.stats import DAY_S, RollingStats, StatsMinute
from services.router.settings import ObserveSettings
from shared.bus import Bus, subjects

log = logging.getLogger(__name__)


class StatsSharing:
    def __init__(
        self, bus: Bus, router_id: str, stats: RollingStats, settings: ObserveSettings
    ) -> None:
        self.bus = bus
        self.router_id = router_id
        self.stats = stats
        self.settings = settings

    async def start(self, stack: AsyncExitStack) -> None:
        bus = self.bus
        await bus.ensure_stream(
            subjects.STATS_STREAM, [subjects.STATS_ALL], max_age_s=DAY_S, last_per_subject=True
        )
        await bus.follow(subjects.STATS_STREAM, subjects.STATS_ALL, StatsMinute, self.stats.merge)
        sharer = asyncio.create_task(self._every())
        stack.callback(sharer.cancel)
        stack.push_async_callback(self.share)  # the last minutes, when stopping

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_share_s)
            await self.share()

    async def share(self) -> None:
        for minute in self.stats.to_share():
            try:
                subject = subjects.stats(self.router_id, minute.minute)
                await self.bus.publish_durable(subject, minute)
            except Exception as err:  # shared at the next round
                log.warning("statistics not shared: %s", err)
                self.stats.unshared(minute.minute)
