"""What the operator's page costs: requests per second and bytes per minute one open page
makes, and the router's CPU with 5 pages open against none, on a stack under a steady load.

`kvmesh up` on the tiny model; a load of --rps streamed chat requests per second runs
throughout; the router's CPU (from /proc) is measured for --seconds with no page open, then
with --pages pages open in headless Chromium (Debian's chromium, through playwright), whose
requests and response bytes are counted. A screenshot of one page under the load is saved
(--screenshot, the README's).

Last line JSON: page_requests_per_s, page_bytes_per_min, router_cpu_no_pages,
router_cpu_with_pages, router_cpu_added.

    .venv/bin/python bench/dashboard.py [--pages 5] [--seconds 20] [--rps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import threading
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Stack, emit, say  # noqa: E402
from bench.router_capacity import children_of, cpu_seconds  # noqa: E402

PROMPT = "The harbour office keeps a log of every berth, tide and pilot. " * 6


def load(url: str, rps: float, stop: threading.Event) -> None:
    """Streamed chat requests at ``rps`` until ``stop`` (its own thread and loop)."""

    async def run() -> None:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"({i}) {PROMPT}"}],
                    "max_tokens": 16,
                    "stream": True,
                }
                async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                    async for _ in r.content:
                        pass

            tasks, i = set(), 0
            while not stop.is_set():
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(1 / rps)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def router_cpu(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rps", type=float, default=4.0, help="the background load")
    ap.add_argument("--screenshot", type=Path, default=None, help="save one page's screenshot")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs Debian's chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    stack = Stack("tiny", 1, {"KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "0"})
    stop = threading.Event()
    try:
        stack.wait_ready(timeout_s=300)
        router = next(pid for pid, cmd in children_of(stack.proc.pid) if "services.router" in cmd)
        loader = threading.Thread(target=load, args=(stack.url, args.rps, stop), daemon=True)
        loader.start()
        time.sleep(5)  # the load steady
        say(f"router CPU, no page open ({args.seconds:g} s)")
        idle = router_cpu(router, args.seconds)
        counted = {"requests": 0, "bytes": 0}

        def on_response(resp) -> None:  # noqa: ANN001
            if "/v1/" in resp.url:
                counted["requests"] += 1
                with contextlib.suppress(Exception):  # (a body gone when the page closes)
                    counted["bytes"] += len(resp.body())

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            pages = []
            for _ in range(args.pages):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{stack.url}/dashboard")
                page.wait_for_selector("#requests tr[data-request]", timeout=30_000)
                pages.append(page)
            pages[0].on("response", on_response)
            say(f"router CPU, {args.pages} pages open ({args.seconds:g} s)")
            started = time.perf_counter()
            busy = router_cpu(router, args.seconds)
            pages[0].wait_for_timeout(100)  # (events still queued for the thread)
            took = time.perf_counter() - started
            if args.screenshot:
                rows = pages[0].query_selector_all("#requests tr[data-request]")
                if rows:
                    rows[0].click()
                    pages[0].wait_for_selector("#waterfall .span-row", timeout=10_000)
                    pages[0].wait_for_timeout(500)
                pages[0].screenshot(path=str(args.screenshot), full_page=True)
                say(f"screenshot: {args.screenshot}")
            browser.close()
    finally:
        stop.set()
        stack.stop()
    fig = {
        "page_requests_per_s": round(counted["requests"] / took, 2),
        "page_bytes_per_min": round(counted["bytes"] / took * 60),
        "router_cpu_no_pages": round(idle, 3),
        "router_cpu_with_pages": round(busy, 3),
        "router_cpu_added": round(busy - idle, 3),
        "pages": args.pages,
        "load_rps": args.rps,
    }
    print(f"{'':<34}{'value':>12}")
    print(f"{'one page: requests/s':<34}{fig['page_requests_per_s']:>12}")
    print(f"{'one page: bytes/min':<34}{fig['page_bytes_per_min']:>12}")
    print(f"{'router CPU, no page':<34}{fig['router_cpu_no_pages']:>12}")
    print(f"{f'router CPU, {args.pages} pages':<34}{fig['router_cpu_with_pages']:>12}")
    emit(fig)


if __name__ == "__main__":
    main()
