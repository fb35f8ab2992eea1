"""Each worker's KV event feed, as one who applies the stream sees it: how many of its events
came, against how many its heartbeats say it made. Pure and synchronous; times are the
holder's monotonic clock.

A worker numbers its events from 1 in each process (its ``epoch``: when it started) and puts
the count in every heartbeat, with how long the blocks of new KV it computed have waited for
their events (``shared/kvindex/publisher.py``). Two things go wrong:

- **lag**: a heartbeat said N events were made, and some of the first N have not come within
  ``bound_s`` (they were lost, or the stream is that far behind);
- **stopped**: blocks the worker computed have waited longer than ``bound_s`` for their
  events (a bridge whose engine feed went quiet).

Either makes the feed stale: what the index says of that worker's memory tier is not trusted
(routing counts only the storage tier's blocks for it) until the feed is whole again. Events
lost for good are made whole by a resync: the worker clears its location and republishes what
its memory tier holds; the clear accounts for every event before it. A feed that stopped is
whole again only when its events flow again (a resync cannot mend a quiet engine).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.messages.kvevents import KvEvent, memory_location


@dataclass
class Feed:
    # What the stream brought (the same for whoever applies it, and kept in snapshots).
    epoch: float = 0.0  # the process whose events these are
    applied: int = 0  # its events accounted for: every one up to a clear, and each since
    cleared: int = 0  # the seq of its last clear (earlier events are superseded)
    # What its heartbeats say (each holder's own, from the beats it heard).
    heard_epoch: float = 0.0
    claims: deque[tuple[int, float]] = field(default_factory=deque)  # (made, heard at), unmet
    made: int = 0  # events made, as last heard
    unannounced_s: float = 0.0  # how long new blocks have waited for their events, as heard
    stale: str = ""  # why the feed is not trusted ("" while it is)
    stale_since: float = 0.0
    lagging: bool = False  # stale for events lost (a resync mends it), not for a quiet feed

    def state(self) -> list:
        return [self.epoch, self.applied, self.cleared]

    def applied_for(self, epoch: float) -> int:
        """Events of the process ``epoch`` accounted for (none of a process not yet heard)."""
        return self.applied if epoch == self.epoch else 0

    def lag(self) -> int:
        """Events the worker said it made that have not come."""
        return max(0, self.made - self.applied_for(self.heard_epoch))


class Feeds:
    def __init__(self, bound_s: float = 2.0) -> None:
        self.bound_s = bound_s
        self.by_source: dict[str, Feed] = {}

    # -- the stream ---------------------------------------------------------------------------

    def admit(self, event: KvEvent) -> tuple[bool, str]:
        """Count an event against its source's feed. Returns whether it is to be applied, and
        a memory location to forget first ("" for none): a new process of the source starts
        with an empty memory tier. An event of the source's memory tier made before its last
        clear (or by a process before the current one) is superseded: not applied."""
        feed = self.by_source.setdefault(event.source, Feed())
        own = event.location == memory_location(event.source)
        forget = ""
        if event.epoch > feed.epoch:
            if feed.epoch:
                forget = memory_location(event.source)
            feed.epoch, feed.applied, feed.cleared = event.epoch, 0, 0
        elif event.epoch < feed.epoch:
            return not own, forget  # an earlier process's: its memory tier is gone
        if own and event.kind == "cleared":
            feed.cleared = max(feed.cleared, event.seq)
            feed.applied = max(feed.applied, event.seq)
            return True, forget
        if event.seq and event.seq <= feed.cleared:
            return not own, forget
        feed.applied += 1
        return True, forget

    def restore(self, states: dict[str, list]) -> None:
        """Feeds as a snapshot had them (``Feed.state``)."""
        for source, (epoch, applied, cleared) in states.items():
            self.by_source[source] = Feed(epoch=epoch, applied=applied, cleared=cleared)

    def states(self) -> dict[str, list]:
        return {source: feed.state() for source, feed in self.by_source.items()}

    # -- heartbeats ---------------------------------------------------------------------------

    def heard(self, source: str, epoch: float, made: int, unannounced_s: float, now: float) -> None:
        """A worker's heartbeat: process ``epoch`` has made ``made`` events, and the oldest
        blocks of new KV it computed have waited ``unannounced_s`` for theirs."""
        feed = self.by_source.setdefault(source, Feed())
        if epoch != feed.heard_epoch:
            feed.heard_epoch, feed.claims = epoch, deque()
        feed.made, feed.unannounced_s = made, unannounced_s
        if made > feed.applied_for(epoch) and (not feed.claims or feed.claims[-1][0] < made):
            feed.claims.append((made, now))

    def forget(self, source: str) -> None:
        """A worker gone (stopped, or lost): nothing more is expected of it."""
        feed = self.by_source.get(source)
        if feed is not None:
            feed.heard_epoch, feed.claims, feed.stale = 0.0, deque(), ""
            feed.unannounced_s = 0.0

    def check(self, now: float) -> list[tuple[str, str]]:
        """Each feed's staleness brought up to date; returns those that changed, as (source,
        why) with why "" for a feed whole again."""
        changed = []
        for source, feed in self.by_source.items():
            applied = feed.applied_for(feed.heard_epoch)
            while feed.claims and feed.claims[0][0] <= applied:
                feed.claims.popleft()
            why = ""
            feed.lagging = bool(feed.claims) and now - feed.claims[0][1] > self.bound_s
            if feed.lagging:
                why = f"{feed.lag()} KV events made have not come"
            elif feed.unannounced_s > self.bound_s:
                why = f"no KV events for {feed.unannounced_s:.1f} s while it computes"
            if bool(why) != bool(feed.stale):
                feed.stale_since = now
                changed.append((source, why))
            feed.stale = why
        return changed

    def trusted(self, source: str, epoch: float) -> bool:
        """Whether the index's view of the memory tier of ``source``'s process ``epoch`` can
        be routed by: its events are whole, and they are that process's."""
        feed = self.by_source.get(source)
        return feed is not None and not feed.stale and feed.epoch == epoch

    def stale(self) -> dict[str, Feed]:
        return {s: f for s, f in self.by_source.items() if f.stale}
