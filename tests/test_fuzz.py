"""The API fuzzed by maintained fuzzers against a live tiny stack (127.0.0.1, seeded, bounded):
Schemathesis on every operation of /openapi.json with every check it has, and Hypothesis on
the gRPC API's messages. No 5xx, no hang, every error in the API's shape, nothing the schema
allows refused unless for a rule no schema can state (tests/fuzzing.py), and the mesh serving
afterwards. A larger run: bench/fuzz.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import grpc
import openai
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from shared.proto import api_pb2
from tests.fuzzing import ask_grpc, messages, mutants, schemathesis_run
from tests.procs import kvmesh_keys as keys
from tests.stack import TINY_ENCODER, Stack

SEED = 20261203


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A keys file with an admin key (the fuzzer reaches the operator's routes too)."""
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    return path, keys(path, "add", "--tenant", "fuzz", "--admin")


@pytest.fixture(scope="module")
def stack(stacks, admin: tuple[Path, str]) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0"),
        KVMESH_ROUTER_KEYS_FILE=str(admin[0]),
        # (the document's model examples lead most cases to an answer: a short one by default)
        KVMESH_ROUTER_DEFAULT_MAX_TOKENS="4",
        **TINY_ENCODER,
    )


def serves(stack: Stack, key: str) -> bool:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)
    answer = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    return answer.choices[0].finish_reason == "length"


def test_schemathesis_finds_nothing_and_the_mesh_serves_on(
    stack: Stack, admin: tuple[Path, str]
) -> None:
    run = schemathesis_run(stack.url, admin[1], SEED, max_examples=3, timeout_s=300)
    assert run.returncode == 0, run.output[-8000:]
    assert run.operations >= 20 and run.cases >= 500, run.output[-2000:]
    assert run.links >= 4, run.output[-2000:]  # the stateful phase went from call to call
    assert all(s["status"] == "ready" for s in stack.health().values())
    assert serves(stack, admin[1])


GENERATE = api_pb2.GenerateRequest.DESCRIPTOR
LIKELY = {  # a served model, a short answer, a real role: cases that get past the first check
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 4),
    "role": st.sampled_from(["system", "user", "assistant"]),
    "prompt": st.just("Tide times?"),
    "n": st.just(1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "stop": st.just("\n\n"),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.integers(0, 1000),
    "best_of": st.just(1),
}
ANSWERED = api_pb2.GenerateRequest(
    model="tiny",
    messages=[api_pb2.ChatMessage(role="user", content="Tide times?")],
    max_tokens=3,
)
REFUSALS = {  # what a bad message may get: never INTERNAL or UNKNOWN, never a hang
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}


def test_hypothesis_on_the_grpc_messages_gets_answers_or_clear_refusals(
    stack: Stack, admin: tuple[Path, str]
) -> None:
    """Messages drawn from the API's descriptors: each answered, or refused with a code the
    API documents and a reason; both happen (the draws reach past the first check)."""
    seen: Counter[str] = Counter()

    @seed(SEED)
    @settings(max_examples=80, deadline=None, database=None)
    @given(request=st.one_of(messages(GENERATE, LIKELY), mutants(ANSWERED, LIKELY)))
    def one(request: api_pb2.GenerateRequest) -> None:
        outcome, details = ask_grpc(stack.grpc, admin[1], request)
        if outcome != "answered":
            assert grpc.StatusCode[outcome] in REFUSALS, (outcome, details, request)
            assert details, request  # the refusal says why
        seen[outcome] += 1

    one()
    assert seen["answered"] >= 5 and seen["INVALID_ARGUMENT"] >= 5, seen
    assert all(s["status"] == "ready" for s in stack.health().values())
