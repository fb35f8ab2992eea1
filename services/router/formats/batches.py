"""OpenAI's Batch API body: creating a batch (its input file, its endpoint, a completion window
and metadata), checked; a 400 names the field."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from services.router.errors import ApiError
from services.router.formats.endpoints import ENDPOINTS

WINDOW = re.compile(r"^([0-9]{1,9})(s|m|h)$")
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


# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA),
]
Endpoint = Literal[tuple(ENDPOINTS)]


class BatchCreate(BaseModel):
    """POST /v1/batches (OpenAI's fields)."""

    input_file_id: str = Field(description="an uploaded file of purpose batch")
    endpoint: Endpoint
    completion_window: str = Field(
        default="24h",
        pattern=WINDOW.pattern,
        description='"24h", or shorter ("30m", "90s": a kvmesh extension)',
    )
    metadata: Metadata | None = None

    def checked(self) -> tuple[int, dict[str, str] | None]:
        """The window in seconds and the metadata; 400 naming the field otherwise."""
        return window_s(self.completion_window), self.metadata
