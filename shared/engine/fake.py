"""A fake engine for benchmarks of the mesh itself, named as such: ``fake-paced``.

Prefill is the torch engine's (the tiny model's real pass), so KV moves between workers and
reaches the tiers as in production; decode computes nothing: every running sequence gets one
fixed token per step, a step every ``KVMESH_FAKE_STEP_MS`` milliseconds (default 20: 50
tokens/s per stream). A decode worker on it is never the limit, so what a benchmark measures
is the router and the bus (bench/router_capacity.py). Never for serving: its answers are
one token repeated.
"""

from __future__ import annotations

import os
import time

from shared.engine.interface import StepOutput
from shared.engine.torch.engine import TorchEngine


class PacedFakeEngine(TorchEngine):
    """TorchEngine's prefill and bookkeeping; a paced, compute-free decode step."""

    def start(self) -> None:
        super().start()
        self.step_s = float(os.environ.get("KVMESH_FAKE_STEP_MS", "20")) / 1e3
        self.token = self.tokenizer.encode(" tok", add_special_tokens=False).ids[0]
        self._next = 0.0

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
            seq.output_ids.append(self.token)
            seq.n_cached = seq.n_tokens - 1  # (its KV is not computed: never read back here)
            if len(seq.output_ids) >= seq.params.max_tokens:
                seq.finish_reason = "length"
            outputs.append(StepOutput(seq_id, self.token, seq.finish_reason))
        self.running = [s for s in self.running if not self.seqs[s].finished]
        return outputs
