"""Tiny checkpoints for tests, made by the test itself in the real file formats: a Hugging Face
directory (transformers' own ``save_pretrained``: config.json and safetensors) with the bundled
model's tokenizer and chat template beside it, and the same weights as a GGUF file (the
``gguf`` package's writer, in llama.cpp's layout). transformers is a test dependency only."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from shared.model.gguf import find_gguf, read_metadata

SMALL = dict(
    vocab_size=49152,  # the bundled tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

ARCHS = {  # name → (transformers' config class, its model class, what this one sets)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def tokenizer_files(directory: Path) -> None:
    """The bundled model's tokenizer and chat template, as Hugging Face files."""
    tokenizer, config = _bundled_tokenizer()
    (directory / "tokenizer.json").write_text(tokenizer)
    (directory / "tokenizer_config.json").write_text(config)


@functools.cache
def _bundled_tokenizer() -> tuple[str, str]:
    """tokenizer.json and tokenizer_config.json's texts, built once a run (seconds each)."""
    meta = read_metadata(find_gguf(), "tokenizer.")
    from shared.model.tokenizer import build_from_gguf

    config = {
        "chat_template": meta["tokenizer.chat_template"],
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
    }
    return build_from_gguf(meta).to_str(), json.dumps(config)


def hf_checkpoint(  # noqa: ANN201
    directory: Path, arch: str, seed: int = 0, dtype: str = "float32", size: dict | None = None
):
    """A random checkpoint of ``arch`` saved as a Hugging Face directory; the transformers
    model it was saved from (fp32, eager attention). ``size``: dimensions other than SMALL's
    (the benchmark's are SmolLM2-135M's)."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **(size or {})})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # the defaults' 0.02 would make every logit near zero
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    tokenizer_files(directory)
    return model.float()  # (the weights as saved: rounded to ``dtype``)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's permute), from the half-split one."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def gguf_checkpoint(path: Path, model, arch: str, qtype: str = "F32") -> Path:  # noqa: ANN001
    """``model``'s weights (a transformers model of ``arch``) written as a GGUF file, in the
    tensor type ``qtype`` for its matrices (norms and biases in F32, as llama.cpp keeps them)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    c = model.config
    family = {"llama": "llama", "llama3-rope": "llama", "mistral": "llama"}.get(arch, arch)
    w = GGUFWriter(str(path), family)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_context_length(c.max_position_embeddings)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    w.add_vocab_size(c.vocab_size)
    if arch == "mistral":
        w.add_sliding_window(c.sliding_window)
    meta = read_metadata(find_gguf(), "tokenizer.")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_chat_template(meta["tokenizer.chat_template"])
    kind = getattr(GGMLQuantizationType, qtype)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    if arch == "llama3-rope":  # Llama 3.1's frequencies as its converter writes them
        scaled = model.model.rotary_emb.inv_freq.double()
        plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2).double() / head_dim))
        w.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    for name, x in sd.items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name in names:
            out = names[name]
        else:
            _, _, i, *rest = name.split(".")
            part, kind_ = ".".join(rest[:-1]), rest[-1]
            out = f"blk.{i}.{layer[part]}.{kind_}"
        if family == "llama" and out.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in out else c.num_key_value_heads
            x = _permute(x, heads)
        if x.ndim == 2 and kind != GGMLQuantizationType.F32:
            w.add_tensor(out, quantize(x, kind), raw_dtype=kind)
        else:
            w.add_tensor(out, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
