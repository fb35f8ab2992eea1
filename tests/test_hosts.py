"""The mesh across four hosts, with TLS everywhere (network namespaces on a bridge:
tests/hosts.py): a NATS node on each of the first three (one cluster, every stream on all
three); cachemeta and a router on host 0, a prefill worker and a second router on host 1,
decode workers on hosts 2 and 3; the client beside them, through the bridge. Every service
binds and advertises its own host's address; the storage tier is one directory all hosts
see. The mesh's certificates (``kvmesh init --tls --host``) name each host's address: NATS,
the KV hand-over and every HTTP server check them."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from kvmesh.natsconf import write_server_config
from kvmesh.natsserver import Cluster, NatsServer
from kvmesh.tls import MeshTls, ensure_mesh_tls
from tests.hosts import Hosts, hosts_or_skip
from tests.procs import Proc, get_json, secrets_dir, service_env, wait_until

NATS_PORT, ROUTE_PORT, HTTP_PORT, ROUTER_PORT, KV_PORT = 4222, 6222, 9100, 8000, 50061
PLACES = {
    "cachemeta-0": 0,
    "router-0": 0,
    "router-1": 1,
    "prefill-0": 1,
    "decode-0": 2,
    "decode-1": 3,
}
ANSWER = 1200  # tokens: long enough that a host cut after the first chunks was mid-answer


@dataclass
class Mesh:
    hosts: Hosts
    dir: Path
    nats: list[NatsServer]
    procs: dict[str, Proc]
    tls: MeshTls

    @property
    def url(self) -> str:
        return self.router_url("router-0")

    def router_url(self, sid: str) -> str:
        return f"https://{self.hosts.addresses[PLACES[sid]]}:{ROUTER_PORT}"

    def verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.tls.ca))

    def client(self, router: str = "router-0") -> openai.OpenAI:
        base = f"{self.router_url(router)}/v1"
        http = openai.DefaultHttpxClient(verify=self.verify())
        return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, http_client=http)

    def get(self, url: str) -> dict:
        return get_json(url, context=self.verify())[1]

    def health(self, router: str = "router-0") -> dict[str, dict]:
        roles = self.get(f"{self.router_url(router)}/health")["roles"]
        return {w["id"]: w for workers in roles.values() for w in workers}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    hosts_or_skip()
    root = tmp_path_factory.mktemp("hosts")
    with Hosts(4) as hosts:
        addresses = hosts.addresses
        tls = ensure_mesh_tls(root / "state" / "tls", tuple(addresses))
        nats_cert = tls.certs["nats"]
        config = write_server_config(
            root / "nats.conf",
            secrets_dir(root / "state"),
            (tls.ca, nats_cert.cert, nats_cert.key),
        )
        nats = [
            NatsServer(
                addresses[i],
                NATS_PORT,
                root / f"nats-{i}",
                log_file=root / f"nats-{i}.log",
                config=config,
                cluster=Cluster("kvmesh", i, (ROUTE_PORT,) * 3, tuple(addresses[:3])),
                prefix=("ip", "netns", "exec", hosts.namespaces[i]),
                tls=True,
            )
            for i in range(3)
        ]
        procs: dict[str, Proc] = {}
        try:
            for server in nats:
                server.start(timeout_s=20)
            urls = ",".join(f"tls://{a}:{NATS_PORT}" for a in addresses[:3])
            for sid, i in PLACES.items():
                role = sid.split("-")[0]
                prefix = f"KVMESH_{role.upper()}_"
                env = service_env(
                    urls,
                    root / f"state-{i}",
                    KVMESH_SECRETS_DIR=str(secrets_dir(root / "state")),
                    KVMESH_KV_STORE_DIR=str(root / "kvstore"),  # (one directory for all hosts)
                    KVMESH_JETSTREAM_REPLICAS="3",
                    KVMESH_SERVICE_ID=sid,
                    KVMESH_ROUTER_TOKEN_TIMEOUT_S="3",  # (a worker cut off: moved within 3 s)
                    **{
                        f"{prefix}HTTP_HOST": addresses[i],
                        f"{prefix}HTTP_PORT": str(ROUTER_PORT if role == "router" else HTTP_PORT),
                    },
                )
                env.update(tls.env(role))
                if role == "decode":
                    env["KVMESH_DECODE_KV_PORT"] = str(KV_PORT)
                procs[sid] = hosts.service(i, role, env, root / f"{sid}.log")
            m = Mesh(hosts, root, nats, procs, tls)
            wait_until(
                lambda: (
                    {s: w["status"] for s, w in m.health().items() if s in PLACES}
                    == dict.fromkeys(PLACES, "ready")
                ),
                120,
                what="every service on its host ready",
            )
            yield m
        finally:
            for proc in procs.values():
                proc.stop()
            for server in nats:
                server.stop()


def test_every_service_advertises_its_own_hosts_address(mesh: Mesh) -> None:
    health = mesh.health()
    for sid, i in PLACES.items():
        assert health[sid]["address"].startswith(f"https://{mesh.hosts.addresses[i]}:"), sid


def test_a_request_is_prefilled_on_one_host_and_decoded_on_another(mesh: Mesh) -> None:
    client = mesh.client()
    words = " ".join(f"harbour{i}" for i in range(400))  # past the local-prefill bound
    started = time.monotonic()
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"{words}. What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
    assert time.monotonic() - started < 60
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
    env = mesh.procs["prefill-0"].env
    mesh.procs["prefill-0"] = mesh.hosts.service(1, "prefill", env, mesh.dir / "prefill-0.1.log")
    wait_until(
        lambda: mesh.health().get("prefill-0", {}).get("status") == "ready", 60, what="prefill"
    )
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
    """The host of the decode worker streaming an answer is cut off (its cable pulled): the
    router hears no more of it, moves the answer to the other decode worker, and the client
    gets the uninterrupted answer token for token. Back on the network, the worker rejoins."""
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
    (sid,) = [s for s, h in PLACES.items() if h == host]
    wait_until(lambda: mesh.health().get(sid, {}).get("status") == "ready", 60, what=f"{sid} back")


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
