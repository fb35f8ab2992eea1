"""A prompt with images: its prefix hashes, reused or not, are the workers' block hashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.images import PLACEHOLDER_ID, ImageInput, join_prompt
from services.router.tokens import PrefixHashes, PromptTokenizer
from shared.engine.loader import load_text_model
from shared.kvstore.hashing import block_hashes


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model = load_text_model("smollm2-135m-instruct", Path(tmp_path_factory.mktemp("state")))
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
        assert all(ids[r.start : r.start + r.tokens] == [PLACEHOLDER_ID] * 77 for r in refs)
        got = cache.hashes(segments, 64, "fp", "")  # reused from the prompt before, or not
        assert got == block_hashes(ids, 64, "fp", images=refs)
    first_a = join_prompt([tokenizer.encode_segments(text), a])
    first_b = join_prompt([tokenizer.encode_segments(text), b])
    start = first_a[2][0].start
    ha = block_hashes(first_a[0], 64, "fp", images=first_a[2])
    hb = block_hashes(first_b[0], 64, "fp", images=first_b[2])
    same = start // 64
    assert ha[:same] == hb[:same] and ha[same] != hb[same]


async def test_remote_images_only_when_allowed(tmp_path: Path) -> None:
    import io

    from aiohttp import web
    from PIL import Image

    from services.router.images import ImageLimits, read_image
    from services.router.openai_api import ApiError
    from shared.vision.grid import VisionGrid

    out = io.BytesIO()
    Image.new("RGB", (56, 84), (9, 9, 9)).save(out, "PNG")

    async def cat(_: web.Request) -> web.Response:
        return web.Response(body=out.getvalue())

    app = web.Application()
    app.add_routes([web.get("/cat.png", cat)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    limits = ImageLimits(10**6, 10**7, 8, True, 5.0, 5.0, VisionGrid())
    try:
        img = await read_image(f"http://127.0.0.1:{port}/cat.png", "p", limits, 8 << 20)
        assert img.tokens == 2 * 3 and img.data == out.getvalue()
        with pytest.raises(ApiError, match="HTTP 404") as err:
            await read_image(f"http://127.0.0.1:{port}/dog.png", "p", limits, 8 << 20)
        assert err.value.status == 400 and err.value.param == "p"
        off = ImageLimits(10**6, 10**7, 8, False, 5.0, 5.0, VisionGrid())
        with pytest.raises(ApiError, match="only data: URLs"):
            await read_image(f"http://127.0.0.1:{port}/cat.png", "p", off, 8 << 20)
    finally:
        await runner.cleanup()
