"""A workload described, not recorded: conversations whose every turn sends the whole history
again (as chat and agent clients do), made into a trace for the simulator.

A conversation opens with one of a few shared system prompts (``system_tokens``); each turn
adds ``fresh`` tokens no earlier prompt had (the answer before it, ``output_mean``, and the
user's or a tool's new text), so turn k's prompt is system + k × fresh − output. Over T turns
the mean prompt m is system + fresh × (T + 1) / 2 − output, and the share of the prompts an
earlier one sent (the reuse) is 1 − (T × fresh − output) / (T × m), the system prompts shared.
Given m and the reuse, these fix fresh and T: 77K tokens at 96% reuse with 1K-token answers
are 48 turns of 3.1K fresh tokens.

Conversations start as a Poisson process; a turn follows the one before after a think time
(lognormal, median ``think_s``), except that a share ``come_back`` of them come back days later
(uniform over ``come_back_days``): those are what a storage tier's retention decides. (Such
a conversation's turns before the gap are placed that much earlier, among those before the
trace: the trace holds the turns that come back, with their history days old.)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from simulator.traces import TraceRequest

DAY = 86400.0


@dataclass(frozen=True)
class Workload:
    rate: float = 2.0  # conversation turns a second (all conversations together)
    requests: int = 2000
    input_mean: int = 8192  # tokens per prompt
    output_mean: int = 256  # tokens per answer
    reuse: float = 0.9  # share of prompt tokens sent by an earlier turn
    think_s: float = 30.0  # median time between a turn's answer and the next turn
    come_back: float = 0.0  # share of turns that come back days later
    come_back_days: tuple[float, float] = (1.0, 10.0)
    system_tokens: int = 1024  # each conversation's system prompt (one of ``systems``)
    systems: int = 4
    agent_share: float = 0.0  # of conversations, agents' (their retention class)
    block_size: int = 512
    seed: int = 0
    # LoRA adapters: each conversation computed under one of ``adapters`` (0: none), picked
    # with Zipf popularity (the k-th most used ∝ 1 / k^adapter_skew); its KV is its own.
    adapters: int = 0
    adapter_skew: float = 1.0

    def check(self) -> None:
        """ValueError naming the field and its limit."""
        limits = (
            ("rate", self.rate > 0, "above 0"),
            ("requests", self.requests >= 1, "at least 1"),
            ("input_mean", self.input_mean >= self.block_size, "at least one block"),
            ("output_mean", self.output_mean >= 1, "at least 1"),
            ("reuse", 0 <= self.reuse < 1, "in [0, 1)"),
            ("think_s", self.think_s > 0, "above 0"),
            (
                "output_mean",
                self.output_mean < self.fresh,
                f"below a turn's fresh tokens, (1 - reuse) × input_mean = {self.fresh:.0f}",
            ),
            ("system_tokens", 0 <= self.system_tokens < self.input_mean, "in [0, input_mean)"),
            ("come_back", 0 <= self.come_back <= 1, "in [0, 1]"),
            ("agent_share", 0 <= self.agent_share <= 1, "in [0, 1]"),
            ("block_size", self.block_size >= 1, "at least 1"),
        )
        for name, ok, limit in limits:
            if not ok:
                raise ValueError(f"{name}: {limit} (got {getattr(self, name)})")

    @property
    def turns(self) -> float:
        """Turns per conversation, for the mean input at the reuse (``fresh``'s equations,
        solved by iterating: they converge in a few steps)."""
        m, s, o, new = self.input_mean, self.system_tokens, self.output_mean, 1 - self.reuse
        t = max(1.0, 2 * (m - s + o) / (new * m) - 1)
        for _ in range(50):
            t = max(1.0, (2 * (m - s + o) - o * (t + 1) / t) / (new * m) - 1)
        return t

    @property
    def fresh(self) -> float:
        """Tokens each turn adds that no earlier prompt had."""
        return (1 - self.reuse) * self.input_mean + self.output_mean / self.turns


def generate(w: Workload) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """The workload's requests, by time (the first at 0), and the last turn each conversation
    had before it began (negative times): what the storage tier holds when it starts."""
    w.check()
    rng = random.Random(w.seed)
    bs = w.block_size
    out: list[tuple[float, TraceRequest]] = []
    earlier: list[TraceRequest] = []
    # Conversations start so that turns arrive at ``rate`` on average, from before the trace
    # begins (it opens in the steady state, not with every conversation at its first turn);
    # the trace keeps the first ``requests`` turns from 0 on.
    popularity = [1 / (k + 1) ** w.adapter_skew for k in range(w.adapters)]
    start_rate = w.rate / w.turns
    horizon = 1.5 * w.requests / w.rate  # (at least: then cut to ``requests``)
    t, c, sigma = -w.turns * w.think_s * math.exp(0.5), 0, 0.5
    own_mean = w.fresh - w.output_mean  # a turn's new text (the answer before is the rest)
    while t < horizon or len(out) < w.requests:
        t += rng.expovariate(start_rate)
        system = rng.randrange(w.systems)
        retention = "agent" if rng.random() < w.agent_share else "chat"
        turns = int(w.turns) + (rng.random() < w.turns % 1)
        adapter = ""
        if popularity:
            adapter = f"lora{rng.choices(range(w.adapters), popularity)[0]}"
        history = [f"{adapter}s{system}b{i}" for i in range(w.system_tokens // bs)]
        tokens, at = w.system_tokens, t
        turns_at: list[tuple[float, TraceRequest]] = []
        for _ in range(turns):
            tokens += max(1, round(own_mean * math.exp(rng.gauss(-(sigma**2) / 2, sigma))))
            history = history + [f"c{c}b{i}" for i in range(len(history), tokens // bs)]
            n_out = max(1, round(rng.expovariate(1 / w.output_mean)))
            turns_at.append((at, TraceRequest(at, tokens, n_out, history, retention, adapter)))
            tokens += n_out  # (the answer is in the next turn's history)
            if rng.random() < w.come_back:
                # Days later: the turns before are moved back by as much, so the conversation
                # goes on where it was, its history last used days before.
                gap = rng.uniform(*w.come_back_days) * DAY
                turns_at = [(when - gap, r) for when, r in turns_at]
            at += w.think_s * math.exp(rng.gauss(0, 1))
        out.extend((when, r) for when, r in turns_at if when >= 0)
        before = [(when, r) for when, r in turns_at if when < 0]
        if before:  # (its last turn before holds every block the others had)
            when, r = before[-1]
            earlier.append(replace(r, t=when))
        c += 1
    out.sort(key=lambda x: x[0])
    out = out[: w.requests]
    t0 = out[0][0] if out else 0.0
    requests = [replace(r, t=at - t0) for at, r in out]
    earlier.sort(key=lambda r: r.t)
    before = [replace(r, t=r.t - t0) for r in earlier]
    return requests, before
