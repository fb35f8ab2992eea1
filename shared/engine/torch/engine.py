"""The torch engine: our own Llama-family model (``model.py``) over a paged KV cache, on CPU
or CUDA, behind the ``Engine`` interface."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from llguidance import LLTokenizer

from shared.engine import kvformat
from shared.engine.interface import (
    Cancelled,
    Engine,
    EngineOptions,
    EngineStats,
    ImageEmbeds,
    Paused,
    PoolExhausted,
    PrefillRequest,
    Prefix,
    StepOutput,
)
from shared.engine.torch.blocks import BlockPool
from shared.engine.torch.graphs import DecodeGraphs
from shared.engine.torch.kvio import KvIO
from shared.engine.torch.loader import LoadedModel, load_model
from shared.engine.torch.lora import BASE, AdapterSlots, LoraPass
from shared.engine.torch.model import KVCache, Segment, Transformer
from shared.engine.torch.sampler import held_back, logprobs_of, sample
from shared.engine.torch.sequence import Sequence
from shared.engine.torch.speculate import (
    MODES,
    AcceptanceTable,
    CostCurve,
    Draft,
    NgramIndex,
    cached_costs,
    choose_lengths,
)
from shared.eplb.balancer import BalancerOptions, ExpertBalancer
from shared.messages.sampling import SamplingParams, TokenLogprobs, stop_string_hit
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig
from shared.model.grammar import GrammarError, Matcher, vocabulary
from shared.model.lora import AdapterSpec

SCORE_ROWS = 256  # prompt rows whose logits are made at once (prompt_logprobs)
log = logging.getLogger(__name__)


def compute_device(name: str) -> torch.device:
    """The torch device named (``cpu``, ``cuda``, ``cuda:N``), checked to be there."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: cpu, cuda or cuda:N (got {name!r})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name} asked, but torch {torch.__version__} sees no GPU")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device: {name}, but there are {torch.cuda.device_count()} GPUs")
    elif device.type != "cpu":
        raise ValueError(f"device: cpu, cuda or cuda:N (got {name!r})")
    return device


