"""The real model through the whole mesh: `make run`'s promise, and a two-turn conversation
whose second turn, on another prefill worker, reuses the first from the storage tier."""

from __future__ import annotations

import pytest

from tests.conftest import REAL
from tests.procs import wait_until
from tests.stack import Stack

LONG_TEXT = " ".join(
    f"Section {i}: the storage tier keeps every computed block of the conversation so that "
    f"any prefill worker can reuse it later, which saves time on turn {i} and beyond."
    for i in range(1, 26)
)


@pytest.fixture(scope="module")
def real_stack(stacks) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0"),
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # the KV moves, as for any real prompt
    )


def chat(stack: Stack, messages: list[dict], **headers: str):
    return stack.client().chat.completions.create(
        model=REAL, messages=messages, max_tokens=40, temperature=0, extra_headers=headers
    )


def test_real_model_names_paris_through_the_mesh(real_stack: Stack) -> None:
    client = real_stack.client()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    resp = chat(real_stack, question)
    assert "Paris" in resp.choices[0].message.content
    assert resp.model_extra["kvmesh"]["kv_bytes"] > 0  # prefilled on one worker, decoded on another
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=REAL, messages=question, max_tokens=40, temperature=0, stream=True
        )
    )
    assert streamed == resp.choices[0].message.content


def test_second_turn_on_another_worker_reuses_the_first_from_storage(real_stack: Stack) -> None:
    procs = real_stack.procs
    turn1 = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": LONG_TEXT + "\nWhat does the storage tier keep?"},
    ]
    first = chat(real_stack, turn1)
    served = next(w for w in first.model_extra["kvmesh"]["workers"] if w.startswith("prefill"))
    # That worker goes away (its memory tier with it): turn 2 must find turn 1 in the files.
    procs[served].stop()  # its last heartbeat says "stopped": the router forgets it at once
    wait_until(lambda: served not in real_stack.ready_ids()["prefill"], 30, what=f"{served} gone")
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Say it in five words."},
    ]
    second = chat(real_stack, turn2)
    timing = second.model_extra["kvmesh"]
    assert served not in timing["workers"]
    cached, prompt = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    assert cached >= 0.9 * prompt, (cached, prompt)
    assert timing["cached_tokens_by_tier"]["storage"] == cached
    # The same conversation computed cold (another tenant shares no blocks) says the same.
    cold = chat(real_stack, turn2, **{"x-kvmesh-tenant": "cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == second.choices[0].message.content
    # Asked again on the same worker, turn 2 now comes from its memory tier.
    again = chat(real_stack, turn2)
    assert again.model_extra["kvmesh"]["cached_tokens_by_tier"]["memory"] >= cached
