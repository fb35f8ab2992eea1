"""The SGLang worker engine (shared/engine/sglang/engine.py) short of a GPU: the arguments it
starts SGLang with are fields of the pinned release's ``ServerArgs`` and parse with SGLang's own
command line (its choices included); and against ``ScriptedSglang``, a scripted stand-in for
``sglang.Engine`` (named as such: SGLang needs CUDA), what the adapter asks and makes of the
answers: sampling parameters, the tenant's ``cache_salt``, stop strings matched in the worker
and the request aborted there, abort, log-probabilities, cached tokens by tier, SGLang's load,
and the storage backend's reports published with each request's retention class."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.engine.interface import EngineOptions
from shared.engine.sglang.engine import SglangEngine, sglang_params
from shared.engine.sglang.params import logprob_fields, prompt_logprobs_of
from shared.kvstore.hashing import pack_tokens, packed_sglang_hashes, sglang_cache_salt
from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.config import ModelConfig
from shared.model.grammar import lark_of
from shared.model.text import TextModel
from tests.sglang_release import load

OPTIONS = EngineOptions(
    block_size=16,
    kv_cache_tokens=8192,
    max_running=12,
    prefill_chunk=256,
    kv_store_dir="/srv/kv",
    memory_tier_bytes=3 << 30,
)


@pytest.fixture
def engine(real_text: TextModel, tmp_path: Path) -> SglangEngine:
    config: ModelConfig = real_text.config
    return SglangEngine(config, tmp_path / "hf", OPTIONS, tmp_path, real_text.tokenizer)


class ScriptedSglang:
    """A scripted stand-in for ``sglang.Engine``: each request streams the outputs scripted for
    it (what SGLang's tokenizer manager yields with ``incremental_streaming_output``); the
    calls made of it are kept."""

    def __init__(self, outputs: list[dict]) -> None:
        self.outputs = outputs
        self.asked: list[dict] = []
        self.aborted: list[str] = []
        self.closed = False
        self.tokenizer_manager = SimpleNamespace(
            abort_request=lambda rid: self.aborted.append(rid), get_loads=self.get_loads
        )

    async def async_generate(self, **kwargs) -> AsyncIterator[dict]:  # noqa: ANN003
        self.asked.append(kwargs)
        return self._stream()

    async def _stream(self) -> AsyncIterator[dict]:
        try:
            for out in self.outputs:
                yield out
        finally:
            self.closed = True

    def shutdown(self) -> None:
        self.closed = True

    async def get_loads(self) -> list:
        load = SimpleNamespace(
            num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=1600, max_total_num_tokens=8192
        )
        return [load]


def out(ids: list[int], finish: str | None = None, **meta) -> dict:  # noqa: ANN003
    reason = None if finish is None else {"type": finish}
    return {"output_ids": ids, "meta_info": {"finish_reason": reason, **meta}}


def test_every_server_arg_is_sglangs_and_parses_with_its_own_command_line(
    engine: SglangEngine,
) -> None:
    load()
    import msgspec
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for args in (
        engine.server_args("tcp://127.0.0.1:5557", "ipc:///run/replay", "tcp://127.0.0.1:5558"),
        SglangEngine(
            engine.config, engine.directory, EngineOptions(), engine.state_dir
        ).server_args(),
    ):
        assert set(args) <= fields, set(args) - fields
        argv = []
        for name, value in args.items():
            flag = f"--{name.replace('_', '-')}"
            argv += [flag] if value is True else [flag, str(value)]
        parsed = vars(parser.parse_args(argv))
        assert {name: parsed[name] for name in args} == args
    args = engine.server_args("tcp://127.0.0.1:5557", "ipc:///run/replay", "tcp://127.0.0.1:5558")
    assert (args["page_size"], args["max_total_tokens"], args["hicache_size"]) == (16, 8192, 3)
    extra = json.loads(args["hicache_storage_backend_extra_config"])
    assert extra["module_path"] == "shared.engine.sglang.storage" and extra["interface_v1"] == 1
    assert extra["fingerprint"] == engine.config.fingerprint and extra["store_dir"] == "/srv/kv"
    events = json.loads(args["kv_events_config"])
    assert events["endpoint"] == "tcp://127.0.0.1:5557"
    assert events["replay_endpoint"] == "ipc:///run/replay"


def test_sampling_parameters_are_sglangs() -> None:
    grammar = json.dumps({"grammars": [{"json_schema": {"type": "integer"}}]})
    p = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        seed=5,
        stop=["\n\n"],
        stop_token_ids=(7,),
        logit_bias=((42, -3.0),),
        grammar=grammar,
        min_tokens=2,
        min_p=0.05,
        repetition_penalty=1.1,
    )
    asked = sglang_params(p)
    assert asked == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # SGLang's "the whole vocabulary"
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "min_new_tokens": 2,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "no_stop_trim": True,
        "stop_token_ids": [7],
        "sampling_seed": 5,
        "logit_bias": {"42": -3.0},
        "ebnf": lark_of(grammar),
    }
    assert "stop" not in asked  # (SGLang without its tokenizer applies none: the worker does)
    load()
    from sglang.srt.sampling.sampling_params import SamplingParams as Theirs

    Theirs(**asked)  # every key one of SGLang's


def test_the_prompts_scores_are_read_from_sglangs_input_logprobs() -> None:
    asked = logprob_fields(SamplingParams(prompt_logprobs=2))
    assert asked == {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    assert "logprob_start_len" not in logprob_fields(SamplingParams(logprobs=1))
    meta = {
        "input_token_logprobs": [(None, 5, None), (-1.5, 6, None), (-0.25, 7, None)],
        "input_top_logprobs": [None, [(-1.0, 9, None), (-1.5, 6, None)], [(-0.25, 7, None)]],
    }
    got = prompt_logprobs_of(meta, 2)
    assert got == [TokenLogprobs(-1.5, ((9, -1.0), (6, -1.5))), TokenLogprobs(-0.25, ((7, -0.25),))]
    assert prompt_logprobs_of(meta, None) is None  # (the fields' names: test_protocols.py)


async def _answer(engine: SglangEngine, params: SamplingParams, salt: str = "") -> list:
    return [p async for p in engine.generate("r-1", list(range(100, 140)), params, salt)]


def test_a_stop_string_ends_the_answer_in_the_worker_and_aborts_it_in_sglang(
    engine: SglangEngine, real_text: TextModel
) -> None:
    tokens = real_text.tokenizer.encode("The capital is Paris, of course.").ids
    scripted = ScriptedSglang(
        [out(tokens[:2], cached_tokens=32), out(tokens[2:]), out([], "length")]
    )
    engine._engine = scripted
    params = SamplingParams(max_tokens=20, stop=["Paris"])
    pieces = asyncio.run(_answer(engine, params, salt="harbour"))
    text = real_text.tokenizer.decode([t for p in pieces for t in p.token_ids])
    assert text.endswith("Paris") and "course" not in text
    assert (pieces[-1].finish_reason, pieces[-1].stop_string) == ("stop", "Paris")
    assert scripted.aborted == ["r-1"] and scripted.closed
    (asked,) = scripted.asked
    assert asked["rid"] == "r-1" and asked["input_ids"] == list(range(100, 140))
    assert asked["cache_salt"] == sglang_cache_salt(engine.config.fingerprint, 16, "harbour")
    assert pieces[0].cached_tokens == 32 and pieces[1].cached_tokens == 0


def test_cached_tokens_by_tier_logprobs_and_abort(engine: SglangEngine) -> None:
    details = {"device": 16, "host": 32, "storage": 64, "storage_backend": "KvmeshHiCacheStorage"}
    scripted = ScriptedSglang(
        [
            out([], cached_tokens=112),  # (a chunk before any token: not a piece)
            out([5], cached_tokens=112, output_token_logprobs=[(-0.5, 5, None)],
                output_top_logprobs=[[(-0.5, 5, None), (-1.5, 6, None)]]),
            out([6, 7], "stop", cached_tokens=112, cached_tokens_details=details,
                output_token_logprobs=[(-0.5, 5, None), (-0.1, 6, None), (-0.2, 7, None)],
                output_top_logprobs=[[], [(-0.1, 6, None)], [(-0.2, 7, None)]]),
        ]
    )  # fmt: skip
    engine._engine = scripted
    pieces = asyncio.run(_answer(engine, SamplingParams(max_tokens=4, logprobs=1)))
    assert [p.token_ids for p in pieces] == [[5], [6, 7]]
    assert pieces[0].cached_tokens == 112 and pieces[-1].finish_reason == "stop"
    assert pieces[-1].cached_by_tier == {"memory": 48, "storage": 64}
    assert [lp.logprob for p in pieces for lp in p.logprobs] == [-0.5, -0.1, -0.2]
    assert pieces[0].logprobs[0].top == ((5, -0.5),) and pieces[1].logprobs[1].top == ((7, -0.2),)
    asyncio.run(engine.abort("r-9"))
    assert scripted.aborted == ["r-9"]  # SGLang's tokenizer manager's abort (no public one)


def test_sglangs_load_fills_the_heartbeat_figures(engine: SglangEngine) -> None:
    assert engine.stats().kv_blocks_total == 8192 // 16  # (not read yet: the pool as set)
    engine._engine = ScriptedSglang([])

    async def one_read() -> None:
        task = asyncio.create_task(engine._read_load())
        for _ in range(500):  # (until the first read, 5 s at most)
            if engine._load is not None:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(one_read())
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.kv_blocks_total, stats.sequences, stats.running) == (
        100,
        512,
        5,
        3,
    )


def test_the_storage_backends_reports_are_published_with_each_requests_retention(
    engine: SglangEngine,
) -> None:
    import zmq

    said: list[tuple] = []

    async def on_blocks(kind: str, hashes: list[str], tier: str, retention: str, size: int):
        said.append((kind, hashes, tier, retention, size))

    prompt = list(range(300, 348))  # three pages of 16
    pages = packed_sglang_hashes(pack_tokens(prompt), 16, engine.config.fingerprint, "t")

    async def run() -> None:
        engine._engine = ScriptedSglang([out([1], "length")])
        params = SamplingParams(max_tokens=1)
        done = [p async for p in engine.generate("r-2", prompt, params, "t", retention="agent")]
        assert done[-1].stored == pages  # (what a P/D prefill worker waits for in the tier)
        endpoint = engine._bind_reports(on_blocks)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(endpoint)
        push.send(
            json.dumps({"stored": [[pages[0], 900], ["ab" * 32, 900]], "damaged": []}).encode()
        )
        push.send(json.dumps({"stored": [], "damaged": [pages[1]]}).encode())
        for _ in range(200):
            if len(said) == 3:
                break
            await asyncio.sleep(0.01)
        push.close(linger=0)
        await engine.stop()

    asyncio.run(run())
    assert said == [
        ("stored", [pages[0]], "storage", "agent", 900),
        ("stored", ["ab" * 32], "storage", "chat", 900),  # a page of no request seen here
        ("removed", [pages[1]], "storage", "chat", 0),
    ]


def test_options_without_tiers_start_sglang_without_hicache(engine: SglangEngine) -> None:
    bare = replace(OPTIONS, kv_store_dir="", memory_tier_bytes=0)
    args = SglangEngine(engine.config, engine.directory, bare, engine.state_dir).server_args()
    assert "enable_hierarchical_cache" not in args and "hicache_storage_backend" not in args


def test_an_engines_own_pd_is_sglangs_and_its_transfer_one_of_sglangs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from services.decode.settings import DecodeSettings
    from services.decode.whole import WholeRequests
    from shared.settings import CommonSettings, SettingsError, load_settings

    monkeypatch.setenv("KVMESH_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("KVMESH_DECODE_PD_TRANSFER", "rdma")
    with pytest.raises(SettingsError, match="KVMESH_DECODE_PD_TRANSFER.*one of mooncake, nixl"):
        load_settings(DecodeSettings)
    monkeypatch.setenv("KVMESH_DECODE_PD_TRANSFER", "nixl")
    monkeypatch.setenv("KVMESH_DECODE_ENGINE", "vllm")
    settings = load_settings(DecodeSettings)
    with pytest.raises(SettingsError) as err:
        WholeRequests.check(load_settings(CommonSettings), settings)
    said = str(err.value)
    assert "KVMESH_DECODE_PD_TRANSFER=nixl with KVMESH_DECODE_ENGINE=vllm" in said
    assert "through the storage tier" in said
