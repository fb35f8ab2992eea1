"""Plain decode steps on a GPU, replayed as CUDA graphs.

A decode step of a small model is hundreds of small kernels; launched one by one from Python,
the launches, not the GPU, set its pace. A CUDA graph records the step's kernels once and
replays them with one launch. A graph has fixed shapes and addresses, so a step is padded:
its batch to the next size of ``BATCHES``, its contexts to the next power of two (at least
``MIN_CONTEXT``), and the inputs are copied into the graph's own buffers before each replay.
Padded rows write their KV into a scratch block the engine holds for them, and read only it.
One graph per (batch, context) size, made on first use; all share one memory pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.torch.model import KVCache, Transformer

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # tokens, positions, new_slots [B]; context [B, L]; lens [B]
    logits: torch.Tensor  # [B, V] fp32
    best: torch.Tensor  # [B]: each row's argmax


class DecodeGraphs:
    def __init__(self, model: Transformer, cache: KVCache, scratch_slot: int) -> None:
        self.model = model
        self.cache = cache
        self.scratch = scratch_slot
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None  # (the graphs' memory pool, made with the first)
        self.pin = model.device.type == "cuda"

    @staticmethod
    def fits(batch: int) -> bool:
        return batch <= BATCHES[-1]

    def step(
        self, tokens: list[int], positions: list[int], contexts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[int]]:
        """Logits [B, V] and each row's argmax for one new token per sequence: ``tokens`` and
        ``positions`` [B], ``contexts`` each sequence's slots (its new token's last)."""
        b, longest = len(tokens), max(len(c) for c in contexts)
        size = next(n for n in BATCHES if n >= b)
        width = max(MIN_CONTEXT, 1 << (longest - 1).bit_length())
        host = self._inputs(size, width, tokens, positions, contexts)
        if not self.pin:  # (no GPU: the same padded step, run as it is, for tests)
            logits = self.model.logits(self.model.decode(*host, self.cache))
            return logits[:b], logits.argmax(-1)[:b].tolist()
        g = self.graphs.get((size, width))
        if g is None:
            g = self.graphs[(size, width)] = self._record(host)
        else:
            for buf, value in zip(g.inputs, host, strict=True):
                buf.copy_(value, non_blocking=True)
            g.graph.replay()
        return g.logits[:b], g.best[:b].tolist()

    def _inputs(
        self,
        size: int,
        width: int,
        tokens: list[int],
        positions: list[int],
        contexts: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """The step's inputs at the graph's shapes, in pinned host memory."""
        b = len(tokens)
        pad = size - b
        context = torch.full((size, width), self.scratch, dtype=torch.int64, pin_memory=self.pin)
        for row, slots in enumerate(contexts):
            context[row, : len(slots)] = slots
        lens = torch.tensor([len(c) for c in contexts] + [1] * pad, dtype=torch.int64)
        new_slots = torch.tensor([int(c[-1]) for c in contexts] + [self.scratch] * pad)
        pinned = (lambda t: t.pin_memory()) if self.pin else (lambda t: t)
        return (
            pinned(torch.tensor(tokens + [0] * pad, dtype=torch.int64)),
            pinned(torch.tensor(positions + [0] * pad, dtype=torch.int64)),
            pinned(new_slots),
            context,
            pinned(lens),
        )

    def _record(self, host: tuple[torch.Tensor, ...]) -> _Graph:
        """The step's graph, recorded after two eager runs on a side stream (which also make
        this step's output: the inputs are this step's)."""
        device = self.model.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        inputs = tuple(t.to(device) for t in host)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.model.logits(self.model.decode(*inputs, self.cache))
            return logits, logits.argmax(-1)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, best = run()
        graph.replay()
        return _Graph(graph, inputs, logits, best)
