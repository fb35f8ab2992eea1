"""The heartbeat link: every service → routers (and `kvmesh status`, `kvmesh up`)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from shared.messages import Message

Role = Literal["router", "prefill", "decode", "encoder", "cachemeta"]
ROLES: tuple[str, ...] = get_args(Role)

# ready: takes work. draining: finishing what it has, takes nothing new. stopped: gone now.
Status = Literal["ready", "draining", "failing", "stopped"]


class Load(Message):
    """Load figures a service reports; a role fills what applies to it."""

    inflight: int = Field(default=0, ge=0, description="requests being worked on")
    queued: int = Field(default=0, ge=0, description="requests waiting to start")
    kv_blocks_used: int = Field(default=0, ge=0)
    kv_blocks_total: int = Field(default=0, ge=0)
    kv_block_size: int = Field(default=0, ge=0, description="tokens per KV block (workers)")
    kv_hash: Literal["xxh3", "sglang"] = Field(
        default="xxh3",
        description="workers: how their KV blocks are named, so how the router hashes their "
        "model's prompts (shared/kvstore/hashing.py: sglang for SGLang's own page hashes)",
    )
    queued_tokens: int = Field(
        default=0, ge=0, description="prefill: prompt tokens waiting, less its memory-tier hits"
    )
    memory_tier_bytes: int = Field(default=0, ge=0, description="workers: memory tier in use")
    memory_tier_capacity: int = Field(default=0, ge=0, description="workers: its size")
    kv_write_skips: int = Field(
        default=0, ge=0, description="blocks not stored because the write-behind queue was full"
    )
    kv_store_error: str = Field(
        default="",
        description="workers: why the storage tier is not being written (full, read_only, "
        "io); empty when it is",
    )
    kv_events: int = Field(
        default=0, ge=0, description="workers: KV events made since it started (the last seq)"
    )
    kv_unannounced_s: float = Field(
        default=0.0,
        ge=0,
        description="workers: how long the oldest blocks of new KV computed here have waited "
        "for their KV event (0 when none wait)",
    )
    adapters: list[str] = Field(
        default_factory=list,
        description="workers: LoRA adapters resident in the engine (a request of one starts "
        "without loading it)",
    )
    adapter_load_s: float = Field(
        default=0.0, ge=0, description="workers: seconds an adapter's load took, on average"
    )


class Heartbeat(Message):
    service_id: str
    role: Role
    version: str
    status: Status = "ready"
    addresses: dict[str, str] = Field(default_factory=dict, description="name → URL")
    models: list[str] = Field(default_factory=list, description="models this worker serves")
    whole: bool = Field(
        default=False,
        description="its engine owns its KV (vLLM): a decode worker of it computes whole "
        "requests (a request of its model needs no prefill worker); it pairs only with "
        "workers of its kind",
    )
    pd_only: bool = Field(
        default=False,
        description="(decode) its engine decodes only what a prefill worker's engine hands it "
        "(SGLang's own P/D): the router never has it prefill a request itself",
    )
    load: Load = Field(default_factory=Load)
    connection: str = Field(
        default="",
        description="the NATS connection its beats come over (server id:client id): when the "
        "server says that connection closed, routers drop it at once",
    )
    interval_s: float = Field(gt=0, description="the sender's heartbeat interval")
    started_at: float = Field(description="unix time the service started")
    sent_at: float = Field(description="unix time of this heartbeat")


class WhoIs(Message):
    """Who holds a service id? Asked by a process about to start under it."""

    asker: str = Field(default="", description="the asking process: host and pid")


class Holder(Message):
    """The process that holds a service id, answering ``WhoIs``."""

    service_id: str
    role: Role
    host: str
    pid: int
    started_at: float


class RegistryQuery(Message):
    """Ask a router for its registry of live workers."""

    role: Role | None = None


class WorkerEntry(Message):
    service_id: str
    role: Role
    status: Status
    addresses: dict[str, str]
    models: list[str]
    load: Load
    age_s: float = Field(description="seconds since the last heartbeat, at the router")
    uptime_s: float
    breaker: Literal["closed", "open", "half_open"] = Field(
        default="closed", description="the answering router's circuit breaker for it"
    )
    kv_events: str = Field(
        default="",
        description="workers: its KV event feed at the answering router: ok, or why it is "
        "stale (its memory tier not routed by)",
    )


class RegistrySnapshot(Message):
    router_id: str
    workers: list[WorkerEntry]
    index_blocks: int = Field(default=0, description="blocks in the answering router's index")
    index_bytes: int = Field(default=0, description="the memory they take, estimated")


class PlanQuery(Message):
    """Ask a router for the pools its recent traffic needs (``/v1/plan``)."""


class PlanReply(Message):
    router_id: str
    requests: int = Field(description="requests answered in the window")
    window_s: float
    recommended: dict[str, int] = Field(description="workers by role: prefill, decode")
    current: dict[str, int] = Field(description="ready workers by role now")
