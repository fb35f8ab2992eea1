"""P/D with vLLM on both sides (`KVMESH_PREFILL_ENGINE=vllm`, `KVMESH_DECODE_ENGINE=vllm`):
a vLLM prefill worker computes the prompt and sends the first token, its storage connector
writes the prompt's blocks to kvmesh's tier, and a vLLM decode worker loads them from there
and streams the rest. The answer is vLLM's own, token for token (greedy, eager mode); a short
prompt is decoded in place; a later turn on another prefill worker comes from the tier. Last,
the stack's workers are lost: an answer goes on on another decode worker, and a model whose
workers are all gone is 503. (The stack is the vLLM modules' one, ``vllm_mesh``, after
test_vllm.py's tests.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import openai
import pytest

from shared.messages.kvevents import STORE, memory_location
from tests.conftest import REAL, VLLM_DECODE, VLLM_PREFILLS
from tests.procs import get_json, wait_until
from tests.stack import Stack
from tests.vllm_answers import OwnVllm, answered_as_vllm

vllm = pytest.importorskip("vllm", reason="the vllm extra (make test installs it)")

PREFILLS, DECODE = VLLM_PREFILLS, VLLM_DECODE
SYSTEM = "You keep the harbour's records, and you answer in full sentences. " * 12
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def pd_stack(vllm_mesh: Stack) -> Stack:
    return vllm_mesh


def chat_ids(stack: Stack, messages: list[dict]) -> list[int]:
    """The token ids of a chat's prompt as SmolLM2's template renders it."""
    from shared.model.text import load_text_model

    tokenizer = load_text_model(REAL, Path(stack.dir)).tokenizer
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return tokenizer.encode(text + "<|im_start|>assistant\n").ids


@pytest.fixture(scope="module")
def prompt_ids(pd_stack: Stack) -> list[int]:
    """A chat prompt of ~200 tokens (past what decode prefills in place), as token ids."""
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = chat_ids(pd_stack, question)
    assert 150 < len(ids) < 400, len(ids)
    return ids


@pytest.fixture(scope="module")
def own_answer(pd_stack: Stack, own_vllm: OwnVllm, prompt_ids: list[int]) -> list[int]:
    return own_vllm.answer(Path(pd_stack.dir), prompt_ids)


def test_a_long_prompt_is_prefilled_on_one_vllm_worker_and_decoded_on_another(
    pd_stack: Stack, prompt_ids: list[int], own_answer: list[int]
) -> None:
    kvmesh = answered_as_vllm(pd_stack, prompt_ids, own_answer)
    assert kvmesh["workers"][0] in PREFILLS and kvmesh["workers"][1:] == [DECODE]
    # The prompt's full blocks went through the tier, under kvmesh's hashes.
    hashes = pd_stack.hashes(prompt_ids, model=REAL)
    assert (pd_stack.lookup(hashes) or {}).get(STORE) == len(hashes)


def fresh(tag: str) -> list[dict]:
    """A chat no worker has seen (its system prompt starts with ``tag``): past what decode
    prefills in place, so it goes P/D; asked again, its prompt is in the tier and decode
    prefills it in place."""
    return [
        {"role": "system", "content": f"[{tag}] {SYSTEM}"},
        {"role": "user", "content": QUESTION},
    ]


def test_chat_anthropic_and_responses_get_the_same_answer_pd_and_in_place(
    pd_stack: Stack,
) -> None:
    question = fresh("formats")
    chat = pd_stack.client().chat.completions.create(
        model=REAL, messages=question, max_tokens=24, temperature=0
    )
    assert chat.model_extra["kvmesh"]["workers"][1:] == [DECODE]  # P/D
    messages = anthropic.Anthropic(base_url=pd_stack.url, api_key="none").messages.create(
        model=REAL,
        system=question[0]["content"],
        messages=question[1:],
        max_tokens=24,
        extra_body={"temperature": 0},
    )
    responses = pd_stack.client().responses.create(
        model=REAL, input=question, max_output_tokens=24, temperature=0
    )
    text = chat.choices[0].message.content
    assert "Paris" in text
    assert messages.content[0].text == text  # (in place: the prompt is in the tier now)
    assert responses.output_text == text


def test_logprobs_stop_strings_and_a_one_token_answer_across_the_handoff(pd_stack: Stack) -> None:
    client = pd_stack.client()

    def ask(tag: str, **options):
        return client.chat.completions.create(model=REAL, messages=fresh(tag), **options)

    scored = ask("logprobs", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert scored.model_extra["kvmesh"]["workers"][1:] == [DECODE]
    content = scored.choices[0].logprobs.content  # the first from prefill, the rest decode's
    assert len(content) == scored.usage.completion_tokens == 6
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    reference = ask("stop", max_tokens=24, temperature=0).choices[0].message.content
    stop = reference.split()[3]
    cut = ask("stop", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == reference[: reference.index(stop)]
    one = ask("one", max_tokens=1, temperature=0)  # the prefill worker's token is all of it
    assert one.model_extra["kvmesh"]["workers"] == [one.model_extra["kvmesh"]["workers"][0]]
    assert one.model_extra["kvmesh"]["workers"][0] in PREFILLS
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1


def test_a_seeded_answer_is_the_same_pd_and_in_place(pd_stack: Stack) -> None:
    """vLLM's seeded sampler is per request: through P/D, decode samples every token."""
    client = pd_stack.client()
    ask = dict(model=REAL, messages=fresh("seed"), max_tokens=16, temperature=1.0, seed=5)
    pd = client.chat.completions.create(**ask)
    assert pd.model_extra["kvmesh"]["workers"][1:] == [DECODE]
    here = client.chat.completions.create(**ask)
    assert here.model_extra["kvmesh"]["workers"] == [DECODE]
    assert pd.choices[0].message.content == here.choices[0].message.content


