"""One server this router routes to without having started it, as the router's registry and
index see a worker: what it is (the engine, the model it serves under which name, its KV block
size), its load and health from its ``/metrics`` (read every ``upstream_poll_s``), and its
prefix cache from its own KV events (``shared/engine/bridge.py`` over the network, under the
router's hashes).

Each read of its metrics is a heartbeat of its own (a decode worker that takes whole requests,
as kvmesh's vLLM workers are): a server that stops answering misses them and leaves the
registry as a worker does. Its events are applied to this router's index under its id, numbered
as a worker numbers its own, with what its feed's health needs in the heartbeat: how many came,
and how long the prompt tokens it computed since the last event have waited for one (a server
whose events port is closed, or that was started without them, computes with no event: its
feed is stale and it is routed by load, as /health says).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from services.router.upstream.metrics import ServerMetrics, parse
from services.router.upstream.protocols import PROTOCOLS
from shared.engine.bridge import KvEventBridge
from shared.messages.heartbeat import Heartbeat, Load
from shared.messages.kvevents import MEMORY, STORE, KvEvent, memory_location

log = logging.getLogger(__name__)

Apply = Callable[[KvEvent], None]
# A bound endpoint's wildcard host: the server's own address is dialed instead.
WILDCARD = re.compile(r"//(\*|0\.0\.0\.0|\[::\])")


def server_id(url: str) -> str:
    """A server's worker id, from its address (one id per address: a restarted server keeps
    it, as a restarted worker keeps its own)."""
    parts = urlsplit(url)
    return "up-" + re.sub(r"[^A-Za-z0-9_.-]", "-", f"{parts.hostname}-{parts.port or 80}")[:58]


class Server:
    def __init__(
        self, url: str, model: str, fingerprint: str, apply: Apply, entry: str = ""
    ) -> None:
        self.url = url.rstrip("/")
        self.entry = entry or url  # the settings' entry that names it (a dns:// name's)
        self.id = server_id(url)
        self.model = model
        self.fingerprint = fingerprint
        self.apply = apply
        self.served = ""  # the model's name at the server (its /v1/models)
        self.protocol = ""  # how requests are put to it (protocols.py)
        self.metrics: ServerMetrics | None = None
        self.first_seen = time.time()
        self.bridge: KvEventBridge | None = None
        self.events = ""  # its KV event feed: the endpoint followed, or why none
        self.made = 0  # events applied under its id (the heartbeat's count)
        self.epoch = 0.0  # the server process those events are of
        # When its events were last heard (monotonic), the prompt tokens it had computed
        # then, and since when those computed after have waited for theirs (None: none wait).
        self.heard_at = 0.0
        self.computed_at_event = 0
        self.waiting_since: float | None = None
        self.failures = 0  # reads of its metrics failed in a row
        self.refused = False  # the last one's connection was refused (gone, not slow)
        self.error = ""

    # -- reading it -------------------------------------------------------------------------

    async def poll(self, session: aiohttp.ClientSession, timeout_s: float, events: bool) -> bool:
        """Read its metrics (and, the first time, what it serves and where its events are);
        False when it did not answer."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.get(f"{self.url}/metrics", timeout=timeout) as response:
                response.raise_for_status()
                metrics = parse(await response.text())
            if not self.served:
                self.served = await self._served(session, timeout)
                self.protocol = await self._protocol(session, timeout, metrics.engine)
            restarted = self.metrics is not None and metrics.started_at != self.metrics.started_at
            self.metrics = metrics
            if events and (not self.events or restarted):
                await self._follow(session, timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as err:
            self.failures += 1
            self.refused = isinstance(err, aiohttp.ClientConnectorError)
            self.error = f"{type(err).__name__}: {err}"
            if self.failures == 1:
                log.warning("upstream %s did not answer: %s", self.url, self.error)
            return False
        if self.failures:
            log.info("upstream %s answers again", self.url)
        self.failures, self.refused, self.error = 0, False, ""
        self._watch_feed(time.monotonic())
        return True

    async def _served(self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> str:
        async with session.get(f"{self.url}/v1/models", timeout=timeout) as response:
            response.raise_for_status()
            models = (await response.json())["data"]
        return str(models[0]["id"])

    async def _protocol(
        self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout, engine: str
    ) -> str:
        """SGLang's own; for vLLM, its token-in-token-out endpoint where it is on (a server
        started with --enable-scale-out refuses an empty prompt; one without, any request),
        else OpenAI's completions."""
        if engine == "sglang":
            return "sglang"
        probe = {"token_ids": []}
        async with session.post(
            f"{self.url}{PROTOCOLS['generate'].path}", json=probe, timeout=timeout
        ) as response:
            on = response.status in (400, 422)
        log.info("upstream %s: vLLM, requests by %s", self.url, "generate" if on else "completions")
        return "generate" if on else "completions"

    async def _events_config(
        self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout
    ) -> dict | None:
        """Where the server publishes its KV events, as it says: vLLM's /kv_event_sources,
        SGLang's /server_info (its first data-parallel rank's; None: it publishes none)."""
        assert self.metrics is not None
        if self.metrics.engine == "sglang":  # (its /server_info's kv_events descriptor)
            async with session.get(f"{self.url}/server_info", timeout=timeout) as response:
                info = await response.json() if response.status == 200 else {}
            said = info.get("kv_events") if isinstance(info, dict) else None
            if not isinstance(said, dict) or said.get("publisher") != "zmq":
                return None
            replay = said.get("replay_endpoint_port_base")
            return {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{said['endpoint_port_base']}",
                "replay_endpoint": f"tcp://*:{replay}" if replay else "",
            }
        async with session.get(f"{self.url}/kv_event_sources", timeout=timeout) as response:
            sources = await response.json() if response.status == 200 else {}
        return next(iter(sources.values()), None) if isinstance(sources, dict) else None

    async def _follow(self, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> None:
        """Follow its KV events, where the server says they are published."""
        await self.stop()
        self.epoch, self.made = self.started_at, 0
        self.computed_at_event = self.metrics.computed_tokens if self.metrics else 0
        config = await self._events_config(session, timeout)
        if not config or not config.get("enable_kv_cache_events") or "endpoint" not in config:
            self.events = "none: the server publishes no KV events (--kv-events-config)"
            return
        host = urlsplit(self.url).hostname or "127.0.0.1"
        endpoint = WILDCARD.sub(f"//{host}", config["endpoint"])
        replay = WILDCARD.sub(f"//{host}", config.get("replay_endpoint") or "")
        if self.metrics.engine == "sglang":
            from shared.engine.sglang.events import SglangEventBridge

            self.bridge = SglangEventBridge(self.metrics.block_size, self._blocks, replay)
        else:
            from shared.engine.vllm.events import VllmEventBridge

            self.bridge = VllmEventBridge(
                self.fingerprint, self.metrics.block_size, self._blocks, replay
            )
        self.bridge.connect(endpoint)
        self.bridge.start()
        self.events = endpoint
        log.info("upstream %s: following its KV events at %s", self.url, endpoint)

    async def _blocks(
        self, change: str, hashes: list[str], tier: str, retention: str, size: int
    ) -> None:
        """The bridge's blocks, applied to the router's index under this server's id."""
        if not hashes:
            return
        self.made += 1
        location = memory_location(self.id) if tier == MEMORY else STORE
        self.apply(
            KvEvent(
                kind=change,  # type: ignore[arg-type]
                location=location,
                hashes=hashes,
                sizes=[size] * len(hashes) if size and change == "stored" else [],
                retention=retention,  # type: ignore[arg-type]
                at=time.time(),
                source=self.id,
                epoch=self.epoch,
                seq=self.made,
            )
        )

    def _watch_feed(self, now: float) -> None:
        """How long prompt tokens it computed have waited for an event (its feed's health)."""
        assert self.metrics is not None
        computed = self.metrics.computed_tokens
        heard = self.bridge.heard_at if self.bridge is not None else 0.0
        if heard > self.heard_at:  # events came since the last read
            self.heard_at, self.computed_at_event, self.waiting_since = heard, computed, None
        elif self.waiting_since is None and computed - self.computed_at_event >= max(
            1, self.metrics.block_size
        ):
            self.waiting_since = now

    @property
    def started_at(self) -> float:
        """Its process's start (as its metrics say; else when this router first saw it)."""
        m = self.metrics
        return m.started_at if m is not None and m.started_at else self.first_seen

    async def stop(self) -> None:
        if self.bridge is not None:
            await self.bridge.stop()
            self.bridge = None

    # -- as a worker ------------------------------------------------------------------------

    def heartbeat(self, interval_s: float) -> Heartbeat:
        """The server as a worker's heartbeat says it (after a read of its metrics)."""
        m = self.metrics
        assert m is not None
        now = time.monotonic()
        return Heartbeat(
            service_id=self.id,
            role="decode",
            version=f"upstream {m.engine}",
            status="ready",
            addresses={"http": self.url, "upstream": m.engine},
            models=[self.model],
            whole=True,
            load=Load(
                inflight=m.running + m.waiting,
                queued=m.waiting,
                kv_blocks_used=round(m.kv_usage * m.kv_blocks),
                kv_blocks_total=m.kv_blocks,
                kv_block_size=m.block_size,
                kv_hash="sglang" if m.engine == "sglang" else "xxh3",
                kv_events=self.made,
                kv_unannounced_s=0.0 if self.waiting_since is None else now - self.waiting_since,
            ),
            interval_s=interval_s,
            started_at=self.started_at,
            sent_at=time.time(),
        )

    def report(self) -> dict:
        """The server as /health shows it."""
        m = self.metrics
        return {
            "url": self.url,
            "model": self.model,
            "served_as": self.served,
            "engine": m.engine if m else "",
            "answering": m is not None and not self.failures,
            "error": self.error,
            "kv_events": self.events or "off",
            "kv_event_batches": self.bridge.batches if self.bridge else 0,
        }
