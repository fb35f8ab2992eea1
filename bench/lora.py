"""LoRA adapters: what they cost the torch engine, and what routing with them in mind buys.

Engine (the bundled model, fp32, this machine's threads): decode tokens/s at batch 8 with 0, 1,
4 and 8 distinct adapters in the batch (rank ``--rank`` on all seven projections) against the
base alone; an adapter's load time cold (read from disk) and warm (its host copy); the time to
first token of a request whose adapter is not resident against one whose adapter is.

Simulator (``--sim``): a trace whose sessions each use one of ``--adapters`` adapters
(popularity Zipf-skewed), replayed over ``--workers`` prefill workers that hold ``--max-loras``
adapters each and load others in ``--load-ms``: TTFT and hit ratio for the default policy,
the same policy blind to adapters (the KV is still per adapter: only where adapters are
resident is ignored), and round robin.

Adapters are written in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``)
with random weights.

    .venv/bin/python bench/lora.py [--rank 16] [--steps 32] [--sim] [--seeds 0,1,2]

Prints tables, then as its last line one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import say  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.config import ModelConfig  # noqa: E402
from shared.model.gguf import REAL_MODEL  # noqa: E402
from shared.model.lora import MODULES, AdapterSpec, _module_shape, digest_of  # noqa: E402

BATCH = 8


def write_adapter(
    directory: Path, config: ModelConfig, rank: int, seed: int, b_scale: float = 0.01
) -> AdapterSpec:
    """A random adapter of every projection, in PEFT's files (``b_scale``: how far its B
    moves the model: 0.3 changes a greedy answer within a few tokens)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.n_layers):
        for module in MODULES:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out, in_ = _module_shape(config, module)
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_, generator=g) * in_**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * b_scale
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(MODULES),
                "bias": "none",
            }
        )
    )
    return AdapterSpec(directory.name, REAL_MODEL, str(directory), digest_of(directory))


def decode_tok_s(engine: TorchEngine, adapters: list[str], steps: int, prompt: list[int]) -> float:
    """Tokens/s of ``steps`` decode steps of a batch of 8 (sequence i under adapters[i % n],
    none when the list is empty), after two steps of warm-up."""
    for i in range(BATCH):
        adapter = adapters[i % len(adapters)] if adapters else ""
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, adapter=adapter)
        engine.prefill(f"s{i}", prompt[: 100 + i], params)
    engine.step()
    engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    took = time.perf_counter() - started
    for i in range(BATCH):
        engine.free(f"s{i}")
    return steps * BATCH / took


def bench_engine(args: argparse.Namespace, root: Path) -> dict:
    say("loading the bundled model")
    model = load_model(REAL_MODEL, root / "state")
    options = EngineOptions(block_size=64, kv_cache_tokens=16384, max_loras=BATCH)
    engine = TorchEngine(model, options)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine.start()
    say(f"writing {BATCH} adapters of rank {args.rank}")
    specs = [write_adapter(root / f"a{i}", model.config, args.rank, i) for i in range(BATCH)]
    for spec in specs:
        engine.register_adapter(spec)
    prompt = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    # The base model alone: an engine that never loaded an adapter (its weights as loaded),
    # beside one that holds all eight (0 of them in the batch: the base rows of that engine).
    plain = TorchEngine(model, options)
    for spec in specs:
        engine.adapters.release(engine.adapters.acquire(spec.name))
    figures: dict[str, float] = {}
    rounds: dict[str, list[float]] = {k: [] for k in ("base", "0", "1", "4", "8")}
    order = random.Random(0)
    for r in range(args.rounds):  # (each round in its own order: the median of the rounds)
        for key in order.sample(list(rounds), len(rounds)):
            say(f"decode, batch 8, {key} (round {r + 1}/{args.rounds})")
            if key == "base":
                rounds[key].append(decode_tok_s(plain, [], args.steps, prompt))
            else:
                names = [s.name for s in specs[: int(key)]]
                rounds[key].append(decode_tok_s(engine, names, args.steps, prompt))
    figures["decode_b8_base_tok_s"] = base = statistics.median(rounds["base"])
    for n in (0, 1, 4, 8):
        figures[f"decode_b8_{n}_adapters_tok_s"] = statistics.median(rounds[str(n)])
    figures["decode_b8_0_adapters_cost"] = 1 - figures["decode_b8_0_adapters_tok_s"] / base
    for n in (1, 4, 8):
        figures[f"decode_b8_{n}_adapters_cost"] = (
            1 - figures[f"decode_b8_{n}_adapters_tok_s"] / base
        )

    # Load times: cold (read from disk: a fresh engine's first use), warm (its host copy, after
    # its slot went to another adapter).
    say("adapter load times, cold and warm")
    small = TorchEngine(model, EngineOptions(block_size=64, kv_cache_tokens=8192, max_loras=1))
    cold, warm = [], []
    for spec in specs:
        small.register_adapter(spec)
    one = SamplingParams(max_tokens=1)
    for i, spec in enumerate(specs):
        loads = small.adapters.load_seconds
        small.adapters.acquire(spec.name)
        cold.append(small.adapters.load_seconds - loads)
        small.adapters.release(0)
        if i:  # the previous adapter, again: from its host copy
            loads = small.adapters.load_seconds
            small.adapters.acquire(specs[i - 1].name)
            warm.append(small.adapters.load_seconds - loads)
            small.adapters.release(0)
    figures["adapter_load_cold_ms"] = 1e3 * statistics.median(cold)
    figures["adapter_load_warm_ms"] = 1e3 * statistics.median(warm)
    # Time to first token (a 512-token prompt's prefill): its adapter resident, and not.
    ids = prompt * 3
    ttft_resident, ttft_loading = [], []
    for spec in specs:
        params = replace_adapter(one, spec.name)
        started = time.perf_counter()
        small.prefill("cold", ids[:512], params)  # (its slot held another's: loaded now)
        ttft_loading.append(time.perf_counter() - started)
        small.free("cold")
        started = time.perf_counter()
        small.prefill("warm", ids[:512], params)
        ttft_resident.append(time.perf_counter() - started)
        small.free("warm")
    figures["ttft_adapter_resident_ms"] = 1e3 * statistics.median(ttft_resident)
    figures["ttft_adapter_loaded_ms"] = 1e3 * statistics.median(ttft_loading)
    figures["adapter_mb"] = sum(p.stat().st_size for p in Path(specs[0].path).iterdir()) / 2**20
    return figures


