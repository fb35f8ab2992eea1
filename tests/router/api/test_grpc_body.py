"""A gRPC request becomes the OpenAI body it mirrors, every sampling field carried under the
HTTP API's name (the same checks then apply to both)."""

from __future__ import annotations

import json

from services.router.api.grpc import as_body
from shared.proto import api_pb2


def test_every_sampling_field_is_carried_into_the_body() -> None:
    req = api_pb2.GenerateRequest(
        model="tiny",
        prompt="The tide",
        max_tokens=9,
        temperature=0.5,
        top_p=0.75,
        top_k=4,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        seed=7,
        ignore_eos=True,
        min_tokens=3,
        stop_token_ids=[5, 6],
        stop=["END"],
        n=1,
        best_of=2,
    )
    body, chat = as_body(req)
    assert not chat
    assert json.loads(body) == {
        "model": "tiny",
        "prompt": "The tide",
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.75,
        "top_k": 4,
        "min_p": 0.25,
        "repetition_penalty": 1.5,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "seed": 7,
        "ignore_eos": True,
        "min_tokens": 3,
        "stop_token_ids": [5, 6],
        "stop": ["END"],
        "n": 1,
        "best_of": 2,
    }
    plain, _ = as_body(api_pb2.GenerateRequest(model="tiny", prompt="x"))
    assert json.loads(plain) == {"model": "tiny", "stop": [], "prompt": "x"}
