"""A fake engine for benchmarks of the mesh itself, named as such: ``fake-paced``.

Prefill is the torch engine's (the tiny model's real pass), so KV moves between workers and
reaches the tiers as in production; decode computes nothing: every running sequence gets one
fixed token per step, a step every ``KVMESH_FAKE_STEP_MS`` milliseconds (default 20: 50
tokens/s per stream). A decode worker on it is never the limit, so what a benchmark measures
is the router and the bus (bench/router_capacity.py). With ``KVMESH_FAKE_PREFILL=1`` prefill
computes nothing either: a prompt's blocks are taken (and its KV, never written, moves as
usual) and its first token is the fixed one, so a benchmark charges no model compute to the
mesh (bench/e2e.py; its blocks are not worth keeping: run it without tiers). Never for
serving: its answers are one token repeated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from shared.engine.interface import (
    ImageEmbeds,
    PoolExhausted,
    PrefillRequest,
    Prefix,
    StepOutput,
)
from shared.engine.torch.engine import TorchEngine
from shared.engine.torch.sequence import Sequence
from shared.messages.sampling import SamplingParams


class PacedFakeEngine(TorchEngine):
    """TorchEngine's prefill and bookkeeping; a paced, compute-free decode step."""

    def start(self) -> None:
        super().start()
        self.step_s = float(os.environ.get("KVMESH_FAKE_STEP_MS", "20")) / 1e3
        self.token = self.tokenizer.encode(" tok", add_special_tokens=False).ids[0]
        self._next = 0.0
        self.fake_prefill = os.environ.get("KVMESH_FAKE_PREFILL", "") == "1"

    def prefill(
        self,
        seq_id: str,
        token_ids: list[int],
        params: SamplingParams,
        prefix: Prefix | None = None,
        images: tuple[ImageEmbeds, ...] = (),
        handoff: bool = False,
        cancelled: Callable[[], bool] | None = None,
        pause: Callable[[], bool] | None = None,
    ) -> StepOutput:
        if not self.fake_prefill:
            return super().prefill(
                seq_id, token_ids, params, prefix, images, handoff, cancelled, pause
            )
        request = PrefillRequest(seq_id, token_ids, params, prefix, handoff, images)
        return self._fixed_first(self._admit(request), handoff)

    def prefill_batch(self, requests: list[PrefillRequest]) -> list[StepOutput | Exception]:
        if not self.fake_prefill:
            return super().prefill_batch(requests)
        results: list[StepOutput | Exception] = []
        for req in requests:
            try:
                results.append(self._fixed_first(self._admit(req), req.handoff))
            except (ValueError, PoolExhausted) as err:
                results.append(err)
        return results

    def _fixed_first(self, seq: Sequence, handoff: bool) -> StepOutput:
        """A prompt "computed": its KV taken as it is, the fixed token its first."""
        seq.n_cached = len(seq.prompt_ids)
        out = self._fixed_token(seq)
        if not seq.finished and not handoff:
            self.running.append(seq.seq_id)
        return out

    def _fixed_token(self, seq: Sequence) -> StepOutput:
        seq.output_ids.append(self.token)
        if len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish_reason = "length"
        return StepOutput(seq.seq_id, self.token, seq.finish_reason)

    def step(self) -> list[StepOutput]:
        if not self.running:
            return []
        now = time.perf_counter()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(now, self._next) + self.step_s
        outputs = []
        for seq_id in self.running:
            seq = self.seqs[seq_id]
            outputs.append(self._fixed_token(seq))
            seq.n_cached = seq.n_tokens - 1  # (its KV is not computed: never read back here)
        self.running = [s for s in self.running if not self.seqs[s].finished]
        return outputs
