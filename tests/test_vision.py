"""Images through real processes (tiny model, seeded random vision tower): encoded once, KV
reused past a repeated image and never for another one, every bad input refused, and an
encoder that is slow or gone fails image requests fast while text goes on."""

from __future__ import annotations

import asyncio
import base64
import io
import signal

import grpc
import openai
import pytest
from nats.aio.msg import Msg
from PIL import Image

from services.router.dispatch.encodes import ENCODE_RESEND_S
from shared.bus import subjects
from shared.messages.encode import EncodeRequest, unframe
from shared.proto import api_pb2, api_pb2_grpc
from tests.images import ask, data_url, image, png
from tests.procs import connect_as, secrets_dir, wait_until
from tests.stack import Stack

TAIL = "Now say what you see, in detail, " * 25  # text after the image: blocks past it


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", "prefill-0", "decode-0", "encoder-0"),
        # Prompts with at most 40 uncached tokens are prefilled on decode (a small image).
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="40",
        KVMESH_ROUTER_IMAGE_MAX_BYTES="200000",
        KVMESH_ENCODER_MODELS='["tiny"]',
        KVMESH_ENCODER_THREADS="1",
        KVMESH_ENCODER_LAYERS="2",
        KVMESH_ENCODER_STORE_EMBEDS="true",
    )


def chat(stack: Stack, messages: list[dict], max_tokens: int = 12, url: str = ""):
    client = stack.client(url) if url else stack.client()
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_the_same_image_twice_is_encoded_once_and_its_kv_reused(stack: Stack) -> None:
    messages = ask("What is in this picture?", image(data_url(png(1))), TAIL)
    first, second = chat(stack, messages), chat(stack, messages)
    img1, img2 = first.model_extra["kvmesh"]["images"][0], second.model_extra["kvmesh"]["images"][0]
    assert img1["tokens"] == 7 * 11  # 300×200 → 7 × 11 tokens of 28 × 28 pixels
    assert (img1["cached"], img2["cached"]) == (False, True)  # encoded once
    assert img2["encode_ms"] == 0
    image_end = img1["start"] + img1["tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens >= image_end
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > image_end
    assert second.choices[0].message.content == first.choices[0].message.content
    # The test encoder's tower has random weights: the answer says it does not see the image.
    assert img1["untrained_tower"] is True
    assert "random weights" in first.model_extra["kvmesh"]["warnings"][0]


def test_one_tenants_image_never_finds_anothers_embeddings(stack: Stack) -> None:
    """Embeddings are kept per tenant (the image's identity is salted with the tenant's
    salt): another tenant sending the same image has it encoded anew, and reuses no KV, not
    even the text before it."""
    messages = ask("What is in this picture?", image(data_url(png(11))), TAIL)

    def send(tenant: str):
        return stack.client().chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_headers={"x-kvmesh-tenant": tenant},
        )

    first, again, other = send("acme"), send("acme"), send("beta")
    cached = [r.model_extra["kvmesh"]["images"][0]["cached"] for r in (first, again, other)]
    assert cached == [False, True, False]
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_another_image_changes_the_answer_and_hits_nothing_past_it(stack: Stack) -> None:
    a = ask("What is in this picture?", image(data_url(png(2))), TAIL)
    b = ask("What is in this picture?", image(data_url(png(3))), TAIL)
    first = chat(stack, a, max_tokens=24)
    other = chat(stack, b, max_tokens=24)
    start = other.model_extra["kvmesh"]["images"][0]["start"]
    assert other.model_extra["kvmesh"]["images"][0]["cached"] is False
    assert other.usage.prompt_tokens_details.cached_tokens <= start  # only the text before it
    assert other.choices[0].message.content != first.choices[0].message.content


def test_the_next_turn_reuses_the_blocks_past_the_image_in_its_history(stack: Stack) -> None:
    turn1 = ask("Look:", image(data_url(png(4))), TAIL)
    first = chat(stack, turn1)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "A picture of noise."},
        {"role": "user", "content": "And what else?"},
    ]
    second = chat(stack, turn2)
    assert second.model_extra["kvmesh"]["images"][0]["cached"] is True
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 64 * 64


