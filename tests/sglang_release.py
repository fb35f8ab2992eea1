"""The pinned SGLang release's own code, for the tests of kvmesh's SGLang plug points.

SGLang does not install here (it needs CUDA), but several of its modules import on CPU with
kvmesh's torch once its package's top-level ``__init__`` (which loads the GPU runtime) is
skipped: the HiCache storage interface and its ``dynamic`` factory, the KV event types, their
recorder and ZMQ publisher, ``ServerArgs``, the page hash (a C++ extension of SGLang's,
compiled on first use). ``make test`` fetches the release's wheel from the package registry
into ``.venv/sglang-<version>`` (never committed); ``load()`` makes ``import sglang.…`` find
it. The tests that use it are skipped, saying so, where it was not fetched.
"""

from __future__ import annotations

import ast
import os
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

VERSION = "0.5.23"  # as the Makefile fetches it
REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / ".venv" / f"sglang-{VERSION}"


def load() -> Path:
    """The release's ``sglang`` package, importable (its top-level ``__init__`` skipped)."""
    package = ROOT / "sglang"
    if not (package / "srt").is_dir():
        pytest.skip(f"SGLang {VERSION}'s code is not in {ROOT} (make test fetches it)")
    loaded = sys.modules.get("sglang")
    if loaded is None:
        stub = types.ModuleType("sglang")
        stub.__path__ = [str(package)]  # type: ignore[attr-defined]
        sys.modules["sglang"] = stub
    elif list(getattr(loaded, "__path__", [])) != [str(package)]:
        pytest.skip(f"another sglang is imported: {loaded}")
    # SGLang's page hash is a C++ extension built on first use: kept beside the release.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "torch-extensions"))
    return package


def _methods(path: Path, cls: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source of class ``cls``'s methods ``names`` in a file of the release."""
    tree = ast.parse(path.read_text())
    source = path.read_text()
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    found = {
        f.name: textwrap.dedent(ast.get_source_segment(source, f) or "")
        for f in node.body
        if isinstance(f, ast.FunctionDef) and f.name in names
    }
    assert set(found) == set(names), f"{cls} in SGLang {VERSION} lacks {set(names) - set(found)}"
    return found


class HostPoolStandIn:
    """A stand-in for SGLang's ``MHATokenToKVPoolHost`` (whose module pulls in SGLang's GPU
    model configs), running **the release's own** ``init_kv_buffer``, ``get_data_page``,
    ``get_dummy_flat_data_page`` and ``set_from_flat_data_page``, taken from its source: the
    buffer's shape in each layout and what SGLang reads and writes as a page are SGLang's, not
    this test's idea of them."""

    def __init__(
        self,
        layout: str,
        layers: int,
        heads: int,
        head_dim: int,
        page_size: int,
        pages: int,
        dtype: torch.dtype,
    ) -> None:
        self.layout, self.layer_num, self.head_num = layout, layers, heads
        self.head_dim, self.page_size, self.page_num = head_dim, page_size, pages
        self.size, self.dtype = pages * page_size, dtype
        self.device, self.pin_memory, self.allocator = "cpu", False, None
        self._transfer_device = torch.device("cpu")
        self.kv_buffer = self.init_kv_buffer()

    @classmethod
    def build(cls) -> type[HostPoolStandIn]:
        package = load()
        names = (
            "init_kv_buffer",
            "get_data_page",
            "get_dummy_flat_data_page",
            "set_from_flat_data_page",
        )
        found = _methods(package / "srt/mem_cache/pool_host/mha.py", "MHATokenToKVPoolHost", names)

        def alloc(dims, dtype, device, pin_memory, allocator, **_) -> torch.Tensor:  # noqa: ANN001
            return torch.zeros(dims, dtype=dtype, device=device)

        scope = {"torch": torch, "ALLOC_MEMORY_FUNCS": {"cpu": alloc}, "Optional": object}
        members = {}
        for name, source in found.items():
            exec(compile(source, f"sglang-{VERSION}:mha.py:{name}", "exec"), scope, members)  # noqa: S102
        return type("SglangHostPool", (cls,), members)


def storage_config(extra: dict, **overrides):  # noqa: ANN003, ANN201
    """SGLang's ``HiCacheStorageConfig`` for one rank of an MHA model, as its cache controller
    builds it, with the backend's extra config."""
    load()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="smollm2",
        extra_config=extra,
    )
    return HiCacheStorageConfig(**{**fields, **overrides})
