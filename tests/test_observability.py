"""Traces, metrics and the operator's statistics through a real multi-process stack (tiny
model): one trace per request across every service, read back from the span files; a client's
traceparent as its parent; /metrics parsed by prometheus-client and moving with traffic;
/v1/stats matching a known workload."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable

import pytest

from kvmesh.trace import read_spans, request_trace
from tests.images import ask, data_url, image, png
from tests.procs import REPO, get_json, metrics, wait_until
from tests.stack import TINY_ENCODER, Stack

ROLES = ("router", "encoder", "cachemeta", "prefill", "decode")


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    """The five roles on a NATS of their own: the statistics stream holds only this mesh's."""
    return stacks(
        ("cachemeta-0", "router-0", "prefill-0", "decode-0", "encoder-0"),
        own_nats=True,
        KVMESH_ROUTER_STATS_SHARE_S="0.3",
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        **TINY_ENCODER,
        KVMESH_TRACE_EXPORTER="file",
        OTEL_BSP_SCHEDULE_DELAY="100",  # spans on disk within a tenth of a second
        KVMESH_HEAP_TRIM_INTERVAL_S="0.5",
    )


def trace_of(stack: Stack, rid: str, names: set[str], services: Iterable[str] = ()) -> list[dict]:
    """The request's spans, once every span named in ``names`` is on disk, and a span of each
    of ``services`` (a name can be two services' spans: each exports in its own time)."""

    def found() -> list[dict] | None:
        spans = request_trace(read_spans(stack.dir / "traces"), rid)
        seen = {s["service"].removeprefix("kvmesh-") for s in spans}
        return spans if names <= {s["name"] for s in spans} and set(services) <= seen else None

    return wait_until(found, 30, what=f"spans {sorted(names)} of {rid}")


