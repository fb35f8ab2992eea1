"""Batches (OpenAI's /v1/batches): their durable state and the work of running them.

A batch's record lives in a JetStream key-value bucket, and each line's result in another,
keyed by batch and line, written with "create" (only if absent): however many routers ran a
line (one that was thought dead, then was not), its ``custom_id`` is answered once. Any router
runs any batch: it takes a lease on the record (a compare-and-set on the record's revision),
renews it while it works and gives it back when it stops; when a router dies, its lease runs
out and another carries the batch on from the lines already answered.

Batch lines run at the batch priority (services/prefill/queue.py, decode's admission): online
requests go first. Lines sharing a prompt prefix run as a group: the first computes the
prefix, the rest follow it and reuse it from the tiers (Schedule).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from pydantic import BaseModel, Field

from services.router.files import FileInfo, Files
from services.router.openai_api import ApiError
from shared.bus import Bus, subjects
from shared.messages import Message

log = logging.getLogger(__name__)

BATCHES = subjects.BATCHES_BUCKET
RESULTS = subjects.RESULTS_BUCKET
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
WINDOWS = {"24h": 24 * 3600.0}
Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # someone must work on it
ENDED = ("failed", "completed", "expired", "cancelled")
MAX_LINE_ERRORS = 100  # listed in a failed batch's errors (the count says how many in all)


class Counts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(Message):
    """A batch as stored (OpenAI's batch object, plus who owns it and its lease)."""

    id: str
    tenant: str = ""
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    status: Status = "validating"
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: Counts = Field(default_factory=Counts)
    errors: list[LineError] | None = None
    owner: str = ""  # the router working on it, while its lease lasts
    lease_until: float = 0.0

    def to_api(self) -> dict:
        body = self.model_dump(exclude={"tenant", "owner", "lease_until", "errors"})
        body["object"] = "batch"
        body["errors"] = (
            None
            if self.errors is None
            else {"object": "list", "data": [e.model_dump() for e in self.errors]}
        )
        return body

    def changed(self, **fields: object) -> BatchRecord:
        return self.model_copy(update=fields)


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class Conflict(Exception):
    """The record changed since it was read (another router, or a cancel)."""


class BatchStore:
    """The two buckets."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.records = None
        self.results = None
        self._ended: dict[str, BatchRecord] = {}  # records of ended batches, read once

    async def start(self) -> None:
        js, replicas = self.bus.js, self.bus.replicas
        self.records = await js.create_key_value(
            KeyValueConfig(bucket=BATCHES, history=1, storage=StorageType.FILE, replicas=replicas)
        )
        self.results = await js.create_key_value(
            KeyValueConfig(bucket=RESULTS, history=1, storage=StorageType.FILE, replicas=replicas)
        )

    async def create(self, record: BatchRecord) -> None:
        await self.records.create(record.id, record.to_bytes())

    async def get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            entry = await self.records.get(batch_id)
        except KeyNotFoundError:
            return None
        if entry is None or entry.value is None:
            return None
        return BatchRecord.from_bytes(entry.value), entry.revision

    async def update(self, record: BatchRecord, revision: int) -> int:
        """Store the record if nobody changed it since ``revision``; its new revision."""
        try:
            return await self.records.update(record.id, record.to_bytes(), last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(record.id) from None

    async def all(self) -> list[BatchRecord]:
        """Every batch; ended ones from memory (an ended batch's record never changes)."""
        try:
            keys = await self.records.keys()
        except NoKeysError:
            return []
        found = await asyncio.gather(*(self.get(k) for k in keys if k not in self._ended))
        for record, _ in filter(None, found):
            if record.status in ENDED:
                self._ended[record.id] = record
        live = [f[0] for f in found if f is not None and f[0].id not in self._ended]
        return live + [self._ended[k] for k in keys if k in self._ended]

    async def put_result(self, batch_id: str, line: int, result: bytes) -> bool:
        """A line's result, unless one is stored already (then False: the first stays)."""
        try:
            await self.results.create(f"{batch_id}.{line}", result)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def results_of(self, batch_id: str) -> dict[int, bytes]:
        """Every stored result of a batch, by line."""
        watcher = await self.results.watch(f"{batch_id}.*", ignore_deletes=True)
        found: dict[int, bytes] = {}
        try:
            async for entry in watcher:
                if entry is None:  # the values stored so far are all in
                    break
                found[int(entry.key.rsplit(".", 1)[1])] = entry.value or b""
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        return found

    async def drop_results(self, batch_id: str, lines: int) -> None:
        """A finished batch's results (its output and error files have them now)."""
        for line in range(lines):
            with contextlib.suppress(Exception):
                await self.results.purge(f"{batch_id}.{line}")


# -- a batch's input --------------------------------------------------------------------------


class Line(BaseModel):
    index: int
    custom_id: str
    body: dict
    body_bytes: bytes  # the body as a request would carry it


def parse_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[LineError]]:
    """Every line checked (JSON, the fields, a custom_id once, the batch's endpoint, no
    streaming) before any runs; the errors name their line (1-based)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    raw_lines = [r for r in data.decode("utf-8", errors="replace").splitlines()]
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue

        def bad(code: str, message: str, param: str | None = None, n: int = number) -> None:
            errors.append(LineError(code=code, message=message, param=param, line=n))

        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            bad("invalid_json_line", f"line {number} is not JSON: {err.msg}")
            continue
        if not isinstance(obj, dict):
            bad("invalid_request", f"line {number}: a JSON object expected")
            continue
        custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            bad("missing_custom_id", "custom_id: a string of 1 to 512 characters", "custom_id")
            continue
        if custom_id in seen:
            bad("duplicate_custom_id", f"custom_id {custom_id!r} appears twice", "custom_id")
            continue
        seen.add(custom_id)
        if method != "POST":
            bad("invalid_method", f"method: POST (got {method!r})", "method")
            continue
        if url != endpoint:
            bad("mismatched_url", f"url: the batch's endpoint {endpoint} (got {url!r})", "url")
            continue
        if not isinstance(body, dict):
            bad("invalid_request", "body: a JSON object", "body")
            continue
        if body.get("stream"):
            bad("invalid_request", "body.stream: a batch line cannot stream", "body.stream")
            continue
        lines.append(Line(index=len(lines), custom_id=custom_id, body=body, body_bytes=b""))
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="the input file has no request"))
    if len(lines) > max_lines:
        errors.append(
            LineError(
                code="too_many_requests",
                message=f"a batch holds at most {max_lines} requests (got {len(lines)})",
            )
        )
    for line in lines:
        line.body_bytes = json.dumps(line.body).encode()
    return lines, errors


def prefix_key(line: Line) -> tuple[str, str]:
    """What a line's prompt starts with (its model, then the text of its system prompt and
    messages, or its raw prompt, from the start): lines with the same key share a prefix."""
    body = line.body
    text = json.dumps(body.get("system", ""), sort_keys=True)
    for message in body.get("messages") or []:
        if len(text) > PREFIX_CHARS:
            break
        text += json.dumps(message, sort_keys=True)
    if "prompt" in body:
        text += json.dumps(body["prompt"])
    return str(body.get("model", "")), text[:PREFIX_CHARS]


PREFIX_CHARS = 4096


class Schedule:
    """A batch's lines in the order that reuses prefixes: the first line of each group that
    shares a prefix (its leader) goes alone; the rest of the group once the leader is answered
    (its prefix is in the tiers by then), ahead of other groups' leaders, so a group runs
    while its prefix is still in memory. Lines that share nothing are each a group of one."""

    def __init__(self, lines: list[Line]) -> None:
        groups: dict[tuple[str, str], list[Line]] = {}
        for line in lines:
            groups.setdefault(prefix_key(line), []).append(line)
        self.ready = collections.deque(group[0] for group in groups.values())
        self.followers = {group[0].index: group[1:] for group in groups.values() if group[1:]}
        self.running = 0
        self.changed = asyncio.Event()

    async def take(self) -> Line | None:
        """The next line to run; None when none is left."""
        while True:
            if self.ready:
                self.running += 1
                return self.ready.popleft()
            if not self.followers:
                return None
            self.changed.clear()
            await self.changed.wait()

    def done(self, line: Line) -> None:
        """A line ended (answered or not): its group's other lines may go."""
        self.running -= 1
        self.ready.extendleft(reversed(self.followers.pop(line.index, [])))
        if not self.running and not self.ready:
            self.followers.clear()  # (leaders that never ran: the batch stopped)
        self.changed.set()


