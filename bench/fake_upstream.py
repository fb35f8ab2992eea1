"""A fake upstream for router benchmarks (named as such: no model behind it).

An OpenAI-compatible HTTP server on 127.0.0.1 whose streaming chat answer is ``max_tokens``
chunks of one token each, sent at once or one every ``--itl-ms`` milliseconds, so what a
router in front of it adds can be measured apart from any engine. It also answers what
`sglang-router` asks a worker (health, model and server info).

    .venv/bin/python bench/fake_upstream.py --port 8001 [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "fake"


def chunk(i: int, created: int, content: str, finish: str | None = None) -> bytes:
    body = {
        "id": f"chatcmpl-fake{i}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def build(itl_s: float) -> web.Application:
    counter = iter(range(1 << 62))

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        created, i = int(time.time()), next(counter)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": f"chatcmpl-fake{i}",
                    "object": "chat.completion",
                    "created": created,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": " tok" * n},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t in range(n):
            if t and itl_s:
                await asyncio.sleep(itl_s)
            await resp.write(chunk(i, created, " tok", "length" if t == n - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            tail = {"id": f"chatcmpl-fake{i}", "object": "chat.completion.chunk", "choices": []}
            await resp.write(b"data: " + json.dumps({**tail, "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": MODEL, "tokenizer_path": None, "is_generation": True}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    for path in ("/health", "/health_generate", "/get_server_info", "/server_info", "/flush_cache"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--itl-ms", type=float, default=0.0, help="between chunks (0: at once)")
    args = ap.parse_args()
    web.run_app(build(args.itl_ms / 1e3), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
