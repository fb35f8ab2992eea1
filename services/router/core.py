"""The router's request machinery, built from its settings in the order a request meets it from
the bottom: the mesh it follows (``dispatch/mesh.py``) with the servers it routes to that
kvmesh did not start (``upstream/``), dispatch and its routing policy,
tenancy, the request's preparation and answers, and what is recorded. The transports are
built over it (``api/server.py``); the process around both is ``service.py``.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.mesh import Mesh
from services.router.observe.cachemiss import CacheMisses, Explainer
from services.router.observe.recorder import RequestRecorder
from services.router.request.answer import Answers
from services.router.request.image_reader import ImageReader
from services.router.request.prepare import Preparer
from services.router.settings import RouterSettings
from services.router.tenancy.admission import Tenancy
from services.router.upstream.fleet import Upstreams
from shared.bus import Bus
from shared.settings import CommonSettings


@dataclass
class Core:
    router_id: str
    settings: RouterSettings
    common: CommonSettings
    bus: Bus
    mesh: Mesh
    dispatcher: Dispatcher
    tenancy: Tenancy
    preparer: Preparer
    answers: Answers
    recorder: RequestRecorder
    upstreams: Upstreams

    @classmethod
    def build(
        cls,
        router_id: str,
        started_at: float,
        settings: RouterSettings,
        common: CommonSettings,
        bus: Bus,
    ) -> Core:
        s, secrets = settings, common.resolved_secrets_dir
        mesh = Mesh(router_id, started_at, s, common)
        policy = s.policy(router_id)
        upstreams = Upstreams(s, mesh)
        dispatcher = Dispatcher(
            *(bus, router_id, mesh.registry, mesh.breakers, mesh.kv, policy, s, secrets),
            *(upstreams, mesh.links_tls),
        )
        tenancy = Tenancy(s, secrets, mesh.lag)
        images = ImageReader(s, common)
        preparer = Preparer(
            s, images, dispatcher, tenancy, Path(common.state_dir), common.models, common.loras
        )
        upstreams.connect(dispatcher.replies.deliver, preparer.renderer.text_model)
        explainer = None
        if s.cache_explain_bytes:  # why a prompt missed the cache, in its response
            explainer = Explainer(CacheMisses(s.cache_explain_bytes), dispatcher.prompt_hashes)
        answers = Answers(dispatcher, on_last=explainer)
        recorder = RequestRecorder(
            router_id,
            started_at,
            s,  # (the pools the traffic needs: from the pool's fitted rates and the workers)
            lambda: policy.pool.estimate,
            lambda role: len(mesh.registry.ready(role)),
            s.recent_requests_bytes,
        )
        mesh.on_sweep.append(recorder.stats.tick)  # workers live, minute by minute
        return cls(
            router_id,
            s,
            common,
            bus,
            mesh,
            dispatcher,
            tenancy,
            preparer,
            answers,
            recorder,
            upstreams,
        )

    async def start(self, stack: AsyncExitStack) -> None:
        await self.mesh.start(stack, self.bus)
        await self.upstreams.start(stack)
        await self.preparer.served.adapters.start()  # (LoRA adapters loaded at run time)
        await self.recorder.start(stack, self.bus, self.settings)
        s = self.settings
        await self.dispatcher.start(s.http_host, s.advertised_host())
        stack.push_async_callback(self.dispatcher.stop)

    async def drained(self) -> None:
        """Until no request is in progress."""
        while self.tenancy.inflight:
            await asyncio.sleep(0.05)
