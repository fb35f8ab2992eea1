"""Batch work through real processes with the official `openai` client: files in the JetStream
object store, batches run to completed, cancelled, expired, failed; a bad line in the error
file; a router killed mid-batch and another carrying it on, every custom_id answered once;
`kvmesh batch`, resumable."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.procs import wait_until
from tests.stack import Stack

SYSTEM = "You answer for a harbour office: berths, tides and pilots. Keep it short. " * 6
LEASE_S = 3.0


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0"),
        KVMESH_ROUTER_BATCH_LEASE_S=str(LEASE_S),
        KVMESH_ROUTER_BATCH_CONCURRENCY="2",
        KVMESH_ROUTER_FILES_MAX_BYTES=str(1 << 20),
        KVMESH_ROUTER_FILES_STORE_BYTES=str(4 << 20),  # (every file together)
    )


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return stack.client()


def line(i: int, max_tokens: int = 8, url: str = "/v1/chat/completions", **body: object) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": url,
        "body": {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Which berth for ship number {i}?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def upload(client: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def run_batch(client: openai.OpenAI, lines: list[dict | str], **create: object):  # noqa: ANN201
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint=create.pop("endpoint", "/v1/chat/completions"),
        completion_window=create.pop("completion_window", "24h"),
        **create,
    )
    assert batch.status == "validating"
    return batch


def answering(client: openai.OpenAI, n: int):  # noqa: ANN201
    """A batch of ``n`` lines of 48 tokens, once two of them are answered."""
    batch = run_batch(client, [line(i, max_tokens=48) for i in range(n)])
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2,
        60,
        what="two lines answered",
        interval_s=0.05,
    )
    return batch


def each_line_answered_once(client: openai.OpenAI, batch_id: str, n: int) -> None:
    done = finished(client, batch_id, timeout_s=120)
    assert done.status == "completed", done
    out = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))
    assert done.request_counts.completed == n and done.request_counts.failed == 0


def finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):  # noqa: ANN201
    found = {}

    def done() -> bool:
        found["b"] = client.batches.retrieve(batch_id)
        return found["b"].status in ("completed", "failed", "expired", "cancelled")

    wait_until(done, timeout_s, what=f"batch {batch_id} finished", interval_s=0.2)
    return found["b"]


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def test_a_batch_answers_every_line_once_as_online_would(client: openai.OpenAI) -> None:
    lines = [line(i) for i in range(6)]
    batch = run_batch(client, lines, metadata={"job": "berths"})
    done = finished(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 6 and done.request_counts.completed == 6
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.metadata == {"job": "berths"}
    out = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(6)]
    by_id = {o["custom_id"]: o for o in out}
    for i in (0, 5):  # the same request online: the same greedy answer
        online = client.chat.completions.create(**line(i)["body"])
        response = by_id[f"req-{i}"]["response"]
        assert response["status_code"] == 200 and by_id[f"req-{i}"]["error"] is None
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
    # Lines sharing the system prompt ran after one another: the later ones reused its blocks.
    usage = [o["response"]["body"]["usage"] for o in out]
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes > 0
    assert done.id in [b.id for b in client.batches.list(limit=100).data]


def test_a_messages_batch_answers_in_anthropics_shape(client: openai.OpenAI) -> None:
    lines = []
    for i in range(2):
        lines.append(
            {
                "custom_id": f"m-{i}",
                "method": "POST",
                "url": "/v1/messages",
                "body": {
                    "model": "tiny",
                    "system": SYSTEM,
                    "max_tokens": 6,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": f"Tide at berth {i}?"}],
                },
            }
        )
    done = finished(client, run_batch(client, lines, endpoint="/v1/messages").id)
    assert done.status == "completed", done
    out = lines_of(client, done.output_file_id)
    assert {o["custom_id"] for o in out} == {"m-0", "m-1"}
    for o in out:
        body = o["response"]["body"]
        assert body["type"] == "message" and body["stop_reason"] == "max_tokens"
        assert body["usage"]["output_tokens"] == 6


def test_a_responses_batch_answers_as_the_responses_api(client: openai.OpenAI) -> None:
    """Every endpoint of the format table takes batches: OpenAI's Responses too."""
    body = {"model": "tiny", "instructions": SYSTEM, "input": "Tide at berth 7?"}
    lines = [
        {
            "custom_id": "r-0",
            "method": "POST",
            "url": "/v1/responses",
            "body": {**body, "max_output_tokens": 5, "temperature": 0},
        }
    ]
    done = finished(client, run_batch(client, lines, endpoint="/v1/responses").id)
    assert done.status == "completed", done
    (out,) = lines_of(client, done.output_file_id)
    answer = out["response"]["body"]
    assert answer["object"] == "response" and answer["status"] == "incomplete"
    assert answer["usage"]["output_tokens"] == 5
    online = client.responses.create(**body, max_output_tokens=5, temperature=0)
    assert answer["output"][0]["content"][0]["text"] == online.output_text


