"""API keys: the keys file, which `kvmesh keys` writes and the router reads.

Each entry holds a key's SHA-256 (never the key: a key is 32 random bytes, so a plain hash is
enough to keep it from being recovered), the tenant it speaks for, its role (``user`` or
``admin``), its limits (requests and input tokens per minute, requests at once, answers
per prompt; 0: none, or the router's), the classes its requests may ask for (``tier_ceiling``:
the highest; ``tier_default``: what one asking for none gets; empty: ``priority`` and
``default``), its tenant's weight in the fair share of a class (``weight``; 0: 1) and how
long and how much of its KV it may pin (``pin_ttl_s``, ``pin_bytes``; 0: the router's).
JSON, or TOML when the file's name ends in ``.toml``:

    {"keys": [{"id": "key_3f9a0c1d", "sha256": "…", "tenant": "acme", "role": "user",
               "rpm": 600, "tpm": 2000000, "concurrency": 32, "choices": 4,
               "tier_ceiling": "default", "tier_default": "default", "weight": 2,
               "revoked": false, "created_at": "2026-12-01T10:00:00Z"}]}

A key is shown once, when it is made; its id (from its hash) names it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import tomllib
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from shared.files import write_atomically

ROLES = ("user", "admin")
PREFIX = "kvm_"
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class KeysFileError(ValueError):
    pass


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


LIMITS = ("rpm", "tpm", "concurrency", "choices")  # a key's limits: whole numbers, 0 for none
TIERS = ("priority", "default", "flex")  # the classes a request may ask for, highest first
MAX_WEIGHT = 1000


@dataclass(frozen=True)
class ApiKey:
    id: str
    sha256: str
    tenant: str
    role: str = "user"
    rpm: int = 0  # requests per minute (0: no limit)
    tpm: int = 0  # input tokens per minute
    concurrency: int = 0  # requests in progress at once
    choices: int = 0  # answers per prompt (n, best_of) at most (0: the router's max_choices)
    tier_ceiling: str = ""  # the highest class its requests may ask for ("": priority)
    tier_default: str = ""  # the class of a request that asks for none ("": default)
    weight: int = 0  # its tenant's weight in a class's fair share (0: 1)
    pin_ttl_s: int = 0  # a conversation's KV pinned for at most this long (0: the router's)
    pin_bytes: int = 0  # KV its tenant may have pinned at once (0: the router's)
    revoked: bool = False
    created_at: str = ""

    def check(self) -> None:
        if not _TENANT.match(self.tenant):
            raise KeysFileError(
                f"key {self.id}: tenant must be 1-64 of letters, digits, '.', '_', '-'"
            )
        if self.role not in ROLES:
            raise KeysFileError(f"key {self.id}: role must be one of {', '.join(ROLES)}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise KeysFileError(f"key {self.id}: sha256 must be 64 hex digits")
        for name in LIMITS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise KeysFileError(f"key {self.id}: {name} must be a whole number ≥ 0")
        for name in ("tier_ceiling", "tier_default"):
            if getattr(self, name) not in ("", *TIERS):
                raise KeysFileError(f"key {self.id}: {name} must be one of {', '.join(TIERS)}")
        if TIERS.index(self.default_tier) < TIERS.index(self.ceiling):
            raise KeysFileError(
                f"key {self.id}: tier_default {self.default_tier!r} is above its "
                f"tier_ceiling {self.ceiling!r}"
            )
        if not isinstance(self.weight, int) or not 0 <= self.weight <= MAX_WEIGHT:
            raise KeysFileError(f"key {self.id}: weight must be a whole number 0-{MAX_WEIGHT}")
        for name in ("pin_ttl_s", "pin_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise KeysFileError(f"key {self.id}: {name} must be a whole number ≥ 0")

    @property
    def ceiling(self) -> str:
        return self.tier_ceiling or "priority"

    @property
    def default_tier(self) -> str:
        return self.tier_default or "default"


def new_key(tenant: str, role: str = "user", **limits: int | str) -> tuple[str, ApiKey]:
    """A fresh key (shown once) and its entry."""
    key = PREFIX + secrets.token_urlsafe(32)
    digest = key_hash(key)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry = ApiKey(f"key_{digest[:8]}", digest, tenant, role, created_at=stamp, **limits)
    entry.check()
    return key, entry


@dataclass
class KeysFile:
    keys: list[ApiKey] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> KeysFile:
        """The file's keys; a missing file has none. A malformed one raises KeysFileError
        naming the file and what is wrong."""
        if not path.exists():
            return cls()
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text or "{}")
            entries = data.get("keys", [])
            if not isinstance(entries, list):
                raise ValueError("'keys' must be a list")
        except (OSError, ValueError, AttributeError) as err:
            raise KeysFileError(f"{path}: not a keys file ({err})") from None
        keys = []
        for n, entry in enumerate(entries, 1):
            if not isinstance(entry, dict):
                raise KeysFileError(f"{path}: entry {n} is not a table")
            missing = {"id", "sha256", "tenant"} - set(entry)
            unknown = set(entry) - set(ApiKey.__dataclass_fields__)
            if missing or unknown:
                what = [f"missing {', '.join(sorted(missing))}"] if missing else []
                what += [f"unknown {', '.join(sorted(unknown))}"] if unknown else []
                raise KeysFileError(f"{path}: entry {n}: {'; '.join(what)}")
            k = ApiKey(**entry)
            try:
                k.check()
            except KeysFileError as err:
                raise KeysFileError(f"{path}: {err}") from None
            keys.append(k)
        return cls(keys)

    def write(self, path: Path) -> None:
        entries = [asdict(k) for k in self.keys]
        if path.suffix == ".toml":
            text = "".join(
                "[[keys]]\n" + "".join(_toml(k, v) for k, v in e.items()) + "\n" for e in entries
            )
        else:
            text = json.dumps({"keys": entries}, indent=2) + "\n"
        write_atomically(path, text)
        path.chmod(0o600)

    def add(self, entry: ApiKey) -> None:
        self.keys.append(entry)

    def revoke(self, key_id: str) -> ApiKey:
        for i, k in enumerate(self.keys):
            if k.id == key_id:
                self.keys[i] = replace(k, revoked=True)
                return self.keys[i]
        raise KeysFileError(f"no key {key_id!r}")


def _toml(name: str, value: object) -> str:
    if isinstance(value, bool):
        return f"{name} = {'true' if value else 'false'}\n"
    if isinstance(value, int):
        return f"{name} = {value}\n"
    return f"{name} = {json.dumps(str(value))}\n"  # a JSON string is a TOML basic string
