"""Batches' durable state: each batch's record in a JetStream key-value bucket, and each
line's result in another, keyed by batch and line, written with "create" (only if absent):
however many routers ran a line (one that was thought dead, then was not), its ``custom_id``
is answered once. A record changes by compare-and-set on its revision (``Conflict`` when
another router, or a cancel, changed it first)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Literal

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from pydantic import BaseModel, Field

from shared.bus import Bus, subjects
from shared.messages import Message

BATCHES = subjects.BATCHES_BUCKET
RESULTS = subjects.RESULTS_BUCKET
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
