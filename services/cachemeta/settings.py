"""The cachemeta service's own settings (env prefix KVMESH_CACHEMETA_, file table [cachemeta])."""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class CachemetaSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_CACHEMETA_")
    file_table: ClassVar[str] = "cachemeta"
