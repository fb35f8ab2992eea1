"""Settings: one pydantic-settings class per service, read once at start, then passed down frozen.

Every value comes, in order of precedence, from the environment, from the optional settings file
named by ``KVMESH_SETTINGS_FILE`` (TOML: common values under ``[common]``, a service's own under
``[router]``, ``[prefill]``, ...), then from the defaults here.

Common values use the prefix ``KVMESH_`` (``KVMESH_NATS_URL``); a service's own values use
``KVMESH_<ROLE>_`` (``KVMESH_ROUTER_HTTP_PORT``), so one environment can configure a whole stack.
"""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, FilePath, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from shared.vision.grid import VisionGrid

SETTINGS_FILE_VAR = "KVMESH_SETTINGS_FILE"

LogLevel = Literal["debug", "info", "warning", "error"]


class SettingsError(Exception):
    """A setting a user gave is invalid; the message names the variable and what is allowed."""


class KvmeshSettings(BaseSettings):
    """Base of every settings class: frozen, strict about unknown file keys, file-aware."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", env_prefix="KVMESH_")
    # The [table] of the settings file this class reads; subclasses set it.
    file_table: ClassVar[str] = "common"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(SETTINGS_FILE_VAR)
        if path:
            table = settings_cls.file_table  # type: ignore[attr-defined]
            sources.append(TomlConfigSettingsSource(settings_cls, Path(path), (table,)))
            if "models" in settings_cls.model_fields:  # the file's own [models] table
                sources.append(_ModelsTable(settings_cls, Path(path)))
        return tuple(sources)


class _ModelsTable(PydanticBaseSettingsSource):
    """The settings file's ``[models]`` table (served name = path) as the ``models`` field."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        super().__init__(settings_cls)
        with open(path, "rb") as f:
            self.table = tomllib.load(f).get("models", {})

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # noqa: ANN401
        return self.table if field_name == "models" else None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return {"models": self.table} if self.table else {}


