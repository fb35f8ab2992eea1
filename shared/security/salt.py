"""Tenant salts, derived by the server: HMAC-SHA256 of the tenant id under a secret kept in the
state dir. A client can name a tenant (with auth off) but never choose a salt, and cannot
compute another tenant's salt without the secret, so block hashes, storage-tier file names
and KV events say nothing a client could match against its own.

The secret is 32 random bytes in ``<state dir>/secrets/tenant-salt.key`` (mode 0600), made at
first start. Routers that share a mesh must share it (the same state dir, or the same file
copied into each); workers only ever see the salts the router sends with each task.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

SECRET_FILE = Path("secrets") / "tenant-salt.key"
SALT_CHARS = 32  # hex: 128 bits


def load_or_create_secret(state_dir: Path) -> bytes:
    """The mesh's salt secret, made now if there is none (several processes starting at
    once agree on one: the first to create the file wins, the others read it)."""
    path = state_dir / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(100):  # the creator may still be writing
            data = path.read_bytes()
            if len(data) == 32:
                return data
            time.sleep(0.01)
        raise ValueError(f"{path}: not a 32-byte secret") from None
    secret = secrets.token_bytes(32)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The salt of a tenant's block hashes; the empty tenant (no tenant named, auth off) has
    the empty salt: the shared namespace."""
    if not tenant:
        return ""
    return hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:SALT_CHARS]
