"""The encoder service's own settings (environment prefix KVMESH_ENCODER_, file table [encoder])."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class EncoderSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_ENCODER_")
    file_table: ClassVar[str] = "encoder"

    models: list[str] = Field(
        default_factory=list,
        description="language models to make embeddings for (each has its own projector); "
        "empty: every model of the mesh (the built-in ones and KVMESH_MODELS')",
    )
    dim: int = Field(default=256, ge=16, le=4096, description="vision tower width")
    layers: int = Field(default=4, ge=1, le=64, description="vision tower depth")
    heads: int = Field(default=4, ge=1, le=64)
    seed: int = Field(default=0, description="seed of the random tower weights")
    weights_dir: Path | None = Field(
        default=None,
        description="real tower weights: <dir>/<model>.safetensors where present (names and "
        "shapes as VisionTower.state_dict()); else random weights from the seed",
    )
    threads: int = Field(default=0, ge=0, le=1024, description="torch threads; 0: all cores")
    max_batch: int = Field(default=8, ge=1, le=256, description="images encoded in one pass")
    cache_bytes: int = Field(
        default=256 << 20, ge=0, description="embeddings kept by image hash (LRU), bytes"
    )
    store_embeds: bool = Field(
        default=False,
        description="also keep embeddings in the storage tier (<kv_store_dir>/embeds), so "
        "they outlive this process and are shared by every encoder",
    )
    embeds_ttl_s: float = Field(
        default=600.0, gt=0, description="how long embeddings stay on the stream for prefill"
    )
    embeds_stream_bytes: int = Field(
        default=512 << 20, ge=1 << 20, description="the embeddings stream's size in memory"
    )
