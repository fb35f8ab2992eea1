"""The cachemeta service's own settings (env prefix KVMESH_CACHEMETA_, file table [cachemeta])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class CachemetaSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_CACHEMETA_")
    file_table: ClassVar[str] = "cachemeta"

    ttl_chat_s: float = Field(
        default=7 * 86400, gt=0, description="a chat block lives this long after its last use"
    )
    ttl_agent_s: float = Field(
        default=3 * 86400, gt=0, description="an agent block lives this long after its last use"
    )
    store_capacity_bytes: int = Field(
        default=64 << 30, gt=0, description="the storage tier's size; LRU eviction past it"
    )
    high_watermark: float = Field(
        default=0.9, gt=0, le=1, description="eviction starts above this share of capacity"
    )
    low_watermark: float = Field(
        default=0.8, gt=0, le=1, description="and stops at this share of capacity"
    )
    gc_interval_s: float = Field(default=10.0, gt=0, description="how often expiry/eviction runs")
    snapshot_interval_s: float = Field(
        default=30.0, gt=0, description="how often the index is saved (it restarts from there)"
    )
    events_stream_bytes: int = Field(
        default=2 << 30,
        gt=0,
        description="the KV event stream's size on the NATS servers at most (reserved there; "
        "the oldest events go first: the index is restored from its latest snapshot, taken "
        "every snapshot_interval_s, then the events after it)",
    )

    def ttls(self) -> dict[str, float]:
        return {"chat": self.ttl_chat_s, "agent": self.ttl_agent_s}