def test_structured_output_through_pd(pd_stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    answer = pd_stack.client().chat.completions.create(
        model=REAL, messages=fresh("json"), response_format=fmt, max_tokens=30, temperature=0
    )
    assert answer.model_extra["kvmesh"]["workers"][1:] == [DECODE]
    assert isinstance(json.loads(answer.choices[0].message.content)["city"], str)


def test_a_stream_closed_early_is_aborted_on_decode(pd_stack: Stack) -> None:
    story = [{"role": "system", "content": f"[cancel] {SYSTEM}"}]
    story.append({"role": "user", "content": "Write a long story about the sea."})
    stream = pd_stack.client().chat.completions.create(
        model=REAL, messages=story, max_tokens=2000, temperature=0, stream=True
    )
    for n, chunk in enumerate(stream):
        assert not (chunk.choices and chunk.choices[0].finish_reason), "it ended by itself"
        if n == 5:
            break
    stream.close()
    wait_until(
        lambda: all(pd_stack.health()[w]["load"]["inflight"] == 0 for w in (DECODE, *PREFILLS)),
        15,
        what="no vLLM worker running the request once the client has gone",
    )


def test_a_hand_over_without_the_routers_token_is_refused(pd_stack: Stack) -> None:
    """What a prefill identity can send decode is a hand-over, on its own subject, and only
    with the router's token for that request and that decode worker."""
    from shared.bus import subjects
    from shared.messages.generate import GenerateTask, Handover, TaskAck
    from shared.messages.sampling import SamplingParams
    from shared.security.handoff import HANDOFF_SECRET, handoff_token
    from shared.security.secret import load_or_create
    from tests.procs import connect_as, secrets_dir

    secrets = secrets_dir(pd_stack.dir)
    deadline = time.time() + 60
    task = GenerateTask(
        request_id="forged",
        model=REAL,
        token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=2),
        reply_subject=subjects.replies("nobody"),
        decode_id=DECODE,
        decode_kv_address="",
        deadline=deadline,
        handover=Handover(answer_ids=[]),
    )
    other = handoff_token(load_or_create(secrets, HANDOFF_SECRET), "another", DECODE, deadline)

    async def ask() -> list[TaskAck]:
        bus = await connect_as(pd_stack.nats_url, "prefill", secrets)
        try:
            subject = subjects.handovers(DECODE)
            return [
                await bus.request(
                    subject, task.model_copy(update={"handoff_token": t}), TaskAck, 10
                )
                for t in ("", other)
            ]
        finally:
            await bus.close()

    acks = asyncio.run(ask())
    assert [a.accepted for a in acks] == [False, False]
    assert acks[0].reason == "refused: no handoff token"
    assert acks[1].reason == "refused: a handoff token that is not this request's"


def test_a_short_prompt_is_decoded_in_place(pd_stack: Stack) -> None:
    answer = pd_stack.client().chat.completions.create(
        model=REAL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0
    )
    assert answer.model_extra["kvmesh"]["workers"] == [DECODE]


