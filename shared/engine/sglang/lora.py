"""LoRA adapters on an SGLang worker, through SGLang's own multi-LoRA (``enable_lora``): an
adapter registered with the worker is loaded into SGLang by its name at its first request
(``async_load_lora_adapter``), and the least recently used idle one is unloaded once
``HOST_FACTOR`` × ``max_loras`` are loaded (SGLang itself keeps ``max_loras`` of them on the
GPU, ``max_loras_per_batch``). A request names its adapter by that name (``lora_path``).

KV: kvmesh names an adapter's blocks with the adapter's digest in the fingerprint
(``shared/model/lora.py``: ``kv_fingerprint``), and that fingerprint goes to SGLang in the
request's ``cache_salt``. SGLang's KV events carry the salt, so the event bridge names the
blocks as the router does, and no two adapters (nor an adapter and its base) share one.

SGLang names its storage pages by the adapter's load too: a load's ``lora_id`` (a random
uuid, read from SGLang's registry after the load) goes into the request's extra key, which
seeds the page hashes with the salt. So the worker tells kvmesh's storage backend, before
each request, the names the router gives the prompt's pages (``StorageNames``: SGLang's page
hash → kvmesh's; ``shared/engine/sglang/storage.py`` files and reports a page by kvmesh's
name): an adapter's turn written by one worker is read by any other, whatever its load's id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from shared.engine.interface import EngineOptions
from shared.kvstore.hashing import sglang_chain, sglang_seed
from shared.model.config import ModelConfig
from shared.model.lora import MODULES, AdapterSpec, check_spec, kv_fingerprint

log = logging.getLogger(__name__)

HOST_FACTOR = 4  # adapters loaded in SGLang (its host memory) per GPU slot
NAMES_KEPT = 200_000  # page names the storage backend keeps (SGLang's hash → kvmesh's)


def lora_args(options: EngineOptions) -> dict:
    """SGLang's LoRA arguments: none unless asked (its LoRA layers cost every step). Adapters
    come at run time, so the rank and the modules are given, not inferred from paths."""
    if not options.enable_lora:
        return {}
    return {
        "enable_lora": True,
        "max_loras_per_batch": options.max_loras,
        "max_lora_rank": options.max_lora_rank,
        "lora_target_modules": list(MODULES),
    }


class SglangAdapters:
    """The adapters a worker serves (``register``), those loaded into SGLang (LRU), and the
    fingerprint each one's KV goes by."""

    def __init__(self, config: ModelConfig, options: EngineOptions) -> None:
        self.config = config
        self.options = options
        self.specs: dict[str, AdapterSpec] = {}
        self.loaded: OrderedDict[str, None] = OrderedDict()  # in SGLang, least recent first
        self.users: dict[str, int] = {}  # requests computing with each loaded one
        self.loads, self.load_seconds = 0, 0.0
        self._lock = asyncio.Lock()  # (one load or unload at a time, as SGLang takes them)
        self._tasks: set[asyncio.Task] = set()
        self.engine: Any = None  # sglang.Engine, once started

    def register(self, spec: AdapterSpec) -> None:
        if not self.options.enable_lora:
            raise ValueError(
                "LoRA adapters on an SGLang worker need KVMESH_<ROLE>_ENABLE_LORA=true"
            )
        checked = check_spec(spec, self.config, self.options.max_lora_rank)
        old = self.specs.get(spec.name)
        self.specs[spec.name] = AdapterSpec(spec.name, spec.base, spec.path, checked.digest)
        if old is not None and old.digest != checked.digest:
            self._later(self._unload(spec.name))  # (the next request loads the new files)

    def unregister(self, name: str) -> None:
        if self.specs.pop(name, None) is not None:
            self._later(self._unload(name))  # (SGLang lets its requests finish first)

    def fingerprint(self, name: str) -> str:
        """The fingerprint of the KV a request of adapter ``name`` computes ("": the base's)."""
        if not name:
            return self.config.fingerprint
        return kv_fingerprint(self.config.fingerprint, self._spec(name).digest)

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(self.loaded)

    async def acquire(self, name: str) -> str:
        """Adapter ``name`` loaded into SGLang for one more request (ValueError for one this
        worker does not serve); its load's ``lora_id``."""
        spec = self._spec(name)
        async with self._lock:
            if name not in self.loaded:
                await self._make_room()
                started = time.perf_counter()
                out = await self.engine.async_load_lora_adapter(name, spec.path)
                if not getattr(out, "success", True):
                    raise ValueError(f"model {name!r}: SGLang did not load it: {out.error_message}")
                self.loads += 1
                self.load_seconds += time.perf_counter() - started
            self.loaded[name] = None
            self.loaded.move_to_end(name)
            self.users[name] = self.users.get(name, 0) + 1
        return self.lora_id(name)

    def release(self, name: str) -> None:
        self.users[name] = self.users.get(name, 1) - 1

    def lora_id(self, name: str) -> str:
        """The id SGLang gave adapter ``name``'s current load (it seeds the page hashes)."""
        return self.engine.tokenizer_manager.lora_registry.get_all_adapters()[name].lora_id

    def _spec(self, name: str) -> AdapterSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"model {name!r}: no such adapter on this worker")
        return spec

    async def _make_room(self) -> None:
        """The least recently used idle adapter unloaded while SGLang holds its most."""
        while len(self.loaded) >= HOST_FACTOR * self.options.max_loras:
            idle = next((n for n in self.loaded if not self.users.get(n)), None)
            if idle is None:
                return  # (all in use: SGLang holds one more for a while)
            await self._unload_now(idle)

    async def _unload(self, name: str) -> None:
        async with self._lock:
            if name in self.loaded:
                await self._unload_now(name)

    async def _unload_now(self, name: str) -> None:
        del self.loaded[name]
        self.users.pop(name, None)
        if self.engine is not None:
            await self.engine.async_unload_lora_adapter(name)

    def _later(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class StorageNames:
    """What the worker tells kvmesh's storage backend before a request: for a base model's
    request, its chain's first page (``head``: SGLang's names are kvmesh's); for an adapter's,
    each prompt page's name in kvmesh's chain by its hash in SGLang's (JSON over a ZMQ PUSH
    socket the worker binds; the backend connects)."""

    def __init__(self) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def tell(
        self, packed: bytes, block_size: int, cache_salt: str, lora_id: str, names: list[str]
    ) -> None:
        """``names``: the prompt's pages as kvmesh names them (by the salt alone); SGLang's
        own chain for them is seeded by the salt and the load's id (none: the same names)."""
        if not names:
            return  # (no full page: the chain's head is not known here; nothing is filed)
        import zmq

        said: dict[str, Any] = {"head": names[0]}
        if lora_id:
            theirs = sglang_chain(packed, block_size, sglang_seed(cache_salt, lora_id))
            said = {"names": list(zip(theirs, names, strict=True))}
        try:
            self._socket.send(json.dumps(said).encode(), zmq.NOBLOCK)
        except zmq.Again:  # (no backend connected yet: this request's pages are not filed)
            log.debug("storage names not told (no backend listening)")

    def close(self) -> None:
        self._socket.close(linger=0)


class ToldNames:
    """The storage backend's side of ``StorageNames``: the base model's chains by their first
    page, the adapters' pages' names, the oldest forgotten first. A page is read under its
    name told, else as SGLang names it; written under its name told, or as SGLang names it in
    a base model's chain, else not at all (what no router could name stays out of the tier:
    an adapter's answer pages, a chain not told of)."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.base_heads: OrderedDict[str, None] = OrderedDict()
        self.names: OrderedDict[str, str] = OrderedDict()  # SGLang's hash → kvmesh's
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.connect(endpoint)
        threading.Thread(target=self._read, name="kvmesh-storage-names", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                self.take(json.loads(self._socket.recv()))
            except Exception as err:  # (one bad message must not stop the reading)
                log.warning("storage names: %s", err)

    def take(self, said: dict) -> None:
        if "head" in said:
            self.base_heads[said["head"]] = None
            self.base_heads.move_to_end(said["head"])
        for theirs, ours in said.get("names") or ():
            self.names[theirs] = ours
            self.names.move_to_end(theirs)
        while len(self.base_heads) > NAMES_KEPT // 8:
            self.base_heads.popitem(last=False)
        while len(self.names) > NAMES_KEPT:
            self.names.popitem(last=False)

    def of(self, head: str, keys: list[str], writing: bool) -> list[str | None]:
        """kvmesh's name for each of a chain's ``keys`` (None: not to be written)."""
        if not writing or head in self.base_heads:
            return [self.names.get(k, k) for k in keys]
        return [self.names.get(k) for k in keys]
