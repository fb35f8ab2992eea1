"""The decode service's own settings (environment prefix KVMESH_DECODE_, file table [decode])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class DecodeSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_DECODE_")
    file_table: ClassVar[str] = "decode"

    model: str = Field(default="smollm2-135m-instruct", min_length=1, description="model served")
