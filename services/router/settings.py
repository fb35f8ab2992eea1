"""The router's settings (environment prefix KVMESH_ROUTER_, file table [router]), in sections.

Each section is the settings of one part of the router, a frozen model that part takes as it
is (as vLLM's scheduler takes ``vllm_config.scheduler_config``): the dispatcher a
``DispatchSettings``, the image reader an ``ImageSettings``, ... ``RouterSettings`` is every
section at once, so the names stay flat in the environment and the settings file
(``KVMESH_ROUTER_ACK_TIMEOUT_S``, ``ack_timeout_s`` under ``[router]``), the router's
settings are handed to each part whole, and a test builds just the section a part needs
(``DispatchSettings(token_timeout_s=0.2)``). Every default is written once, here.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.router.routing.policies import POLICIES
from services.router.routing.route import RoutingPolicy
from services.router.routing.ttft import CostDefaults
from shared.security.keys import KeysFile, KeysFileError
from shared.service import ServiceSettings


class Section(BaseModel):
    """A part of the router's settings: frozen, and strict about unknown names."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ApiSettings(Section):
    """The transports (services/router/api/)."""

    grpc_port: int = Field(default=50051, ge=0, le=65535, description="the public gRPC API port")
    stream_ping_s: float = Field(
        default=5.0,
        gt=0,
        description="a streamed answer with no token for this long (a long prefill) opens its "
        "stream and sends a keep-alive (Anthropic's ping event, an SSE comment in OpenAI's "
        "formats), and again every interval; errors after that arrive in the stream",
    )


class TenancySettings(Section):
    """Who may send what (services/router/tenancy/): keys, and the router's admission."""

    keys_file: Path | None = Field(
        default=None,
        description="the API keys file (JSON, or TOML by its name; `kvmesh keys` writes it): "
        "when set, every request needs a key and its tenant is the key's; unset: auth is off",
    )
    max_inflight: int = Field(
        default=256, ge=1, description="requests in progress at most; more get 429"
    )
    max_loop_lag_s: float = Field(
        default=0.25,
        gt=0,
        description="new requests get 429 while the router's event loop runs this far behind "
        "(it streams more tokens than it can write: the answers in flight go first)",
    )
    max_cache_ttl_s: float = Field(
        default=3600.0,
        ge=0,
        description="a conversation's KV is pinned for at most this long "
        "(x-kvmesh-cache-ttl-s; a key's own pin_ttl_s can set less or more); 0: no pins",
    )
    pinned_bytes_per_tenant: int = Field(
        default=4 << 30,
        ge=0,
        description="KV a tenant may have pinned at once, counted by this router (a key's own "
        "pin_bytes can set another)",
    )

    @field_validator("keys_file")
    @classmethod
    def _readable_keys(cls, path: Path | None) -> Path | None:
        if path is not None:
            if not path.is_file():
                raise ValueError(f"no such file: {path} (make one with `kvmesh keys add`)")
            try:
                KeysFile.read(path)
            except KeysFileError as err:
                raise ValueError(str(err)) from None
        return path


class RequestSettings(Section):
    """A request's preparation (services/router/request/): rendering, limits, deadline."""

    default_max_tokens: int = Field(
        default=512, ge=1, description="answer length when a request gives none"
    )
    token_cache_tokens: int = Field(
        default=4_000_000,
        ge=0,
        description="tokens of prompt segments (messages) kept tokenized for the next turn",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="a request still unanswered after this fails (504)"
    )
    max_choices: int = Field(
        default=16,
        ge=1,
        le=128,
        description="answers per prompt at most (n, best_of), unless a key says fewer",
    )
    max_prompts: int = Field(
        default=64, ge=1, le=1024, description="prompts in one Completions request at most"
    )


class ImageSettings(Section):
    """Images in requests: reading and checking them, and their encodes."""

    image_max_bytes: int = Field(
        default=5 << 20, ge=1, description="bytes per image at most (also NATS's max_payload)"
    )
    images_per_request: int = Field(default=8, ge=0, le=256, description="images at most")
    allow_remote_images: bool = Field(
        default=False, description="fetch http(s) image URLs (off: data: URLs only, no egress)"
    )
    remote_images_private: bool = Field(
        default=False,
        description="let remote image URLs reach private, loopback and link-local addresses "
        "(off: public addresses only, checked on every connection and redirect)",
    )
    remote_image_hosts: list[str] = Field(
        default_factory=list,
        description="hosts (names or addresses) remote image URLs may reach though they are "
        "not public: an internal image server; every other host must be public",
    )
    remote_image_timeout_s: float = Field(default=10.0, gt=0, description="to fetch one image")
    encode_timeout_s: float = Field(
        default=30.0, gt=0, description="an image not encoded within this fails its request (503)"
    )
    encode_ahead: bool = Field(
        default=True,
        description="send images to the encoder as soon as a request is checked (off: only "
        "after tokenizing, and route once they are encoded; for comparison)",
    )