class TorchEngine(Engine):
    def __init__(self, model: LoadedModel, options: EngineOptions = EngineOptions()) -> None:
        self.config = model.config
        self.options = options
        self.block_size = options.block_size
        self.tokenizer = model.tokenizer
        self.device = compute_device(options.device)
        dtype_name = options.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        self.dtype = kvformat.DTYPES[dtype_name]
        weights = {k: v.to(self.device, self.dtype) for k, v in model.weights.items()}
        self.model = Transformer(model.config, weights)
        n_blocks = options.kv_cache_tokens // options.block_size
        self.pool = BlockPool(n_blocks, options.block_size)
        self.cache = KVCache(model.config, n_blocks * options.block_size, self.dtype, self.device)
        self.seqs: dict[str, Sequence] = {}
        self.running: list[str] = []
        self.kv = KvIO(model.config, self.pool, self.cache, dtype_name)
        self.graphs: DecodeGraphs | None = None  # a GPU's plain decode steps (not a MoE's)
        if self.device.type == "cuda" and options.cuda_graphs and not model.config.moe:
            scratch = self.pool.allocate(1)[0]  # (what padded rows write and read)
            self.graphs = DecodeGraphs(self.model, self.cache, scratch * options.block_size)
        self._vocab: LLTokenizer | None = None  # for grammars, built on the first one
        if options.speculative not in MODES:
            raise ValueError(
                f"speculative: one of {', '.join(MODES)} (got {options.speculative!r})"
            )
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache_dir: Path | None = None  # where machine-bound measurements are kept
        self.costs: dict[int, CostCurve] = {}  # forward seconds by tokens, per batch size
        self._base_cost: CostCurve | None = None
        self.acceptance = AcceptanceTable()  # every sequence's, by match length and position
        self.drafted = self.accepted = 0
        self.balancer = self._balancer(model.config, options)
        self.adapters = AdapterSlots(
            *(model.config, options.max_loras, options.max_lora_rank, self.dtype, self.device),
            weights=self.model.w if self.device.type == "cpu" else None,
        )

    def _balancer(self, config: ModelConfig, options: EngineOptions) -> ExpertBalancer | None:
        """Expert placement, for a MoE model when eplb_cards is set."""
        if not (config.moe and options.eplb_cards):
            return None
        balancer = ExpertBalancer(
            len(config.moe.layers),
            config.moe.n_experts,
            BalancerOptions(
                cards=options.eplb_cards,
                slots=options.eplb_slots or config.moe.n_experts,
                window_steps=options.eplb_window_steps,
                replan_steps=options.eplb_replan_steps,
                move_cost=options.eplb_move_cost,
                record=options.eplb_record,
            ),
        )
        self.model.place(balancer.placement.slot_expert)
        return balancer

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def load(cls, model: ModelSource, state_dir: Path, options: EngineOptions) -> TorchEngine:
        engine = cls(load_model(model, state_dir), options)
        engine.cache_dir = state_dir / "cache"
        return engine

    def start(self) -> None:
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        if self.options.speculative == "adaptive":
            self._base_cost = self._costs()

    def _costs(self) -> CostCurve:
        """Speculation's cost curve, measured once per machine and model (``cached_costs``:
        the model, dtype, threads and pool size are what it depends on here)."""
        if self.cache_dir is None:
            return self._measure_costs()
        depends = [
            self.config.fingerprint,
            str(self.dtype),
            str(self.device),
            torch.get_num_threads(),
            self.options.max_draft,
            self.pool.n_blocks * self.block_size,
        ]
        return cached_costs(self.cache_dir, depends, self._measure_costs)

    def _measure_costs(self, repeats: int = 5, context: int = 256) -> CostCurve:
        """Seconds per forward pass of 1, 2, … new tokens of one sequence after a
        ``context``-token context (in scratch blocks, freed after): every size up to a whole
        draft, then sparser up to what a batch of drafts brings; sizes interleaved, the
        median of ``repeats`` passes each (a pass of this machine's is ±20% at times; the
        sizes past a whole draft, costlier and less decisive, two)."""
        room = self.pool.free_blocks * self.block_size  # a small pool: a shorter context
        whole = self.options.max_draft + 1
        top = max(1, min(max(64, 2 * whole), self.config.max_context, room))
        context = max(0, min(context, room - top, self.config.max_context - top))
        sizes = sorted({n for n in range(1, whole + 1)} | {16, 32, 64})
        sizes = [n for n in sizes if n < top] + [top]
        blocks = self.pool.allocate(self.pool.blocks_for(context + top))
        try:
            scratch = Sequence("", [], SamplingParams(), block_table=blocks)
            slots = scratch.slots(self.block_size, context + top)
            times: dict[int, list[float]] = {n: [] for n in sizes}
            for round_ in range(repeats + 1):  # the first warms up; sizes interleaved
                for n in sizes if round_ <= 2 else sizes[:whole]:
                    seg = Segment(0, n, slots[: context + n])
                    tokens = torch.zeros(n, dtype=torch.long)
                    positions = torch.arange(context, context + n)
                    started = time.perf_counter()
                    self.model.logits(self.model.forward(tokens, positions, [seg], self.cache))
                    self._synchronize()
                    if round_:
                        times[n].append(time.perf_counter() - started)
        finally:
            self.pool.free(blocks)
        return CostCurve({n: statistics.median(t) for n, t in times.items()})

    def _synchronize(self) -> None:
        """Wait for the device's queued work (a GPU runs it after the call returns)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def cleanup(self) -> None:
        for seq_id in list(self.seqs):
            self.abort(seq_id)
        if self.balancer is not None and self.balancer.unsaved:
            self.balancer.save_record()

    # -- admission -------------------------------------------------------------------------

    def _blocks_needed(
        self, n_prompt: int, params: SamplingParams, prefix: Prefix | None, answer: bool = True
    ) -> int:
        # Room for the whole answer is reserved up front, so decode never runs out mid-answer.
        total = min(n_prompt + (params.max_tokens if answer else 0), self.config.max_context)
        held = len(prefix.block_ids) if prefix else 0
        return self.pool.blocks_for(total) - held

    def can_admit(self, n_prompt: int, params: SamplingParams, held_blocks: int = 0) -> bool:
        return len(self.seqs) < self.options.max_running and self.pool.can_allocate(
            self._blocks_needed(n_prompt, params, None) - held_blocks
        )

    def _check_fits(self, seq_id: str, n: int, params: SamplingParams) -> None:
        limit = self.config.max_context
        if n == 0:
            raise ValueError("prompt must have at least one token")
        if n + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {limit} tokens"
            )
        assert seq_id not in self.seqs, f"sequence {seq_id} exists"
        if len(self.seqs) >= self.options.max_running:
            raise PoolExhausted(f"{self.options.max_running} sequences already running")

    # -- prefill and decode ----------------------------------------------------------------

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
        paused = self.seqs.get(seq_id)
        if paused is not None and paused.n_cached < len(token_ids) and not paused.output_ids:
            seq = paused  # a paused prefill goes on
        else:
            seq = self._admit(PrefillRequest(seq_id, token_ids, params, prefix, handoff, images))
        n, n_cached = len(token_ids), seq.n_cached
        hidden = None
        chunk = self.options.prefill_chunk
        for start in range(n_cached, n, chunk):
            if cancelled is not None and cancelled():
                self.free(seq_id)
                raise Cancelled(f"prefill of {seq_id} cancelled at token {start} of {n}")
            if start > n_cached and pause is not None and pause():
                seq.n_cached = start
                raise Paused(seq_id, start)
            end = min(n, start + chunk)
            seg = Segment(0, end - start, seq.slots(self.block_size, end))
            tokens = torch.tensor(token_ids[start:end])
            hidden = self.model.forward(
                tokens,
                torch.arange(start, end),
                [seg],
                self.cache,
                self._embeds(tokens, start, images),
                self._lora([(seq, end - start)]),
            )
            if params.prompt_logprobs is not None:
                self._score_prompt(seq, hidden, start)
        seq.n_cached = n
        assert hidden is not None
        return self._first_token(seq, self.model.logits(hidden[-1:])[0], handoff)

    def prefill_batch(self, requests: list[PrefillRequest]) -> list[StepOutput | Exception]:
        """Several prompts in one forward pass: for short ones, whose uncached tokens together
        fit about one prefill chunk (one pass over the weights instead of one each). Each
        result is the first token, or the error that request alone got (ValueError,
        PoolExhausted); the others are unaffected."""
        results: list[StepOutput | Exception] = []
        admitted: list[tuple[int, Sequence, PrefillRequest]] = []
        for i, req in enumerate(requests):
            try:
                admitted.append((i, self._admit(req), req))
                results.append(ValueError("not computed"))
            except (ValueError, PoolExhausted) as err:
                results.append(err)
        if not admitted:
            return results
        segments, tokens, positions, row = [], [], [], 0
        rows: list[torch.Tensor | None] = []
        for _, seq, req in admitted:
            n, start = len(req.token_ids), seq.n_cached
            segments.append(Segment(row, n - start, seq.slots(self.block_size, n)))
            mine = torch.tensor(req.token_ids[start:])
            tokens.append(mine)
            rows.append(self._embeds(mine, start, req.images))
            positions += range(start, n)
            row += n - start
        all_tokens = torch.cat(tokens)
        embeds = None
        if any(r is not None for r in rows):  # some prompt has images: every row spelled out
            embeds = torch.cat(
                [
                    r if r is not None else self.model.embed(t)
                    for r, t in zip(rows, tokens, strict=True)
                ]
            )
        lora = self._lora(
            [(seq, s.q_len) for s, (_, seq, _) in zip(segments, admitted, strict=True)]
        )
        hidden = self.model.forward(
            all_tokens, torch.tensor(positions), segments, self.cache, embeds, lora
        )
        last_rows = torch.tensor([seg.q_start + seg.q_len - 1 for seg in segments])
        logits = self.model.logits(hidden[last_rows])
        for seg, (_, seq, req) in zip(segments, admitted, strict=True):
            if req.params.prompt_logprobs is not None:
                rows = hidden[seg.q_start : seg.q_start + seg.q_len]
                self._score_prompt(seq, rows, len(req.token_ids) - seg.q_len)
        for j, (i, seq, req) in enumerate(admitted):
            seq.n_cached = len(req.token_ids)
            results[i] = self._first_token(seq, logits[j], req.handoff)
        return results

    def _embeds(
        self, tokens: torch.Tensor, start: int, images: tuple[ImageEmbeds, ...]
    ) -> torch.Tensor | None:
        """Input rows for ``tokens`` (prompt positions start, start+1, ...): their token
        embeddings with any image overlapping them spliced in; None when none does."""
        end = start + len(tokens)
        overlapping = [(at, e) for at, e in images if at < end and at + len(e) > start]
        if not overlapping:
            return None
        x = self.model.embed(tokens).clone()
        for at, e in overlapping:
            lo, hi = max(at, start), min(at + len(e), end)
            x[lo - start : hi - start] = e[lo - at : hi - at].to(x.dtype)
        return x

    def _admit(self, req: PrefillRequest) -> Sequence:
        """Check a prompt fits, take its blocks (sharing the prefix's), create its sequence."""
        n, params, prefix = len(req.token_ids), req.params, req.prefix
        self._check_fits(req.seq_id, n, params)
        n_cached = prefix.n_tokens if prefix else 0
        assert n_cached < n, "a prefix must leave at least one token to compute"
        matcher = self._matcher(req.token_ids, params)  # (a bad grammar takes no blocks)
        slot = self._adapter(params)
        try:
            # A handed-off sequence needs KV for its prompt only: the answer is decoded
            # elsewhere.
            new_blocks = self.pool.allocate(self._blocks_needed(n, params, prefix, not req.handoff))
        except PoolExhausted:
            self.adapters.release(slot)
            raise
        if prefix:
            self.pool.share(list(prefix.block_ids))
        seq = Sequence(req.seq_id, list(req.token_ids), params, matcher=matcher)
        seq.adapter_slot = slot
        seq.block_table = [*(prefix.block_ids if prefix else ()), *new_blocks]
        seq.n_cached = n_cached
        self.seqs[req.seq_id] = seq
        return seq

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """The log-probabilities of the prompt's tokens after ``start``, from the hidden rows
        of its tokens from ``start`` on (a chunk): each under the tokens before it, with the
        most likely (``prompt_logprobs`` of them), kept on the sequence; logits made a few
        hundred rows at a time (a row is the vocabulary's size)."""
        top = seq.params.prompt_logprobs or 0
        targets = seq.prompt_ids[start + 1 : start + 1 + len(hidden)]  # (none past the prompt)
        for at in range(0, len(targets), SCORE_ROWS):
            wanted = torch.tensor(targets[at : at + SCORE_ROWS])
            logp = torch.log_softmax(self.model.logits(hidden[at : at + len(wanted)]).float(), -1)
            chosen = logp.gather(1, wanted[:, None])[:, 0].tolist()
            ranked = logp.topk(top) if top else None
            for i, value in enumerate(chosen):
                best = ()
                if ranked is not None:
                    pairs = zip(ranked.indices[i].tolist(), ranked.values[i].tolist(), strict=True)
                    best = tuple(pairs)
                seq.prompt_logprobs.append(TokenLogprobs(value, best))

    def _first_token(self, seq: Sequence, logits: torch.Tensor, handoff: bool) -> StepOutput:
        seq.last_logits = logits
        out = self._append(seq, logits)
        if seq.params.prompt_logprobs is not None:
            out = replace(out, prompt_logprobs=list(seq.prompt_logprobs))
        if not seq.finished and not handoff:
            self.running.append(seq.seq_id)
        return out

    def reserve(self, seq_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self._check_fits(seq_id, len(token_ids), params)
        matcher = self._matcher(token_ids, params)
        slot = self._adapter(params)
        try:
            blocks = self.pool.allocate(self._blocks_needed(len(token_ids), params, None))
        except PoolExhausted:
            self.adapters.release(slot)
            raise
        seq = Sequence(seq_id, list(token_ids), params, matcher=matcher, adapter_slot=slot)
        seq.block_table = blocks
        self.seqs[seq_id] = seq

    # -- LoRA adapters ---------------------------------------------------------------------

    def register_adapter(self, spec: AdapterSpec) -> None:
        self.adapters.register(spec)

    def unregister_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    def _adapter(self, params: SamplingParams) -> int:
        """The slot of the adapter a new sequence computes with (loaded when needed)."""
        return self.adapters.acquire(params.adapter) if params.adapter else BASE

    def _lora(self, rows: list[tuple[Sequence, int]]) -> LoraPass | None:
        """A pass's adapters: (sequence, its rows in the pass), in row order."""
        if all(seq.adapter_slot == BASE for seq, _ in rows):
            return None
        return self.adapters.batch([seq.adapter_slot for seq, n in rows for _ in range(n)])

    def write_kv(self, seq_id: str, source: bytes | BinaryIO) -> None:
        seq = self.seqs[seq_id]
        assert seq.n_cached == 0 and not seq.output_ids, f"sequence {seq_id} already has KV"
        f = kvformat.as_reader(source)
        header, data_start = self.kv.read_header(f)
        if header.n_tokens != len(seq.prompt_ids):
            raise kvformat.KVFormatError(
                f"KV covers {header.n_tokens} tokens; the prompt has {len(seq.prompt_ids)}"
            )
        self.kv.write_cells(f, header, data_start, seq.block_table)

    def join(self, seq_id: str, first_token: int) -> None:
        seq = self.seqs[seq_id]
        seq.n_cached = len(seq.prompt_ids)
        seq.output_ids.append(first_token)
        if seq.matcher is not None and first_token not in self.config.eos_ids:
            seq.matcher.take([first_token])  # prefill's matcher took it; this one follows
        self.running.append(seq_id)

    def step(self) -> list[StepOutput]:
        """One decode step for every running sequence: its next token, or, speculating, its
        drafted tokens verified in the same pass and as many of them as the model agrees
        with, then one more (the output is token for token what plain decode gives)."""
        if not self.running:
            return []
        seqs = [self.seqs[s] for s in self.running]
        drafts = self._drafts(seqs)
        segments, tokens, positions, row = [], [], [], 0
        for seq, draft in zip(seqs, drafts, strict=True):
            n, k = seq.n_tokens, len(draft.tokens)
            segments.append(Segment(row, 1 + k, seq.slots(self.block_size, n + k)))
            tokens += [seq.tokens[-1], *draft.tokens]
            positions += range(n - 1, n + k)
            row += 1 + k
        # The grammars' masks for each sequence's first token are computed on another
        # thread while the model runs (llguidance lets go of the GIL): off the step's path.
        bound = [s for s in seqs if s.matcher is not None]
        masks = self._masker.submit(lambda: [s.matcher.allowed() for s in bound]) if bound else None
        started = time.perf_counter()
        lora = self._lora([(seq, s.q_len) for seq, s in zip(seqs, segments, strict=True)])
        if self.graphs is not None and lora is None and row == len(seqs) and self.graphs.fits(row):
            logits, best = self.graphs.step(tokens, positions, [s.slots for s in segments])
        else:
            hidden = self.model.forward(
                torch.tensor(tokens), torch.tensor(positions), segments, self.cache, lora=lora
            )
            logits = self.model.logits(hidden)
            best = logits.argmax(-1).tolist()  # (every row's greedy token in one call)
        ahead = dict(zip(map(id, bound), masks.result(), strict=True)) if masks else {}
        if self._base_cost is not None:
            self._cost(len(seqs)).observe(len(tokens), time.perf_counter() - started)
        if self.balancer is not None:  # a decode step's expert load; on schedule, a new plan
            counts = self.model.expert_counts.cpu().numpy(), self.model.slot_counts.cpu().numpy()
            if self.balancer.observe(*counts):
                self.model.place(self.balancer.placement.slot_expert)
        outputs = []
        for seq, seg, proposal in zip(seqs, segments, drafts, strict=True):
            seq.n_cached = seq.n_tokens  # the KV of its last token, and of its drafts
            draft, accepted = proposal.tokens, 0
            for j in range(len(draft) + 1):
                row = seg.q_start + j
                out = self._append(seq, logits[row], ahead.pop(id(seq), None), best[row])
                outputs.append(out)
                if seq.finished or j == len(draft) or out.token_id != draft[j]:
                    break
                accepted += 1
            seq.n_cached = seq.n_tokens - 1  # (a rejected draft's KV is past the end: unread)
            if draft:
                seq.acceptance.record(len(draft), accepted)
                self.acceptance.record(proposal.match, len(draft), accepted)
                seq.drafted += len(draft)
                seq.accepted += accepted
                self.drafted += len(draft)
                self.accepted += accepted
        self.running = [s for s in self.running if not self.seqs[s].finished]
        return outputs

    def _drafts(self, seqs: list[Sequence]) -> list[Draft]:
        """Each sequence's drafted tokens to verify this step (none when speculation is off
        or nothing is worth it)."""
        mode = self.options.speculative
        if mode == "off":
            return [Draft([], 0) for _ in seqs]
        proposals = []
        for seq in seqs:
            room = (
                min(len(seq.prompt_ids) + seq.params.max_tokens, self.config.max_context)
                - seq.n_tokens
            )
            cap = min(self.options.max_draft, room, seq.params.max_tokens - len(seq.output_ids) - 1)
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(self.options.max_ngram)
            proposals.append(seq.ngrams.draft(seq.tokens, cap) if cap > 0 else Draft([], 0))
        if mode == "fixed":
            k = self.options.fixed_draft
            return [Draft(p.tokens[:k], p.match) for p in proposals]
        candidates = [
            (
                [
                    seq.acceptance.chance(j, self.acceptance.chance(j, p.match))
                    for j in range(len(p.tokens))
                ],
                len(p.tokens),
            )
            for seq, p in zip(seqs, proposals, strict=True)
        ]
        lengths = choose_lengths(candidates, self._cost(len(seqs)))
        return [Draft(p.tokens[:k], p.match) for p, k in zip(proposals, lengths, strict=True)]

    def _cost(self, batch: int) -> CostCurve:
        """The cost curve of passes with ``batch`` sequences: at first the measured one, by
        the tokens in the pass (the matrix products' rows, where the time goes), then each
        batch size's own scale, learned as it runs."""
        if batch not in self.costs:
            assert self._base_cost is not None
            base = self._base_cost
            self.costs[batch] = CostCurve(dict(zip(base.sizes, base.seconds, strict=True)))
            self.costs[batch].scale = self.costs[1].scale if 1 in self.costs else 1.0
        return self.costs[batch]

    def _append(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        mask: np.ndarray | None = None,
        best: int | None = None,
    ) -> StepOutput:
        """The sequence's next token from ``logits``; ``mask``: its grammar's allowed tokens,
        when they were computed ahead (else they are computed here); ``best``: the logits'
        argmax, when known (a plain greedy token needs nothing else: a GPU's logits stay
        there)."""
        p = seq.params
        early = len(seq.output_ids) < p.min_tokens  # (nothing may end the answer yet)
        plain = p.greedy and not (p.reshaped or early or seq.matcher)
        token = best if best is not None and plain else None
        if token is None:
            token = self._sampled(seq, logits.float().cpu(), mask)
        logprobs = None if p.logprobs is None else logprobs_of(logits.cpu(), token, p.logprobs)
        seq.output_ids.append(token)
        stops = len(seq.output_ids) >= p.min_tokens  # (before: its stop tokens held back)
        ends = token in self.config.eos_ids and not p.ignore_eos or token in p.stop_token_ids
        if stops and ends:
            seq.finish_reason = "stop"
        elif (
            stops
            and p.stop
            and (hit := stop_string_hit(self.tokenizer.decode, seq.output_ids, p.stop))
        ):
            seq.finish_reason, seq.stop_string = "stop", hit
        elif len(seq.output_ids) >= p.max_tokens or seq.n_tokens >= self.config.max_context:
            seq.finish_reason = "length"
        return StepOutput(seq.seq_id, token, seq.finish_reason, seq.stop_string, logprobs)

    def _sampled(self, seq: Sequence, logits: torch.Tensor, mask: np.ndarray | None) -> int:
        """A token drawn (or the greedy one) from host ``logits`` with the sequence's bias,
        penalties, least length and grammar."""
        p = seq.params
        answer: list[int] = []
        if p.penalized:  # the whole answer: a resumed one's earlier tokens end its prompt
            earlier = seq.prompt_ids[len(seq.prompt_ids) - p.answer_offset :]
            answer = earlier + seq.output_ids
        seen = seq.tokens if p.repetition_penalty != 1.0 else ()  # (prompt and answer)
        allowed = logits
        if seq.matcher is not None:
            allowed = self._constrained(logits, mask if mask is not None else seq.matcher.allowed())
        elif len(seq.output_ids) < p.min_tokens:  # (a grammar decides its own ending)
            allowed = held_back(logits, (*self.config.eos_ids, *p.stop_token_ids))
        token = sample(allowed, p, p.answer_offset + len(seq.output_ids), answer, seen)
        if seq.matcher is not None and token not in self.config.eos_ids:
            seq.matcher.take([token])  # (an end-of-answer token ends it: nothing to take)
        return token

    def _matcher(self, token_ids: list[int], params: SamplingParams) -> Matcher | None:
        """A constrained sequence's matcher, past the answer tokens its prompt ends with (a
        request resumed here after a failure)."""
        if params.grammar is None:
            return None
        if self._vocab is None:
            self._vocab = vocabulary(self.tokenizer, tuple(self.config.eos_ids))
        earlier = list(token_ids[len(token_ids) - params.answer_offset :])
        try:
            return Matcher(params.grammar, self._vocab, earlier if params.answer_offset else [])
        except GrammarError as err:
            raise ValueError(f"grammar: {err}") from None

    @staticmethod
    def _constrained(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
        """The logits with every token the grammar does not allow next at -inf."""
        mask = torch.from_numpy(allowed)
        if mask.numel() != logits.numel():  # a vocabulary padded (or cut) in the weights
            padded = torch.zeros(logits.numel(), dtype=torch.bool)
            padded[: mask.numel()] = mask[: logits.numel()]
            mask = padded
        return logits.masked_fill(~mask, float("-inf"))

    # -- ending ----------------------------------------------------------------------------

    def abort(self, seq_id: str) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return
        if not seq.finished:
            seq.finish_reason = "abort"
        self.free(seq_id)

    def free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq_id in self.running:
            self.running.remove(seq_id)
        self.pool.free(seq.block_table)
        self.adapters.release(seq.adapter_slot)

    # -- what is held ----------------------------------------------------------------------

    def holds(self, seq_id: str) -> bool:
        return seq_id in self.seqs

    def sequence(self, seq_id: str) -> Sequence:
        return self.seqs[seq_id]

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_used=self.pool.used_blocks,
            kv_blocks_total=self.pool.n_blocks,
            block_size=self.block_size,
            sequences=len(self.seqs),
            running=len(self.running),
            draft_tokens=self.drafted,
            accepted_tokens=self.accepted,
            eplb=self.balancer.stats() if self.balancer else None,
            adapters=tuple(self.adapters.resident),
            adapter_loads=self.adapters.loads,
            adapter_load_s=self.adapters.load_seconds,
        )

    # -- KV in the block format -------------------------------------------------------------

    def export_kv(self, seq_id: str, dtype: str | None = None, partial: bool = False) -> bytes:
        return self.kv.export_kv(self.seqs[seq_id], dtype, partial)

    def export_blocks(
        self, seq_id: str, first: int, last: int, dtype: str | None = None
    ) -> list[bytes]:
        return self.kv.export_blocks(self.seqs[seq_id], first, last, dtype)

    def import_kv(self, source: bytes | BinaryIO) -> Prefix:
        return self.kv.import_kv(source)

    def import_blocks(self, sources: list[bytes | BinaryIO], trusted: int = 0) -> Prefix:
        return self.kv.import_blocks(sources, trusted)

    def release(self, prefix: Prefix) -> None:
        self.pool.free(list(prefix.block_ids))

    def share_prefix(self, seq_id: str, n_blocks: int) -> Prefix | None:
        # A block wholly inside the computed KV is never written again (a sequence writes
        # only at its own end), so sharing it needs no copy.
        seq = self.seqs.get(seq_id)
        n_tokens = n_blocks * self.block_size
        if seq is None or seq.n_cached < n_tokens or n_blocks <= 0:
            return None
        ids = tuple(seq.block_table[:n_blocks])
        self.pool.share(list(ids))
        return Prefix(ids, n_tokens)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for seq in self.seqs.values():
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for b, count in held.items():
            assert self.pool.refcount[b] >= count, f"block {b} used by more than it counts"
        assert set(self.running) <= set(self.seqs)
        self.adapters.check_integrity()
        users = [0] * self.adapters.n_slots
        for seq in self.seqs.values():
            if seq.adapter_slot != BASE:
                users[seq.adapter_slot] += 1
        assert users == self.adapters.users, "adapter slots' users are not the sequences'"
