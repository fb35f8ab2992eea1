"""LoRA adapters on an SGLang worker (shared/engine/sglang/lora.py), short of a GPU: the
arguments that turn SGLang's multi-LoRA on parse with its own command line; against a scripted
``sglang.Engine`` keeping its adapters in SGLang's own registry (each load a random id, as
SGLang gives them), an adapter is loaded at its first request, named in each request, its KV
salted with its digest, the least recently used idle one unloaded; SGLang's own event recorder
and page hash show the bridge and the storage tier name an adapter's blocks as the router does,
whatever id SGLang gave the load, so an adapter's turn stored by one worker is read by
another."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared.engine.interface import EngineOptions
from shared.engine.sglang.engine import SglangEngine
from shared.kvstore.hashing import pack_tokens, packed_sglang_hashes, sglang_cache_salt
from shared.messages.sampling import SamplingParams
from shared.model.config import TINY_CONFIGS
from shared.model.lora import AdapterSpec, LoraError, kv_fingerprint
from tests.engine.lora_adapters import peft_adapter, tiny_shaped_base
from tests.procs import until, wait_until
from tests.sglang_release import HostPoolStandIn, load, storage_config

CONFIG = TINY_CONFIGS["tiny"]
OPTIONS = EngineOptions(
    block_size=4, kv_cache_tokens=4096, enable_lora=True, max_loras=1, max_lora_rank=8
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterSpec]:
    """Six adapters of the tiny model (and one of rank 16, over the workers' most, 8)."""
    root, base = tmp_path_factory.mktemp("sglang-adapters"), tiny_shaped_base()
    specs = {}
    for i, name in enumerate(["a", "b", "c", "d", "e", "wide"]):
        peft_adapter(base, root / name, seed=i, r=16 if name == "wide" else 4)
        specs[name] = AdapterSpec(name, "tiny", str(root / name))
    return specs


class LoraSglang:
    """A scripted ``sglang.Engine`` with SGLang's own LoRA registry: a load registers a new
    ``LoRARef`` (a random id), an unload forgets it; a request names a loaded adapter."""

    def __init__(self) -> None:
        load()
        from sglang.srt.lora.lora_registry import LoRARegistry

        self.registry = LoRARegistry()
        self.tokenizer_manager = SimpleNamespace(lora_registry=self.registry)
        self.calls: list[tuple] = []
        self.asked: list[dict] = []

    async def async_load_lora_adapter(self, name: str, path: str) -> SimpleNamespace:
        from sglang.srt.lora.lora_registry import LoRARef

        self.calls.append(("load", name, path))
        await self.registry.register(LoRARef(lora_name=name, lora_path=path))
        return SimpleNamespace(success=True, error_message="")

    async def async_unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        await self.registry.unregister(name)

    async def async_generate(self, **kwargs) -> AsyncIterator[dict]:  # noqa: ANN003
        if kwargs.get("lora_path"):
            assert kwargs["lora_path"] in self.registry.get_all_adapters(), "not loaded"
        self.asked.append(kwargs)
        return self._answer()

    async def _answer(self) -> AsyncIterator[dict]:
        yield {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}

    def shutdown(self) -> None:
        return


def engine_with(tmp_path: Path, options: EngineOptions = OPTIONS) -> SglangEngine:
    engine = SglangEngine(CONFIG, tmp_path / "hf", options, tmp_path)
    engine._engine = engine.adapters.engine = LoraSglang()
    return engine


async def ask(engine: SglangEngine, model: str, prompt: list[int], salt: str = "t") -> list:
    params = SamplingParams(max_tokens=1, adapter=model)
    return [p async for p in engine.generate(f"r-{time.monotonic_ns()}", prompt, params, salt)]


def test_sglangs_lora_arguments_parse_with_its_own_command_line(tmp_path: Path) -> None:
    load()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = SglangEngine(CONFIG, tmp_path, replace(OPTIONS, max_loras=3), tmp_path).server_args()
    lora = {k: v for k, v in args.items() if "lora" in k}
    assert lora == {
        "enable_lora": True,
        "max_loras_per_batch": 3,
        "max_lora_rank": 8,
        "lora_target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ],
    }  # fmt: skip
    argv = ["--model-path", "m", "--enable-lora", "--max-loras-per-batch", "3"]
    argv += ["--max-lora-rank", "8"]
    parsed = vars(parser.parse_args([*argv, "--lora-target-modules", *lora["lora_target_modules"]]))
    assert {k: parsed[k] for k in lora} == lora
    plain = SglangEngine(CONFIG, tmp_path, EngineOptions(), tmp_path).server_args()
    assert not any("lora" in k for k in plain)  # (off unless asked: it costs every step)


def test_an_adapter_is_loaded_at_its_first_request_and_its_kv_salted_with_its_digest(
    tmp_path: Path, adapters: dict[str, AdapterSpec]
) -> None:
    engine = engine_with(tmp_path)
    sglang = engine._engine
    engine.register_adapter(adapters["a"])
    prompt = list(range(100, 112))

    async def run() -> None:
        for model in ("a", "a", ""):
            assert (await ask(engine, model, prompt))[-1].token_ids == [7]

    asyncio.run(run())
    assert sglang.calls == [("load", "a", adapters["a"].path)]  # once
    first, second, base = sglang.asked
    assert first["lora_path"] == second["lora_path"] == "a" and "lora_path" not in base
    digest = engine.adapters.specs["a"].digest
    assert first["cache_salt"] == sglang_cache_salt(
        kv_fingerprint(CONFIG.fingerprint, digest), 4, "t"
    )
    assert base["cache_salt"] == sglang_cache_salt(CONFIG.fingerprint, 4, "t")
    stats = engine.stats()
    assert stats.adapters == ("a",) and stats.adapter_loads == 1 and stats.adapter_load_s > 0

    with pytest.raises(ValueError, match="'zz': no such adapter"):
        asyncio.run(ask(engine, "zz", prompt))
    with pytest.raises(LoraError, match="rank 16"):
        engine.register_adapter(adapters["wide"])  # (over KVMESH_<ROLE>_MAX_LORA_RANK=8)


def test_adapters_need_lora_on_and_the_least_recently_used_idle_one_is_unloaded(
    tmp_path: Path, adapters: dict[str, AdapterSpec]
) -> None:
    with pytest.raises(ValueError, match="ENABLE_LORA=true"):
        engine_with(tmp_path, replace(OPTIONS, enable_lora=False)).register_adapter(adapters["a"])
    engine = engine_with(tmp_path)  # (max_loras 1: four loaded in SGLang at most)
    sglang = engine._engine
    for name in "abcde":
        engine.register_adapter(adapters[name])

    async def run() -> None:
        for model in ["a", "b", "c", "d", "a", "e"]:
            await ask(engine, model, [1, 2, 3, 4, 5])
        engine.unregister_adapter("c")
        await until(lambda: ("unload", "c") in sglang.calls, 5, "the unregistered adapter unloaded")
        await engine.adapters.stop()

    asyncio.run(run())
    assert [c[:2] for c in sglang.calls] == [
        ("load", "a"), ("load", "b"), ("load", "c"), ("load", "d"),
        ("unload", "b"),  # the least recently used ("a" was asked again)
        ("load", "e"),
        ("unload", "c"),  # unregistered
    ]  # fmt: skip
    assert engine.stats().adapters == ("d", "a", "e")
    assert set(sglang.registry.get_all_adapters()) == {"a", "d", "e"}


@pytest.fixture(scope="module")
def release():  # noqa: ANN201
    load()
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache import events, utils
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return SimpleNamespace(
        kv_events=kv_events, events=events, utils=utils, factory=StorageBackendFactory
    )


class Key:
    """What SGLang's RadixKey holds of a LoRA request: its tokens, its salt and its extra
    key (SGLang puts the adapter load's id there)."""

    def __init__(self, token_ids: list[int], cache_salt: str, extra_key: str | None) -> None:
        self.token_ids, self.cache_salt, self.extra_key = token_ids, cache_salt, extra_key
        self.is_bigram = False

    def __len__(self) -> int:
        return len(self.token_ids)


def test_sglangs_events_of_an_adapter_are_named_as_the_router_names_them(release) -> None:
    from shared.engine.sglang.events import SglangEventBridge

    fp = kv_fingerprint(CONFIG.fingerprint, "d1" * 16)
    tokens = list(range(40, 52))  # three pages of 4
    named = []
    for lora_id in ("0" * 32, "f" * 32):  # two workers' loads of the adapter, two ids
        bridge = SglangEventBridge(4, None)  # type: ignore[arg-type] (nothing published here)
        recorder = release.events.KVCacheEventRecorder(enabled=True, page_size=4)
        root = SimpleNamespace(
            parent=None, key=Key([], "", None), hash_value=[], event_hash_value=None
        )
        node = SimpleNamespace(
            parent=root,
            key=Key(tokens, sglang_cache_salt(fp, 4, "t"), lora_id),
            hash_value=None,
            event_hash_value=None,
        )
        recorder.record_store(node, release.kv_events.StorageMedium.GPU)
        (event,) = recorder.take()
        named.append(bridge.stored(event, "GPU"))
    ours = packed_sglang_hashes(pack_tokens(tokens), 4, fp, "t")
    assert named == [ours, ours]  # the router's, whichever load
    assert ours != packed_sglang_hashes(pack_tokens(tokens), 4, CONFIG.fingerprint, "t")


def test_an_adapters_pages_stored_by_one_worker_are_read_by_another(
    release, tmp_path: Path, adapters: dict[str, AdapterSpec]
) -> None:
    """Two workers, each with its own load of the adapter (its own id): SGLang's page hashes
    differ, the tier's names do not."""
    from shared.engine.sglang.storage import storage_args

    prompt = list(range(200, 214))  # three full pages and two tokens
    pool = HostPoolStandIn.build()("page_first", 2, 2, 8, 4, 8, torch.float32)
    pool.kv_buffer.normal_()
    tier = tmp_path / "tier"
    workers = []
    for _ in range(2):
        engine = engine_with(tmp_path, replace(OPTIONS, kv_store_dir=str(tier)))
        engine.register_adapter(adapters["a"])
        from shared.engine.sglang.lora import StorageNames

        engine._names = StorageNames()
        extra = storage_args(str(tier), CONFIG.fingerprint, "", "", engine._names.endpoint)
        assert extra.pop("hicache_storage_pass_prefix_keys") is True  # (SGLang's to read)
        made = release.factory.create_backend("dynamic", storage_config(extra), pool)
        made.register_mem_pool_host(pool)
        workers.append((engine, made))

    def their_keys(engine: SglangEngine, model: str) -> list[str]:
        """SGLang's own page hashes for the prompt: seeded by the salt and the load's id."""
        fp = engine.adapters.fingerprint(model)
        key = Key(prompt[:12], sglang_cache_salt(fp, 4, "t"), engine.adapters.lora_id(model))
        return release.utils.get_storage_hash_str(key, None, page_size=4)

    async def told(engine: SglangEngine, backend, model: str) -> list[str]:  # noqa: ANN001
        done = await ask(engine, model, prompt)
        await until(  # (the backend's thread takes what it was told)
            lambda: set(their_keys(engine, model)) <= backend.told.names.keys(),
            5,
            "the backend told the prompt's names",
        )
        return done[-1].stored

    (one, backend_one), (two, backend_two) = workers
    names = asyncio.run(told(one, backend_one, "a"))
    assert names == packed_sglang_hashes(pack_tokens(prompt), 4, one.adapters.fingerprint("a"), "t")
    keys = their_keys(one, "a")
    assert keys != names
    slots = torch.arange(0, 16)  # (three pages and an answer's page)
    answer_key = "ab" * 32  # the next page of the chain, which no router could name
    assert backend_one.batch_set_v1([*keys, answer_key], slots) == [True] * 4
    assert sorted(p.stem for p in tier.rglob("*") if p.is_file()) == sorted(names)

    asyncio.run(told(two, backend_two, "a"))
    theirs = their_keys(two, "a")
    assert theirs != keys  # another load, another id: SGLang's hashes differ
    assert backend_two.batch_exists(theirs) == 3
    assert backend_two.batch_get_v1(theirs, torch.arange(16, 28)) == [True] * 3
    assert torch.equal(pool.kv_buffer[:, 16:28], pool.kv_buffer[:, 0:12])
    assert backend_two.exists(theirs[1])
    assert backend_two.batch_exists(["cd" * 32]) == 0  # a chain never told: a miss
    assert backend_two.batch_set_v1(["cd" * 32], torch.arange(0, 4)) == [True]  # not written
    assert len([p for p in tier.rglob("*") if p.is_file()]) == 3

    # A base model's chain (its first page told): its pages, the answer's too, as SGLang names them.
    base = asyncio.run(ask(one, "", prompt))[-1].stored
    wait_until(lambda: base[0] in backend_one.told.base_heads, 5, what="the base chain told")
    after = SimpleNamespace(prefix_keys=base)  # (SGLang's HiCacheStorageExtraInfo)
    assert backend_one.batch_set_v1(base, slots[:12]) == [True] * 3
    assert backend_one.batch_set_v1(["ef" * 32], slots[:4], after) == [True]
    assert {"ef" * 32, *base} <= {p.stem for p in tier.rglob("*") if p.is_file()}
    for engine, _ in workers:
        engine._names.close()