# -- running ----------------------------------------------------------------------------------

# Runs one line (the body as the endpoint takes it, the request id, the tenant), returning
# the answer's body, or raising ApiError.
Answer = Callable[[str, bytes, str, str], Awaitable[dict]]
ONLINE_POLL_S = 0.01
RETRYABLE = (429, 503)  # the mesh is busy or a worker is gone: the line waits and goes again


class BatchRunner:
    """Takes the leases of active batches nobody works on, and works on them."""

    def __init__(
        self,
        store: BatchStore,
        files: Files,
        answer: Answer,
        router_id: str,
        online: Callable[[], int],
        concurrency: int,
        lease_s: float,
        max_lines: int,
        poll_s: float = 1.0,
    ) -> None:
        self.store = store
        self.files = files
        self.answer = answer
        self.router_id = router_id
        self.online = online  # online requests in flight on this router
        self.concurrency = concurrency
        self.lease_s = lease_s
        self.max_lines = max_lines
        self.poll_s = poll_s
        self.running: dict[str, asyncio.Task] = {}
        self._loop: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._loop = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        """Stop working; give the leases back so another router carries on at once."""
        if self._loop is not None:
            self._loop.cancel()
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def kick(self) -> None:
        """Look for work now (a batch was just created or cancelled here)."""
        self._wake.set()

    async def _watch(self) -> None:
        while True:
            try:
                await self._claim_free()
            except Exception as err:  # the bus away a while: look again later
                log.warning("batches: %s", err)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            self._wake.clear()

    async def _claim_free(self) -> None:
        now = time.time()
        for record in await self.store.all():
            if record.status not in ACTIVE or record.id in self.running:
                continue
            if record.owner and record.owner != self.router_id and record.lease_until > now:
                continue
            found = await self.store.get(record.id)
            if found is None:
                continue
            record, revision = found
            if record.status not in ACTIVE:
                continue
            try:
                revision = await self.store.update(
                    record.changed(owner=self.router_id, lease_until=now + self.lease_s),
                    revision,
                )
            except Conflict:
                continue  # another router took it first
            log.info("batch %s: working on it (%s)", record.id, record.status)
            task = asyncio.create_task(self._work(record.id))
            self.running[record.id] = task
            task.add_done_callback(lambda _, i=record.id: self.running.pop(i, None))

    async def _work(self, batch_id: str) -> None:
        work = BatchWork(self, batch_id)
        try:
            await work.run()
        except asyncio.CancelledError:
            await asyncio.shield(work.release())
            raise
        except Lost:
            log.warning("batch %s: lease lost; another router has it", batch_id)
        except Exception:
            log.exception("batch %s: failed here; another try after its lease", batch_id)


