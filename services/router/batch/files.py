"""Files for batch work (OpenAI's /v1/files), kept in a JetStream object store.

Every router reads and writes the same bucket, so a file uploaded to one is there for all, and
it lasts as long as the bus's storage (replicated when the bus is a cluster). A file belongs
to the tenant that uploaded it: another tenant is told it does not exist. What OpenAI's file
object says (purpose, name, time) travels in the object's headers.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError, ObjectNotFoundError

from services.router.errors import ApiError
from services.router.settings import BatchSettings
from shared.bus import Bus, riding_out, subjects

BUCKET = subjects.FILES_BUCKET
PURPOSES = ("batch", "batch_output")  # what may be uploaded; what the mesh writes
TENANT, PURPOSE, FILENAME, CREATED = (
    "Kvmesh-Tenant",
    "Kvmesh-Purpose",
    "Kvmesh-Filename",
    "Kvmesh-Created",
)


@dataclass(frozen=True)
class FileInfo:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class Files:
    """The bucket, per tenant."""

    def __init__(self, bus: Bus, settings: BatchSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.max_bytes = settings.files_max_bytes
        self._store = None

    async def start(self) -> None:
        config = ObjectStoreConfig(
            bucket=BUCKET,
            description="kvmesh batch files",
            storage=StorageType.FILE,
            replicas=self.bus.replicas,
            ttl=self.settings.batch_keep_s,  # (its size: checked at each put, not reserved)
        )
        self._store = await self.bus.js.create_object_store(BUCKET, config=config)

    async def put(self, tenant: str, purpose: str, filename: str, data: bytes) -> FileInfo:
        if len(data) > self.max_bytes:
            raise ApiError(
                413, f"file: at most {self.max_bytes} bytes (got {len(data)})", param="file"
            )
        info = FileInfo(new_file_id(), tenant, purpose, filename, len(data), int(time.time()))
        headers = {
            TENANT: tenant,
            PURPOSE: purpose,
            FILENAME: filename,
            CREATED: str(info.created_at),
        }
        held = (await riding_out(self._store.status, "the files' store")).size
        room = self.settings.files_store_bytes
        if held + len(data) > room:  # (checked first: a put that fails leaves its chunks)
            why = f"file: the files kept hold {held:,} of {room:,} bytes; delete files for room"
            raise ApiError(413, why, param="file", code="files_store_full")
        meta = ObjectMeta(name=info.id, headers=headers)
        await riding_out(lambda: self._store.put(info.id, data, meta=meta), f"file {info.id}")
        return info

    async def info(self, tenant: str, file_id: str) -> FileInfo:
        try:
            found = await riding_out(lambda: self._store.get_info(file_id), f"file {file_id}")
        except (ObjectNotFoundError, NotFoundError):
            found = None
        info = _info(found) if found is not None and not found.deleted else None
        if info is None or info.tenant != tenant:
            raise ApiError(404, f"no file {file_id!r}", param="file_id", code="not_found")
        return info

    async def content(self, tenant: str, file_id: str) -> bytes:
        await self.info(tenant, file_id)
        return (await riding_out(lambda: self._store.get(file_id), f"file {file_id}")).data or b""

    async def list(self, tenant: str, purpose: str | None = None) -> list[FileInfo]:
        try:
            found = await riding_out(
                lambda: self._store.list(ignore_deletes=True), "the files' store"
            )
        except NotFoundError:  # an empty bucket
            return []
        infos = [i for i in map(_info, found) if i is not None and i.tenant == tenant]
        if purpose:
            infos = [i for i in infos if i.purpose == purpose]
        return sorted(infos, key=lambda i: (i.created_at, i.id), reverse=True)

    async def delete(self, tenant: str, file_id: str) -> None:
        await self.info(tenant, file_id)
        await riding_out(lambda: self._store.delete(file_id), f"file {file_id}")


def _info(obj) -> FileInfo | None:  # noqa: ANN001  (nats' ObjectInfo)
    headers = (obj.headers or {}) if obj is not None else {}
    if obj is None or PURPOSE not in headers:
        return None
    return FileInfo(
        id=obj.name,
        tenant=headers.get(TENANT, ""),
        purpose=headers[PURPOSE],
        filename=headers.get(FILENAME, ""),
        bytes=obj.size or 0,
        created_at=int(headers.get(CREATED, "0")),
    )
