"""What a worker asks of its engine: each op runs where the engine is, on its thread
(``shared/hosting/runner.py``) or in its own process (``shared/hosting/process.py``), between two
decode steps, and takes the engine first. A process runs only the ops named here (``OPS``),
by name: nothing else crosses to it.

Some ops are several engine calls that belong together (a prefill timed, blocks exported
then the sequence freed), so that they take one turn of the engine's loop, not several.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from shared import faults
from shared.engine.interface import Engine, ImageEmbeds, PrefillRequest, Prefix, StepOutput
from shared.messages.sampling import SamplingParams
from shared.model.lora import AdapterSpec


def step(engine: Engine) -> list[StepOutput]:
    """One decode step. A sequence's last token carries its speculation totals (the worker
    reads them once the sequence is freed)."""
    _fault("engine_step")
    if faults.ACTIVE:
        _poison(*(engine.sequence(seq_id).prompt_ids for seq_id in engine.running))
    outputs = engine.step()
    for i, out in enumerate(outputs):
        if out.finish_reason and engine.holds(out.seq_id):
            seq = engine.sequence(out.seq_id)
            outputs[i] = dataclasses.replace(out, drafted=seq.drafted, accepted=seq.accepted)
    return outputs


def _fault(name: str) -> None:
    """The engine call raises when a test switched ``name`` on (``shared/faults.py``)."""
    if faults.on(name):
        raise RuntimeError(f"fault hook {name}: the engine raised")


def _poison(*prompts: list[int]) -> None:
    """The engine call raises on a prompt a test poisoned (``shared/faults.py``)."""
    if faults.poisoned(prompts):
        raise RuntimeError("fault hook poison_token: the engine raised on this prompt")


def abort(engine: Engine, seq_id: str) -> None:
    engine.abort(seq_id)


def free(engine: Engine, seq_id: str) -> None:
    engine.free(seq_id)


def release(engine: Engine, prefix: Prefix) -> None:
    engine.release(prefix)


def import_blocks(engine: Engine, blobs: list[bytes], trusted: int = 0) -> Prefix:
    return engine.import_blocks(blobs, trusted)


def share_prefix(engine: Engine, seq_id: str, n_blocks: int) -> Prefix | None:
    return engine.share_prefix(seq_id, n_blocks)


def reserve(engine: Engine, seq_id: str, token_ids: list[int], params: SamplingParams) -> None:
    engine.reserve(seq_id, token_ids, params)


def join(engine: Engine, seq_id: str, first_token: int) -> int:
    """The sequence joined to the batch; when it joined (ns since the epoch: its first step
    may be answered before the caller hears back)."""
    engine.join(seq_id, first_token)
    return time.time_ns()


def write_kv(engine: Engine, seq_id: str, data: bytes) -> None:
    """A handed-off prompt's KV into its reserved blocks (they are its alone: this may run
    beside the steps)."""
    engine.write_kv(seq_id, data)


def write_and_join(engine: Engine, seq_id: str, data: bytes, first_token: int) -> int:
    """A handed-off prompt's KV written, and the sequence joined to the batch (as ``join``)."""
    engine.write_kv(seq_id, data)
    return join(engine, seq_id, first_token)


def timed_prefill(
    engine: Engine,
    seq_id: str,
    token_ids: list[int],
    params: SamplingParams,
    prefix: Prefix | None,
    images: tuple[ImageEmbeds, ...] = (),
) -> tuple[StepOutput, float]:
    """A prompt computed (it joins the batch); its first token, and the compute time."""
    _fault("engine_prefill")
    _poison(token_ids)
    started = time.perf_counter()
    out = engine.prefill(seq_id, token_ids, params, prefix=prefix, images=images)
    return out, time.perf_counter() - started


def prefill(engine: Engine, seq_id: str, token_ids: list[int], params: SamplingParams, **kw):  # noqa: ANN003, ANN201
    """A prompt computed for a handoff, with its cancel and pause checks (in-process only:
    they are callables)."""
    _fault("engine_prefill")
    _poison(token_ids)
    return engine.prefill(seq_id, token_ids, params, **kw)


def prefill_batch(engine: Engine, requests: list[PrefillRequest]) -> list[StepOutput | Exception]:
    _fault("engine_prefill")
    _poison(*(r.token_ids for r in requests))
    return engine.prefill_batch(requests)


def export_kv(engine: Engine, seq_id: str, partial: bool = False) -> bytes:
    return engine.export_kv(seq_id, partial=partial)


def export_blocks(
    engine: Engine, seq_id: str, first: int, n_full: int, dtype: str | None
) -> list[bytes]:
    return engine.export_blocks(seq_id, first, n_full, dtype)


def export_upto(
    engine: Engine, seq_id: str, first: int, n_full: int | None, dtype: str | None, free: bool
) -> tuple[list[bytes], list[int]]:
    """Blocks ``first`` .. ``n_full`` of the sequence (None: all its full blocks) and its
    tokens up to there; then the sequence freed when ``free`` (nothing when it is gone)."""
    if not engine.holds(seq_id):
        return [], []
    seq = engine.sequence(seq_id)
    bs = engine.block_size
    n_full = seq.n_cached // bs if n_full is None else n_full
    blobs = engine.export_blocks(seq_id, first, n_full, dtype)
    tokens = seq.tokens[: n_full * bs]
    if free:
        engine.free(seq_id)
    return blobs, tokens


def export_new(
    engine: Engine, seq_id: str, first: int, dtype: str | None, keep: bool
) -> list[bytes]:
    """A prefilled prompt's new full blocks (from block ``first``) for the tiers when they
    ``keep`` them; then the sequence freed (nothing when it is gone already)."""
    if not keep:
        engine.free(seq_id)
        return []
    return export_upto(engine, seq_id, first, None, dtype, True)[0]


def register_adapter(engine: Engine, spec: AdapterSpec) -> None:
    engine.register_adapter(spec)


def unregister_adapter(engine: Engine, name: str) -> None:
    engine.unregister_adapter(name)


OPS: dict[str, Callable] = {
    f.__name__: f
    for f in (
        abort,
        free,
        release,
        import_blocks,
        share_prefix,
        reserve,
        join,
        write_kv,
        write_and_join,
        timed_prefill,
        export_blocks,
        export_upto,
        register_adapter,
        unregister_adapter,
    )
}
