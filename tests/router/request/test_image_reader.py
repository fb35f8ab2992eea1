"""A prompt with images: its prefix hashes, reused or not, are the workers' block hashes; image
URLs fetched only when allowed, and only from public addresses."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from services.router.dispatch.encodes import ImageInput
from services.router.dispatch.plan import PrefixHashes
from services.router.errors import ApiError
from services.router.request import remote
from services.router.request.image_reader import ImageReader
from services.router.request.render import PLACEHOLDER_ID, PromptTokenizer, join_prompt
from services.router.settings import ImageSettings
from shared.kvstore.hashing import block_hashes
from shared.model.text import TextModel
from shared.settings import CommonSettings


@pytest.fixture(scope="module")
def tokenizer(real_text: TextModel) -> PromptTokenizer:
    model = real_text
    return PromptTokenizer(model.tokenizer)


def picture(name: str, tokens: int) -> ImageInput:
    return ImageInput(f"messages[0].content[{name}]", b"", name * 32, tokens)


def test_joined_prompts_hash_as_the_workers_do(tokenizer: PromptTokenizer) -> None:
    cache = PrefixHashes()
    text = "<|im_start|>user\\nLook at these " * 20
    a, b = picture("a", 77), picture("b", 77)
    for images in ((a,), (a,), (b,), (a, b)):
        parts: list = [tokenizer.encode_segments(text)]
        for img in images:
            parts += [img, tokenizer.encode_segments(" and then " * 30)]
        ids, segments, refs = join_prompt(parts)
        assert [r.tokens for r in refs] == [77] * len(images)
        assert all(list(ids[r.start : r.start + r.tokens]) == [PLACEHOLDER_ID] * 77 for r in refs)
        got = cache.hashes(segments, 64, "fp", "")  # reused from the prompt before, or not
        assert got == block_hashes(ids, 64, "fp", images=refs)
    first_a = join_prompt([tokenizer.encode_segments(text), a])
    first_b = join_prompt([tokenizer.encode_segments(text), b])
    start = first_a[2][0].start
    ha = block_hashes(first_a[0], 64, "fp", images=first_a[2])
    hb = block_hashes(first_b[0], 64, "fp", images=first_b[2])
    same = start // 64
    assert ha[:same] == hb[:same] and ha[same] != hb[same]


@pytest.fixture
async def image_server() -> AsyncIterator[tuple[int, bytes]]:
    """A local HTTP server with an image, redirects to it, a redirect loop, and redirects to
    a file and to the cloud metadata address; one that stalls mid-body, and one that sends
    more than any limit."""
    import io

    from aiohttp import web
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (56, 84), (9, 9, 9)).save(out, "PNG")

    def moved(to: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            raise web.HTTPFound(to)

        return handler

    async def cat(_: web.Request) -> web.Response:
        return web.Response(body=out.getvalue())

    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        await resp.write(out.getvalue()[:20])
        await asyncio.sleep(3)  # (the client gives up after 1 s)
        return resp

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB, past the reader's 1 MB
            await resp.write(b"\0" * (64 << 10))
        return resp

    app = web.Application()
    app.add_routes(
        [
            web.get("/cat.png", cat),
            web.get("/stalls.png", stalls),
            web.get("/endless.png", endless),
            web.get("/hop", moved("/cat.png")),
            web.get("/loop", moved("/loop")),
            web.get("/file", moved("file:///etc/passwd")),
            web.get("/meta", moved("http://169.254.169.254/latest/meta-data/")),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1], out.getvalue()  # type: ignore[union-attr]
    await runner.cleanup()


class Names(AbstractResolver):
    """The test's own name table, in place of the system's resolver: ``localhost`` is the
    loopback; any other name does not resolve (no lookup leaves the machine)."""

    TABLE = {"localhost": "127.0.0.1"}

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host not in self.TABLE:
            raise OSError(f"{host}: no such name")
        address = self.TABLE[host]
        return [
            ResolveResult(
                hostname=host, host=address, port=port, family=socket.AF_INET, proto=0, flags=0
            )
        ]

    async def close(self) -> None:
        pass


def limits(
    allow_remote: bool = True,
    private: bool = False,
    hosts: tuple[str, ...] = (),
    timeout_s: float = 5.0,
) -> ImageReader:
    settings = ImageSettings(
        image_max_bytes=10**6,
        allow_remote_images=allow_remote,
        remote_images_private=private,
        remote_image_hosts=list(hosts),
        remote_image_timeout_s=timeout_s,
    )
    return ImageReader(settings, CommonSettings(image_max_pixels=10**7), Names())


async def fetched(url: str, lim: ImageReader) -> ImageInput:
    return await lim.read(url, "messages[0].content[1].image_url", 8 << 20)


async def refused(url: str, lim: ImageReader, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        await fetched(url, lim)
    assert err.value.status == 400 and err.value.param == "messages[0].content[1].image_url"


async def test_remote_images_only_when_allowed(image_server: tuple[int, bytes]) -> None:
    port, png = image_server
    base = f"http://127.0.0.1:{port}"
    await refused(f"{base}/cat.png", limits(allow_remote=False), "only data: URLs")
    inside = limits(private=True)  # an operator who lets URLs reach private networks
    img = await fetched(f"{base}/cat.png", inside)
    assert img.tokens == 2 * 3 and img.data == png
    assert (await fetched(f"{base}/hop", inside)).data == png  # redirects are followed
    await refused(f"{base}/dog.png", inside, "HTTP 404")
    await refused(f"{base}/loop", inside, "more than 5 redirects")
    await refused(f"{base}/file", inside, "only http")


async def test_a_remote_image_that_stalls_is_too_large_or_does_not_resolve_is_a_400(
    image_server: tuple[int, bytes],
) -> None:
    """The fetch is bounded in time and in bytes, and a name that does not resolve is said
    so: each a 400 naming the image, at once or within the timeout (1 s here)."""
    port, _ = image_server
    base = f"http://127.0.0.1:{port}"
    inside = limits(private=True, timeout_s=1.0)
    await refused(f"{base}/stalls.png", inside, "cannot fetch the URL \\(.*Timeout")
    await refused(f"{base}/endless.png", inside, "larger than 1,000,000 bytes")
    await refused("http://kvmesh-test.invalid/x.png", inside, "does not resolve")
    await refused("http://kvmesh-test.invalid/x.png", limits(), "does not resolve")


async def test_remote_urls_reach_public_addresses_only(image_server: tuple[int, bytes]) -> None:
    """The router fetches on the client's behalf from inside the cluster: a URL naming a
    loopback, private or link-local address, directly, by a name or by a redirect, is refused
    before any byte is sent there."""
    port, png = image_server
    public_only = limits()
    for url in (
        f"http://127.0.0.1:{port}/cat.png",
        f"http://[::ffff:127.0.0.1]:{port}/cat.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/x.png",
    ):
        await refused(url, public_only, "not a public address: refused")
    await refused(f"http://localhost:{port}/cat.png", public_only, "localhost resolves to")
    # An internal image server named in KVMESH_ROUTER_REMOTE_IMAGE_HOSTS is reached, by its
    # name and its address; a redirect from it to anywhere else is checked as any URL.
    internal = limits(hosts=("localhost", "127.0.0.1"))
    assert (await fetched(f"http://localhost:{port}/hop", internal)).data == png
    await refused(f"http://127.0.0.1:{port}/meta", internal, "169.254.169.254 is not a public")
    await refused(f"http://[::ffff:127.0.0.1]:{port}/cat.png", internal, "not a public address")


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fd00::1", False),
        ("fe80::1%eth0", False),
        ("::ffff:10.0.0.1", False),
    ],
)
def test_which_addresses_are_public(address: str, public: bool) -> None:
    assert remote.is_public(address) is public
