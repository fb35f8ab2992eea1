"""What kvmesh's SGLang plug points cost on this machine's CPU, against the pinned release's own
code (``make test`` fetches it: tests/sglang_release.py):

  - **the hash scheme**: a 77K-token prompt's block hashes, XXH3 (kvmesh's) against SGLang's
    chained SHA-256 as the router computes it (``hashing.packed_sglang_hashes``) and as SGLang
    does (its C++ page hash), the median of ``--repeat`` runs each;
  - **pages through the storage backend** (shared/engine/sglang/storage.py): ``--pages`` pages
    of a Llama-3-8B-shaped model (32 layers, 8 KV heads of 128, bfloat16, 64 tokens: 8 MiB a
    page) written from and read into a host pool of each MHA layout (SGLang's own buffer code)
    as kvmesh blocks (converted, CRC per layer), against plain file I/O of the same bytes as
    SGLang's file backend moves them (the page as it lies, no conversion and no checksum).

Prints a table; the last line is one JSON object: hash_ms (xxh3, sglang_python,
sglang_native), and per layout write_mb_s and read_mb_s, with plain_write_mb_s and
plain_read_mb_s.

    .venv/bin/python bench/sglang_tier.py [--pages 64] [--repeat 20] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)  # (not bench/: its profile.py would hide the standard library's)

from bench.harness import emit  # noqa: E402
from shared.kvstore.hashing import (  # noqa: E402
    pack_tokens,
    packed_block_hashes,
    packed_sglang_hashes,
    sglang_cache_salt,
)
from tests.sglang_release import HostPoolStandIn, load, storage_config  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 64  # Llama-3-8B's KV shape, SGLang's usual page


def median_ms(fn, repeat: int) -> float:  # noqa: ANN001
    fn()  # (warm)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def hash_costs(repeat: int) -> dict[str, float]:
    load()
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = [(i * 7919) % 49152 for i in range(77_000)]
    packed = pack_tokens(tokens)
    fp, salt = "bench-fingerprint", "tenant"

    class Key(list):
        extra_key, is_bigram = None, False
        cache_salt = sglang_cache_salt(fp, PAGE, salt)

    key = Key(tokens[: len(tokens) // PAGE * PAGE])
    ours = packed_sglang_hashes(packed, PAGE, fp, salt)
    assert ours == get_storage_hash_str(key, None, page_size=PAGE), "not SGLang's hashes"
    return {
        "xxh3": median_ms(lambda: packed_block_hashes(packed, PAGE, fp, salt), repeat),
        "sglang_python": median_ms(lambda: packed_sglang_hashes(packed, PAGE, fp, salt), repeat),
        "sglang_native": median_ms(lambda: get_storage_hash_str(key, None, PAGE), repeat),
    }


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / 2**20 / seconds


def say(what: str, mb_s: dict) -> None:
    print(f"  {what:<18} write {mb_s['write_mb_s']:6.0f} MB/s  read {mb_s['read_mb_s']:6.0f} MB/s")


def page_costs(pages: int, where: Path) -> dict:
    from shared.engine.sglang.storage import storage_args

    load()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool_class = HostPoolStandIn.build()
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2
    total = pages * page_bytes
    out: dict = {"page_mib": page_bytes / 2**20, "pages": pages}
    for i, layout in enumerate((LAYOUTS[0], *LAYOUTS)):  # (round 0 warms the file system)
        pool = pool_class(layout, LAYERS, HEADS, DIM, PAGE, pages, torch.bfloat16)
        pool.kv_buffer.normal_()
        with tempfile.TemporaryDirectory(dir=where) as tier:
            extra = storage_args(tier, "bench-fingerprint", "", "")
            config = storage_config(extra, is_page_first_layout=layout != "layer_first")
            backend = StorageBackendFactory.create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            keys = [f"{i:064x}" for i in range(1, pages + 1)]
            slots = torch.arange(pages * PAGE)
            t = time.perf_counter()
            assert all(backend.batch_set_v1(keys, slots))
            wrote = time.perf_counter() - t
            pool.kv_buffer.zero_()
            t = time.perf_counter()
            assert all(backend.batch_get_v1(keys, slots))
            read = time.perf_counter() - t
        out[layout] = {"write_mb_s": rate(total, wrote), "read_mb_s": rate(total, read)}
        if i:
            say(layout, out[layout])
    # Plain file I/O of the same bytes: SGLang's file backend's way (the page as it lies).
    pool = pool_class("page_first_direct", LAYERS, HEADS, DIM, PAGE, pages, torch.bfloat16)
    pool.kv_buffer.normal_()
    with tempfile.TemporaryDirectory(dir=where) as tier:
        paths = [Path(tier) / f"{i}.bin" for i in range(pages)]
        t = time.perf_counter()
        for i, path in enumerate(paths):
            pool.get_data_page(i * PAGE).contiguous().view(torch.uint8).numpy().tofile(path)
        wrote = time.perf_counter() - t
        target = pool.get_dummy_flat_data_page()
        t = time.perf_counter()
        for i, path in enumerate(paths):
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(target.view(torch.uint8).numpy()))
            pool.set_from_flat_data_page(i * PAGE, target)
        read = time.perf_counter() - t
    out["plain"] = {"write_mb_s": rate(total, wrote), "read_mb_s": rate(total, read)}
    say("plain file I/O", out["plain"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    print("hashing a 77K-token prompt (blocks of 64), median of", args.repeat, flush=True)
    hashes = hash_costs(args.repeat)
    for name, ms in hashes.items():
        print(f"  {name:<18} {ms:6.2f} ms")
    print(f"{args.pages} pages of {LAYERS}x{HEADS}x{DIM} bf16, {PAGE} tokens, in {args.dir}")
    pages = page_costs(args.pages, args.dir)
    figures = {"hash_ms": {k: round(v, 3) for k, v in hashes.items()}}
    for layout in (*LAYOUTS, "plain"):
        figures[layout] = {k: round(v) for k, v in pages[layout].items()}
    figures["page_mib"] = pages["page_mib"]
    emit(figures)


if __name__ == "__main__":
    main()
