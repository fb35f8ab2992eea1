"""Batches' durable state: each batch's record in a JetStream key-value bucket, and each
line's result in another, keyed by batch and line, written with "create" (only if absent):
however many routers ran a line (one that was thought dead, then was not), its ``custom_id``
is answered once. A record changes by compare-and-set on its revision (``Conflict`` when
another router, or a cancel, changed it first)."""

from __future__ import annotations

import contextlib
import secrets
from typing import Literal

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from pydantic import BaseModel, Field

from shared.bus import Bus, riding_out, subjects
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

    def __init__(self, bus: Bus, keep_s: float) -> None:
        self.bus = bus
        self.keep_s = keep_s  # how long a batch's record and results are kept
        self.records = None
        self.results = None
        self._ended: dict[str, BatchRecord] = {}  # records of ended batches, read once

    async def start(self) -> None:
        js, replicas = self.bus.js, self.bus.replicas

        def bucket(name: str) -> KeyValueConfig:
            return KeyValueConfig(
                bucket=name, history=1, storage=StorageType.FILE, replicas=replicas, ttl=self.keep_s
            )

        self.records = await js.create_key_value(bucket(BATCHES))
        self.results = await js.create_key_value(bucket(RESULTS))

    async def create(self, record: BatchRecord) -> None:
        data = record.to_bytes()

        async def create() -> None:
            try:
                await self.records.create(record.id, data)
            except KeyWrongLastSequenceError:  # asked again after a create that was done?
                if (await self.records.get(record.id)).value != data:
                    raise Conflict(record.id) from None

        await riding_out(create, f"batch {record.id}")

    async def get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            entry = await riding_out(lambda: self.records.get(batch_id), f"batch {batch_id}")
        except KeyNotFoundError:
            return None
        if entry is None or entry.value is None:
            return None
        return BatchRecord.from_bytes(entry.value), entry.revision

    async def update(self, record: BatchRecord, revision: int) -> int:
        """Store the record if nobody changed it since ``revision``; its new revision."""
        try:
            return await riding_out(
                lambda: self.records.update(record.id, record.to_bytes(), last=revision),
                f"batch {record.id}",
            )
        except KeyWrongLastSequenceError:
            raise Conflict(record.id) from None

    async def all(self) -> list[BatchRecord]:
        """Every batch; ended ones decoded once (an ended batch's record never changes)."""
        found = []
        for key, value in await self._stored(BATCHES, ">"):
            record = self._ended.get(key) or BatchRecord.from_bytes(value)
            if record.status in ENDED:
                self._ended[key] = record
            found.append(record)
        return found

    async def put_result(self, batch_id: str, line: int, result: bytes) -> bool:
        """A line's result, unless one is stored already (then False: the first stays)."""
        try:
            key = f"{batch_id}.{line}"
            await riding_out(lambda: self.results.create(key, result), f"result {key}")
        except KeyWrongLastSequenceError:
            return False
        return True

    async def results_of(self, batch_id: str) -> dict[int, bytes]:
        """Every stored result of a batch, by line."""
        found = await self._stored(RESULTS, f"{batch_id}.*")
        return {int(key.rsplit(".", 1)[1]): value for key, value in found}

    async def _stored(self, bucket: str, keys: str) -> list[tuple[str, bytes]]:
        """The keys matching ``keys`` in ``bucket`` that hold a value, with it. Read whole by
        the bus (nats-py's own ``keys()`` and watchers can answer "none" while the first
        entries are still on their way)."""
        prefix = f"$KV.{bucket}."
        found = []
        for msg in await self.bus.latest(f"KV_{bucket}", prefix + keys):
            if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                continue
            found.append((msg.subject[len(prefix) :], msg.data or b""))
        return found

    async def drop_results(self, batch_id: str, lines: int) -> None:
        """A finished batch's results (its output and error files have them now)."""
        for line in range(lines):
            with contextlib.suppress(Exception):
                await self.results.purge(f"{batch_id}.{line}")