def test_images_in_one_request_are_encoded_together(stack: Stack) -> None:
    urls = [data_url(png(10 + i, (120, 90))) for i in range(3)]
    resp = chat(stack, ask("Compare", *(image(u) for u in urls)))
    images = resp.model_extra["kvmesh"]["images"]
    assert [i["tokens"] for i in images] == [12, 12, 12]  # 120×90 → 3 × 4
    assert images[1]["start"] == images[0]["start"] + 12


def test_grpc_takes_images_as_bytes(stack: Stack) -> None:
    data = png(11)
    url_answer = chat(stack, ask("What is in this picture?", image(data_url(data)), TAIL))
    parts = [
        api_pb2.ContentPart(text="What is in this picture?"),
        api_pb2.ContentPart(image=api_pb2.Image(data=data, media_type="image/png")),
        api_pb2.ContentPart(text=TAIL),
    ]
    req = api_pb2.GenerateRequest(
        model="tiny",
        messages=[api_pb2.ChatMessage(role="user", parts=parts)],
        max_tokens=12,
        temperature=0,
    )
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        resp = stub.Generate(req, timeout=30)
        assert resp.text == url_answer.choices[0].message.content
        assert resp.usage.cached_tokens >= url_answer.usage.prompt_tokens // 64 * 64
        bad = api_pb2.ContentPart(image=api_pb2.Image(data=b"nope", media_type="image/png"))
        req.messages[0].parts.append(bad)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].content[3].image_url" in err.value.details()


def test_a_short_image_prompt_is_prefilled_on_decode_with_its_image(stack: Stack) -> None:
    small = [data_url(png(20 + i, (56, 56))) for i in range(2)]  # 2 × 2 tokens each
    first = chat(stack, ask("Say", image(small[0])), max_tokens=24)
    again = chat(stack, ask("Say", image(small[0])), max_tokens=24)
    other = chat(stack, ask("Say", image(small[1])), max_tokens=24)
    assert first.model_extra["kvmesh"]["route"]["prefill"] == "on decode"
    assert first.model_extra["kvmesh"]["workers"] == ["decode-0"]
    assert first.model_extra["kvmesh"]["images"][0]["tokens"] == 4
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other.choices[0].message.content != first.choices[0].message.content


