"""KV handoff tokens: the router's word to a decode worker that a KV push is for the request it
sent there. HMAC-SHA256 of (request id, decode worker, expiry) under the mesh's ``kv-handoff``
secret: bound to one request and one decode worker, short-lived (it expires with the
request's deadline), unforgeable without the secret, and checked without a round trip. A
decode worker refuses a push without one, with another request's, or past its expiry."""

from __future__ import annotations

import hashlib
import hmac

HANDOFF_SECRET = "kv-handoff"


def _mac(secret: bytes, request_id: str, decode_id: str, expires: int) -> str:
    return hmac.new(
        secret, f"{request_id}\n{decode_id}\n{expires}".encode(), hashlib.sha256
    ).hexdigest()


def handoff_token(secret: bytes, request_id: str, decode_id: str, expires_at: float) -> str:
    expires = int(expires_at) + 1
    return f"{expires}.{_mac(secret, request_id, decode_id, expires)}"


def handoff_refusal(secret: bytes, token: str, request_id: str, decode_id: str, now: float) -> str:
    """Why a push carrying ``token`` is refused; "" when the token is good."""
    if not token:
        return "no handoff token"
    expires, _, mac = token.partition(".")
    if not expires.isdigit():
        return "a malformed handoff token"
    if not hmac.compare_digest(mac, _mac(secret, request_id, decode_id, int(expires))):
        return "a handoff token that is not this request's"
    if now > int(expires):
        return "an expired handoff token"
    return ""
