"""OpenAI's Files and Batches endpoints: /v1/files and /v1/batches.

A tenant sees only its own files and batches (with auth on, its key's tenant; else the
x-kvmesh-tenant header's). The work itself is services/router/batches.py's.
"""

from __future__ import annotations

import re
import time

from aiohttp import BodyPartReader, web
from pydantic import BaseModel, Field

from services.router.batches import (
    ENDPOINTS,
    BatchRecord,
    BatchRunner,
    BatchStore,
    Conflict,
    new_batch_id,
)
from services.router.files import Files
from services.router.frontend import Frontend, KvOptions
from services.router.http_api import api_error, query_int
from services.router.openai_api import ApiError, parse_body

WINDOW = re.compile(r"^(\d+)(s|m|h)$")
UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600
MAX_METADATA = 16


def window_s(window: object) -> int:
    """OpenAI's "24h"; shorter windows too ("30m", "90s": a kvmesh extension)."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * UNITS[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ApiError(
            400,
            f"completion_window: 24h, or a shorter time like 30m (got {window!r})",
            param="completion_window",
        )
    return seconds


def check_metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise ApiError(
            400,
            "metadata: at most 16 string pairs, keys up to 64 characters, values up to 512",
            param="metadata",
        )
    return metadata


class BatchCreate(BaseModel):
    """POST /v1/batches (OpenAI's fields)."""

    input_file_id: str = Field(description="an uploaded file of purpose batch")
    endpoint: str = Field(description=f"one of {', '.join(ENDPOINTS)}")
    completion_window: str = Field(
        default="24h", description='"24h", or shorter ("30m", "90s": a kvmesh extension)'
    )
    metadata: dict[str, str] | None = None


class BatchApi:
    def __init__(
        self, frontend: Frontend, files: Files, store: BatchStore, runner: BatchRunner
    ) -> None:
        self.frontend = frontend
        self.files = files
        self.store = store
        self.runner = runner

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", self.upload),
            web.get("/v1/files", self.list_files),
            web.get("/v1/files/{file_id}", self.get_file),
            web.get("/v1/files/{file_id}/content", self.file_content),
            web.delete("/v1/files/{file_id}", self.delete_file),
            web.post("/v1/batches", self.create),
            web.get("/v1/batches", self.list_batches),
            web.get("/v1/batches/{batch_id}", self.get_batch),
            web.post("/v1/batches/{batch_id}/cancel", self.cancel),
        ]

    def _tenant(self, request: web.Request) -> str:
        caller = self.frontend.identify(request.headers)
        return KvOptions.from_headers(request.headers, caller).tenant

    # -- files ------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
            if not request.content_type.startswith("multipart/"):
                raise ApiError(400, "a multipart/form-data body with file and purpose")
            purpose, name, data = "", "", b""
            limit = self.files.max_bytes
            async for part in await request.multipart():
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.read(decode=True)).decode(errors="replace").strip()
                elif part.name == "file":
                    name = part.filename or "upload.jsonl"
                    data = await _read_limited(part, limit)
            if purpose != "batch":
                raise ApiError(400, f"purpose: batch (got {purpose!r})", param="purpose")
            if not name:
                raise ApiError(400, "file: missing", param="file")
            info = await self.files.put(tenant, purpose, name, data)
            return web.json_response(info.to_dict())
        except ApiError as err:
            return api_error(err)

    async def list_files(self, request: web.Request) -> web.Response:
        try:
            purpose = request.query.get("purpose")
            infos = await self.files.list(self._tenant(request), purpose)
            return web.json_response(
                {"object": "list", "data": [i.to_dict() for i in infos], "has_more": False}
            )
        except ApiError as err:
            return api_error(err)

    async def get_file(self, request: web.Request) -> web.Response:
        try:
            info = await self.files.info(self._tenant(request), request.match_info["file_id"])
            return web.json_response(info.to_dict())
        except ApiError as err:
            return api_error(err)

    async def file_content(self, request: web.Request) -> web.Response:
        try:
            data = await self.files.content(self._tenant(request), request.match_info["file_id"])
            return web.Response(body=data, content_type="application/octet-stream")
        except ApiError as err:
            return api_error(err)

    async def delete_file(self, request: web.Request) -> web.Response:
        try:
            file_id = request.match_info["file_id"]
            await self.files.delete(self._tenant(request), file_id)
            return web.json_response({"id": file_id, "object": "file", "deleted": True})
        except ApiError as err:
            return api_error(err)

    # -- batches ----------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
            body = parse_body(await request.read(), BatchCreate)
            assert isinstance(body, BatchCreate)
            endpoint, window, file_id = body.endpoint, body.completion_window, body.input_file_id
            if endpoint not in ENDPOINTS:
                raise ApiError(
                    400,
                    f"endpoint: one of {', '.join(ENDPOINTS)} (got {endpoint!r})",
                    param="endpoint",
                )
            seconds = window_s(window)
            metadata = check_metadata(body.metadata)
            info = await self.files.info(tenant, file_id)
            if info.purpose != "batch":
                raise ApiError(
                    400, f"input_file_id: a file of purpose batch ({file_id} is {info.purpose})"
                )
            now = int(time.time())
            record = BatchRecord(
                id=new_batch_id(),
                tenant=tenant,
                endpoint=endpoint,
                input_file_id=file_id,
                completion_window=window,
                metadata=metadata,
                created_at=now,
                expires_at=now + seconds,
                # This router starts on it at once (another carries it on if this one dies).
                owner=self.runner.router_id,
                lease_until=time.time() + self.runner.lease_s,
            )
            await self.store.create(record)
            self.runner.kick()
            return web.json_response(record.to_api())
        except ApiError as err:
            return api_error(err)

    async def _record(self, request: web.Request) -> tuple[BatchRecord, int]:
        tenant = self._tenant(request)
        batch_id = request.match_info["batch_id"]
        found = await self.store.get(batch_id) if batch_id.startswith("batch_") else None
        if found is None or found[0].tenant != tenant:
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="not_found")
        return found

    async def get_batch(self, request: web.Request) -> web.Response:
        try:
            return web.json_response((await self._record(request))[0].to_api())
        except ApiError as err:
            return api_error(err)

    async def list_batches(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
            limit = query_int(request, "limit", 20, 100)
            after = request.query.get("after")
            records = sorted(
                (r for r in await self.store.all() if r.tenant == tenant),
                key=lambda r: (r.created_at, r.id),
                reverse=True,
            )
            if after:
                ids = [r.id for r in records]
                records = records[ids.index(after) + 1 :] if after in ids else []
            page = records[:limit]
            return web.json_response(
                {
                    "object": "list",
                    "data": [r.to_api() for r in page],
                    "first_id": page[0].id if page else None,
                    "last_id": page[-1].id if page else None,
                    "has_more": len(records) > limit,
                }
            )
        except ApiError as err:
            return api_error(err)

    async def cancel(self, request: web.Request) -> web.Response:
        try:
            for _ in range(10):
                record, revision = await self._record(request)
                if record.status in ("cancelling", "cancelled"):
                    return web.json_response(record.to_api())
                if record.status not in ("validating", "in_progress"):
                    raise ApiError(
                        409,
                        f"batch {record.id} is {record.status}: it can no longer be cancelled",
                        code="conflict",
                    )
                new = record.changed(status="cancelling", cancelling_at=int(time.time()))
                try:
                    await self.store.update(new, revision)
                except Conflict:
                    continue  # its router saved progress meanwhile: read it again
                self.runner.kick()
                return web.json_response(new.to_api())
            raise ApiError(503, "the batch kept changing; retry", code="unavailable")
        except ApiError as err:
            return api_error(err)


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 20):
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413,
                f"file: at most {limit} bytes (KVMESH_ROUTER_FILES_MAX_BYTES)",
                param="file",
                code="file_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)
