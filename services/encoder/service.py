"""The encoder process. It joins the mesh and heartbeats; its work comes in a later issue."""

from __future__ import annotations

from contextlib import AsyncExitStack

from shared.bus import Bus
from shared.service import Service


class EncoderService(Service):
    role = "encoder"

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        pass