class Lost(Exception):
    """This router's lease on the batch is gone."""


class BatchWork:
    """One batch on this router, from where its record says it is to the end."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.runner = runner
        self.store = runner.store
        self.batch_id = batch_id
        self.record: BatchRecord | None = None
        self.revision = 0

    async def _load(self) -> BatchRecord:
        found = await self.store.get(self.batch_id)
        if found is None:
            raise Lost(self.batch_id)
        self.record, self.revision = found
        if self.record.owner != self.runner.router_id:
            raise Lost(self.batch_id)
        return self.record

    async def save(self, **fields: object) -> BatchRecord:
        """The record with ``fields`` changed and the lease renewed; a cancel stored
        meanwhile by another router is kept (and read back)."""
        for _ in range(5):
            record = await self._load() if self.record is None else self.record
            lease = time.time() + self.runner.lease_s
            new = record.changed(**fields, lease_until=lease)
            try:
                self.revision = await self.store.update(new, self.revision)
                self.record = new
                return new
            except Conflict:
                record = await self._load()
                if record.status == "cancelling" and fields.get("status") in (
                    "in_progress",
                    "finalizing",
                ):
                    fields = {k: v for k, v in fields.items() if not k.endswith("_at")}
                    fields["status"] = "cancelling"
        raise Lost(self.batch_id)

    async def release(self) -> None:
        with contextlib.suppress(Exception):
            record = await self._load()
            await self.store.update(record.changed(owner="", lease_until=0.0), self.revision)

    async def run(self) -> None:
        record = await self._load()
        if record.status == "validating":
            record = await self._validate(record)
        if record.status in ("in_progress", "cancelling"):
            record = await self._run_lines(record)
        if record.status in ("finalizing", "cancelling"):
            await self._finalize(record)

    async def _input(self, record: BatchRecord) -> tuple[list[Line], list[LineError]]:
        try:
            data = await self.runner.files.content(record.tenant, record.input_file_id)
        except ApiError:
            return [], [LineError(code="file_not_found", message="the input file is gone")]
        return parse_input(data, record.endpoint, self.runner.max_lines)

    async def _validate(self, record: BatchRecord) -> BatchRecord:
        lines, errors = await self._input(record)
        now = int(time.time())
        if errors:
            log.info("batch %s failed validation: %d errors", record.id, len(errors))
            return await self.save(status="failed", failed_at=now, errors=errors[:MAX_LINE_ERRORS])
        return await self.save(
            status="in_progress", in_progress_at=now, request_counts=Counts(total=len(lines))
        )

    async def _run_lines(self, record: BatchRecord) -> BatchRecord:
        lines, _ = await self._input(record)
        done = await self.store.results_of(record.id)
        todo = [line for line in lines if line.index not in done]
        if record.status == "cancelling":
            todo = []
        counts = _counts(done, len(lines))
        if todo and record.status == "in_progress":
            log.info("batch %s: %d of %d lines to run", record.id, len(todo), len(lines))
        schedule = Schedule(todo)
        stop = asyncio.Event()

        async def worker() -> None:
            while True:
                # While online requests are in flight here, one batch line at a time.
                while schedule.running >= (1 if self.runner.online() else self.runner.concurrency):
                    await asyncio.sleep(ONLINE_POLL_S)
                if (line := await schedule.take()) is None:
                    return
                try:
                    if time.time() > record.expires_at:
                        stop.set()
                    if stop.is_set():
                        return
                    result = await self._run_line(record, line, stop)
                    if result is None:
                        return
                    if await self.store.put_result(record.id, line.index, result):
                        ok = _succeeded(result)
                        counts.completed += ok
                        counts.failed += not ok
                finally:
                    schedule.done(line)

        async def keeper() -> None:
            """Renews the lease with the counts; stops the workers on a cancel or expiry."""
            while not stop.is_set():
                await asyncio.sleep(min(1.0, self.runner.lease_s / 3))
                now = time.time()
                current = await self.save(request_counts=counts.model_copy())
                if current.status == "cancelling" or now > current.expires_at:
                    stop.set()

        workers = [asyncio.create_task(worker()) for _ in range(self.runner.concurrency)]
        keep = asyncio.create_task(keeper())
        try:
            await asyncio.gather(*workers)
        finally:
            keep.cancel()
            for w in workers:
                w.cancel()
            await asyncio.gather(keep, *workers, return_exceptions=True)
        record = await self.save(request_counts=counts.model_copy())
        now = int(time.time())
        if record.status == "cancelling":
            return record  # finalized as cancelled below
        if time.time() > record.expires_at and counts.completed + counts.failed < counts.total:
            return await self.save(status="finalizing", finalizing_at=now, expired_at=now)
        return await self.save(status="finalizing", finalizing_at=now)

    async def _run_line(self, record: BatchRecord, line: Line, stop: asyncio.Event) -> bytes | None:
        """The line's output line (an answer, or an error the request got); None when the
        batch stopped (cancel, expiry) before it could run."""
        wait = 0.5
        while not stop.is_set():
            rid = f"{record.id}-{line.index}-{secrets.token_hex(4)}"
            try:
                body = await self.runner.answer(
                    record.endpoint, line.body_bytes, rid, record.tenant
                )
                return _output(line, rid, 200, body)
            except ApiError as err:
                if err.status in RETRYABLE:  # busy: online traffic goes first
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, 5.0)
                    continue
                error = {"message": err.message, "type": "invalid_request_error", "code": err.code}
                if err.param:
                    error["param"] = err.param
                return _output(line, rid, err.status, {"error": error})
        return None

    async def _file(self, record: BatchRecord, kind: str, results: list[bytes]) -> FileInfo | None:
        if not results:
            return None
        name = f"{record.id}_{kind}.jsonl"
        return await self.runner.files.put(record.tenant, "batch_output", name, _jsonl(results))

    async def _finalize(self, record: BatchRecord) -> None:
        lines, _ = await self._input(record)
        done = await self.store.results_of(record.id)
        ok, failed = [], []
        for line in lines:
            result = done.get(line.index)
            if result is None:  # never ran: cancelled or expired first
                code = "batch_cancelled" if record.cancelling_at else "batch_expired"
                why = "cancelled" if record.cancelling_at else "expired"
                result = json.dumps(
                    {
                        "id": f"batch_req_{line.index}",
                        "custom_id": line.custom_id,
                        "response": None,
                        "error": {"code": code, "message": f"the batch was {why} first"},
                    }
                ).encode()
            (ok if _succeeded(result) else failed).append(result)
        output = await self._file(record, "output", ok)
        errors = await self._file(record, "errors", failed)
        now = int(time.time())
        if record.cancelling_at:
            status, stamp = "cancelled", {"cancelled_at": now}
        elif record.expired_at:
            status, stamp = "expired", {}
        else:
            status, stamp = "completed", {"completed_at": now}
        await self.save(
            status=status,
            output_file_id=output.id if output else None,
            error_file_id=errors.id if errors else None,
            request_counts=_counts(done, len(lines)),
            owner="",
            **stamp,
        )
        await self.store.drop_results(record.id, len(lines))
        log.info("batch %s %s: %d answered, %d failed", record.id, status, len(ok), len(failed))


def _succeeded(result: bytes) -> bool:
    return json.loads(result).get("error") is None and _status(result) < 400


def _output(line: Line, rid: str, status: int, body: dict) -> bytes:
    return json.dumps(
        {
            "id": f"batch_req_{rid}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": rid, "body": body},
            "error": None,
        }
    ).encode()


def _status(result: bytes) -> int:
    response = json.loads(result).get("response") or {}
    return int(response.get("status_code", 500))


def _counts(done: dict[int, bytes], total: int) -> Counts:
    ok = sum(1 for r in done.values() if _succeeded(r))
    return Counts(total=total, completed=ok, failed=len(done) - ok)


def _jsonl(results: list[bytes]) -> bytes:
    return b"".join(r + b"\n" for r in results)