class CommonSettings(KvmeshSettings):
    """What every service and the CLI share."""

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        pattern=r"^(nats|tls)://[^\s/,]+:\d+(,\s*(nats|tls)://[^\s/,]+:\d+)*$",
        description="NATS server, or a cluster's servers comma-separated; `kvmesh up` starts "
        "one here unless this names a running server",
    )
    # How a service proves who it is to NATS. Unset: its role's NKey from the secrets dir
    # (what `kvmesh up` and docker-compose configure nats-server with). For another NATS:
    nats_creds_file: FilePath | None = Field(
        default=None, description="NATS credentials file (a user JWT and its NKey seed)"
    )
    nats_user: str = Field(default="", description="NATS user (with KVMESH_NATS_PASSWORD)")
    nats_password: SecretStr = SecretStr("")
    nats_token: SecretStr = Field(default=SecretStr(""), description="NATS token")
    nats_tls_ca_file: FilePath | None = Field(
        default=None, description="CA that signs NATS's certificate; unset: KVMESH_TLS_CA_FILE"
    )
    nats_tls_cert_file: FilePath | None = Field(
        default=None, description="certificate shown to NATS (mutual TLS); unset: the mesh's"
    )
    nats_tls_key_file: FilePath | None = None

    # The mesh's TLS: services' listeners (the router's HTTP and gRPC APIs, the KV handoff)
    # serve this certificate; services verify each other (and NATS) against the CA and show
    # their certificate to each other (mutual TLS). Unset: plain TCP. `kvmesh up --tls` makes
    # a local CA and certificates under <state_dir>/tls.
    tls_ca_file: FilePath | None = Field(default=None, description="CA of the mesh's certificates")
    tls_cert_file: FilePath | None = Field(default=None, description="this service's certificate")
    tls_key_file: FilePath | None = Field(default=None, description="its private key")
    state_dir: Path = Field(default=Path(".kvmesh"), description="local state: NATS store, logs")
    service_id: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_.-]{0,64}$",
        description="unique id of this process; empty means role-host-pid",
    )
    log_level: LogLevel = "info"
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=60)
    fault_hooks: bool = Field(
        default=False,
        description="tests only: serve PUT/DELETE /faults/{name}, faults switched on inside the "
        "process (shared/faults.py; the route has no auth)",
    )
    bench_engines: bool = Field(
        default=False,
        description="benchmarks only: let a worker run an engine whose answers are not the "
        "model's (fake-paced, for measuring the mesh itself)",
    )

    @property
    def kv_feed_bound_s(self) -> float:
        """How late a worker's KV events may come (or how long they may stop while it
        computes) before its feed is stale: a stopped feed is flagged within 3 heartbeats."""
        return 1.2 * self.heartbeat_interval_s

    drain_timeout_s: float = Field(default=10.0, ge=0, le=600)
    nats_connect_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="how long to wait for NATS at start"
    )
    nats_lost_after_s: float = Field(
        default=4.0,
        ge=1,
        le=600,
        description="a NATS node that acknowledges nothing this service sent (or answers none "
        "of its pings) for this long is taken as lost, and the service moves to another of the "
        "cluster's: a host cut off leaves its TCP connections open, only silence tells",
    )
    jetstream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="copies of each JetStream stream (KV events, statistics, embeddings) on "
        "a NATS cluster's nodes: 3 on a cluster of three or more, so losing a node loses none",
    )

    models: dict[str, str] = Field(
        default_factory=dict,
        description="a team's own models: served name → a GGUF file or a Hugging Face "
        "directory (a JSON object; or [models] in the settings file, or kvmesh up --model "
        "NAME=PATH); the bundled smollm2-135m-instruct and the tiny test models need none",
    )
    loras: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served as models of their own: served name → BASE:PATH "
        "(the base model's name, a PEFT adapter directory: adapter_config.json and "
        "adapter_model.safetensors); a JSON object, or kvmesh up --lora NAME=BASE:PATH. More "
        "are loaded at run time through a router's /v1/load_lora_adapter",
    )

    kv_store_dir: Path | None = Field(
        default=None,
        description="the KV storage tier: a directory, shared by every worker (a shared file "
        "system mounted at the same path in a cluster); unset: <state_dir>/kvstore",
    )

    secrets_dir: Path | None = Field(
        default=None,
        description="the mesh's secrets (tenant salts, KV handoff tokens): every router and "
        "worker of a mesh must read the same ones; unset: <state_dir>/secrets",
    )

    trace_exporter: Literal["file", "otlp-grpc", "otlp-http", "console", "none"] = Field(
        default="file",
        description="where spans go: JSON lines under <state_dir>/traces (read by `kvmesh "
        "trace`), OTLP over gRPC or HTTP (Jaeger, Tempo), the console, or nowhere",
    )
    trace_endpoint: str = Field(
        default="", description="OTLP endpoint; empty: OTEL_EXPORTER_OTLP_ENDPOINT or localhost"
    )
    trace_sample_ratio: float = Field(
        default=1.0, ge=0, le=1, description="share of new traces recorded (a parent's choice wins)"
    )
    recent_traces: int = Field(
        default=4096,
        ge=0,
        le=1 << 20,
        description="traces each process keeps in memory, the most recent, for the operator "
        "page's request detail (a trace is this process's spans of one request)",
    )
    recent_traces_bytes: int = Field(
        default=64 << 20,
        ge=0,
        description="and the most memory they take, by the spans' own count (their attributes "
        "and events): the oldest go first",
    )
    heap_trim_interval_s: float = Field(
        default=10.0,
        ge=0,
        description="every this many seconds, the C heap's free pages are given back to the "
        "system (glibc's malloc_trim, on a thread): without it a long-running process keeps "
        "what it freed in holes between live objects (buffers of every size: KV blocks, gRPC "
        "frames, JSON bodies), resident; 0: never",
    )

    # How an image becomes placeholder tokens: the router counts them, the encoder makes
    # that many embeddings; both must read the same values.
    image_patch_size: int = Field(default=14, ge=2, le=64, description="ViT patch side, pixels")
    image_merge: int = Field(
        default=2, ge=1, le=4, description="patches merged per side into one token (2: 2×2 → 1)"
    )
    image_max_tokens: int = Field(
        default=256, ge=1, le=16384, description="tokens per image at most (larger is scaled down)"
    )
    image_min_tokens: int = Field(
        default=4, ge=1, le=16384, description="tokens per image at least (smaller is scaled up)"
    )

    image_max_pixels: int = Field(
        default=25_000_000,
        ge=1,
        description="pixels an image may declare (width × height): refused above, before any "
        "pixel is decoded (decompression bombs)",
    )

    @property
    def vision_grid(self) -> VisionGrid:
        return VisionGrid(
            self.image_patch_size, self.image_merge, self.image_min_tokens, self.image_max_tokens
        )

    @model_validator(mode="after")
    def _pairs(self) -> CommonSettings:
        for cert, key, prefix in (
            (self.tls_cert_file, self.tls_key_file, "KVMESH_TLS"),
            (self.nats_tls_cert_file, self.nats_tls_key_file, "KVMESH_NATS_TLS"),
        ):
            if (cert is None) != (key is None):
                raise ValueError(f"{prefix}_CERT_FILE and {prefix}_KEY_FILE go together")
        if self.tls_cert_file is not None and self.tls_ca_file is None:
            raise ValueError("KVMESH_TLS_CERT_FILE needs KVMESH_TLS_CA_FILE (the mesh's CA)")
        if self.nats_user and not self.nats_password.get_secret_value():
            raise ValueError("KVMESH_NATS_USER needs KVMESH_NATS_PASSWORD")
        from shared.model.lora import LoraError, parse_spec

        for name, where in self.loras.items():
            try:
                parse_spec(f"{name}={where}")
            except LoraError as err:
                raise ValueError(f"KVMESH_LORAS: {err}") from None
        return self

    @property
    def nats_servers(self) -> list[str]:
        return [u.strip() for u in self.nats_url.split(",")]

    @property
    def nats_tls_files(self) -> tuple[Path | None, Path | None, Path | None]:
        """CA, certificate and key for NATS: its own settings, else the mesh's."""
        if self.nats_tls_ca_file or self.nats_tls_cert_file:
            return self.nats_tls_ca_file, self.nats_tls_cert_file, self.nats_tls_key_file
        return self.tls_ca_file, self.tls_cert_file, self.tls_key_file

    @property
    def tls(self) -> bool:
        """The mesh's services talk TLS to each other."""
        return self.tls_ca_file is not None

    @property
    def resolved_kv_store_dir(self) -> Path:
        return self.kv_store_dir or self.state_dir / "kvstore"

    @property
    def resolved_secrets_dir(self) -> Path:
        return self.secrets_dir or self.state_dir / "secrets"

    def resolved_service_id(self, role: str) -> str:
        return self.service_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable that sets ``field`` of ``cls``."""
    prefix = cls.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Read ``cls`` from the environment and the settings file, or raise SettingsError.

    The error lists every bad value as ``VARIABLE: what is allowed (got ...)``.
    """
    try:
        return cls(**overrides)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            if not e["loc"]:  # a rule across fields: its message names them
                lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
                continue
            field = str(e["loc"][0])
            if field in cls.model_fields:
                name = env_name(cls, field)
            else:  # only the settings file can name an unknown key
                table = getattr(cls, "file_table", "")
                name = f"{os.environ.get(SETTINGS_FILE_VAR)} [{table}] {field}"
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {name}: {e['msg']}{shown}")
        raise SettingsError("invalid settings:\n" + "\n".join(lines)) from None
    except (OSError, ValueError) as err:  # an unreadable or malformed settings file
        raise SettingsError(f"cannot read {SETTINGS_FILE_VAR}: {err}") from None
