"""The mesh across four hosts, with TLS everywhere (network namespaces on a bridge:
tests/hosts.py): a NATS node on each of hosts 1-3 (one cluster, every stream on all three);
cachemeta and a router on host 0, a prefill worker and a second router on host 1,
decode workers on hosts 2 and 3, the encoder on host 3; the client beside them, through the
bridge. Every service binds and advertises its own host's address; the storage tier is one
directory all hosts see. The mesh's certificates (``kvmesh init --tls --host``) name each
host's address: NATS, the KV hand-over and every HTTP server check them."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from tests.hosts import Hosts, Mesh, hosts_or_skip, mesh_on
from tests.images import ask, data_url, image, png
from tests.procs import wait_until

PLACES = {
    "cachemeta-0": 0,
    "router-0": 0,
    "router-1": 1,
    "prefill-0": 1,
    "decode-0": 2,
    "decode-1": 3,
    "encoder-0": 3,
}
NATS_HOSTS = (1, 2, 3)  # (a decode worker's host cut off takes a NATS node with it)
ANSWER = 1200  # tokens: long enough that a host cut after the first chunks was mid-answer


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    hosts_or_skip()
    with (
        Hosts(4) as hosts,
        mesh_on(
            hosts,
            tmp_path_factory.mktemp("hosts"),
            PLACES,
            NATS_HOSTS,
            KVMESH_ROUTER_TOKEN_TIMEOUT_S="3",  # (a worker cut off: its answers moved within 3 s)
            KVMESH_ROUTER_ENCODE_TIMEOUT_S="30",
            KVMESH_ROUTER_BATCH_CONCURRENCY="2",
        ) as mesh,
    ):
        yield mesh


def test_every_service_advertises_its_own_hosts_address(mesh: Mesh) -> None:
    health = mesh.health()
    for sid, i in PLACES.items():
        assert health[sid]["address"].startswith(f"https://{mesh.hosts.addresses[i]}:"), sid


def test_a_request_is_prefilled_on_one_host_and_decoded_on_another(mesh: Mesh) -> None:
    client = mesh.client(timeout=60)
    words = " ".join(f"harbour{i}" for i in range(400))  # past the local-prefill bound
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"{words}. What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
    extra = answer.model_extra["kvmesh"]
    # The KV crossed from host 1 to host 2 or 3 over gRPC (1.5 MB of it).
    prefill, decode = extra["workers"]
    assert prefill == "prefill-0" and PLACES[decode] > 1 and extra["kv_bytes"] > 1_000_000


def test_a_second_turn_is_read_from_the_storage_tier_by_a_worker_on_another_host(
    mesh: Mesh,
) -> None:
    """The prefill worker on host 1 wrote the first turn's blocks to the one directory all
    hosts see; after its memory tier is gone (restarted), they come back from there."""
    client = mesh.client()
    turn = [{"role": "user", "content": " ".join(f"quay{i}" for i in range(300))}]
    first = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4)
    assert first.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
    wait_until(lambda: any((mesh.dir / "kvstore").rglob("*.kvb")), 20, what="blocks in the tier")
    mesh.procs["prefill-0"].stop()
    mesh.start("prefill-0")
    mesh.ready("prefill-0")
    again = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4)
    tiers = again.model_extra["kvmesh"]["cached_tokens_by_tier"]
    assert tiers["storage"] >= 256 and tiers["memory"] == 0


def serving(mesh: Mesh) -> str:
    """The decode worker holding a request now (its own /health says so)."""

    def busy() -> list[str]:
        return [
            sid
            for sid in ("decode-0", "decode-1")
            if mesh.get(f"{mesh.health()[sid]['address']}/health")["load"]["inflight"]
        ]

    return wait_until(busy, 30, interval_s=0.01, what="a decode worker serving")[0]


def read(mesh: Mesh, during=None) -> tuple[str, int]:  # noqa: ANN001
    """A long greedy answer, streamed: its text and tokens; ``during()`` after 300 chunks."""
    chunks = mesh.client().completions.create(
        model="tiny",
        prompt="Tell the long story of a lighthouse keeper and the ships she guided home. " * 3,
        max_tokens=ANSWER,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], 0
    for i, chunk in enumerate(chunks):
        if i == 300 and during is not None:
            during()
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return "".join(text), usage


def test_a_host_cut_off_mid_stream_loses_nothing_and_its_worker_comes_back(mesh: Mesh) -> None:
    """The host of the decode worker streaming an answer is cut off (its cable pulled),
    with the NATS node on it: the router hears no more of the worker, moves the answer to the
    other decode worker, and the client gets the uninterrupted answer token for token. The
    services whose NATS node was lost move to another node. Back on the network, the host's
    services rejoin, as both routers see."""
    reference = read(mesh)
    assert reference[1] == ANSWER
    cut: list[int] = []

    def cut_its_host() -> None:
        host = PLACES[serving(mesh)]
        mesh.hosts.cut(host)
        cut.append(host)

    try:
        answer = read(mesh, during=cut_its_host)
    finally:
        for host in cut:
            mesh.hosts.heal(host)
    assert answer == reference
    (host,) = cut
    wait_until(
        lambda: all(
            {s: w["status"] for s, w in mesh.health(router).items() if s in PLACES}
            == dict.fromkeys(PLACES, "ready")
            for router in ("router-0", "router-1")
        ),
        60,
        what=f"host {host}'s services back, as both routers see them",
    )


def test_a_router_on_each_of_two_hosts_shares_one_mesh(mesh: Mesh) -> None:
    """Each router lists every service; a conversation's next turn through the other router
    finds the first turn's blocks where that router's own index says they are."""
    for router in ("router-0", "router-1"):
        health = mesh.health(router)
        assert all(health[sid]["status"] == "ready" for sid in PLACES), router
    turn = [{"role": "user", "content": " ".join(f"pier{i}" for i in range(300))}]
    first = mesh.client("router-0").chat.completions.create(
        model="tiny", messages=turn, max_tokens=4
    )
    assert first.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
    again = first.choices[0].message.content
    turn2 = [*turn, {"role": "assistant", "content": again}, {"role": "user", "content": "More."}]

    def reused() -> int:
        answer = mesh.client("router-1").chat.completions.create(
            model="tiny", messages=turn2, max_tokens=4
        )
        return answer.model_extra["kvmesh"]["prompt_cache_hit_tokens"]

    wait_until(lambda: reused() >= 256, 20, what="turn 2 through router-1 finding turn 1's blocks")


def test_an_image_is_encoded_on_one_host_and_its_embeddings_prefilled_on_another(
    mesh: Mesh,
) -> None:
    """The encoder on host 3 encodes the image; prefill on host 1 takes its embeddings; the
    same image again is not encoded again, and its KV is reused."""
    messages = ask("What is in this picture?", image(data_url(png(7))), "Say it. " * 60)
    client = mesh.client()

    def indexed() -> int:
        return mesh.get(f"{mesh.url}/health")["kv_index"]["blocks"]

    before = indexed()
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    full = first.usage.prompt_tokens // 64  # (the tiny model's blocks)
    # The next turn comes once the router knows the first's blocks (KV events cross hosts).
    wait_until(lambda: indexed() >= before + full, 20, what="the first's blocks indexed")
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    images = [r.model_extra["kvmesh"]["images"][0] for r in (first, again)]
    assert [i["cached"] for i in images] == [False, True]
    image_end = images[0]["start"] + images[0]["tokens"]
    assert images[0]["tokens"] > 0
    assert again.usage.prompt_tokens_details.cached_tokens >= image_end


def test_a_batch_sent_to_one_router_is_read_back_through_the_other(mesh: Mesh) -> None:
    """A batch's files live in JetStream's object store, replicated on the three NATS hosts:
    created through the router on host 1, run, and its output read through host 0's."""
    lines = [
        {
            "custom_id": f"berth-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Which berth for ship {i}?"}],
                "max_tokens": 4,
            },
        }
        for i in range(4)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    sender = mesh.client("router-1")
    upload = sender.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = sender.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    reader = mesh.client("router-0")
    done = wait_until(
        lambda: (b := reader.batches.retrieve(batch.id)).status == "completed" and b,
        120,
        what="the batch completed",
    )
    assert done.request_counts.completed == 4 and done.request_counts.failed == 0
    out = [json.loads(x) for x in reader.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"berth-{i}" for i in range(4)]
    assert all(o["response"]["status_code"] == 200 for o in out)
