"""The operator's LoRA endpoints (admin keys only), in vLLM's names and bodies:
POST /v1/load_lora_adapter ``{"lora_name", "lora_path", "base_model"?}`` checks the adapter
against its base model (its config, every tensor's name and shape: no tensor is read here) and
serves it from every worker of that model, through every router; POST /v1/unload_lora_adapter
``{"lora_name"}`` stops serving it (requests computing with it finish first). A load answers
once the base model's workers serve the adapter (or after ``WAIT_S``), saying which do."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from services.router.api.middleware import ADMIN, Route
from services.router.dispatch.mesh import Mesh
from services.router.errors import ApiError
from services.router.formats.adapters import LoadAdapter, UnloadAdapter
from services.router.formats.wire import parse_body
from services.router.request.prepare import Preparer
from shared.model.lora import AdapterSpec, LoraError, check_adapter

WAIT_S = 10.0  # how long a load waits for the base model's workers to serve it


class AdapterApi:
    def __init__(self, router_id: str, preparer: Preparer, mesh: Mesh) -> None:
        self.router_id = router_id
        self.adapters = preparer.served.adapters
        self.known = preparer.served.known  # the base models
        self.renderer = preparer.renderer
        self.mesh = mesh

    def routes(self) -> list[Route]:
        return [
            (web.post("/v1/load_lora_adapter", self.load), ADMIN),
            (web.post("/v1/unload_lora_adapter", self.unload), ADMIN),
        ]

    async def load(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read(), LoadAdapter)
        assert isinstance(body, LoadAdapter)
        name, path = body.lora_name, body.lora_path
        base = body.base_model or self._only_base()
        if base not in self.known:
            known = ", ".join(sorted(self.known))
            raise ApiError(
                400, f"base_model: {base!r} is not a model of this mesh ({known})", "base_model"
            )
        if name in self.known:
            raise ApiError(400, f"lora_name: {name!r} is a base model's name", param="lora_name")
        if name in self.adapters.fixed:
            raise ApiError(
                400, f"lora_name: {name!r} is set in the settings (KVMESH_LORAS)", "lora_name"
            )
        config = (await self.renderer.text_model(base)).config
        try:  # (reads the two files' headers: off the loop)
            checked = await asyncio.to_thread(check_adapter, path, config)
            await self.adapters.load(AdapterSpec(name, base, path, checked.digest), self.router_id)
        except LoraError as err:
            raise ApiError(400, str(err), param="lora_path") from None
        served, not_yet = await self._served(name, base)
        return web.json_response(
            {
                "lora_name": name,
                "base_model": base,
                "digest": checked.digest,
                "rank": checked.rank,
                "served_by": served,
                "not_served_by": not_yet,
            }
        )

    async def unload(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read(), UnloadAdapter)
        assert isinstance(body, UnloadAdapter)
        name = body.lora_name
        try:
            spec = await self.adapters.unload(name, self.router_id)
        except KeyError:
            raise ApiError(
                404, f"lora_name: no adapter {name!r} is loaded", "lora_name", "model_not_found"
            ) from None
        except LoraError as err:
            raise ApiError(400, str(err), param="lora_name") from None
        return web.json_response({"lora_name": name, "base_model": spec.base, "unloaded": True})

    def _only_base(self) -> str | None:
        served = {m for r in self.mesh.registry.ready("decode") for m in r.heartbeat.models[:1]}
        return next(iter(served)) if len(served) == 1 else None

    async def _served(self, name: str, base: str) -> tuple[list[str], list[str]]:
        """The workers of ``base`` that serve ``name`` and those that do not yet, once all do
        (or ``WAIT_S`` passed)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            workers = [
                r
                for role in ("prefill", "decode")
                for r in self.mesh.registry.ready(role)
                if r.heartbeat.models and r.heartbeat.models[0] == base
            ]
            served = sorted(r.service_id for r in workers if name in r.heartbeat.models)
            rest = sorted(r.service_id for r in workers if name not in r.heartbeat.models)
            if not rest or time.monotonic() >= deadline:
                return served, rest
            await asyncio.sleep(0.05)
