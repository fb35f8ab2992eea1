"""The decode worker process. It joins the mesh and advertises its model; the work comes later."""

from __future__ import annotations

from contextlib import AsyncExitStack

from services.decode.settings import DecodeSettings
from shared.bus import Bus
from shared.service import Service
from shared.settings import CommonSettings


class DecodeService(Service):
    role = "decode"

    def __init__(self, common: CommonSettings, settings: DecodeSettings) -> None:
        super().__init__(common, settings)
        self.model = settings.model

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        pass

    def models(self) -> list[str]:
        return [self.model]
