"""The prefill service's own settings (environment prefix KVMESH_PREFILL_, file table [prefill])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.worker import WorkerSettings


class PrefillSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_PREFILL_")
    file_table: ClassVar[str] = "prefill"

    max_queued: int = Field(
        default=64, ge=0, description="tasks waiting at most; more are refused (busy)"
    )
    kv_chunk_bytes: int = Field(
        default=1 << 20, ge=4096, le=4 << 20, description="bytes per KV handoff message"
    )
    max_transfers: int = Field(
        default=8, ge=1, description="KV handoffs in flight at once (prefill goes on meanwhile)"
    )
    handoff_timeout_s: float = Field(
        default=10.0, gt=0, description="a decode worker must answer a handoff step within this"
    )
