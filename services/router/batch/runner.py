"""Running batches (OpenAI's /v1/batches). Any router runs any batch: it takes a lease on the
record (a compare-and-set on the record's revision), renews it while it works and gives it
back when it stops; when a router dies, its lease runs out and another carries the batch on
from the lines already answered.

Batch lines run at the batch priority (services/prefill/queue.py, decode's admission): online
requests go first. Lines sharing a prompt prefix run as a group: the first computes the
prefix, the rest follow it and reuse it from the tiers (Schedule).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from services.router.batch.files import FileInfo, Files
from services.router.batch.lines import Line, Schedule, parse_input
from services.router.batch.store import (
    ACTIVE,
    MAX_LINE_ERRORS,
    BatchRecord,
    BatchStore,
    Conflict,
    Counts,
    LineError,
)
from services.router.errors import ApiError
from services.router.settings import BatchSettings

log = logging.getLogger(__name__)

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
        settings: BatchSettings,
        poll_s: float = 1.0,
    ) -> None:
        self.store = store
        self.files = files
        self.answer = answer
        self.router_id = router_id
        self.online = online  # online requests in flight on this router
        self.settings = settings
        self.concurrency = settings.batch_concurrency
        self.lease_s = settings.batch_lease_s
        self.max_lines = settings.batch_max_requests
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
