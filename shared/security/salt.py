"""Tenant salts, derived by the server: HMAC-SHA256 of the tenant id under the mesh's
``tenant-salt`` secret. A client can name a tenant (with auth off) but never choose a salt, and
cannot compute another tenant's salt without the secret, so block hashes, storage-tier file
names and KV events say nothing a client could match against its own. Routers derive salts;
workers only ever see the salts the router sends with each task."""

from __future__ import annotations

import hashlib
import hmac

SALT_SECRET = "tenant-salt"
SALT_CHARS = 32  # hex: 128 bits


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The salt of a tenant's block hashes; the empty tenant (no tenant named, auth off) has
    the empty salt: the shared namespace."""
    if not tenant:
        return ""
    return hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:SALT_CHARS]
