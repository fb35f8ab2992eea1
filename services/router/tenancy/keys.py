"""Who a request is: its API key and the tenant the key speaks for. Keys come from the keys
file (shared/security/keys.py), read again when it changes: adding or revoking a key needs no
restart.

A key is accepted as ``Authorization: Bearer <key>`` (OpenAI clients), ``x-api-key: <key>``
(Anthropic clients) or the same names in gRPC metadata. With no keys file configured, auth is
off: every request is let in, and the tenant is what ``x-kvmesh-tenant`` says.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.router.errors import ApiError
from shared.security.keys import ApiKey, KeysFile, KeysFileError, key_hash

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 0.5  # how often the keys file's stamp is looked at, at most


@dataclass(frozen=True)
class Caller:
    """Who sent a request. ``key`` is None when auth is off."""

    tenant: str = ""
    key: ApiKey | None = None


ANONYMOUS = Caller()  # auth off


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in a request's headers (aiohttp's are case-insensitive; gRPC metadata keys
    are lower-case)."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


class KeyRing:
    """The keys file as the router sees it now."""

    def __init__(self, path: Path) -> None:
        """Raises KeysFileError when the file is malformed (RouterSettings has checked that
        it is there and reads at start)."""
        self.path = path
        self._by_hash = {k.sha256: k for k in KeysFile.read(path).keys}
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def reload(self) -> None:
        """Read the file if it changed. A file that does not parse keeps the keys read last
        (and says why): a bad edit must not let everyone in, or lock everyone out."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = KeysFile.read(self.path).keys
        except KeysFileError as err:
            log.error("keys file not read again, the keys read before stay: %s", err)
            return
        self._by_hash = {k.sha256: k for k in keys}
        revoked = sum(k.revoked for k in keys)
        log.info("keys file %s read: %d keys (%d revoked)", self.path, len(keys), revoked)

    def identify(self, headers: Mapping[str, str]) -> Caller:
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            self.reload()
        key = presented_key(headers)
        if not key:
            raise unauthorized(
                "no API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        entry = self._by_hash.get(key_hash(key))
        if entry is None:
            raise unauthorized("the API key is not valid")
        if entry.revoked:
            raise unauthorized(f"the API key {entry.id} has been revoked")
        return Caller(entry.tenant, entry)
