"""The layout says what may import what; these tests read every module's imports (with ast,
every import statement, also those inside functions or under TYPE_CHECKING) and hold the code
to it. Each failure names the file, the line and the import."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import REPO, service_env

PARTS = ("shared", "services", "kvmesh", "simulator")  # the project's packages


@dataclass(frozen=True)
class Import:
    file: str  # path from the repo root
    line: int
    module: str  # the project module imported (the longest one that exists)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for part in PARTS:
        for path in (REPO / part).rglob("*.py"):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                found[module_name(path)] = path
    return found


MODULES = project_modules()


def resolve(name: str) -> str | None:
    """The project module ``name`` refers to: itself, or the package or module defining it
    (``from shared.bus import Bus`` → shared.bus)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(REPO))
    found: dict[tuple[int, str], Import] = {}  # one per line and module
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from a.b import c": c may be a module of a.b, or a name defined in it
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = resolve(name)
            if target is not None and target != module:
                found[node.lineno, target] = Import(rel, node.lineno, target)
    return list(found.values())


GRAPH = {m: imports_of(m) for m in MODULES}


def part_of(module: str) -> str:
    """shared, kvmesh, simulator, or services.<role>."""
    head = module.split(".")
    return ".".join(head[:2]) if head[0] == "services" and len(head) > 1 else head[0]


def test_the_project_is_found() -> None:
    assert {"shared.engine.interface", "services.router.service", "kvmesh.main"} <= set(MODULES)
    assert {"simulator.replay", "shared.model.text"} <= set(MODULES)


def test_shared_imports_no_service_and_nothing_above_it() -> None:
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if part_of(m) == "shared"
        for i in found
        if part_of(i.module) != "shared"
    ]
    assert not bad, "shared/ imports only shared/:\n" + "\n".join(bad)


def test_no_service_imports_another_or_the_parts_above() -> None:
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if m.startswith("services.")
        for i in found
        if part_of(i.module) not in ("shared", part_of(m))
    ]
    assert not bad, "a service imports only itself and shared/:\n" + "\n".join(bad)


def test_only_the_cli_and_the_simulator_import_more_than_one_service() -> None:
    services: dict[str, set[str]] = {}
    for m, found in GRAPH.items():
        for i in found:
            if i.module.startswith("services."):
                services.setdefault(part_of(m), set()).add(part_of(i.module))
    many = {part: s for part, s in services.items() if len(s) > 1}
    assert set(many) <= {"kvmesh", "simulator"}, f"parts importing several services: {many}"
    assert "simulator" in many, "the simulator reuses the router's and cachemeta's code"


def test_nothing_imports_the_cli() -> None:
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if part_of(m) != "kvmesh"
        for i in found
        if part_of(i.module) == "kvmesh"
    ]
    assert not bad, "the kvmesh command is above everything:\n" + "\n".join(bad)


def test_the_simulator_reuses_pure_code_only() -> None:
    """No service's asyncio/NATS layer (its service.py) in the simulator."""
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if part_of(m) == "simulator"
        for i in found
        if i.module.startswith("services.") and i.module.endswith((".service", ".__main__"))
    ]
    assert not bad, "\n".join(bad)


def test_workers_reach_the_engine_through_its_interface() -> None:
    """Only the registry names a backend; services and the worker code import the interface."""
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if not m.startswith("shared.engine")
        for i in found
        if i.module.startswith("shared.engine.torch")
    ]
    assert not bad, "a backend imported outside shared/engine:\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    """Tarjan's strongly connected components over the module graph: every component of more
    than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for i in GRAPH[m]:
            if i.module not in index:
                visit(i.module)
                low[m] = min(low[m], low[i.module])
            elif i.module in on_stack:
                low[m] = min(low[m], index[i.module])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                circles.append(component)

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    described = [
        "\n".join(str(i) for m in sorted(c) for i in GRAPH[m] if i.module in c) for c in circles
    ]
    assert not circles, "import circles:\n\n" + "\n\n".join(described)


ROUTER_WITHOUT_TORCH = textwrap.dedent(
    """
    import asyncio
    import sys
    from contextlib import AsyncExitStack

    from aiohttp import web

    from services.router.service import RouterService
    from services.router.settings import RouterSettings
    from shared.bus import Bus
    from shared.bus.auth import connect_options
    from shared.service import build_app
    from shared.settings import CommonSettings, load_settings


    async def main() -> None:
        common = load_settings(CommonSettings)
        service = RouterService(common, load_settings(RouterSettings))
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(
                common.nats_url, service.service_id, 10, connect_options(common, "router")
            )
            stack.push_async_callback(bus.close)
            await service.start(stack, bus)
            runner = web.AppRunner(build_app(service))
            await runner.setup()  # the application started, on no socket
            stack.push_async_callback(runner.cleanup)
            for model in ("smollm2-135m-instruct", "tiny"):
                text = await service.core.preparer.text_model(model)
                chat = text.chat_template.render([{"role": "user", "content": "Hello"}])
                assert text.tokenizer.encode(chat).ids, model
        print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "torch"))


    asyncio.run(main())
    """
)


@pytest.mark.timeout(120)
def test_the_router_runs_without_torch(nats_url: str, state_dir: Path) -> None:
    """The router's application, started on a real NATS with both models' text loaded (the
    real one's config, tokenizer and template read from its GGUF file), has not imported torch."""
    env = service_env(nats_url, state_dir, KVMESH_TRACE_EXPORTER="none")
    run = subprocess.run(
        [sys.executable, "-c", ROUTER_WITHOUT_TORCH],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "loaded: []", run.stdout
