"""The router's shape, read from its code and from one request: how far a newcomer must look.

From the source (``services/router/``, every ``.py`` file under it):

- files in its largest folder, the largest file and the largest class (lines);
- functions over 60 lines (every ``def``, methods and nested ones included);
- the most project modules one router module imports (every import statement, those inside
  functions too, resolved to the project module it names: ``tests/test_layout.py``'s graph).

From one request: a router runs in this process, on a real `kvmesh up` stack (tiny model;
the stack's own router beside it, unused), and one streamed chat request is sent to it after a
warm-up; every Python call made on the event loop's thread is seen with ``sys.setprofile``.
The request's calls are those made in tasks that did nothing during an idle window of the same
length just before (so the heartbeat, sweep and statistics loops are left out, and the
handler's task, the token events' subscription and the tasks the request starts are in).
Reported: the router modules those calls live in, and how many distinct functions.

With ``--suite``, the test suite is run too (``python -m pytest -q``) and its wall time is
reported.

    .venv/bin/python bench/router_layout.py [--suite] [--no-trace]

Prints a table, then as its last line one JSON object: largest_folder_files,
largest_folder, largest_file_lines, largest_class_lines, functions_over_60,
most_imports, request_modules, request_functions, suite_s (with --suite).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import emit, say  # noqa: E402

ROUTER = REPO / "services" / "router"
LONG_FUNCTION = 60


# -- from the code ---------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def code_figures() -> dict:
    files = sorted(ROUTER.rglob("*.py"))
    folders = Counter(str(f.parent.relative_to(REPO)) for f in files)
    largest_folder, in_folder = folders.most_common(1)[0]
    lines = {str(f.relative_to(REPO)): len(f.read_text().splitlines()) for f in files}
    largest_file = max(lines, key=lines.__getitem__)
    classes: dict[str, int] = {}
    long_functions: dict[str, int] = {}
    for f in files:
        rel = str(f.relative_to(REPO))
        for node in ast.walk(ast.parse(f.read_text())):
            size = (
                (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            )
            if isinstance(node, ast.ClassDef):
                classes[f"{rel}:{node.name}"] = size
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > LONG_FUNCTION:
                long_functions[f"{rel}:{node.name}"] = size
    largest_class = max(classes, key=classes.__getitem__)
    # The import graph as the layout test reads it (every import statement, resolved to the
    # project module it names).
    from tests.test_layout import GRAPH

    imports = {m: len(found) for m, found in GRAPH.items() if m.startswith("services.router")}
    most = max(imports, key=imports.__getitem__)
    return {
        "router_files": len(files),
        "largest_folder": largest_folder,
        "largest_folder_files": in_folder,
        "largest_file": largest_file,
        "largest_file_lines": lines[largest_file],
        "largest_class": largest_class,
        "largest_class_lines": classes[largest_class],
        "functions_over_60": len(long_functions),
        "long_functions": dict(sorted(long_functions.items(), key=lambda kv: -kv[1])),
        "most_imports_module": most,
        "most_imports": imports[most],
    }


# -- from one request ------------------------------------------------------------------------


class Calls:
    """Calls into the router's code on this thread, by task: (module, function) seen."""

    def __init__(self) -> None:
        # by the task itself (an id could be reused by a later task once one is freed)
        self.by_task: dict[object, set[tuple[str, str]]] = {}
        self._router = str(ROUTER) + os.sep

    def __call__(self, frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's)
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(self._router):
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        module = module_name(Path(filename))
        self.by_task.setdefault(task, set()).add((module, frame.f_code.co_qualname))

    def watching(self, on: bool) -> None:
        sys.setprofile(self if on else None)


# Each prompt's own part is longer than the router's local-prefill bound (64 uncached tokens),
# so the request goes through a prefill worker and the routing policy, as most do.
LONG_PART = " ".join(f"Item {i}: the tide came in over stone number {i * 7}." for i in range(16))


async def streamed_chat(session, url: str, text: str) -> int:  # noqa: ANN001 (aiohttp's)
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"{text}\n{LONG_PART}"},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
    return chunks


