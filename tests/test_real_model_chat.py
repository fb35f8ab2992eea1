"""`make run`'s promise: the real model answers a chat through the whole mesh."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from shared.natsserver import NatsServer
from tests.procs import Proc, free_port, service_env, start_service, wait_until
from tests.test_request_path import workers_ready

REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real_stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("real-chat")
    port = free_port()
    env = service_env(
        nats_server.url,
        tmp,
        KVMESH_ROUTER_HTTP_PORT=str(port),
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # the KV moves, as for any real prompt
    )
    procs: list[Proc] = [
        start_service(role, {**env, "KVMESH_SERVICE_ID": f"{role}-r"}, tmp, role)
        for role in ("router", "prefill", "decode")
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: workers_ready(url) == 2, 120, what="real-model workers ready")
        yield url
    finally:
        for proc in procs:
            proc.stop()


def test_real_model_names_paris_through_the_mesh(real_stack: str) -> None:
    client = openai.OpenAI(base_url=real_stack + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=REAL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content
    assert resp.model_extra["kvmesh"]["kv_bytes"] > 0  # prefilled on one worker, decoded on another
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=REAL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30,
            temperature=0,
            stream=True,
        )
    )
    assert streamed == resp.choices[0].message.content