def test_one_request_gives_one_trace_across_every_service(stack: Stack) -> None:
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    resp = stack.client().chat.completions.with_raw_response.create(
        model="tiny",
        messages=ask("Describe this. " * 40, image(data_url(png(30, (120, 90))))),
        max_tokens=70,  # the answer fills a block: decode stores it
        temperature=0,
        extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
    )
    rid = resp.headers["x-request-id"]
    assert resp.headers["x-kvmesh-trace-id"] == client_trace
    names = {
        "/v1/chat/completions",
        "tokenize",
        "encode",
        "kv.lookup",
        "route",
        "generate",
        "prefill",
        "kv.load",
        "embeds.wait",
        "prefill.compute",
        "kv.transfer",
        "decode",
        "kv.receive",
        "kv.store",
    }
    # Every role on the request's path: cachemeta is not (the router looks up in its own index).
    on_path = set(ROLES) - {"cachemeta"}
    spans = trace_of(stack, rid, names, on_path)
    assert {s["trace_id"] for s in spans} == {client_trace}  # one trace: the client's
    assert {s["service"].removeprefix("kvmesh-") for s in spans} == on_path
    by_id = {s["span_id"]: s for s in spans}
    root = next(s for s in spans if s["name"] == "/v1/chat/completions")
    assert root["parent_id"] == client_span  # the client's span is the parent
    assert all(s["parent_id"] in by_id for s in spans if s is not root)  # no orphan

    def parent(name: str, service: str) -> dict:
        span = next(s for s in spans if s["name"] == name and s["service"] == f"kvmesh-{service}")
        return by_id[span["parent_id"]]

    assert parent("encode", "encoder")["name"] == "encode"  # the router's client span
    lookup = next(s for s in spans if s["name"] == "kv.lookup")
    assert lookup["service"] == "kvmesh-router" and lookup["attributes"]["blocks"] >= 1
    assert parent("prefill", "prefill")["name"] == "generate"
    assert parent("decode", "decode")["name"] == "prefill"  # over the gRPC handoff
    for step in ("kv.load", "prefill.compute", "kv.transfer", "embeds.wait"):
        assert parent(step, "prefill")["name"] == "prefill"
    assert {parent("kv.store", s)["name"] for s in ("prefill", "decode")} == {"prefill", "decode"}
    route = next(s for s in spans if s["name"] == "route")["attributes"]
    assert route["chosen"] == "prefill-0" and route["candidate_count"] == 1
    (candidate,) = json.loads(route["candidates"])
    assert candidate["worker"] == "prefill-0" and candidate["ttft_s"] > 0
    compute = next(s for s in spans if s["name"] == "prefill.compute")["attributes"]
    assert compute["tokens_computed"] + compute["tokens_reused"] == resp.parse().usage.prompt_tokens
    decode = next(s for s in spans if s["name"] == "decode")["attributes"]
    assert decode["tokens"] == resp.parse().usage.completion_tokens and decode["tpot_ms"] > 0
    transfer = next(s for s in spans if s["name"] == "kv.transfer")["attributes"]
    assert transfer["bytes"] > 0 and transfer["mb_s"] > 0
    # The points each service marked on the path (bench/e2e.py's hop table), in path order.
    at = {name: t for s in spans for name, t in s.get("events", ())}
    path = ["prepared", "routed", "picked", "reserved", "first_sent", "exported", "joined"]
    assert [at[p] for p in path] == sorted(at[p] for p in path), at
    assert at["first_sent"] < at["first_token"] and at["joined"] < at["first_step"]

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "trace",
            rid,
            "--dir",
            str(stack.dir / "traces"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert f"trace {client_trace}" in out.stdout
    for line_start in on_path:
        assert f" {line_start} " in out.stdout
    assert "prefill.compute" in out.stdout and "tokens_computed=" in out.stdout

    log = stack.procs["router-0"].output()
    assert f"request={rid} trace={client_trace}" in log  # its log line names both


def test_metrics_parse_on_every_service_and_move_with_traffic(stack: Stack) -> None:
    urls = {role: stack.health()[f"{role}-0"]["address"] for role in ROLES if role != "router"}
    urls["router"] = stack.url
    before = {role: metrics(url) for role, url in urls.items()}
    resp = stack.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count " * 200}], max_tokens=9
    )
    written = ("kvmesh_bytes_total", (("direction", "write"), ("link", "store")))
    wait_until(
        lambda: metrics(urls["prefill"]).get(written, 0) > before["prefill"].get(written, 0),
        30,
        what="the write-behind's bytes counted",
    )
    after = {role: metrics(url) for role, url in urls.items()}

    def moved(role: str, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[role].get(key, 0.0) - before[role].get(key, 0.0)

    ok = {"endpoint": "/v1/chat/completions", "status": "200"}
    assert moved("router", "kvmesh_requests_total", **ok) == 1
    assert moved("router", "kvmesh_output_tokens_total") == resp.usage.completion_tokens
    computed = moved("router", "kvmesh_input_tokens_total", source="computed")
    cached = sum(
        moved("router", "kvmesh_input_tokens_total", source=s) for s in ("memory", "storage")
    )
    assert computed + cached == resp.usage.prompt_tokens
    assert moved("router", "kvmesh_ttft_seconds_count") == 1
    # Token events came in messages (the first token's from prefill, decode's after it), each
    # timed from its worker's send, within the request's own time.
    transits = moved("router", "kvmesh_token_transit_seconds_count")
    assert 2 <= transits <= resp.usage.completion_tokens
    assert 0 < moved("router", "kvmesh_token_transit_seconds_sum") / transits < 1
    assert moved("prefill", "kvmesh_bytes_total", link="handoff", direction="out") > 0
    assert moved("decode", "kvmesh_bytes_total", link="handoff", direction="in") > 0
    assert moved("prefill", "kvmesh_bytes_total", link="store", direction="write") > 0
    assert after["decode"][("kvmesh_kv_blocks_total", (("role", "decode"),))] > 0
    drafted = ("kvmesh_spec_tokens_total", (("kind", "drafted"),))
    accepted = ("kvmesh_spec_tokens_total", (("kind", "accepted"),))
    assert 0 <= after["decode"][accepted] <= after["decode"][drafted]  # speculation's counts
    age = ("kvmesh_heartbeat_age_seconds", (("role", "prefill"), ("service_id", "prefill-0")))
    assert 0 <= after["router"][age] < 3.0  # (beats a second; dropped after 3 missed)
    assert ("kvmesh_queued_requests", (("role", "encoder"),)) in after["encoder"]
    assert after["router"][("kvmesh_recent_traces", ())] >= 1  # (its spans, for the page)
    assert after["router"][("kvmesh_router_prefix_prompts", ())] >= 1  # (the chat's hashes)
    assert after["router"][("kvmesh_router_cache_explain_bytes", ())] > 0  # (and its parts)
    for role in urls:  # every process's NATS backlog (nothing waits once the answer is in)
        out = ("kvmesh_nats_pending_bytes", (("direction", "out"), ("role", role)))
        assert 0 <= after[role][out] < 64 << 10  # (at most a beat or an event in flight)
        assert ("kvmesh_nats_pending_messages", (("role", role),)) in after[role]
    trims = ("kvmesh_heap_trims_total", ())
    for role, url in urls.items():  # every process's C heap, given back as it goes
        assert after[role][("kvmesh_heap_bytes", (("of", "in_use"),))] > 10 << 20  # (its imports)
        assert ("kvmesh_heap_bytes", (("of", "free"),)) in after[role]
        wait_until(
            lambda u=url, r=role: metrics(u)[trims] > after[r][trims],
            10,
            what=f"{role}'s heap trimmed again",
        )
    stored = wait_until(  # the blocks the chat wrote, indexed
        lambda: (s := get_json(f"{urls['cachemeta']}/health")[1]["storage_tier"])["bytes"] and s,
        10,
        what="the storage tier's bytes indexed",
    )
    assert stored["bytes"] <= stored["capacity"] == 64 << 30


def test_stats_match_a_known_workload(stack: Stack) -> None:
    """Two agent-class requests of 300 prompt tokens; the second reuses 4 blocks."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    outs = [
        stack.client().completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_headers={"x-kvmesh-retention": "agent", "x-kvmesh-tenant": "stats-tenant"},
        )
        for _ in range(2)
    ]
    assert [o.usage.prompt_tokens_details.cached_tokens for o in outs] == [0, 256]
    _, stats = get_json(f"{stack.url}/v1/stats")
    tenant = stats["by_tenant"]["stats-tenant"]
    assert tenant["requests"] == 2 and tenant["input_tokens"] == 600
    assert tenant["input_cache_hit_ratio"] == pytest.approx(256 / 600, abs=1e-6)
    agent = stats["by_class"]["agent"]
    output = sum(o.usage.completion_tokens for o in outs)
    assert agent["requests"] == 2 and agent["input_tokens"] == 600
    assert agent["output_tokens"] == output
    assert agent["input_tokens_per_request"] == 300
    assert agent["input_cache_hit_ratio"] == pytest.approx(256 / 600, abs=1e-6)
    assert 0 < agent["ttft_mean_s"] < 10
    assert stats["extrapolated"] and 0 < stats["window_s"] < 600
    per_day = (600 + output) / stats["window_s"] * 86400
    assert agent["tokens_per_day"] == pytest.approx(per_day, rel=0.01)
    assert stats["worker_hours"] > 0  # 2 workers since the router started
    assert agent["requests_per_worker_hour"] == pytest.approx(2 / stats["worker_hours"], rel=0.01)
    overall = stats["overall"]
    assert overall["requests"] >= 2 + stats["by_class"].get("chat", {}).get("requests", 0)
    assert overall["input_tokens"] >= agent["input_tokens"]
    json.dumps(stats, allow_nan=False)  # strict JSON: no NaN or Infinity from an empty ratio


def test_every_router_reports_the_mesh_and_a_restart_keeps_it(stack: Stack) -> None:
    """A second router reports the first one's requests too (the routers share their minutes
    on a stream); the first, restarted, still reports what it answered before."""
    _, before = get_json(f"{stack.url}/v1/stats")
    assert before["routers"] == 1 and before["by_class"]["agent"]["requests"] == 2
    other = stack.router("router-1")
    seen = wait_until(
        lambda: (s := get_json(f"{other}/v1/stats")[1])["overall"]["requests"] > 0 and s,
        30,
        what="router-0's minutes at router-1",
    )
    assert seen["routers"] == 2 and seen["overall"]["requests"] == before["overall"]["requests"]
    counts = ("requests", "input_tokens", "output_tokens", "input_cache_hit_ratio", "ttft_mean_s")
    assert {k: seen["by_class"]["agent"][k] for k in counts} == {
        k: before["by_class"]["agent"][k] for k in counts
    }

    stack.restart("router-0")
    stack.wait_ready()
    _, after = get_json(f"{stack.url}/v1/stats")
    assert after["by_class"]["agent"]["requests"] == 2  # from before the restart
    assert after["routers"] == 2 and after["window_s"] >= before["window_s"]


def test_a_moe_decode_worker_shows_its_expert_placement(stack: Stack) -> None:
    """Workers for tiny-moe with expert placement on (2 cards, 6 slots, a window of 8 steps, a
    plan every 16): its /metrics carry the placement's balance, per card, replans and moves,
    and the decode span says how balanced the cards were."""
    stack.start(
        "prefill-moe",
        "decode-moe",
        KVMESH_PREFILL_MODEL="tiny-moe",
        KVMESH_DECODE_MODEL="tiny-moe",
        KVMESH_DECODE_EPLB_CARDS="2",
        KVMESH_DECODE_EPLB_SLOTS="6",
        KVMESH_DECODE_EPLB_WINDOW_STEPS="8",
        KVMESH_DECODE_EPLB_REPLAN_STEPS="16",
    )
    try:
        stack.wait_ready(["prefill-moe", "decode-moe"])
        url = stack.health()["decode-moe"]["address"]
        resp = stack.client().completions.with_raw_response.create(
            model="tiny-moe", prompt="count " * 30, max_tokens=48, temperature=0
        )
        rid = resp.headers["x-request-id"]
        after = metrics(url)
        assert after[("kvmesh_eplb_steps_total", ())] >= 32
        assert after[("kvmesh_eplb_replans_total", ())] >= 2
        measured = after[("kvmesh_eplb_balance", (("kind", "measured"),))]
        assert 1.0 <= measured <= 2.0  # busiest of two cards ÷ their mean
        shares = [
            after[("kvmesh_eplb_card_share", (("card", c), ("kind", "measured")))] for c in "01"
        ]
        assert sum(shares) == pytest.approx(1.0)
        decode = next(s for s in trace_of(stack, rid, {"decode"}) if s["name"] == "decode")
        assert decode["attributes"]["eplb_replans"] >= 1
        assert 1.0 <= decode["attributes"]["eplb_measured"] <= 2.0
    finally:
        stack.procs["prefill-moe"].stop()
        stack.procs["decode-moe"].stop()


def test_the_plan_and_its_metric_agree(stack: Stack) -> None:
    """/v1/plan recommends pools from the recent traffic; /metrics carries the same counts as
    kvmesh_recommended_workers, for an autoscaler."""
    for i in range(3):
        stack.client().completions.create(
            model="tiny", prompt=f"Ship {i} asks for a berth.", max_tokens=4
        )
    _, plan = get_json(f"{stack.url}/v1/plan")
    assert plan["requests"] >= 3 and plan["current"] == {"prefill": 1, "decode": 1}
    assert set(plan["recommended"]) == {"prefill", "decode"}
    assert all(1 <= n <= 64 for n in plan["recommended"].values())
    assert plan["predicted"]["ttft_p99_s"] > 0 and plan["fitted"]["uncached"] > 0
    scraped = metrics(stack.url)
    for role, n in plan["recommended"].items():
        assert scraped[("kvmesh_recommended_workers", (("role", role),))] == n
