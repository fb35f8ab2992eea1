"""Frames between a worker and its engine's process: a JSON header and binary parts (KV
blocks, image embeddings) after it. No pickle: what crosses is plain JSON values, bytes,
float tensors, and the dataclasses and errors named here, rebuilt field by field.

A frame is ``<u32 header length><u32 parts>`` then the header, then each part as
``<u64 length>`` and its bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO

from shared.engine.interface import (
    KV_DTYPES,
    BadBlock,
    Cancelled,
    EngineOptions,
    EngineStats,
    KVFormatError,
    Paused,
    PoolExhausted,
    Prefix,
    StepOutput,
)
from shared.eplb.balancer import BalancerStats
from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig, MoEConfig, RopeScaling
from shared.model.lora import AdapterSpec, LoraError

HEAD = struct.Struct("<II")
PART = struct.Struct("<Q")

TYPES: dict[str, type] = {
    c.__name__: c
    for c in (
        SamplingParams,
        TokenLogprobs,
        Prefix,
        StepOutput,
        EngineStats,
        BalancerStats,
        EngineOptions,
        ModelSource,
        ModelConfig,
        MoEConfig,
        RopeScaling,
        AdapterSpec,
    )
}
ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (
        PoolExhausted,
        Cancelled,
        KVFormatError,
        LoraError,
        ValueError,
        KeyError,
        AssertionError,
        RuntimeError,
        MemoryError,
    )
}


class WireError(ValueError):
    """A frame that is not one (a bug on one side, or a stray writer)."""


def encode(value: Any, parts: list) -> Any:
    """``value`` as JSON, its bytes and tensors appended to ``parts``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        parts.append(value)
        return {"$b": len(parts) - 1}
    torch = sys.modules.get("torch")  # (a process that never imported it holds no tensor)
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {"$t": len(parts) - 1, "shape": list(t.shape), "dtype": str(t.dtype)[6:]}
    if isinstance(value, list):
        return [encode(v, parts) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, parts) for v in value]}
    if isinstance(value, dict):
        return {"$dict": {str(k): encode(v, parts) for k, v in value.items()}}
    if isinstance(value, Path):
        return {"$path": str(value)}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and TYPES.get(name) is type(value):
        fields = {f.name: encode(getattr(value, f.name), parts) for f in dataclasses.fields(value)}
        return {"$d": name, "v": fields}
    raise TypeError(f"a {name} does not cross to the engine's process")


def decode(value: Any, parts: list[bytes]) -> Any:
    if isinstance(value, list):
        return [decode(v, parts) for v in value]
    if not isinstance(value, dict):
        return value
    if "$b" in value:
        return parts[value["$b"]]
    if "$t" in value:
        import torch  # (here: a worker whose engine has its own process is sent none)

        if value["dtype"] not in KV_DTYPES:
            raise WireError(f"not a float tensor: {value['dtype']!r}")
        dtype = getattr(torch, value["dtype"])
        data = bytearray(parts[value["$t"]])
        return (
            torch.frombuffer(data, dtype=dtype).view(value["shape"])
            if data
            else torch.empty(value["shape"], dtype=dtype)
        )
    if "$tuple" in value:
        return tuple(decode(v, parts) for v in value["$tuple"])
    if "$dict" in value:
        return {k: decode(v, parts) for k, v in value["$dict"].items()}
    if "$path" in value:
        return Path(value["$path"])
    if "$d" in value:
        cls = TYPES.get(value["$d"])
        if cls is None:
            raise WireError(f"unknown type {value['$d']!r}")
        return cls(**{k: decode(v, parts) for k, v in value["v"].items()})
    raise WireError(f"not a value: {sorted(value)}")


def encode_error(err: BaseException) -> dict:
    out = {"type": type(err).__name__, "message": str(err)}
    if isinstance(err, BadBlock):
        out["index"] = err.index
    if isinstance(err, Paused):
        out["n_cached"] = err.n_cached
    return out


def decode_error(e: dict) -> BaseException:
    kind, message = e.get("type", ""), e.get("message", "")
    if kind == "BadBlock":
        index = int(e.get("index", 0))
        return BadBlock(index, message.removeprefix(f"block {index}: "))
    cls = ERRORS.get(kind)
    if cls is None:
        return RuntimeError(f"{kind}: {message}")
    return cls(message)


# -- a step's outputs, compactly (they cross at every step) -------------------------------


def encode_outputs(outputs: list[StepOutput]) -> list:
    return [
        [
            o.seq_id,
            o.token_id,
            o.finish_reason,
            o.stop_string,
            None if o.logprobs is None else [o.logprobs.logprob, [list(t) for t in o.logprobs.top]],
            o.drafted,
            o.accepted,
        ]
        for o in outputs
    ]


def decode_outputs(rows: list) -> list[StepOutput]:
    return [
        StepOutput(
            seq_id,
            token_id,
            finish,
            stop,
            None if lp is None else TokenLogprobs(lp[0], tuple((i, p) for i, p in lp[1])),
            drafted,
            accepted,
        )
        for seq_id, token_id, finish, stop, lp, drafted, accepted in rows
    ]


# -- frames ---------------------------------------------------------------------------------


def frame(header: dict, parts: list) -> list[bytes | bytearray | memoryview]:
    """A frame's buffers, to be written in order."""
    head = json.dumps(header, separators=(",", ":")).encode()
    out: list = [HEAD.pack(len(head), len(parts)), head]
    for part in parts:
        out += [PART.pack(len(part)), part]
    return out


def _parse_header(data: bytes) -> dict:
    try:
        header = json.loads(data)
    except ValueError as err:
        raise WireError(f"a frame's header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise WireError("a frame's header is not an object")
    return header


def read_frame(source: BinaryIO) -> tuple[dict, list[bytes]] | None:
    """The next frame from a blocking stream; None at its end."""
    head = source.read(HEAD.size)
    if len(head) < HEAD.size:
        return None
    size, n = HEAD.unpack(head)
    header = _parse_header(_exactly(source, size))
    parts = [_exactly(source, PART.unpack(_exactly(source, PART.size))[0]) for _ in range(n)]
    return header, parts


def _exactly(source: BinaryIO, n: int) -> bytes:
    data = source.read(n)
    if len(data) < n:
        raise EOFError("the stream ended inside a frame")
    return data


async def read_frame_async(reader: asyncio.StreamReader) -> tuple[dict, list[bytes]] | None:
    try:
        size, n = HEAD.unpack(await reader.readexactly(HEAD.size))
    except asyncio.IncompleteReadError:
        return None
    header = _parse_header(await reader.readexactly(size))
    parts = []
    for _ in range(n):
        (length,) = PART.unpack(await reader.readexactly(PART.size))
        parts.append(await reader.readexactly(length))
    return header, parts
