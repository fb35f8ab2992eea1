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
    assert "simulator" in services, "the simulator reuses the router's code"


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
    """No service's asyncio/NATS layer (its service.py) in the simulator, and of the router
    only its pure routing stage."""
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if part_of(m) == "simulator"
        for i in found
        if i.module.startswith("services.")
        and (
            i.module.endswith((".service", ".__main__"))
            or (part_of(i.module) == "services.router" and stage_of(i.module) != "routing")
        )
    ]
    assert not bad, "\n".join(bad)


# -- the router, in stages along the request path -------------------------------------------

ROUTER = REPO / "services" / "router"
# Each stage imports only the stages after it (and itself): transport → format → request →
# dispatch → routing, with batch work beside the transports, what is recorded beside the
# format, tenancy under the request, the servers kvmesh did not start beside dispatch. The
# root's modules: the composition (service, core) above every stage, the settings and the one
# error type under them.
STAGES = (
    "__main__",
    "service",
    "api",
    "core",
    "batch",
    "formats",
    "observe",
    "request",
    "tenancy",
    "upstream",
    "dispatch",
    "settings",
    "routing",
    "errors",
)


def stage_of(module: str) -> str:
    """The router's stage (a folder) or root module that ``module`` belongs to."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


ROUTER_MODULES = {m: p for m, p in MODULES.items() if m.startswith("services.router.")}


def test_every_router_module_is_in_a_stage() -> None:
    unknown = sorted({stage_of(m) for m in ROUTER_MODULES} - set(STAGES))
    assert not unknown, f"router modules outside the stages: {unknown} (see STAGES)"


def test_the_router_stages_import_one_way() -> None:
    rank = {stage: i for i, stage in enumerate(STAGES)}
    bad = [
        f"{i} ({stage_of(m)} → {stage_of(i.module)})"
        for m in ROUTER_MODULES
        for i in GRAPH[m]
        if i.module.startswith("services.router.") and rank[stage_of(i.module)] < rank[stage_of(m)]
    ]
    assert not bad, "a stage imports a stage before it:\n" + "\n".join(bad)


def test_no_api_adapter_imports_another() -> None:
    """formats/<api>.py and <api>_writer.py import no other API's (the shared parts are in
    wire.py; the endpoint table lists them all)."""

    def api_of(module: str) -> str:
        return module.rsplit(".", 1)[1].removesuffix("_writer")

    adapters = {"openai", "anthropic", "responses"}
    bad = [
        str(i)
        for m in ROUTER_MODULES
        if stage_of(m) == "formats" and api_of(m) in adapters
        for i in GRAPH[m]
        if stage_of(i.module) == "formats"
        and api_of(i.module) in adapters
        and api_of(i.module) != api_of(m)
    ]
    assert not bad, "\n".join(bad)


def test_routing_is_pure_and_synchronous() -> None:
    """No event loop, bus or server in routing/: the simulator runs the same code."""
    io = ("asyncio", "nats", "grpc", "aiohttp", "opentelemetry")
    bad = []
    for m, path in ROUTER_MODULES.items():
        if stage_of(m) != "routing":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in io]
    assert not bad, "\n".join(bad)


def test_each_router_stage_says_what_it_takes_and_gives() -> None:
    missing = [
        str(init.relative_to(REPO))
        for init in ROUTER.glob("*/__init__.py")
        if len(ast.get_docstring(ast.parse(init.read_text())) or "") < 80
    ]
    assert not missing, f"a stage folder's __init__.py says what it takes and gives: {missing}"


# How big a room may grow before it is split (STYLE.md): files in a folder, lines in a file,
# a class and a function, project modules one module imports.
MOST_FILES, MOST_LINES, MOST_CLASS, MOST_FUNCTION, MOST_IMPORTS = 12, 400, 250, 60, 12


def test_the_router_rooms_stay_small() -> None:
    too_big = []
    folders: dict[Path, int] = {}
    for m, path in ROUTER_MODULES.items():
        folders[path.parent] = folders.get(path.parent, 0) + 1
        rel = path.relative_to(REPO)
        if (n := len(path.read_text().splitlines())) > MOST_LINES:
            too_big.append(f"{rel}: {n} lines (at most {MOST_LINES})")
        if (n := len(GRAPH[m])) > MOST_IMPORTS:
            too_big.append(f"{rel}: imports {n} project modules (at most {MOST_IMPORTS})")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            most = MOST_CLASS if isinstance(node, ast.ClassDef) else MOST_FUNCTION
            if (n := node.end_lineno - node.lineno + 1) > most:
                too_big.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {most})")
    for folder, n in folders.items():
        if n > MOST_FILES:
            too_big.append(f"{folder.relative_to(REPO)}: {n} files (at most {MOST_FILES})")
    assert not too_big, "\n".join(too_big)


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


HOSTING = (
    "shared.hosting",
    "shared.worker",
    "shared.owning_worker",
    "shared.bus",
    "shared.kvstore.tiers",
)


def test_the_engine_imports_nothing_that_hosts_it() -> None:
    """The engine package is below what runs it: the loop on a thread or in a process of its
    own (shared/hosting), the workers' common code, the bus, the worker's tiers."""
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if m.startswith("shared.engine")
        for i in found
        if i.module.startswith(HOSTING)
    ]
    assert not bad, "the engine imports what hosts it:\n" + "\n".join(bad)


def test_the_wire_messages_import_no_engine() -> None:
    """What crosses the bus (sampling included) is plain messages: the router and the wire
    read them without the engine package."""
    bad = [
        str(i)
        for m, found in GRAPH.items()
        if m.startswith("shared.messages")
        for i in found
        if i.module.startswith(("shared.engine", "shared.hosting"))
    ]
    assert not bad, "a message imports the engine:\n" + "\n".join(bad)


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
                text = await service.core.preparer.renderer.text_model(model)
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
