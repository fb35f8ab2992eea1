"""OpenAI's Batch API body: creating a batch (its input file, its endpoint, a completion window
and metadata), checked; a 400 names the field."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from services.router.errors import ApiError
from services.router.formats.endpoints import ENDPOINTS

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

    def checked(self) -> tuple[int, dict[str, str] | None]:
        """The window in seconds and the metadata; 400 naming the field otherwise."""
        if self.endpoint not in ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint: one of {', '.join(ENDPOINTS)} (got {self.endpoint!r})",
                param="endpoint",
            )
        return window_s(self.completion_window), check_metadata(self.metadata)
