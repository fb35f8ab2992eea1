"""Security through real processes (tiny model, official `openai` client): 401 without a valid
key, keys added and revoked while the router runs, 429 per key while other keys are served,
the tenant taken from the key (a spoofed tenant header gets nothing of another tenant's cache,
whose salt the server derives), admin-only endpoints, gRPC metadata, `kvmesh keys`, KV
pushes refused without the router's handoff token, and a bus (the module's nats-server, set up
as `kvmesh up` sets it up) that refuses strangers and holds each role to its subjects."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import nats
import nkeys
import openai
import pytest

from shared.bus import Bus, BusError, subjects
from shared.bus.auth import identity
from shared.bus.subjects import KV_EVENTS_STREAM
from shared.messages.generate import GenerateTask
from shared.messages.heartbeat import RegistryQuery, RegistrySnapshot
from shared.messages.kvevents import KvEvent
from shared.messages.sampling import SamplingParams
from shared.proto import api_pb2, api_pb2_grpc, kv_pb2, kv_pb2_grpc
from shared.security.keys import KeysFile
from tests.procs import connect_as, metrics, secrets_dir, start_with, until, wait_until
from tests.procs import kvmesh_keys as keys
from tests.stack import Stack


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys") / "keys.toml"


@pytest.fixture(scope="module")
def tenants(keys_file: Path) -> dict[str, str]:
    """Keys made before the router starts: two tenants, an admin, a slow key and a small one."""
    return {
        "a": keys(keys_file, "add", "--tenant", "acme"),
        "b": keys(keys_file, "add", "--tenant", "beta"),
        "admin": keys(keys_file, "add", "--tenant", "ops", "--admin"),
        "slow": keys(keys_file, "add", "--tenant", "slow", "--rpm", "2"),
        "small": keys(keys_file, "add", "--tenant", "small", "--tpm", "300"),
        "tiers": keys(
            keys_file,
            "add",
            "--tenant",
            "tiered",
            "--tier-ceiling",
            "default",
            "--tier-default",
            "flex",
            "--weight",
            "3",
        ),
    }


@pytest.fixture(scope="module")
def stack(stacks, keys_file: Path, tenants: dict[str, str]) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0"),
        KVMESH_ROUTER_KEYS_FILE=str(keys_file),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
    )


def client(stack: Stack, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key or "", max_retries=0, timeout=120)


def ask(stack: Stack, key: str | None, prompt: str | list[int] = "Hi", **headers: str):
    return client(stack, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_headers=headers
    )


def raw(
    stack: Stack, path: str, headers: dict[str, str], body: dict | None = None, method: str = ""
):
    conn = http.client.HTTPConnection(stack.url.removeprefix("http://"), timeout=60)
    try:
        method = method or ("POST" if body is not None else "GET")
        conn.request(method, path, json.dumps(body) if body else None, headers)
        resp = conn.getresponse()
        data = resp.read()
        json_body = resp.headers.get("Content-Type", "").startswith("application/json")
        return resp.status, dict(resp.headers), json.loads(data) if json_body else data
    finally:
        conn.close()


def test_no_key_or_a_wrong_key_gets_401(stack: Stack, tenants: dict[str, str]) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    status, _, answer = raw(stack, "/v1/completions", {}, body)
    assert status == 401 and "no API key" in answer["error"]["message"]
    assert answer["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as err:
        ask(stack, "kvm_not-a-key")
    assert err.value.status_code == 401
    assert err.value.body["code"] == "invalid_api_key"
    answer = ask(stack, tenants["a"])
    assert answer.usage.completion_tokens >= 1 and answer.choices[0].finish_reason
    # Anthropic clients send x-api-key.
    status, _, _ = raw(stack, "/v1/completions", {"x-api-key": tenants["b"]}, body)
    assert status == 200
    status, _, answer = raw(stack, "/v1/models", {})
    assert status == 401 and "no API key" in answer["error"]["message"]


def test_keys_added_and_revoked_while_the_router_runs(
    stack: Stack, keys_file: Path, tenants: dict[str, str]
) -> None:
    late = keys(keys_file, "add", "--tenant", "late")

    def accepted() -> bool:  # (refused until the router has read the file again)
        try:
            return bool(ask(stack, late))
        except openai.AuthenticationError:
            return False

    wait_until(accepted, 10, what="the new key accepted")
    late_id = next(k.id for k in KeysFile.read(keys_file).keys if k.tenant == "late")
    keys(keys_file, "revoke", late_id)

    def refused() -> bool:
        try:
            ask(stack, late)
        except openai.AuthenticationError as err:
            return "revoked" in err.message
        return False

    wait_until(refused, 10, what="the revoked key refused")
    assert ask(stack, tenants["a"])  # the others still are served
    assert "revoked" in keys(keys_file, "list")


def test_a_key_over_its_rate_gets_429_while_others_are_served(
    stack: Stack, tenants: dict[str, str]
) -> None:
    slow = client(stack, tenants["slow"])
    slow.completions.create(model="tiny", prompt="one", max_tokens=1)
    slow.completions.create(model="tiny", prompt="two", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        slow.completions.create(model="tiny", prompt="three", max_tokens=1)
    assert "2 requests per minute" in err.value.message
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert ask(stack, tenants["a"])  # another key, not limited
    # Input tokens per minute: a prompt larger than the whole budget is named as such.
    with pytest.raises(openai.RateLimitError) as err:
        ask(stack, tenants["small"], list(range(100, 500)))
    assert "400 tokens exceed" in err.value.message and "300 input tokens" in err.value.message
    ask(stack, tenants["small"], list(range(100, 300)))
    with pytest.raises(openai.RateLimitError) as err:
        ask(stack, tenants["small"], list(range(100, 300)))
    assert "300 input tokens per minute" in err.value.message


def test_the_tenant_is_the_keys_and_a_spoofed_header_gets_nothing(
    stack: Stack, tenants: dict[str, str]
) -> None:
    prompt = [(i * 7919) % 40000 + 100 for i in range(640)]  # 10 full blocks
    first = ask(stack, tenants["a"], prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hashes = stack.hashes(prompt, tenant="acme")
    wait_until(lambda: (stack.lookup(hashes) or {}).get("store") == len(hashes), 30)
    spoofed = ask(stack, tenants["b"], prompt, **{"x-kvmesh-tenant": "acme"})
    assert spoofed.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(stack, tenants["a"], prompt)
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * len(prompt)
    # Each tenant's blocks are files of their own, named by hashes salted by the server: a
    # salt is not the tenant's name, so no client can make another tenant's hashes.
    theirs = stack.hashes(prompt, tenant="beta")
    wait_until(lambda: all(h in stack.store for h in theirs), 30, what="B's blocks stored")
    assert all(h in stack.store for h in hashes) and not set(hashes) & set(theirs)
    assert hashes != stack.hashes_with_salt(prompt, "acme")
    secret = secrets_dir(stack.dir) / "tenant-salt.key"
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 32


def test_operator_endpoints_need_an_admin_key(stack: Stack, tenants: dict[str, str]) -> None:
    status, _, body = raw(stack, "/v1/stats", {"Authorization": f"Bearer {tenants['a']}"})
    assert status == 403 and "admin" in body["error"]["message"]
    status, _, body = raw(stack, "/v1/stats", {"Authorization": f"Bearer {tenants['admin']}"})
    assert status == 200 and "overall" in body
    status, _, body = raw(stack, "/v1/models", {"Authorization": f"Bearer {tenants['a']}"})
    assert status == 200 and body["data"]
    status, _, body = raw(stack, "/health", {})  # probes need no key
    assert status != 401 and body["roles"]["prefill"]


def test_grpc_takes_the_key_from_metadata(stack: Stack, tenants: dict[str, str]) -> None:
    req = api_pb2.GenerateRequest(
        model="tiny", messages=[api_pb2.ChatMessage(role="user", content="Hi")], max_tokens=2
    )
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.Generate(
            req, timeout=60, metadata=(("authorization", f"Bearer {tenants['b']}"),)
        )
        assert answer.usage.prompt_tokens > 0


# -- classes: what a key may ask for, and who is refused first --------------------------------


def test_a_key_asks_for_its_class_within_its_ceiling(stack: Stack, tenants: dict[str, str]) -> None:
    """The key's default when a request asks for none (auto too), what it asks for up to the
    key's ceiling, a 400 naming the field and the ceiling above it; the answer says the class
    it ran at, in every API."""
    tiered = client(stack, tenants["tiers"])

    def chat(key: str = tenants["tiers"], **fields):  # noqa: ANN003, ANN202
        return client(stack, key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **fields
        )

    assert chat().service_tier == "flex"  # the key's default
    assert chat(service_tier="auto").service_tier == "flex"
    assert chat(service_tier="default").service_tier == "default"
    with pytest.raises(openai.BadRequestError) as err:
        chat(service_tier="priority")
    assert err.value.body["param"] == "service_tier"
    assert "'priority' is above what this key may ask for ('default' at most)" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        chat(extra_headers={"x-kvmesh-priority": "priority"})
    assert err.value.body["param"] == "x-kvmesh-priority"
    with pytest.raises(openai.BadRequestError) as err:
        chat(extra_headers={"x-kvmesh-priority": "urgent"})
    assert "one of auto, priority, default, flex" in str(err.value)
    assert chat(tenants["a"], service_tier="priority").service_tier == "priority"
    assert chat(tenants["a"]).service_tier == "default"  # (a key with no tiers set)
    done = tiered.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert done.model_extra["service_tier"] == "flex"
    answer = tiered.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert answer.service_tier == "flex"
    headers = {"x-api-key": tenants["a"], "content-type": "application/json"}
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    status, _, reply = raw(stack, "/v1/messages", headers, body)
    assert status == 200 and reply["usage"]["service_tier"] == "standard"
    req = api_pb2.GenerateRequest(
        model="tiny",
        messages=[api_pb2.ChatMessage(role="user", content="Hi")],
        max_tokens=2,
        service_tier="default",
    )
    with grpc.insecure_channel(stack.grpc) as channel:
        metadata = (("authorization", f"Bearer {tenants['tiers']}"),)
        got = api_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60, metadata=metadata)
    assert got.service_tier == "default"


def test_as_the_router_fills_the_lowest_class_is_refused_first(
    stack: Stack, tenants: dict[str, str]
) -> None:
    """A router with room for 4 requests in progress: with 2 answers streaming, a flex
    request (its share: 2) gets 429 naming its class while default (3) and priority (4) are
    served."""
    url = stack.router("router-small4", KVMESH_ROUTER_MAX_INFLIGHT="4")
    small = openai.OpenAI(base_url=url + "/v1", api_key=tenants["a"], max_retries=0, timeout=120)
    body = {"model": "tiny", "prompt": "Tell a long story.", "temperature": 0}
    streams = [small.completions.create(max_tokens=1500, stream=True, **body) for _ in range(2)]
    try:
        for stream in streams:
            next(iter(stream))  # each answering
        with pytest.raises(openai.RateLimitError) as err:
            small.completions.create(max_tokens=2, extra_body={"service_tier": "flex"}, **body)
        assert "for the flex class (2 of 4)" in str(err.value)
        assert err.value.response.headers["retry-after"] == "1"
        assert small.completions.create(max_tokens=2, **body).model_extra["service_tier"] == (
            "default"
        )
        tier = {"service_tier": "priority"}
        served = small.completions.create(max_tokens=2, extra_body=tier, **body)
        assert served.model_extra["service_tier"] == "priority"
    finally:
        for stream in streams:
            stream.close()
    counts = metrics(url)
    assert counts[("kvmesh_refused_total", (("priority", "flex"), ("where", "router")))] == 1


def test_a_first_token_deadline_the_estimate_cannot_meet_is_refused_up_front(
    stack: Stack, tenants: dict[str, str]
) -> None:
    """x-kvmesh-ttft-deadline-ms: refused at once with the estimate when the routing policy
    says it cannot be met; answered when it can."""
    ask(stack, tenants["a"], "warm the estimate")
    with pytest.raises(openai.RateLimitError) as err:
        ask(stack, tenants["a"], "Hi there", **{"x-kvmesh-ttft-deadline-ms": "0.001"})
    assert re.search(r"the first token is estimated in \d+ ms, past the deadline", str(err.value))
    assert ask(stack, tenants["a"], "Hi", **{"x-kvmesh-ttft-deadline-ms": "60000"}).choices
    with pytest.raises(openai.BadRequestError) as err:
        ask(stack, tenants["a"], "Hi", **{"x-kvmesh-ttft-deadline-ms": "soon"})
    assert err.value.body["param"] == "x-kvmesh-ttft-deadline-ms"


def test_a_router_told_to_use_a_bad_keys_file_does_not_start(tmp_path: Path) -> None:
    bad = tmp_path / "keys.json"
    bad.write_text('{"keys": [{"id": "k", "tenant": "acme"}]}')
    done = start_with("router", "KVMESH_ROUTER_KEYS_FILE", str(bad))
    assert done.returncode == 2
    assert "KVMESH_ROUTER_KEYS_FILE" in done.stderr and "missing sha256" in done.stderr
    done = start_with("router", "KVMESH_ROUTER_KEYS_FILE", str(tmp_path / "none.json"))
    assert done.returncode == 2 and "kvmesh keys add" in done.stderr


def test_half_a_tls_pair_is_refused_at_start_naming_both(tmp_path: Path) -> None:
    cert = tmp_path / "service.pem"
    cert.write_text("a certificate, its key not given")
    for var in ("KVMESH_TLS_CERT_FILE", "KVMESH_NATS_TLS_CERT_FILE"):
        done = start_with("prefill", var, str(cert))
        assert done.returncode == 2
        pair = var.removesuffix("CERT_FILE")
        assert f"{pair}CERT_FILE and {pair}KEY_FILE go together" in done.stderr


def kv_address(stack: Stack, sid: str) -> str:
    """A worker's KV handoff address, from the router's registry."""

    async def ask() -> str:
        bus = await connect_as(stack.nats_url, "cli", secrets_dir(stack.dir))
        try:
            snap = await bus.request(
                subjects.ROUTER_REGISTRY, RegistryQuery(role="decode"), RegistrySnapshot, 5.0
            )
        finally:
            await bus.close()
        return next(w.addresses["kv"] for w in snap.workers if w.service_id == sid)

    return asyncio.run(ask())


def forged_push(address: str, request_id: str, token: str) -> kv_pb2.HandoffStatus:
    """A KV push as anyone who reaches the decode worker could send it."""
    task = GenerateTask(
        request_id=request_id,
        model="tiny",
        token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        reply_subject="kvmesh.attacker",
        decode_id="decode-0",
        decode_kv_address=address,
        deadline=time.time() + 60,
        handoff_token=token,
    )
    with grpc.insecure_channel(address) as channel:
        call = kv_pb2_grpc.KvHandoffStub(channel).Handoff(
            iter([kv_pb2.KvChunk(reserve=task.to_bytes())]), timeout=10
        )
        return next(call)


def test_a_kv_push_without_the_routers_token_is_refused_and_the_request_answered(
    stack: Stack, tenants: dict[str, str]
) -> None:
    address = kv_address(stack, "decode-0")
    rid = "victim-request-1"  # a client names its request; an attacker may know the id
    with ThreadPoolExecutor(1) as pool:
        real = pool.submit(
            lambda: client(stack, tenants["a"]).completions.create(
                model="tiny",
                prompt=list(range(100, 400)),
                max_tokens=16,
                temperature=0,
                extra_headers={"x-request-id": rid},
            )
        )
        refusals = [forged_push(address, rid, token) for token in ("", "9999999999." + "0" * 64)]
        answer = real.result(timeout=120)
    assert [(s.ok, s.code) for s in refusals] == [(False, "unauthorized")] * 2
    assert "no handoff token" in refusals[0].error and "not this request" in refusals[1].error
    assert answer.usage.completion_tokens == 16
    assert "refused a KV push for victim-request-1" in stack.procs["decode-0"].output()


def test_the_bus_refuses_strangers_and_holds_each_role_to_its_subjects(stack: Stack) -> None:
    secrets = secrets_dir(stack.dir)

    async def check() -> list[str]:
        # No credentials, or an identity nats-server was not configured with: refused.
        for options in ({}, {"nkeys_seed_str": new_seed()}):
            with pytest.raises(BusError, match="refused this client: .*Authorization Violation"):
                await Bus.connect(stack.nats_url, "stranger", 5, options)
        # A prefill worker's identity (what a compromised worker holds).
        errors: list[str] = []

        async def on_error(err: Exception) -> None:
            errors.append(str(err))

        nc = await nats.connect(stack.nats_url, error_cb=on_error, **identity(secrets, "prefill"))
        try:
            await nc.publish(subjects.kv_events("cachemeta"), b"{}")  # cachemeta's KV events
            await nc.publish(subjects.tasks("decode", "decode-0"), b"{}")  # the router's tasks
            await nc.subscribe(subjects.CACHEMETA_LOOKUP)  # posing as cachemeta
            await nc.subscribe("_INBOX.router.>")  # reading the router's replies
            # (a prefill worker's hand-over to decode has a subject of its own: let through)
            await nc.publish(subjects.handovers("decode-0"), b"{}")

            async def refused_four() -> bool:
                return len(errors) >= 4

            await until(refused_four, 10, "four refusals")
            # What a prefill worker does is let through: its own KV events are stored.
            own = KvEvent(kind="stored", location="mem:prefill-0", hashes=[], at=time.time())
            ack = await nc.jetstream().publish(subjects.kv_events("prefill"), own.to_bytes())
            assert ack.stream == KV_EVENTS_STREAM
        finally:
            await nc.close()
        return errors

    errors = asyncio.run(check())
    assert sorted(errors) == sorted(  # as nats-py reports them (in lower case)
        e.lower()
        for e in [
            'nats: permissions violation for publish to "kvmesh.kv.events.cachemeta"',
            'nats: permissions violation for publish to "kvmesh.decode.decode-0.tasks"',
            'nats: permissions violation for subscription to "kvmesh.cachemeta.lookup"',
            'nats: permissions violation for subscription to "_INBOX.router.>"',
        ]
    )
    # The mesh ran on these permissions all along and was refused nothing.
    for proc in stack.procs.values():
        assert "NATS refused" not in proc.output(), proc.log_path


def new_seed() -> str:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def test_limits_on_what_arrives_are_named_and_the_router_keeps_serving(
    stack: Stack, tenants: dict[str, str]
) -> None:
    url = stack.router(
        "router-limits",
        KVMESH_ROUTER_MAX_BODY_BYTES="4096",
        KVMESH_ROUTER_MAX_HEADER_BYTES="2048",
    )
    auth = {"Authorization": f"Bearer {tenants['a']}", "Content-Type": "application/json"}
    host = url.removeprefix("http://")

    def post(body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    big = json.dumps({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 1}).encode()
    status, body = post(big, auth)
    assert status == 413
    error = json.loads(body)["error"]
    assert "at most 4096 bytes" in error["message"] and "MAX_BODY_BYTES" in error["message"]
    status, _ = post(
        b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1}', {**auth, "x-pad": "y" * 3000}
    )
    assert status == 400
    ok = post(b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1}', auth)
    assert ok[0] == 200  # still serving
    # gRPC: the same bound on a message.
    req = api_pb2.GenerateRequest(
        model="tiny", messages=[api_pb2.ChatMessage(role="user", content="x" * 5000)]
    )
    metadata = (("authorization", f"Bearer {tenants['a']}"),)
    with (
        grpc.insecure_channel(stack.grpc_of("router-limits")) as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        api_pb2_grpc.GenerationStub(channel).Generate(req, timeout=30, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_openapi_describes_every_route_as_it_is(stack: Stack) -> None:
    status, _, doc = raw(stack, "/openapi.json", {})
    assert status == 200 and doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    assert set(paths) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["security"] and "401" in chat["responses"] and "413" in chat["responses"]
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatRequest"]["properties"]
    refs = json.dumps(doc).split('"$ref": "')[1:]
    assert all(r.split('"')[0].removeprefix("#/components/schemas/") in schemas for r in refs)
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    links = paths["/v1/files"]["post"]["responses"]["200"]["links"]  # upload → batch → cancel
    assert links["batch"]["operationId"] == paths["/v1/batches"]["post"]["operationId"]
    cancel = paths["/v1/batches"]["post"]["responses"]["200"]["links"]["cancel"]
    assert cancel["operationId"] == paths["/v1/batches/{batch_id}/cancel"]["post"]["operationId"]
    for ops in paths.values():
        for op in ops.values():
            for link in op["responses"]["200"].get("links", {}).values():
                assert link["operationId"] in ids
    for path, ops in paths.items():  # each documented operation answers as documented
        for method, op in ops.items():
            concrete = re.sub(r"\{[^}]+\}", "x", path)  # (/v1/files/{file_id}: /v1/files/x)
            body = {} if method == "post" else None
            status, _, _ = raw(stack, concrete, {}, body, method.upper())
            assert str(status) in op["responses"], (method, path, status)
            assert status < 500 or path == "/health", (method, path, status)
