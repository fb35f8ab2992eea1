"""The prefill service's own settings (environment prefix KVMESH_PREFILL_, file table [prefill])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class PrefillSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_PREFILL_")
    file_table: ClassVar[str] = "prefill"

    model: str = Field(default="smollm2-135m-instruct", min_length=1, description="model served")