def test_a_bad_line_goes_to_the_error_file_and_the_rest_run(client: openai.OpenAI) -> None:
    lines = [line(0), line(1, model="no-such-model"), line(2, max_tokens=-1), line(3)]
    done = finished(client, run_batch(client, lines).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert {o["custom_id"] for o in lines_of(client, done.output_file_id)} == {"req-0", "req-3"}
    errors = {o["custom_id"]: o["response"] for o in lines_of(client, done.error_file_id)}
    assert errors["req-1"]["status_code"] == 404
    assert "no-such-model" in errors["req-1"]["body"]["error"]["message"]
    assert errors["req-2"]["status_code"] == 400
    assert errors["req-2"]["body"]["error"]["param"] == "max_tokens"


def test_a_malformed_file_fails_with_its_line_numbers(client: openai.OpenAI) -> None:
    lines = [
        line(0),
        "{not json",
        line(0),  # the same custom_id again
        {**line(3), "url": "/v1/completions"},
        {**line(4), "method": "GET"},
    ]
    done = finished(client, run_batch(client, lines).id)
    assert done.status == "failed" and done.failed_at
    found = {(e.line, e.code) for e in done.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "invalid_method"),
    }
    assert done.output_file_id is None and done.in_progress_at is None


def test_bad_batch_requests_get_400_naming_the_field(client: openai.OpenAI) -> None:
    file_id = upload(client, [line(0)])
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert err.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="48h"
        )
    assert err.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_files_belong_to_their_tenant_and_have_a_size_limit(stack: Stack) -> None:
    mine = stack.client(default_headers={"x-kvmesh-tenant": "harbour"})
    theirs = stack.client(default_headers={"x-kvmesh-tenant": "airport"})
    file_id = upload(mine, [line(0)])
    assert mine.files.retrieve(file_id).filename == "in.jsonl"
    assert json.loads(mine.files.content(file_id).text.splitlines()[0])["custom_id"] == "req-0"
    assert file_id in [f.id for f in mine.files.list(purpose="batch").data]
    assert file_id not in [f.id for f in theirs.files.list().data]
    with pytest.raises(openai.NotFoundError):
        theirs.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError) as err:
        mine.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as err:
        mine.files.create(file=("big.jsonl", io.BytesIO(b"x" * (1 << 20) + b"x")), purpose="batch")
    assert err.value.status_code == 413 and "1048576" in err.value.body["message"]
    assert mine.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(file_id)


def test_the_files_kept_have_a_size_limit_and_a_deleted_file_makes_room(stack: Stack) -> None:
    mine = stack.client(default_headers={"x-kvmesh-tenant": "harbour"})
    big = b'{"custom_id": "x"}' + b" " * ((1 << 20) - 32) + b"\n"  # (within one file's limit)
    kept = []
    with pytest.raises(openai.APIStatusError) as err:
        for n in range(5):  # 4 MiB for every file together: the fourth or so does not fit
            kept.append(mine.files.create(file=(f"{n}.jsonl", io.BytesIO(big)), purpose="batch"))
    assert err.value.status_code == 413 and err.value.body["code"] == "files_store_full"
    assert "delete files for room" in err.value.body["message"] and 2 <= len(kept) <= 4
    for f in kept:
        mine.files.delete(f.id)
    again = mine.files.create(file=("again.jsonl", io.BytesIO(big)), purpose="batch")
    mine.files.delete(again.id)