class DispatchSettings(Section):
    """Talking to workers (services/router/dispatch/): asks, progress bounds, moves."""

    ack_timeout_s: float = Field(
        default=2.0, gt=0, description="a worker must queue or refuse a task within this"
    )
    token_links: bool = Field(default=True, description="token events on links, not NATS")
    token_port: int = Field(default=0, ge=0, le=65535, description="where token links connect")
    prefix_prompts: int = Field(
        default=4096,
        ge=0,
        description="conversations whose block hashes are kept, so a next turn hashes only "
        "its new blocks, in at most prefix_bytes (each holds its conversation's text)",
    )
    prefix_bytes: int = Field(default=256 << 20, ge=0, description="(see prefix_prompts)")
    max_starting: int = Field(
        default=32,
        ge=1,
        description="requests looking up their cache or sending their task at once; a burst "
        "beyond it takes turns (replies to those already asking are not starved)",
    )
    migration_limit: int = Field(
        default=3,
        ge=0,
        le=10,
        description="times a request moves to other workers when its workers fail (before its "
        "first token: retried; mid-answer: resumed from the tokens sent); then an error",
    )
    first_token_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="no first token within this: the request's workers are given up on and it "
        "moves (a frozen worker is not waited on until the request's timeout)",
    )
    token_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="no next token within this: the decode worker is given up on and the "
        "request resumes elsewhere",
    )
    resume_wait_s: float = Field(
        default=10.0,
        ge=0,
        le=120,
        description="a request moving mid-answer that finds no worker to resume on waits this "
        "long for one (a worker whose NATS node was lost is back within seconds); the client "
        "cannot retry an answer half sent",
    )
    local_prefill_max_tokens: int = Field(
        default=64, ge=0, description="an uncached prompt this short is prefilled on decode"
    )
    liveness_check_s: float = Field(
        default=0.25,
        gt=0,
        description="how often every answer being waited for is checked: its deadline, its "
        "workers still in the registry, the progress bounds",
    )


class RoutingSettings(Section):
    """Which workers a request goes to (services/router/routing/)."""

    routing_policy: str = Field(default="ttft", description="how prefill workers are picked")
    prefill_tok_s: float = Field(
        default=400.0, gt=0, description="a prefill worker's compute rate until it reports one"
    )
    load_tok_s: float = Field(
        default=20_000.0, gt=0, description="storage-tier load rate until workers report one"
    )
    prefill_batch_tokens: int = Field(
        default=512,
        ge=0,
        description="tokens a prefill worker computes in one pass over the requests queued "
        "together (its KVMESH_PREFILL_PREFILL_CHUNK; 0: a request a pass): the requests waiting "
        "when a pass begins are done when it ends",
    )

    @field_validator("routing_policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"one of {', '.join(POLICIES)}")
        return name

    def policy(self, salt: str = "") -> RoutingPolicy:
        """A new instance of the policy named, starting from the rates set here; ``salt``
        (the router's id) orders its ties."""
        costs = CostDefaults(
            self.prefill_tok_s, self.load_tok_s, batch_tokens=self.prefill_batch_tokens
        )
        return POLICIES[self.routing_policy](costs, salt)


class WorkerSettings(Section):
    """The workers as the router sees them: heartbeats, circuit breakers, and the KV block
    index (services/router/dispatch/kvindex.py)."""

    index_catch_up_s: float = Field(
        default=60.0,
        gt=0,
        description="a router starting reads the index's snapshot and catches up with the KV "
        "event stream before it serves; past this it serves with what it has (a warning)",
    )
    touch_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=3600,
        description="how often the blocks this router used go out as one touch event (their "
        "TTL restarts everywhere)",
    )

    missed_heartbeats: int = Field(
        default=3, ge=1, le=100, description="a service that misses this many beats is dropped"
    )
    breaker_faults: int = Field(
        default=3,
        ge=1,
        description="a worker's faults in a row (no ack, gone mid-request, no token within "
        "the bounds, an error) that open its circuit breaker: it gets no request for a while",
    )
    breaker_cooldown_s: float = Field(
        default=10.0, gt=0, description="how long an open breaker skips its worker"
    )