TOO_BIG = png(5, (400, 300))  # noise: over 200 KB as PNG
BOMB = io.BytesIO()
Image.new("1", (20000, 20000)).save(BOMB, "PNG")  # 48 KB that declare 400 M pixels


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "only data: URLs are accepted"),
        ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "media type 'image/gif'"),
        ("data:image/png;base64,@@not base64@@", "base64 is not valid"),
        ("data:image/png,rawbytes", "must be base64"),
        (data_url(b"hello, I am text"), "not a PNG, JPEG or WebP image"),
        (data_url(TOO_BIG), "larger than 200,000 bytes"),
        (data_url(BOMB.getvalue()), "more than 25,000,000 pixels"),
        ("data:image/png;base64," + base64.b64encode(png(6)[:300]).decode(), "damaged"),
    ],
)
def test_a_bad_image_is_refused_naming_its_part(stack: Stack, url: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(stack, ask("see", image(url)))
    body = err.value.body
    assert body["param"] == "messages[0].content[1].image_url"
    assert message in body["message"] and "messages[0].content[1].image_url" in body["message"]


def test_too_many_images_and_images_outside_user_messages_are_refused(stack: Stack) -> None:
    url = data_url(png(7, (60, 60)))
    with pytest.raises(openai.BadRequestError, match="at most 8 images per request"):
        chat(stack, ask(*(image(url) for _ in range(9))))
    with pytest.raises(openai.BadRequestError, match="user messages only") as err:
        chat(stack, ask("you see", image(url), role="assistant") + ask("hi"))
    assert err.value.body["param"] == "messages[0].content[1].image_url"
    still = chat(stack, ask("still", image(url)))  # still serving, images included
    assert still.usage.completion_tokens == 12 and still.model_extra["kvmesh"]["images"]


def test_embeddings_in_the_storage_tier_outlive_the_encoder(stack: Stack) -> None:
    messages = ask("What is in this picture?", image(data_url(png(12))))
    first = chat(stack, messages).model_extra["kvmesh"]["images"][0]
    assert (first["cached"], first["source"]) == (False, "encoded")
    stack.restart("encoder-0")
    stack.wait_ready(["encoder-0"])
    again = chat(stack, messages).model_extra["kvmesh"]["images"][0]
    assert (again["cached"], again["source"]) == (True, "storage")


def test_an_encode_sent_again_is_still_the_requests_own(stack: Stack) -> None:
    """An encoder slower than the router's resend gets the image twice from one request: the
    answer says it was encoded for it, not shared with another request nor cached."""
    encoder = stack.procs["encoder-0"]
    messages = ask("What is in this picture?", image(data_url(png(11))), "Say it.")

    async def sent_twice() -> dict:
        watcher = await connect_as(stack.nats_url, "encoder", secrets_dir(stack.dir))
        sends: list[EncodeRequest] = []

        async def seen(raw: Msg) -> None:
            sends.append(EncodeRequest.model_validate_json(unframe(raw.data)[0]))

        await watcher.nc.subscribe(subjects.ENCODE, cb=seen)  # (beside the pool)
        encoder.signal(signal.SIGSTOP)
        try:
            answer = asyncio.get_running_loop().run_in_executor(None, chat, stack, messages, 4)
            async with asyncio.timeout(ENCODE_RESEND_S * 4):
                while len(sends) < 2:
                    await asyncio.sleep(0.1)
        finally:
            encoder.signal(signal.SIGCONT)
            await watcher.close()
        assert len({req.ask for req in sends}) == 1  # one request's one ask, sent again
        return (await answer).model_extra["kvmesh"]["images"][0]

    report = asyncio.run(sent_twice())
    assert (report["cached"], report["source"]) == (False, "encoded")
    assert report["encode_ms"] > 0


def test_a_slow_encoder_fails_image_requests_at_the_encode_timeout(stack: Stack) -> None:
    """A router whose encode timeout is 2 s: a frozen encoder costs an image request a 503
    naming the encoder (not a hang: the client gives up after 60 s), and text goes on."""
    url = stack.router("router-encode", KVMESH_ROUTER_ENCODE_TIMEOUT_S="2")
    encoder = stack.procs["encoder-0"]
    encoder.signal(signal.SIGSTOP)
    try:
        client = stack.client(url, timeout=60)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="tiny", messages=ask("see", image(data_url(png(8)))), max_tokens=4
            )
        assert err.value.status_code == 503 and "image encoder" in err.value.message
        assert chat(stack, ask("just text"), url=url).usage.completion_tokens == 12
    finally:
        encoder.signal(signal.SIGCONT)
        stack.procs["router-encode"].stop()


def test_without_an_encoder_image_requests_get_503_and_text_is_unaffected(stack: Stack) -> None:
    """At once (nobody answers the encode request), and once the router has forgotten the
    encoder (a router that drops a service after 3 missed beats)."""
    url = stack.router("router-forget", KVMESH_ROUTER_MISSED_HEARTBEATS="3")
    stack.procs["encoder-0"].signal(signal.SIGKILL)
    for forgotten in (False, True):
        if forgotten:
            wait_until(lambda: not stack.ready_ids(url)["encoder"], 30, what="encoder dropped")
        with pytest.raises(openai.APIStatusError) as err:
            chat(stack, ask("see", image(data_url(png(9)))), url=url)
        assert err.value.status_code == 503 and "encoder" in err.value.message
        assert chat(stack, ask("just text"), url=url).usage.completion_tokens == 12