def test_a_cancelled_batch_keeps_the_answers_it_got(client: openai.OpenAI) -> None:
    # (more lines than a router runs at once, KVMESH_ROUTER_BATCH_CONCURRENCY's 16: lines in
    # flight when the cancel comes are answered, the later ones are not started)
    batch = answering(client, 80)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    answered = lines_of(client, done.output_file_id)
    skipped = lines_of(client, done.error_file_id)
    assert 2 <= len(answered) < 80
    assert {o["error"]["code"] for o in skipped} == {"batch_cancelled"}
    ids = [o["custom_id"] for o in answered + skipped]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(80))  # each once
    completed = finished(client, run_batch(client, [line(0)]).id)
    with pytest.raises(openai.ConflictError):  # too late to cancel
        client.batches.cancel(completed.id)


def test_a_batch_past_its_window_expires_with_what_it_answered(
    client: openai.OpenAI, stack: Stack
) -> None:
    """A 2-second window: once a line is answered the workers are paused until it has
    passed (a fast machine could answer all 40 lines in 2 s), and the rest expire."""
    lines = [line(i, max_tokens=64) for i in range(40)]
    batch = run_batch(client, lines, completion_window="2s")
    wait_until(
        lambda: (
            (b := client.batches.retrieve(batch.id)).request_counts.completed
            or b.status == "expired"
        ),
        30,
        0.05,
        what="a line answered",
    )
    workers = [p for sid, p in stack.procs.items() if sid.startswith(("prefill", "decode"))]
    for worker in workers:
        worker.signal(signal.SIGSTOP)
    try:
        time.sleep(max(0.0, batch.created_at + 2.5 - time.time()))
    finally:
        for worker in workers:
            worker.signal(signal.SIGCONT)
    done = finished(client, batch.id)
    assert done.status == "expired" and done.expired_at
    answered = lines_of(client, done.output_file_id)
    expired = lines_of(client, done.error_file_id)
    assert len(answered) < 40 and {o["error"]["code"] for o in expired} == {"batch_expired"}
    assert sorted(o["custom_id"] for o in answered + expired) == sorted(
        f"req-{i}" for i in range(40)
    )


def test_a_router_killed_mid_batch_another_carries_it_on(stack: Stack) -> None:
    url = stack.router("router-b")
    on_b = stack.client(url, timeout=60)
    batch = answering(on_b, 64)  # four rounds of 16 at once
    stack.procs["router-b"].signal(signal.SIGKILL)  # no lease given back: it runs out
    each_line_answered_once(stack.client(), batch.id, 64)
    assert f"batch {batch.id}: working on it" in stack.procs["router-0"].output()


def test_kvmesh_batch_runs_a_file_and_a_rerun_sends_only_what_is_missing(
    stack: Stack, tmp_path
) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line(i, max_tokens=4)) + "\n" for i in range(5)))

    def kvmesh_batch() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvmesh", "batch", str(src), "-o", str(out)]
            + ["--url", stack.url, "--poll", "0.2"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = kvmesh_batch()
    assert first.returncode == 0, first.stderr
    assert "5/5" in first.stderr and "completed: 5 answers" in first.stderr
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == [f"req-{i}" for i in range(5)]
    again = kvmesh_batch()
    assert again.returncode == 0 and "every line" in again.stderr
    kept = [x for x in out.read_text().splitlines() if json.loads(x)["custom_id"] != "req-3"]
    out.write_text("\n".join(kept) + "\n")  # one answer lost: only it goes again
    third = kvmesh_batch()
    assert third.returncode == 0, third.stderr
    assert "1 requests" in third.stderr and "completed: 1 answers" in third.stderr
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == [f"req-{i}" for i in range(5)]


def test_a_router_frozen_past_its_lease_loses_the_batch_and_no_line_is_answered_twice(
    stack: Stack,
) -> None:
    """router-c works on a batch, then freezes past its lease (3 s): router-0 takes the batch
    over. Woken, router-c finds its lease gone and stops; every line is answered once."""
    url = stack.router("router-c")
    on_c = stack.client(url, timeout=60)
    batch = answering(on_c, 48)
    router_c = stack.procs["router-c"]
    router_c.signal(signal.SIGSTOP)
    try:
        wait_until(
            lambda: f"batch {batch.id}: working on it" in stack.procs["router-0"].output(),
            LEASE_S * 10,
            what="router-0 takes the batch over",
        )
    finally:
        router_c.signal(signal.SIGCONT)
    each_line_answered_once(stack.client(), batch.id, 48)
    wait_until(
        lambda: f"batch {batch.id}: lease lost" in router_c.output(),
        30,
        what="router-c to see its lease gone",
    )
    router_c.stop()