class ObserveSettings(Section):
    """What the router records (services/router/observe/)."""

    stats_share_s: float = Field(default=5.0, gt=0, description="how often minutes are shared")
    cache_explain_bytes: int = Field(
        default=64 * 2**20,
        ge=0,
        description="memory for explaining cache misses (each tenant's recent conversations, "
        "the least recent dropped first); 0 turns explanations off",
    )
    recent_requests_bytes: int = Field(
        default=16 << 20, ge=0, description="memory for the operator page's recent requests"
    )


class PlanSettings(Section):
    """The pools the recent traffic needs (services/router/observe/capacity.py): served at
    /v1/plan and as kvmesh_recommended_workers, for an autoscaler."""

    plan_window_s: float = Field(
        default=300.0, gt=0, le=86400, description="the recent traffic the plan is made from"
    )
    plan_ttft_p50_s: float = Field(default=1.0, gt=0, description="the TTFT p50 to meet")
    plan_ttft_p99_s: float = Field(default=5.0, gt=0, description="the TTFT p99 to meet")
    plan_tpot_mean_s: float = Field(
        default=0.1, gt=0, description="the mean time per output token to meet"
    )
    plan_min_workers: int = Field(default=1, ge=0, description="fewest of a role recommended")
    plan_max_workers: int = Field(default=64, ge=1, description="most of a role recommended")


class BatchSettings(Section):
    """Files and batches (services/router/batch/)."""

    files_max_bytes: int = Field(
        default=200 << 20, ge=1, description="an uploaded file (/v1/files) at most"
    )
    batch_max_requests: int = Field(
        default=50_000, ge=1, description="requests in one batch's input file at most"
    )
    batch_concurrency: int = Field(
        default=16,
        ge=1,
        description="a batch's requests in flight at once on this router (fewer while the "
        "workers turn batch work away: online requests go first)",
    )
    files_store_bytes: int = Field(
        default=64 << 30,
        ge=1,
        description="all files together (uploads, results) at most; a file past it is refused "
        "(413: the routers check it, the NATS servers reserve none of it)",
    )
    batch_keep_s: float = Field(
        default=30 * 86400, gt=0, description="how long files, batches and results are kept"
    )
    batch_lease_s: float = Field(
        default=15.0,
        gt=0,
        description="a router working on a batch renews its claim within this; when it stops "
        "renewing (it died), another router carries the batch on after it",
    )


class UpstreamSettings(Section):
    """Servers this router routes to that kvmesh did not start (``services/router/upstream/``)."""

    upstreams: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible servers (vllm serve, SGLang's server) to route to as "
        "workers, each [MODEL=]URL: MODEL the kvmesh model it serves (the bundled one by "
        "default), URL http://host:port, or dns://name:port for every A record of a name "
        "(a Kubernetes headless Service), resolved again every upstream_resolve_s",
    )
    upstream_poll_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="how often each server's /metrics is read (its load, its health)",
    )
    upstream_resolve_s: float = Field(
        default=10.0, gt=0, description="how often a dns:// upstream's name is resolved again"
    )
    upstream_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="a server that has not answered a request's headers (or a /metrics read) "
        "within this is taken as failing",
    )
    upstream_events: bool = Field(
        default=True,
        description="follow each server's KV cache events (as its /kv_event_sources says: "
        "vllm serve --kv-events-config with a bound tcp://*:PORT endpoint); off, or a server "
        "without them, is routed by load",
    )

    @field_validator("upstreams")
    @classmethod
    def _upstream_urls(cls, upstreams: list[str]) -> list[str]:
        for entry in upstreams:
            url = entry.split("=", 1)[-1]
            if not url.startswith(("http://", "https://", "dns://")) or ":" not in url[6:]:
                raise ValueError(
                    f"upstreams: {entry!r} is not [MODEL=]http://host:port, https://host:port "
                    "or dns://name:port"
                )
        return upstreams


class RouterSettings(
    ServiceSettings,
    ApiSettings,
    TenancySettings,
    RequestSettings,
    ImageSettings,
    DispatchSettings,
    RoutingSettings,
    WorkerSettings,
    ObserveSettings,
    PlanSettings,
    BatchSettings,
    UpstreamSettings,
):
    model_config = SettingsConfigDict(env_prefix="KVMESH_ROUTER_")
    file_table: ClassVar[str] = "router"

    http_port: int = Field(default=8000, ge=0, le=65535, description="the public API port")
    max_body_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="a request body at most (more: 413); images come in the body, base64",
    )
