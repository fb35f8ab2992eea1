"""The router's own settings (environment prefix KVMESH_ROUTER_, file table [router])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service import ServiceSettings


class RouterSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_ROUTER_")
    file_table: ClassVar[str] = "router"

    http_port: int = Field(default=8000, ge=0, le=65535, description="the public API port")
    missed_heartbeats: int = Field(
        default=3, ge=1, le=100, description="a service that misses this many beats is dropped"
    )
