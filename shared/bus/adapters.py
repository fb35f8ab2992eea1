"""The mesh's LoRA adapters as every router and worker knows them: those the settings name
(``KVMESH_LORAS``: served name → ``BASE:PATH``, read at start) and those an operator loads at
run time through a router (``load``, ``unload``), kept on the adapters stream
(``subjects.LORAS_STREAM``, the last message per name). Every service follows the stream from
its start, so one that was away finds what was loaded meanwhile, and a load through any router
reaches every worker of the adapter's base model within moments.

A name the settings give cannot be loaded over or unloaded at run time (the settings would
bring it back at the next start).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from shared.bus import Bus, subjects
from shared.messages.adapters import AdapterRecord
from shared.model.lora import AdapterSpec, LoraError, digest_of, parse_spec

log = logging.getLogger(__name__)

OnChange = Callable[[AdapterSpec, bool], None]  # (the adapter, served from now on or not)


def from_settings(loras: Mapping[str, str]) -> dict[str, AdapterSpec]:
    """The settings' adapters (``name → BASE:PATH``) with their digests: LoraError naming the
    adapter when one cannot be read."""
    specs = {}
    for name, where in loras.items():
        spec = parse_spec(f"{name}={where}")
        specs[name] = AdapterSpec(name, spec.base, spec.path, digest_of(Path(spec.path)))
    return specs


class Adapters:
    """The adapters served, by name; ``on_change`` is told of each one as it comes and goes
    (those of the settings first, at ``start``)."""

    def __init__(
        self,
        bus: Bus,
        settings: Mapping[str, str],
        on_change: OnChange | None = None,
        owner: bool = False,
    ) -> None:
        self.bus = bus
        self.fixed = from_settings(settings)
        self.specs: dict[str, AdapterSpec] = dict(self.fixed)
        self.on_change = on_change
        self.owner = owner  # a router: it makes the stream and writes it

    async def start(self) -> None:
        for spec in self.fixed.values():
            self._tell(spec, True)
        await self.bus.ensure_stream(
            subjects.LORAS_STREAM,
            [subjects.LORAS_ALL],
            last_per_subject=True,
            create_only=not self.owner,
        )
        await self.bus.follow(
            subjects.LORAS_STREAM, subjects.LORAS_ALL, AdapterRecord, self._on_record
        )

    def _on_record(self, record: AdapterRecord, replaying: bool) -> None:
        if record.name in self.fixed:
            return  # (the settings' own: written before a restart changed them)
        old = self.specs.get(record.name)
        if record.loaded:
            spec = record.spec
            if old != spec:
                self.specs[record.name] = spec
                self._tell(spec, True)
        elif old is not None:
            del self.specs[record.name]
            self._tell(old, False)

    def _tell(self, spec: AdapterSpec, served: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(spec, served)
        except Exception:
            log.exception("adapter %s: its change was not applied", spec.name)

    def base_of(self, name: str) -> str | None:
        spec = self.specs.get(name)
        return spec.base if spec else None

    # -- the operator's (routers) ----------------------------------------------------------------

    async def load(self, spec: AdapterSpec, by: str) -> None:
        """Serve ``spec`` everywhere from now on (checked by the caller; LoraError for a
        name the settings give)."""
        self._not_fixed(spec.name)
        record = AdapterRecord.of(spec, by)
        await self.bus.publish_durable(subjects.lora(spec.name), record, retry_s=5.0)
        self._on_record(record, False)

    async def unload(self, name: str, by: str) -> AdapterSpec:
        """Serve ``name`` no more, anywhere (sequences computing with it finish). KeyError
        when no such adapter is loaded."""
        self._not_fixed(name)
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(name)
        record = AdapterRecord.of(spec, by, loaded=False)
        await self.bus.publish_durable(subjects.lora(name), record, retry_s=5.0)
        self._on_record(record, False)
        return spec

    def _not_fixed(self, name: str) -> None:
        if name in self.fixed:
            raise LoraError(f"lora {name!r} is set in the settings (KVMESH_LORAS); change it there")
