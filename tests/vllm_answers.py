"""What the vLLM tests share: vLLM's own greedy answer to a prompt (from an engine of its own
in the test's process, no kvmesh around it), and the check that the mesh answers the same,
token for token, whole and streamed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import REAL
from tests.stack import Stack

MAX_TOKENS = 24


def own_greedy_answer(state_dir: Path, prompt: list[int]) -> list[int]:
    """vLLM's own greedy answer (the export the stack's workers made under ``state_dir`` is
    reused)."""
    from shared.engine.interface import EngineOptions
    from shared.engine.sampling import SamplingParams
    from shared.engine.vllm.engine import VllmEngine
    from shared.model.catalog import resolve

    engine = VllmEngine.load(resolve(REAL, {}), state_dir, EngineOptions(kv_cache_tokens=4096))

    async def run() -> list[int]:
        await engine.start()
        try:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            return [t async for g in engine.generate("own", prompt, params) for t in g.token_ids]
        finally:
            await engine.stop()

    return asyncio.run(run())


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
