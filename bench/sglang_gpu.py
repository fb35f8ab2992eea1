"""SGLang as kvmesh's engine on a CUDA machine: one command for an operator, on a machine with
``sglang==0.5.23`` installed beside kvmesh (``pip install sglang==0.5.23`` into the venv),
under 10 minutes, with no hub access: the model is the bundled SmolLM2-135M exported to a
Hugging Face directory here (``shared/model/export.py``).

What it checks, through kvmesh's own engine code (shared/engine/sglang/), nothing else of the
mesh:

  1. greedy output: SGLang's answer equals transformers' on the same weights, token for token;
  2. KV events: the pages SGLang reports are indexed under the router's hashes of the prompt
     (``hashing.packed_sglang_hashes``), and the storage backend reports what it wrote;
  3. the storage tier: a prefix evicted from GPU and host (the engine restarted) comes back
     from kvmesh's tier, with the same answer;
  4. tenants: another tenant's request of the same prompt loads nothing;
  5. abort: a request aborted mid-answer ends with "abort";
  6. (``--pd``) SGLang's own P/D on one GPU, prefill and decode engines side by side with the
     ``--transfer`` backend: the same greedy answer.

Prints a table; the last line is one JSON object with each check's result and figures.

    .venv/bin/python bench/sglang_gpu.py [--state /tmp/kvmesh-sglang] [--pd --transfer mooncake]

Not run on a GPU by the project yet (these machines have none): see docs/engines.md (SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)  # (not bench/: its profile.py would hide the standard library's)

from bench.harness import emit  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.sglang.engine import SglangEngine  # noqa: E402
from shared.kvstore.backend import FileStore  # noqa: E402
from shared.kvstore.hashing import pack_tokens, packed_sglang_hashes  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.catalog import resolve  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 64
PROMPT = [1, 9690, 198] + [(i * 37) % 40000 + 100 for i in range(700)] + [2, 198]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


class Events:
    """The worker's side of the engine's block events (what it would publish on NATS)."""

    def __init__(self) -> None:
        self.said: list[tuple[str, list[str], str, str, int]] = []

    async def __call__(self, kind: str, hashes: list[str], tier: str, retention: str, size: int):
        self.said.append((kind, hashes, tier, retention, size))

    def held(self, kind: str, tier: str) -> set[str]:
        return {h for k, hs, t, _, _ in self.said if (k, t) == (kind, tier) for h in hs}


async def answer(engine: SglangEngine, rid: str, salt: str = "", prompt=PROMPT) -> tuple:  # noqa: ANN001
    pieces = [p async for p in engine.generate(rid, list(prompt), GREEDY, salt)]
    tokens = [t for p in pieces for t in p.token_ids]
    return tokens, pieces[0].cached_tokens, pieces[-1].cached_by_tier or {}


def transformers_greedy(directory: Path, n: int, device: str) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).to(device)
    ids = torch.tensor([PROMPT], device=device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


async def run(args: argparse.Namespace) -> dict:
    state = Path(args.state)
    tier = state / "kv-store"
    options = EngineOptions(
        block_size=BLOCK,
        kv_cache_tokens=16384,
        max_running=8,
        prefill_chunk=2048,
        kv_store_dir=str(tier),
        memory_tier_bytes=1 << 30,
    )
    figures: dict = {}
    rows: list[tuple[str, str]] = []
    events = Events()
    engine = SglangEngine.load(resolve(MODEL, {}), state, options)
    print(f"model exported to {engine.directory}; starting SGLang", flush=True)
    t = time.monotonic()
    await engine.start(events)
    figures["start_s"] = round(time.monotonic() - t, 1)

    # 1. greedy, against transformers on the same weights
    ours, _, _ = await answer(engine, "greedy-1", salt="harbour")
    theirs = transformers_greedy(engine.directory, GREEDY.max_tokens, args.device)
    same = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours)
    )
    figures["greedy_equal"] = ours == theirs
    figures["greedy_same_prefix"] = same
    rows.append(("greedy = transformers", f"{ours == theirs} ({same}/{len(ours)} tokens)"))

    # 2. KV events under the router's hashes; the storage backend's reports
    pages = packed_sglang_hashes(pack_tokens(PROMPT), BLOCK, engine.config.fingerprint, "harbour")
    await asyncio.sleep(2.0)  # (events and the write-through to the tier)
    in_memory = set(pages) <= events.held("stored", "memory")
    in_tier = [h for h in pages if h in FileStore(tier)]
    figures["events_indexed"] = in_memory
    figures["pages_in_tier"] = f"{len(in_tier)}/{len(pages)}"
    figures["tier_reported"] = set(in_tier) <= events.held("stored", "storage")
    rows.append(("KV events = router's hashes", str(in_memory)))
    rows.append(("pages written to the tier", figures["pages_in_tier"]))

    # 5. abort, mid-answer
    long = replace(GREEDY, max_tokens=400)
    stream = engine.generate("abort-1", PROMPT[:200], long, "harbour")
    first = await stream.__anext__()
    await engine.abort("abort-1")
    rest = [p async for p in stream]
    ended = (rest[-1] if rest else first).finish_reason
    figures["abort"] = ended == "abort"
    rows.append(("abort mid-answer", f"finish_reason {ended}"))
    await engine.stop()

    # 3. a restart: GPU and host memory empty, the prefix comes from kvmesh's tier
    events2 = Events()
    again = SglangEngine.load(resolve(MODEL, {}), state, options)
    await again.start(events2)
    t = time.monotonic()
    tokens, cached, tiers = await answer(again, "greedy-2", salt="harbour")
    figures["after_restart_ms"] = round((time.monotonic() - t) * 1e3, 1)
    figures["after_restart_same"] = tokens == ours
    figures["after_restart_storage_tokens"] = tiers.get("storage", 0)
    rows.append(
        (
            "after a restart, from the tier",
            f"{tiers.get('storage', 0)} tokens, same answer {tokens == ours}",
        )
    )  # noqa: E501

    # 4. another tenant: nothing loaded
    _, cached, tiers = await answer(again, "tenant-2", salt="customs")
    figures["other_tenant_cached"] = cached
    rows.append(("another tenant's cached tokens", str(cached)))
    await again.stop()

    if args.pd:  # 6. SGLang's own P/D on one GPU
        pd = replace(options, pd_transfer=args.transfer, bootstrap_host="127.0.0.1")
        pre = SglangEngine.load(resolve(MODEL, {}), state, replace(pd, pd_role="prefill"))
        dec = SglangEngine.load(resolve(MODEL, {}), state, replace(pd, pd_role="decode"))
        await pre.start()
        await dec.start()
        room = (pre.options.bootstrap_host, pre.options.bootstrap_port, 12345)
        prefilled = asyncio.create_task(_all(pre.generate("pd-1", PROMPT, GREEDY, "pd", peer=room)))
        decoded = await _all(dec.generate("pd-1", PROMPT, GREEDY, "pd", peer=room))
        await prefilled
        pd_tokens = [t for p in decoded for t in p.token_ids]
        figures["pd_same"] = pd_tokens == ours
        rows.append(("P/D (SGLang's transfer)", f"same answer {pd_tokens == ours}"))
        await pre.stop()
        await dec.stop()

    print(f"{'check':<34} result")
    for name, result in rows:
        print(f"{name:<34} {result}")
    return figures


async def _all(pieces) -> list:  # noqa: ANN001
    return [p async for p in pieces]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", default=str(Path(tempfile.gettempdir()) / "kvmesh-sglang"))
    ap.add_argument("--pd", action="store_true", help="also SGLang's own P/D on one GPU")
    ap.add_argument("--transfer", default="mooncake", help="its KV transfer backend")
    ap.add_argument("--device", default="cuda", help="where transformers' reference runs")
    args = ap.parse_args()
    figures = asyncio.run(run(args))
    emit(figures)


if __name__ == "__main__":
    main()
