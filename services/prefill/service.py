"""The prefill worker process. It joins the mesh and advertises its model; the work comes later."""

from __future__ import annotations

from contextlib import AsyncExitStack

from services.prefill.settings import PrefillSettings
from shared.bus import Bus
from shared.service import Service
from shared.settings import CommonSettings


class PrefillService(Service):
    role = "prefill"

    def __init__(self, common: CommonSettings, settings: PrefillSettings) -> None:
        super().__init__(common, settings)
        self.model = settings.model

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        pass

    def models(self) -> list[str]:
        return [self.model]