def replace_adapter(params: SamplingParams, name: str) -> SamplingParams:
    from dataclasses import replace

    return replace(params, adapter=name)


def print_engine(f: dict, rank: int) -> None:
    print(f"\nengine: bundled model, fp32, batch 8 decode, adapters of rank {rank} on 7 modules")
    print(f"{'distinct adapters':>18} {'tokens/s':>10} {'cost vs base':>13}")
    print(f"{'base model alone':>18} {f['decode_b8_base_tok_s']:>10.1f} {'—':>13}")
    for n in (0, 1, 4, 8):
        cost = f"{100 * f[f'decode_b8_{n}_adapters_cost']:.1f}%"
        print(f"{n:>18} {f[f'decode_b8_{n}_adapters_tok_s']:>10.1f} {cost:>13}")
    print(
        f"adapter ({f['adapter_mb']:.1f} MB) load: cold {f['adapter_load_cold_ms']:.1f} ms, "
        f"warm {f['adapter_load_warm_ms']:.1f} ms; 512-token TTFT: resident "
        f"{f['ttft_adapter_resident_ms']:.1f} ms, loaded first {f['ttft_adapter_loaded_ms']:.1f} ms"
    )


SIM_POLICIES = (("ttft", False), ("ttft", True), ("round_robin", False), ("least_loaded", False))


def label(policy: str, blind: bool) -> str:
    return f"{policy} (adapter-blind)" if blind else policy


def bench_sim(args: argparse.Namespace) -> dict:
    """The default policy told and not told where adapters are resident, and the balancers,
    on synthetic chat traces with adapters (each conversation under one)."""
    from dataclasses import replace

    from simulator.replay import SimConfig, infinite_cache_hit_ratio, simulate
    from simulator.replay import speed_for_utilization as speed_for
    from simulator.synthetic import Workload, generate

    runs: dict[tuple[str, bool], list[dict]] = {k: [] for k in SIM_POLICIES}
    bounds = []
    for seed in args.seeds:
        workload = Workload(
            rate=4.0,
            requests=args.sim_requests,
            input_mean=8192,
            output_mean=256,
            reuse=0.9,
            systems=8,
            block_size=512,
            seed=seed,
            adapters=args.adapters,
            adapter_skew=args.skew,
        )
        requests, earlier = generate(workload)
        unique = len({h for r in requests for h in r.hashes})
        cfg = SimConfig(
            prefill=args.workers,
            decode=args.workers,
            memory_blocks=max(50, int(unique * 0.3 / args.workers)),
            max_loras=args.max_loras,
            adapter_load_s=args.load_ms / 1e3,
        )
        cfg = replace(cfg, speed=speed_for(requests, 512, cfg, args.load))
        bounds.append(infinite_cache_hit_ratio(requests, 512))
        for policy, blind in SIM_POLICIES:
            say(f"simulator, seed {seed}: {label(policy, blind)}")
            result = simulate(
                requests, 512, replace(cfg, adapter_blind=blind), policy, None, earlier
            )
            runs[(policy, blind)].append(result.summary(args.workers))
    figures: dict = {"sim_hit_bound_trace_only": statistics.fmean(bounds)}
    for (policy, blind), summaries in runs.items():
        key = f"sim_{policy}{'_blind' if blind else ''}"
        for what in ("ttft_mean_s", "ttft_p99_s", "hit_ratio", "adapter_loads"):
            figures[f"{key}_{what}"] = statistics.fmean(s[what] for s in summaries)
    return figures


def print_sim(f: dict, args: argparse.Namespace) -> None:
    print(
        f"\nsimulator: {args.adapters} adapters (Zipf {args.skew:g}) over {args.workers} prefill "
        f"workers holding {args.max_loras} each, a load {args.load_ms:g} ms; "
        f"{round(args.load * 100)}% busy; mean of seeds {','.join(map(str, args.seeds))}"
    )
    print(f"{'policy':<28} {'TTFT mean s':>12} {'p99 s':>8} {'hit ratio':>10} {'loads':>8}")
    for policy, blind in SIM_POLICIES:
        key = f"sim_{policy}{'_blind' if blind else ''}"
        print(
            f"{label(policy, blind):<28} {f[key + '_ttft_mean_s']:>12.3f} "
            f"{f[key + '_ttft_p99_s']:>8.3f} {f[key + '_hit_ratio']:>10.3f} "
            f"{f[key + '_adapter_loads']:>8.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--sim", action="store_true", help="the simulator's part too")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--load-ms", type=float, default=10.0)
    ap.add_argument("--load", type=float, default=0.8, help="the pool's share busy")
    ap.add_argument("--sim-requests", type=int, default=3000)
    args = ap.parse_args()
    args.seeds = [int(x) for x in args.seeds.split(",")]
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_engine:
            figures.update(bench_engine(args, Path(tmp)))
            print_engine(figures, args.rank)
    if args.sim:
        figures.update(bench_sim(args))
        print_sim(figures, args)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
