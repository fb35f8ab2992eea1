"""Prefill on one engine, decode on another: the handoff the mesh does between workers."""

from __future__ import annotations

import threading

import pytest

from shared.engine.interface import Cancelled, KVFormatError
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine
from tests.engine.test_batching import run_alone
from tests.engine.test_prefix_reuse import prompt


def hand_off(prefill_model, decode_model, ids: list[int], params: SamplingParams) -> list[int]:
    """Prefill on engine A, ship the prompt's KV (a partial last block too) to engine B."""
    a, b = make_engine(prefill_model), make_engine(decode_model)
    first = a.prefill("r", ids, params, handoff=True)
    assert "r" not in a.running, "a handed-off sequence never decodes where it was prefilled"
    blob = a.export_kv("r", partial=True)
    a.free("r")
    assert a.pool.used_blocks == 0
    b.reserve("r", ids, params)
    reserved = b.pool.used_blocks
    assert reserved == b.pool.blocks_for(len(ids) + params.max_tokens)
    b.receive("r", blob, first.token_id)
    out = [first.token_id]
    while b.running:
        out += [o.token_id for o in b.step()]
    b.free("r")
    assert b.pool.used_blocks == 0
    b.check_integrity()
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
def test_handed_off_greedy_answer_equals_one_engine(tiny_models, name: str) -> None:
    model = tiny_models[name]
    ids = prompt(45)  # not a whole number of 8-token blocks: the last block travels partly full
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert hand_off(model, model, ids, params) == run_alone(model, ids, params)


def test_handed_off_seeded_sampling_continues_the_same_stream(tiny_models) -> None:
    model = tiny_models["tiny"]
    ids = prompt(30, seed=3)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    assert hand_off(model, model, ids, params) == run_alone(model, ids, params)


def test_kv_written_on_another_thread_while_the_batch_steps_changes_no_answer(
    tiny_models,
) -> None:
    """What decode does: a handed-off prompt's KV is written on a thread of its own while
    the engine's thread goes on stepping the batch; then it joins. Every answer, the one
    written and those stepping meanwhile, is token for token what it is alone."""
    model = tiny_models["tiny"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    a, b = make_engine(model), make_engine(model)
    ids = prompt(45)
    first = a.prefill("new", ids, params, handoff=True)
    blob = a.export_kv("new", partial=True)
    others = {f"s{i}": prompt(20 + i, seed=i) for i in range(3)}
    outs = {sid: [b.prefill(sid, p, params).token_id] for sid, p in others.items()}
    b.reserve("new", ids, params)
    writer = threading.Thread(target=b.write_kv, args=("new", blob))
    writer.start()
    while writer.is_alive():
        for o in b.step():
            outs[o.seq_id].append(o.token_id)
    writer.join()
    b.join("new", first.token_id)
    outs["new"] = [first.token_id]
    while b.running:
        for o in b.step():
            outs[o.seq_id].append(o.token_id)
    b.check_integrity()
    assert outs["new"] == run_alone(model, ids, params)
    for sid, p in others.items():
        assert outs[sid] == run_alone(model, p, params)


def test_kv_for_another_prompt_length_is_refused(tiny_models) -> None:
    model = tiny_models["tiny"]
    a, b = make_engine(model), make_engine(model)
    params = SamplingParams(max_tokens=4, temperature=0)
    first = a.prefill("r", prompt(20), params, handoff=True)
    blob = a.export_kv("r", partial=True)
    b.reserve("r", prompt(21), params)
    with pytest.raises(KVFormatError, match="20 tokens"):
        b.receive("r", blob, first.token_id)
    b.abort("r")
    assert b.pool.used_blocks == 0


def test_cancelled_prefill_stops_between_chunks_and_frees(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], prefill_chunk=16)
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 2  # cancelled after two chunks

    with pytest.raises(Cancelled, match="at token 32 of 100"):
        engine.prefill("r", prompt(100), SamplingParams(max_tokens=4), cancelled=cancelled)
    assert engine.pool.used_blocks == 0 and not engine.seqs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_answer_resumed_from_its_sent_tokens_goes_on_identically(
    tiny_models, temperature: float
) -> None:
    """A request resumed on another engine after a failure (its prompt plus the tokens already
    sent, ``answer_offset`` of them) continues the answer token for token, seeded too."""
    model = tiny_models["tiny"]
    ids = prompt(30, seed=5)
    params = SamplingParams(max_tokens=14, temperature=temperature, seed=11, ignore_eos=True)
    whole = run_alone(model, ids, params)
    for sent in (1, 6, 13):
        resumed = SamplingParams(
            max_tokens=params.max_tokens - sent,
            temperature=temperature,
            seed=11,
            ignore_eos=True,
            answer_offset=sent,
        )
        assert run_alone(model, ids + whole[:sent], resumed) == whole[sent:]