async def trace_one_request(state_dir: Path, nats_url: str) -> dict:
    """One streamed chat request through a router in this process; the modules and
    functions of its calls."""
    import aiohttp

    from services.router.service import RouterService
    from services.router.settings import RouterSettings
    from shared.bus import Bus
    from shared.bus.auth import connect_options
    from shared.service import build_app
    from shared.settings import CommonSettings, load_settings

    os.environ.update(
        KVMESH_STATE_DIR=str(state_dir),
        KVMESH_NATS_URL=nats_url,
        KVMESH_ROUTER_HTTP_PORT="0",
        KVMESH_ROUTER_GRPC_PORT="0",
        KVMESH_TRACE_EXPORTER="none",
        KVMESH_SERVICE_ID="router-traced",
    )
    common = load_settings(CommonSettings)
    service = RouterService(common, load_settings(RouterSettings))
    calls = Calls()
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(nats_url, service.service_id, 10, connect_options(common, "router"))
        stack.push_async_callback(bus.close)
        await service.start(stack, bus)
        runner = aiohttp.web.AppRunner(build_app(service))
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:  # the workers' heartbeats reach this router
                async with session.get(f"{url}/v1/models") as resp:
                    if (await resp.json())["data"]:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("the in-process router saw no workers within 60 s")
                await asyncio.sleep(0.2)
            await streamed_chat(session, url, "Warm up: say hello.")  # model text loaded
            started = time.perf_counter()
            await streamed_chat(session, url, "Another warm-up, a little longer this time.")
            took = time.perf_counter() - started
            calls.watching(True)
            await asyncio.sleep(max(1.0, 2 * took))  # the idle window
            seen_idle = set(calls.by_task)
            chunks = await streamed_chat(session, url, "Tell me about the sea, in one line.")
            calls.watching(False)
    request = set().union(*(v for k, v in calls.by_task.items() if k not in seen_idle))
    by_module: dict[str, list[str]] = {}
    for module, function in sorted(request):
        by_module.setdefault(module, []).append(function)
    return {
        "request_modules": len(by_module),
        "request_functions": len(request),
        "by_module": by_module,
        "chunks": chunks,
    }


def trace_figures() -> dict:
    from bench.harness import Stack, free_port

    nats_url = f"nats://127.0.0.1:{free_port()}"
    say("starting a stack (tiny model) for the traced request ...")
    stack = Stack("tiny", 1, extra={"KVMESH_NATS_URL": nats_url, "KVMESH_TRACE_EXPORTER": "none"})
    try:
        stack.wait_ready()
        return asyncio.run(trace_one_request(stack.dir, nats_url))
    finally:
        stack.stop()


def suite_seconds() -> float:
    say("running the test suite ...")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=REPO)
    took = time.monotonic() - started
    if run.returncode:
        say(f"the suite failed (exit {run.returncode}); its time is still reported")
    return round(took, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="store_true", help="also run and time the test suite")
    parser.add_argument("--no-trace", action="store_true", help="skip the traced request")
    args = parser.parse_args()
    figures = code_figures()
    if not args.no_trace:
        figures.update(trace_figures())
    if args.suite:
        figures["suite_s"] = suite_seconds()
    rows = [
        ("router .py files", figures["router_files"]),
        (
            f"files in the largest folder ({figures['largest_folder']})",
            figures["largest_folder_files"],
        ),
        (f"largest file ({figures['largest_file']})", figures["largest_file_lines"]),
        (f"largest class ({figures['largest_class']})", figures["largest_class_lines"]),
        (f"functions over {LONG_FUNCTION} lines", figures["functions_over_60"]),
        (f"most project imports ({figures['most_imports_module']})", figures["most_imports"]),
    ]
    if "request_modules" in figures:
        rows += [
            ("router modules of one streamed chat request", figures["request_modules"]),
            ("router functions of that request", figures["request_functions"]),
        ]
    if "suite_s" in figures:
        rows.append(("test suite wall time (s)", figures["suite_s"]))
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for name, size in figures["long_functions"].items():
        print(f"  long: {name} ({size} lines)")
    for module, functions in figures.get("by_module", {}).items():
        print(f"  on the request's path: {module} ({len(functions)}): {', '.join(functions)}")
    keys = (
        "largest_folder_files",
        "largest_folder",
        "largest_file_lines",
        "largest_class_lines",
        "functions_over_60",
        "most_imports",
        "request_modules",
        "request_functions",
        "suite_s",
    )
    emit({k: figures[k] for k in keys if k in figures})


if __name__ == "__main__":
    main()
