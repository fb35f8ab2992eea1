"""The vision encoder: images per second through the tower, and what encoding ahead saves.

1. In this process: the default tower for the real model (hidden 576), 640×480 JPEG images,
   decode + resize + normalize + tower, one image at a time and eight at a time.
2. A real stack (`kvmesh up`: real model, 1 prefill, 1 decode, 1 encoder): streaming chat
   requests, each with a new image (nothing cached) after a short text, TTFT measured by the
   client; once with the router sending images to the encoder at once (the default) and once
   with that head start off (KVMESH_ROUTER_ENCODE_AHEAD=false: encode after tokenizing, then
   route). Idle; with a second client keeping the prefill worker busy with text prompts; and
   after a 3,200-token history whose KV is read from the storage tier's files.

Last line, JSON: encode_images_s_b1, encode_images_s_b8, ttft_ahead_ms, ttft_inline_ms (idle,
medians), and the same two under load and after the history.

    .venv/bin/python bench/encoder.py [--requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from e2e import Stack, say  # noqa: E402

from services.encoder.pixels import pixels  # noqa: E402
from services.encoder.tower import TowerConfig, VisionTower  # noqa: E402
from shared.settings import CommonSettings  # noqa: E402

MODEL = "smollm2-135m-instruct"
SIZE = (640, 480)
LOAD_PROMPT = "Write a long, careful essay about caching in distributed systems. " * 12
# A conversation's earlier turns (about 3,200 tokens), cached in the storage tier: the new
# image comes after them, so prefill loads them while (ahead) or after (inline) encoding.
HISTORY = [
    {"role": "user", "content": "Here are my notes on the design, read them. " * 320},
    {"role": "assistant", "content": "I have read your notes."},
]


def jpeg(seed: int) -> bytes:
    img = Image.effect_noise(SIZE, 40 + seed % 50).convert("RGB")
    img = Image.merge("RGB", [c.rotate(seed * 7 % 360) for c in img.split()])
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90)
    return out.getvalue()


def tower_rates(n: int = 16) -> dict:
    torch.set_num_threads(2)
    grid = CommonSettings().vision_grid
    tower = VisionTower(TowerConfig(hidden=576, grid=grid))
    images = [jpeg(i) for i in range(n)]
    tower.encode([pixels(images[0], grid, 10**8)])  # warm-up
    started = time.perf_counter()
    for data in images:
        tower.encode([pixels(data, grid, 10**8)])
    b1 = n / (time.perf_counter() - started)
    started = time.perf_counter()
    for i in range(0, n, 8):
        tower.encode([pixels(d, grid, 10**8) for d in images[i : i + 8]])
    b8 = n / (time.perf_counter() - started)
    tokens = grid.tokens(*SIZE)
    say(f"tower: {SIZE[0]}×{SIZE[1]} → {tokens} tokens; b1 {b1:.2f} images/s, b8 {b8:.2f}")
    return {"b1": b1, "b8": b8, "tokens": tokens}


def encoder_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            roles = json.loads(r.read())["roles"]
    except OSError:
        return False
    except Exception:  # 503 while a role is missing: urllib raises HTTPError (an OSError)
        return False
    return any(w["status"] == "ready" for w in roles.get("encoder", []))


async def image_request(
    session: aiohttp.ClientSession, url: str, seed: int, history: list[dict] | None = None
) -> float:
    data_url = "data:image/jpeg;base64," + base64.b64encode(jpeg(seed)).decode()
    body = {
        "model": MODEL,
        "messages": [
            *(history or []),
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"({seed}) What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url}},
                ],
            },
        ],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                return time.perf_counter() - sent
    raise SystemExit("no token came")


async def text_load(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"({i}) {LOAD_PROMPT}"}],
            "max_tokens": 1,
        }
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()
        i += 1


async def ttfts(
    url: str, requests: int, seed0: int, loaded: bool, history: list[dict] | None = None
) -> list[float]:
    async with aiohttp.ClientSession() as session:
        await image_request(session, url, seed0 - 1, history)  # warm-up; stores the history
        stop = asyncio.Event()
        load = asyncio.create_task(text_load(session, url, stop)) if loaded else None
        if load:
            await asyncio.sleep(2.0)
        out = []
        for r in range(requests):
            out.append(await image_request(session, url, seed0 + r, history))
            state = "loaded" if loaded else "history" if history else "idle"
            say(f"  {state} request {r + 1}/{requests}: {out[-1] * 1e3:.0f} ms")
            await asyncio.sleep(0.3)
        stop.set()
        if load:
            await load
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="image requests per measurement")
    args = ap.parse_args()
    rates = tower_rates()
    results = {}
    for ahead in (True, False):
        mode = "ahead" if ahead else "inline"
        say(f"starting a stack on {MODEL} with encoding {mode}")
        stack = Stack(
            MODEL,
            2,
            {
                "KVMESH_ROUTER_ENCODE_AHEAD": str(ahead).lower(),
                "KVMESH_ENCODER_THREADS": "2",
                # Cached blocks come from the storage tier's files (the history case).
                "KVMESH_PREFILL_MEMORY_TIER_BYTES": "0",
                "KVMESH_DECODE_MEMORY_TIER_BYTES": "0",
            },
        )
        try:
            stack.wait_ready(300)
            deadline = time.monotonic() + 120
            while not encoder_ready(stack.url):
                if time.monotonic() > deadline:
                    raise SystemExit("the encoder did not come up")
                time.sleep(0.3)
            seed0 = 1000 if ahead else 2000
            idle = asyncio.run(ttfts(stack.url, args.requests, seed0, loaded=False))
            busy = asyncio.run(ttfts(stack.url, args.requests, seed0 + 500, loaded=True))
            long = asyncio.run(
                ttfts(stack.url, args.requests, seed0 + 700, loaded=False, history=HISTORY)
            )
        finally:
            stack.stop()
        results[mode] = {
            "idle": statistics.median(idle) * 1e3,
            "loaded": statistics.median(busy) * 1e3,
            "history": statistics.median(long) * 1e3,
        }
    print(f"{'':24}{'idle TTFT p50':>16}{'loaded TTFT p50':>18}{'after history':>16}")
    for mode, r in results.items():
        print(
            f"{'encoding ' + mode:24}{r['idle']:>13.0f} ms{r['loaded']:>15.0f} ms"
            f"{r['history']:>13.0f} ms"
        )
    b1, b8 = rates["b1"], rates["b8"]
    print(f"tower ({rates['tokens']} tokens/image): b1 {b1:.2f}, b8 {b8:.2f} images/s")
    print(
        json.dumps(
            {
                "encode_images_s_b1": round(rates["b1"], 2),
                "encode_images_s_b8": round(rates["b8"], 2),
                "ttft_ahead_ms": round(results["ahead"]["idle"], 1),
                "ttft_inline_ms": round(results["inline"]["idle"], 1),
                "ttft_ahead_loaded_ms": round(results["ahead"]["loaded"], 1),
                "ttft_inline_loaded_ms": round(results["inline"]["loaded"], 1),
                "ttft_ahead_history_ms": round(results["ahead"]["history"], 1),
                "ttft_inline_history_ms": round(results["inline"]["history"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