def test_turn_two_on_the_other_prefill_worker_comes_from_the_storage_tier(pd_stack: Stack) -> None:
    """Turn 1 (prompt and answer) is in the tier: the prefill worker wrote the prompt, the
    decode worker the answer as it filled blocks. With turn 1's prefill worker gone, turn 2
    goes to the other, whose own cache is empty: it loads turn 1 from the tier, up to the last
    block, damaged on disk here: a miss (the file deleted by the reader), the answer the same
    as another tenant's, who loads nothing."""
    client = pd_stack.client()
    turn1 = [
        {"role": "system", "content": "You keep the lighthouse's log. " * 60},
        {"role": "user", "content": "Tell me a long story about a lighthouse keeper."},
    ]
    first = client.chat.completions.create(model=REAL, messages=turn1, max_tokens=96, temperature=0)
    turn1_tokens = first.usage.prompt_tokens + first.usage.completion_tokens
    prefilled = first.model_extra["kvmesh"]["workers"][0]
    assert prefilled in PREFILLS
    pd_stack.procs[prefilled].stop()
    other = next(p for p in PREFILLS if p != prefilled)
    wait_until(
        lambda: prefilled not in pd_stack.ready_ids().get("prefill", []),
        30,
        what=f"{prefilled} out of the router's registry",
    )
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        # (past what decode prefills in place: turn 2 goes P/D too)
        {"role": "user", "content": "And what happened next? " + "Tell me every detail. " * 20},
    ]
    # Turn 1's last full block, an answer's (decode wrote it), damaged on disk: recomputed.
    ids = chat_ids(pd_stack, turn2)
    block = pd_stack.hashes(ids, model=REAL)[turn1_tokens // 64 - 1]
    damaged = Path(pd_stack.dir, "kvstore", block[:2], f"{block}.kvb")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    second = client.chat.completions.create(model=REAL, messages=turn2, max_tokens=8, temperature=0)
    kvmesh = second.model_extra["kvmesh"]
    assert second.usage.prompt_tokens == len(ids)  # (the hashes were of the prompt sent)
    assert kvmesh["workers"] == [other, DECODE]
    tiers = kvmesh["cached_tokens_by_tier"]
    # (vLLM counts what its connector claimed before loading: the damaged block too)
    assert tiers["storage"] >= 0.9 * turn1_tokens, (tiers, turn1_tokens)
    assert not damaged.exists()  # read, found damaged, deleted
    customs = client.chat.completions.create(
        model=REAL,
        messages=turn2,
        max_tokens=8,
        temperature=0,
        extra_headers={"x-kvmesh-tenant": "customs"},
    )
    assert customs.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
    assert customs.choices[0].message.content == second.choices[0].message.content


@pytest.mark.parametrize(
    ("role", "setting", "value", "named"),
    [
        ("decode", "KVMESH_DECODE_BLOCK_SIZE", "48", "a multiple of 32"),
        ("prefill", "KVMESH_PREFILL_BLOCK_SIZE", "80", "a multiple of 32"),
        ("prefill", "KVMESH_PREFILL_KV_STORE", "false", "through the storage tier"),
    ],
)
def test_a_vllm_worker_refuses_settings_it_cannot_serve_with(
    tmp_path: Path, role: str, setting: str, value: str, named: str
) -> None:
    """Exit 2 before anything starts, naming the settings (the block size and the engine)."""
    engine = f"KVMESH_{role.upper()}_ENGINE"
    done = subprocess.run(
        [sys.executable, "-m", f"services.{role}"],
        env={
            "PATH": "/usr/bin:/bin",
            "KVMESH_STATE_DIR": str(tmp_path),
            engine: "vllm",
            setting: value,
        },
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{setting}={value}" in done.stderr and f"{engine}=vllm" in done.stderr
    assert named in done.stderr


# -- the stack's workers lost (the last tests on it) ------------------------------------------


SECOND = "decode-vllm-b"


def test_a_vllm_worker_killed_mid_stream_the_answer_goes_on_unchanged(pd_stack: Stack) -> None:
    pd_stack.start(SECOND)
    pd_stack.wait_ready([DECODE, SECOND], timeout_s=180)
    client = pd_stack.client()
    question = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    ask = dict(model=REAL, messages=question, max_tokens=120, temperature=0)
    reference = client.chat.completions.create(**ask).choices[0].message.content
    stream = client.chat.completions.create(**ask, stream=True)
    pieces, killed = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) == 10 and not killed:
            # Asked of the workers themselves: the router's view is a heartbeat old.
            inflight = {
                sid: get_json(f"{pd_stack.advertised(sid)}/health")[1]["load"]["inflight"]
                for sid in (DECODE, SECOND)
            }
            killed = next((sid for sid, n in inflight.items() if n), "")
            assert killed, "no vLLM worker reports the stream in flight"
            pd_stack.procs[killed].popen.kill()
    assert killed and "".join(pieces) == reference  # resumed on the other, token for token


def test_a_killed_vllm_worker_leaves_the_index_and_its_model_is_503(pd_stack: Stack) -> None:
    """(The last test on the stack: its vLLM decode workers are gone after it.)"""
    ids = list(range(2000, 2200))
    answer = pd_stack.client().completions.create(model=REAL, prompt=ids, max_tokens=2)
    serving = answer.model_extra["kvmesh"]["workers"][-1]  # (the decode worker)
    assert serving in (DECODE, SECOND)
    hashes = pd_stack.hashes(ids, model=REAL)
    wait_until(
        lambda: (pd_stack.lookup(hashes) or {}).get(memory_location(serving)) == 3,
        20,
        what="the prompt's blocks in cachemeta, at the decode worker",
    )
    for sid, proc in pd_stack.procs.items():
        if sid.startswith("decode-vllm") and proc.alive():
            proc.popen.kill()
    wait_until(
        lambda: memory_location(serving) not in (pd_stack.lookup(hashes) or {}),
        30,
        what="the killed worker's blocks out of cachemeta",
    )
    with pytest.raises(openai.InternalServerError, match=REAL) as err:
        pd_stack.client().chat.completions.create(
            model=REAL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert err.value.status_code == 503
