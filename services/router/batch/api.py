"""OpenAI's Files and Batches endpoints: /v1/files and /v1/batches.

A tenant sees only its own files and batches (with auth on, its key's tenant; else the
x-kvmesh-tenant header's: ``tenant_of``, given by the transport). The work itself is
``runner.py``'s; errors are rendered by the transport's envelope.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import BodyPartReader, web

from services.router.batch.files import Files
from services.router.batch.runner import Answer, BatchRunner
from services.router.batch.store import BatchRecord, BatchStore, Conflict, new_batch_id
from services.router.errors import ApiError
from services.router.formats.batches import BatchCreate
from services.router.formats.wire import parse_body, query_int
from services.router.settings import BatchSettings
from shared.bus import Bus

MAX_LISTED = 100  # batches in one page of GET /v1/batches


class BatchApi:
    def __init__(
        self,
        files: Files,
        store: BatchStore,
        runner: BatchRunner,
        tenant_of: Callable[[web.Request], str],
    ) -> None:
        self.files = files
        self.store = store
        self.runner = runner
        self._tenant = tenant_of

    @classmethod
    async def started(
        cls,
        bus: Bus,
        settings: BatchSettings,
        answer: Answer,
        router_id: str,
        online: Callable[[], int],
        tenant_of: Callable[[web.Request], str],
    ) -> BatchApi:
        """The files and batches on the bus, and a runner (not yet running: ``runner.start``)
        that answers lines with ``answer`` while ``online`` requests leave it room."""
        files = Files(bus, settings)
        await files.start()
        store = BatchStore(bus, settings.batch_keep_s)
        await store.start()
        runner = BatchRunner(store, files, answer, router_id, online, settings)
        return cls(files, store, runner, tenant_of)

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

    # -- files ------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "a multipart/form-data body with file and purpose")
        try:
            purpose, name, data = await self._parts(request)
        except ApiError:
            raise
        except Exception as err:  # a body aiohttp cannot read as multipart: the client's
            raise ApiError(
                400,
                f"a multipart/form-data body with file and purpose: {err or type(err).__name__}",
            ) from None
        if purpose != "batch":
            raise ApiError(400, f"purpose: batch (got {purpose!r})", param="purpose")
        if not name:
            raise ApiError(400, "file: missing", param="file")
        info = await self.files.put(tenant, purpose, name, data)
        return web.json_response(info.to_dict())

    async def _parts(self, request: web.Request) -> tuple[str, str, bytes]:
        """The upload's purpose, file name and bytes (413 past the size limit)."""
        purpose, name, data = "", "", b""
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace").strip()
            elif part.name == "file":
                name = part.filename or "upload.jsonl"
                data = await _read_limited(part, self.files.max_bytes)
            else:
                field = part.name or "a part without a name"
                raise ApiError(400, f"{field}: not a field this API accepts", param=part.name)
        return purpose, name, data

    async def list_files(self, request: web.Request) -> web.Response:
        purpose = request.query.get("purpose")
        infos = await self.files.list(self._tenant(request), purpose)
        return web.json_response(
            {"object": "list", "data": [i.to_dict() for i in infos], "has_more": False}
        )

    async def get_file(self, request: web.Request) -> web.Response:
        info = await self.files.info(self._tenant(request), request.match_info["file_id"])
        return web.json_response(info.to_dict())

    async def file_content(self, request: web.Request) -> web.Response:
        data = await self.files.content(self._tenant(request), request.match_info["file_id"])
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        await self.files.delete(self._tenant(request), file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # -- batches ----------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        body = parse_body(await request.read(), BatchCreate)
        assert isinstance(body, BatchCreate)
        endpoint, window, file_id = body.endpoint, body.completion_window, body.input_file_id
        seconds, metadata = body.checked()
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

    async def _record(self, request: web.Request) -> tuple[BatchRecord, int]:
        tenant = self._tenant(request)
        batch_id = request.match_info["batch_id"]
        found = await self.store.get(batch_id) if batch_id.startswith("batch_") else None
        if found is None or found[0].tenant != tenant:
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="not_found")
        return found

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response((await self._record(request))[0].to_api())

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        limit = query_int(request.query, "limit", 20, MAX_LISTED)
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

    async def cancel(self, request: web.Request) -> web.Response:
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
