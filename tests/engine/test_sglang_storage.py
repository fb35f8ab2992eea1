"""kvmesh's storage tier as SGLang's HiCache storage backend (shared/engine/sglang/storage.py),
against the pinned release's own code (tests/sglang_release.py): built by SGLang's ``dynamic``
factory as a subclass of its ``HiCacheStorage``; pages written from and read into host pools
of every MHA layout, whose buffers and pages are SGLang's own; a damaged or foreign file is a
miss, deleted and reported; what it writes is reported for cachemeta to index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.engine import kvformat
from shared.kvstore.backend import FileStore
from tests.sglang_release import HostPoolStandIn, load, storage_config

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
LAYERS, HEADS, DIM, PAGE, PAGES = 3, 2, 8, 4, 6
FP = "fp-sglang-test"


@pytest.fixture(scope="module")
def sglang():
    load()
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return hicache_storage, StorageBackendFactory, HostPoolStandIn.build()


def backend(sglang, tier: Path, pool, report: str = "", fingerprint: str = FP):  # noqa: ANN001, ANN201
    """The backend as SGLang's cache controller makes it: its factory, then the host pool."""
    from shared.engine.sglang.storage import storage_args

    hicache_storage, factory, _ = sglang
    extra = storage_args(str(tier), fingerprint, "", report)
    made = factory.create_backend("dynamic", storage_config(extra), pool)
    made.register_mem_pool_host(pool)
    return made


def canonical_to_page(layout: str, c: torch.Tensor) -> torch.Tensor:
    """A page given as [2, layers, tokens, heads, dim], in the order SGLang's own
    ``get_data_page`` / ``set_from_flat_data_page`` of ``layout`` hold it."""
    if layout == "layer_first":
        return c
    if layout == "page_first":
        return c.permute(0, 2, 1, 3, 4)
    if layout == "page_first_direct":
        return c.unsqueeze(1)
    return c.permute(0, 3, 2, 1, 4).unsqueeze(1)  # page_head: [2, 1, heads, tokens, layers, dim]


def page_to_canonical(layout: str, page: torch.Tensor) -> torch.Tensor:
    if layout == "layer_first":
        return page
    if layout == "page_first":
        return page.permute(0, 2, 1, 3, 4)
    if layout == "page_first_direct":
        return page.squeeze(1)
    return page.squeeze(1).permute(0, 3, 2, 1, 4)


def test_the_backend_is_built_by_sglangs_dynamic_factory_as_its_hicache_storage(
    sglang, tmp_path: Path
) -> None:
    hicache_storage, _, pool_class = sglang
    from shared.engine.sglang.storage import KvmeshHiCacheStorage

    pool = pool_class("page_first", LAYERS, HEADS, DIM, PAGE, PAGES, torch.float32)
    made = backend(sglang, tmp_path, pool)
    assert type(made) is KvmeshHiCacheStorage
    assert isinstance(made, hicache_storage.HiCacheStorage)
    assert made.mem_pool_host is pool  # (SGLang's own register_mem_pool_host ran)


