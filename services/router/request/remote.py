"""Fetching an http(s) image URL a client sent (only when KVMESH_ROUTER_ALLOW_REMOTE_IMAGES is
on), without letting the client reach what only the router can.

A URL is a request the router makes on the client's behalf from inside the cluster; pointed at
the cloud's metadata service (169.254.169.254), a worker's metrics port or an internal admin
page it would fetch what the client could never reach (server-side request forgery). So, unless
``private_ok``: every address the router connects to must be public, which is checked

- on the addresses a name resolves to, inside the connector's resolver, so the connection goes
  to the address checked (a name that resolves once public and then private gains nothing);
- on literal IP hosts, which aiohttp never resolves;
- on every redirect, followed here one hop at a time (at most ``MAX_REDIRECTS``), each hop
  http(s) only.

Bodies are read up to ``max_bytes`` + 1, the whole fetch within ``timeout_s``.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from shared.vision.images import BadImage

MAX_REDIRECTS = 5


def is_public(address: str) -> bool:
    """Globally routable: not private, loopback, link-local, multicast, reserved or shared."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone names a local link
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class Reach:
    """Where a remote image URL may lead: public addresses, and ``hosts`` (names or
    addresses: an internal image server) even when they are not; or anywhere (``private``)."""

    private: bool = False
    hosts: frozenset[str] = frozenset()

    def allows(self, host: str) -> bool:
        return self.private or host.rstrip(".").lower() in self.hosts


class NotPublic(OSError):
    """A host whose addresses are all non-public (an OSError: aiohttp wraps it as a DNS
    failure, whose cause ``fetch_image`` reports)."""


class PublicResolver(AbstractResolver):
    """A resolver (the system's unless another is given) keeping the addresses ``reach``
    allows: public ones, and every address of a host it names."""

    def __init__(self, reach: Reach, names: AbstractResolver | None = None) -> None:
        self.reach = reach
        self.names = names or ThreadedResolver()

    async def close(self) -> None:
        await self.names.close()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.names.resolve(host, port, family)
        if self.reach.allows(host):
            return found
        public = [r for r in found if is_public(r["host"]) or self.reach.allows(r["host"])]
        if not public:
            shown = ", ".join(sorted({r["host"] for r in found}))
            raise NotPublic(f"{host.rstrip('.')} resolves to {shown}, not a public address")
        return public


async def fetch_image(
    url: str, max_bytes: int, timeout_s: float, reach: Reach, names: AbstractResolver | None = None
) -> bytes:
    """The body at ``url``; BadImage (its message for the client) on anything else.
    ``names``: how host names resolve (the system's resolver unless given)."""
    resolver = names if reach.private else PublicResolver(reach, names)
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    target = URL(url)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                _check_hop(target, reach)
                async with session.get(target, allow_redirects=False) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in (301, 302, 303, 307, 308) and location:
                        target = target.join(URL(location))
                        continue
                    if resp.status != 200:
                        raise BadImage(f"fetching the URL gave HTTP {resp.status}")
                    data = await _body(resp, max_bytes)
                    break
            else:
                raise BadImage(f"fetching the URL took more than {MAX_REDIRECTS} redirects")
    except aiohttp.ClientConnectorDNSError as err:
        if isinstance(err.os_error, NotPublic):
            raise BadImage(f"{err.os_error}: refused") from None
        raise BadImage("cannot fetch the URL (its host does not resolve)") from None
    except (aiohttp.ClientError, TimeoutError) as err:
        raise BadImage(f"cannot fetch the URL ({type(err).__name__})") from None
    if len(data) > max_bytes:
        raise BadImage(f"image is larger than {max_bytes:,} bytes")
    return data


async def _body(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The whole body, or its first ``max_bytes`` + 1 (then it is too large): read to its
    end, not what one read gives (a server that sends a little then stalls is a timeout)."""
    data = bytearray()
    async for chunk in resp.content.iter_chunked(64 << 10):
        data += chunk
        if len(data) > max_bytes:
            break
    return bytes(data)


def _check_hop(url: URL, reach: Reach) -> None:
    if url.scheme not in ("http", "https") or not url.host:
        raise BadImage(f"only http(s) URLs can be fetched, not {str(url)[:100]!r}")
    if reach.allows(url.host):
        return
    try:
        public = is_public(url.host)
    except ValueError:
        return  # a name, not an address: checked as it resolves
    if not public:
        raise BadImage(f"{url.host} is not a public address: refused")
