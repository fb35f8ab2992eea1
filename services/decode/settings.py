"""The decode service's own settings (environment prefix KVMESH_DECODE_, file table [decode])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.worker import WorkerSettings


class DecodeSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_DECODE_")
    file_table: ClassVar[str] = "decode"

    kv_port: int = Field(
        default=0, ge=0, le=65535, description="gRPC port that receives KV handoffs; 0: any"
    )
    max_queued: int = Field(
        default=64, ge=0, description="local-prefill tasks waiting at most; more are refused"
    )
