"""ScriptedSglang: a stand-in for the ``sglang`` package in a worker process, for the tests of
the mesh around SGLang workers (tests/test_sglang_mesh.py), where SGLang itself cannot run (it
needs CUDA). It is not a model: its answer to a prompt is the prompt's own first tokens.

What it does as SGLang does, with the pinned release's own code where that runs here (its
package path goes on into the release fetched by ``make test``): ``Engine(**server_args)``
checks every argument against SGLang's ``ServerArgs``; pages of ``page_size`` tokens are
cached per ``cache_salt`` and reported as SGLang reports them, by SGLang's own event recorder
(its page hashes) and ZMQ publisher, to the ``kv_events_config`` endpoint; ``cached_tokens``
says the leading pages found; in P/D (``disaggregation_mode``), the prefill engine leaves the
prompt in a room of its bootstrap port (a file: the ``fake`` transfer) and the decode engine
answers only from what it finds there. LoRA adapters (``enable_lora``) are kept in SGLang's own
registry (``async_load_lora_adapter``: a random id per load, which namespaces the adapter's
pages as SGLang's extra key does); an adapter's answer is the prompt's last tokens, backwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

_RELEASE = Path(__file__).resolve().parents[3] / ".venv" / "sglang-0.5.23" / "sglang"
__path__ = [str(Path(__file__).parent), str(_RELEASE)]  # noqa: PLE0237 (the release's modules)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_RELEASE.parent / "torch-extensions"))

ROOMS = Path(tempfile.gettempdir()) / "scripted-sglang-rooms"


class _Key:
    def __init__(
        self, token_ids: list[int], cache_salt: str | None, extra_key: str | None = None
    ) -> None:
        self.token_ids, self.cache_salt, self.extra_key, self.is_bigram = (
            token_ids,
            cache_salt,
            extra_key,
            False,
        )

    def __len__(self) -> int:
        return len(self.token_ids)


class Engine:
    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        import msgspec

        from sglang.srt.disaggregation import kv_events
        from sglang.srt.mem_cache.events import KVCacheEventRecorder
        from sglang.srt.server_args import ServerArgs

        fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
        unknown = set(kwargs) - fields
        if unknown:
            raise TypeError(f"not SGLang's ServerArgs: {sorted(unknown)}")
        self.args = kwargs
        self.page = kwargs["page_size"]
        self.mode = kwargs.get("disaggregation_mode", "null")
        self.port = kwargs.get("disaggregation_bootstrap_port", 8998)
        self.cached: dict[tuple, SimpleNamespace] = {}  # (salt, tokens of pages) → radix node
        self.root = SimpleNamespace(
            parent=None, key=_Key([], None), hash_value=[], event_hash_value=None
        )
        self.aborted: set[str] = set()
        self.running = 0
        self._kv_events = kv_events
        self.publisher = None
        self.recorder = KVCacheEventRecorder(enabled=True, page_size=self.page)
        if kwargs.get("kv_events_config"):
            config = json.loads(kwargs["kv_events_config"])
            self.publisher = kv_events.ZmqEventPublisher(
                attn_dp_rank=0,
                endpoint=config["endpoint"],
                replay_endpoint=config.get("replay_endpoint"),
            )
        from sglang.srt.lora.lora_registry import LoRARegistry

        self.loras = LoRARegistry()
        self.tokenizer_manager = SimpleNamespace(
            abort_request=self._abort, get_loads=self._loads, lora_registry=self.loras
        )

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str) -> SimpleNamespace:
        from sglang.srt.lora.lora_registry import LoRARef

        if not self.args.get("enable_lora"):
            return SimpleNamespace(success=False, error_message="LoRA is not enabled")
        await self.loras.register(LoRARef(lora_name=lora_name, lora_path=lora_path))
        return SimpleNamespace(success=True, error_message="")

    async def async_unload_lora_adapter(self, lora_name: str) -> SimpleNamespace:
        await self.loras.unregister(lora_name)
        return SimpleNamespace(success=True, error_message="")

    def _abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.add(rid)

    async def _loads(self) -> list:
        used = len(self.cached) * self.page
        return [
            SimpleNamespace(
                num_running_reqs=self.running,
                num_waiting_reqs=0,
                num_used_tokens=used,
                max_total_num_tokens=self.args["max_total_tokens"],
            )
        ]

    def _cache(self, tokens: list[int], salt: str | None, lora_id: str | None = None) -> int:
        """The prompt's full pages into the cache; the tokens found there before."""
        parent, found, new = self.root, 0, []
        for end in range(self.page, len(tokens) + 1, self.page):
            key = (salt, lora_id, tuple(tokens[:end]))
            node = self.cached.get(key)
            if node is None:
                node = SimpleNamespace(
                    parent=parent,
                    key=_Key(tokens[end - self.page : end], salt, lora_id),
                    hash_value=None,
                    event_hash_value=None,
                )
                self.cached[key] = node
                new.append(node)
            elif not new:
                found = end
            parent = node
        for node in new:
            self.recorder.record_store(node, self._kv_events.StorageMedium.GPU)
        if new and self.publisher is not None:
            batch = self._kv_events.KVEventBatch(ts=time.time(), events=self.recorder.take())
            self.publisher.publish(batch)
        return found

    async def async_generate(
        self,
        input_ids=None,
        sampling_params=None,
        stream=False,
        rid=None,  # noqa: ANN001
        cache_salt=None,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        lora_path=None,
        **_,
    ):  # noqa: ANN003, ANN201
        if (self.mode != "null") != (bootstrap_room is not None):
            raise ValueError(f"{self.mode} mode and bootstrap room {bootstrap_room}")
        lora_id = None
        if lora_path is not None:
            lora_id = await self.loras.acquire(lora_path)  # (ValueError: not loaded)
            await self.loras.release(lora_id)
        where = (bootstrap_port, bootstrap_room)
        return self._answer(
            list(input_ids), sampling_params or {}, rid, cache_salt, *where, lora_id
        )

    async def _answer(self, ids, params, rid, salt, port, room, lora_id):  # noqa: ANN001, ANN202
        self.running += 1
        try:
            if self.mode == "decode":  # the prompt comes from the prefill engine's room
                path = ROOMS / str(port) / f"{room}.json"
                for _ in range(1000):
                    if path.exists():
                        break
                    await asyncio.sleep(0.01)
                ids, cached = json.loads(path.read_text()), 0
                path.unlink()
                await asyncio.sleep(0.05)  # (the KV's way over, as SGLang's decode waits for it)
            else:
                cached = self._cache(ids, salt, lora_id)
            if self.mode == "prefill":
                part = ROOMS / str(self.port) / f"{room}.part"  # (whole once it is there)
                part.parent.mkdir(parents=True, exist_ok=True)
                part.write_text(json.dumps(ids))
                part.rename(part.with_suffix(".json"))
                answer = ids[:1]
            else:
                answer = (ids[::-1] if lora_id else ids)[: params.get("max_new_tokens", 16)]
            details = {"device": cached, "host": 0, "storage": 0}
            for i, token in enumerate(answer):
                await asyncio.sleep(0.005)
                if rid in self.aborted:
                    yield {
                        "output_ids": [],
                        "meta_info": {"finish_reason": {"type": "abort"}, "cached_tokens": cached},
                    }
                    return
                last = i == len(answer) - 1
                meta = {
                    "finish_reason": {"type": "length"} if last else None,
                    "cached_tokens": cached,
                }
                if last:
                    meta["cached_tokens_details"] = details
                yield {"output_ids": [token], "meta_info": meta}
        finally:
            self.running -= 1

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
