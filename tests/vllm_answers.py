"""What the vLLM tests share: vLLM's own greedy answer to a prompt (from an engine of its own
in the test's process, no kvmesh around it: one for the run), and the check that the mesh
answers the same, token for token, whole and streamed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import REAL
from tests.stack import Stack

MAX_TOKENS = 24


class OwnVllm:
    """vLLM's own greedy answers (no kvmesh around it), from one engine for the whole run (a
    vLLM engine takes ~20 s to start here): made at the first question, with the export the
    asking stack's workers made under its state dir, and running one sequence at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()  # the engine's tasks live on it, between calls
        self.engine = None
        self.asked = 0  # (each question's request ids its own)

    def _engine(self, state_dir: Path):  # noqa: ANN202
        if self.engine is None:
            from shared.engine.interface import EngineOptions
            from shared.engine.vllm.engine import VllmEngine
            from shared.model.catalog import resolve

            options = EngineOptions(kv_cache_tokens=4096, max_running=1)
            self.engine = VllmEngine.load(resolve(REAL, {}), state_dir, options)
            self.loop.run_until_complete(self.engine.start())
        return self.engine

    def answer(self, state_dir: Path, prompt: list[int], order: list[str] | None = None):  # noqa: ANN201
        """The greedy answer to ``prompt``; with ``order``, then the order in which two
        requests queued behind a running one start: "low" (rank 3) asked before "high"
        (rank 0), as kvmesh's vLLM worker passes a request's class."""
        from shared.messages.sampling import SamplingParams

        engine = self._engine(state_dir)
        self.asked += 1
        n = self.asked

        async def first_piece(rid: str, rank: int) -> None:
            params = SamplingParams(max_tokens=2, temperature=0)
            async for _ in engine.generate(f"{rid}-{n}", prompt, params, rank=rank):
                order.append(rid)
                return

        async def run() -> list[int]:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            own = [
                t async for g in engine.generate(f"own-{n}", prompt, params) for t in g.token_ids
            ]
            if order is not None:
                long = engine.generate(f"long-{n}", prompt, SamplingParams(max_tokens=64))
                await anext(long)  # running: the next two wait in vLLM's queue
                low = asyncio.create_task(first_piece("low", 3))
                await asyncio.sleep(0.2)
                high = asyncio.create_task(first_piece("high", 0))
                await asyncio.sleep(0.2)
                await long.aclose()
                await asyncio.gather(low, high)
            return own

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.stop())
        self.loop.close()


def answered_as_vllm(stack: Stack, prompt: list[int], own: list[int]) -> dict:
    """Check the mesh's greedy answer to ``prompt``, whole and streamed, is ``own``; returns
    the whole answer's kvmesh figures."""
    from shared.model.text import load_text_model

    client = stack.client()
    whole = client.completions.create(
        model=REAL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    )
    assert len(whole.choices[0].logprobs.tokens) == len(own)
    tokenizer = load_text_model(REAL, Path(stack.dir)).tokenizer
    own_text = tokenizer.decode(own, skip_special_tokens=True)
    assert whole.choices[0].text == own_text and "Paris" in own_text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=REAL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert streamed == own_text
    return whole.model_extra["kvmesh"]