@pytest.mark.parametrize("write_layout", LAYOUTS)
def test_pages_written_in_one_layout_read_back_in_every_layout(
    sglang, tmp_path: Path, write_layout: str
) -> None:
    _, _, pool_class = sglang
    torch.manual_seed(7)
    pages = [torch.randn(2, LAYERS, PAGE, HEADS, DIM) for _ in range(3)]
    source = pool_class(write_layout, LAYERS, HEADS, DIM, PAGE, PAGES, torch.float32)
    slots = [PAGE * 1, PAGE * 4, PAGE * 2]  # pages anywhere in the pool, in any order
    for slot, page in zip(slots, pages, strict=True):
        source.set_from_flat_data_page(slot, canonical_to_page(write_layout, page).flatten())
    keys = [f"{i:02x}" * 32 for i in (1, 2, 3)]
    indices = torch.cat([torch.arange(s, s + PAGE) for s in slots])
    assert backend(sglang, tmp_path, source).batch_set_v1(keys, indices) == [True] * 3

    # The file is kvmesh's block format: each layer's K then V, as the page holds them.
    f = kvformat.as_reader(FileStore(tmp_path).get(keys[0]))
    header, start = kvformat.read_header(f)
    assert (header.fingerprint, header.block_size, header.n_layers) == (FP, PAGE, LAYERS)
    k, v = kvformat.read_cell(f, header, start, 1, 0)
    assert torch.equal(k, pages[0][0, 1]) and torch.equal(v, pages[0][1, 1])

    for read_layout in LAYOUTS:
        target = pool_class(read_layout, LAYERS, HEADS, DIM, PAGE, PAGES, torch.float32)
        into = [PAGE * 5, PAGE * 0, PAGE * 3]
        at = torch.cat([torch.arange(s, s + PAGE) for s in into])
        reader = backend(sglang, tmp_path, target)
        assert reader.batch_exists(keys + ["ee" * 32]) == 3
        assert reader.batch_get_v1(keys, at) == [True] * 3
        for slot, page in zip(into, pages, strict=True):
            got = page_to_canonical(read_layout, target.get_data_page(slot, flat=False))
            assert torch.equal(got, page), (write_layout, read_layout)


def test_a_damaged_or_foreign_page_is_a_miss_deleted_and_reported(sglang, tmp_path: Path) -> None:
    import zmq

    _, _, pool_class = sglang
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    report = f"tcp://127.0.0.1:{port}"
    pool = pool_class("page_first", LAYERS, HEADS, DIM, PAGE, PAGES, torch.bfloat16)
    pool.kv_buffer.normal_()
    ours = backend(sglang, tmp_path, pool, report)
    theirs = backend(sglang, tmp_path, pool, fingerprint="another-model")
    keys = ["a1" * 32, "a2" * 32, "a3" * 32]
    indices = torch.arange(0, 3 * PAGE)
    assert ours.batch_set_v1(keys[:2], indices[: 2 * PAGE]) == [True, True]
    written = json.loads(pull.recv(zmq.NOBLOCK) if pull.poll(2000) else b"{}")
    sizes = [len(FileStore(tmp_path).get(k)) for k in keys[:2]]  # (each block's bytes)
    assert written == {
        "stored": [[k, n] for k, n in zip(keys[:2], sizes, strict=True)],
        "damaged": [],
    }
    path = FileStore(tmp_path).path(keys[1])
    assert theirs.batch_set_v1(keys[2:], indices[2 * PAGE :]) == [True]  # another model's

    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a bit flipped in the last layer's V
    path.write_bytes(bytes(data))
    before = pool.kv_buffer.clone()
    assert ours.batch_get_v1(keys, torch.arange(3 * PAGE, 6 * PAGE)) == [True, False, False]
    assert torch.equal(pool.kv_buffer[:, 4 * PAGE :], before[:, 4 * PAGE :])  # nothing damaged in
    assert not path.exists() and ours.batch_exists(keys) == 1
    said = json.loads(pull.recv() if pull.poll(2000) else b"{}")
    assert said == {"stored": [], "damaged": [keys[1], keys[2]]}
    pull.close(linger=0)


def test_mla_models_and_split_ranks_are_refused_saying_why(sglang, tmp_path: Path) -> None:
    hicache_storage, factory, _ = sglang
    from shared.engine.sglang.storage import storage_args

    extra = storage_args(str(tmp_path), FP, "", "")
    with pytest.raises(ValueError, match="MLA model"):
        factory.create_backend("dynamic", storage_config(extra, is_mla_model=True), None)
    with pytest.raises(ValueError, match="tensor parallelism 2"):
        factory.create_backend("dynamic", storage_config(extra, tp_size=2), None)
    made = factory.create_backend("dynamic", storage_config(extra), None)

    class Unified:  # a layout kvmesh's block format is not converted from
        layout, dtype = "page_unified", torch.float16

    with pytest.raises(ValueError, match="page_unified"):
        made.register_mem_pool_host(Unified())
