"""Request traces for `kvmesh sim`: Mooncake's jsonl (with block hashes) and Azure's csv."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK = 512  # tokens per hash_id in Mooncake's traces


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # seconds after the trace's first request
    n_in: int
    n_out: int
    hashes: list[str]  # the prompt's blocks, in order (shared prefixes share hashes)
    retention: str = "chat"
    adapter: str = ""  # the LoRA adapter computing it (its blocks are that adapter's own)


class TraceError(ValueError):
    pass


def read_trace(path: Path) -> tuple[list[TraceRequest], int]:
    """The requests, sorted by time, and the block size their hashes cover."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"--trace: no such file: {path}")
    if path.suffix == ".csv":
        return _azure(path), MOONCAKE_BLOCK
    return _mooncake(path), MOONCAKE_BLOCK


def _mooncake(path: Path) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                # (a line's LoRA adapter, when it names one: its blocks are that adapter's)
                adapter = str(r.get("adapter") or "")
                hashes = [f"{adapter}/{h}" if adapter else str(h) for h in r["hash_ids"]]
                retention = r.get("class", "chat")
                if retention not in ("chat", "agent"):
                    raise ValueError(f"class must be chat or agent, not {retention!r}")
                out.append(
                    TraceRequest(
                        r["timestamp"] / 1000,
                        int(r["input_length"]),
                        int(r["output_length"]),
                        hashes,
                        retention,
                        adapter,
                    )
                )
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{path}:{n}: not a Mooncake trace line ({err})") from None
    out.sort(key=lambda r: r.t)
    t0 = out[0].t if out else 0.0
    return [replace(r, t=r.t - t0) for r in out]


def _azure(path: Path) -> list[TraceRequest]:
    """No hashes in these traces: every request's blocks are its own (nothing is shared)."""
    out = []
    with open(path, newline="") as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError) as err:
                raise TraceError(f"{path}:{n}: not an Azure trace row ({err})") from None
            blocks = -(-n_in // MOONCAKE_BLOCK)
            out.append(
                TraceRequest(stamp.timestamp(), n_in, n_out, [f"r{n}b{i}" for i in range(blocks)])
            )
    out.sort(key=lambda r: r.t)
    t0 = out[0].t if out else 0.0
    return [TraceRequest(r.t - t0, r.n_in, r.n_out, r.hashes) for r in out]
