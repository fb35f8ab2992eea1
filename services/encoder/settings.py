"""The encoder service's own settings (environment prefix KVMESH_ENCODER_, file table [encoder])."""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class EncoderSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_ENCODER_")
    file_table: ClassVar[str] = "encoder"
